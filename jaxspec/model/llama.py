"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) as Flax NNX modules.

The modules are split once at load time (`nnx.split`) and run functionally: step functions are plain
`jax.jit` functions that `nnx.merge` the graph with the parameters inside. One forward handles every
shape of work the engine needs — prefill (a causal chain), one autoregressive token, or a draft tree —
because attention always reads the committed cache prefix plus the new tokens under a [N, N] mask.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

# (q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, *, scale) -> (out, k_cache, v_cache): writes the
# new keys/values at [lengths, lengths + N) and attends over prefix + tree
# (jaxspec.model.forward.cached_attention).
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]

# One attention step of a decoder layer: (q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D]) of the N new
# tokens (rotated) -> (out [B, Hq, N, D], carried). The target's step writes k, v into its KV cache and
# carries the updated buffers (`cached_attend`); a draft head's step attends over its own key sets and
# carries the new k, v (`jaxspec.drafters.heads.layers.AttentionInputs`).
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, tuple]]

# Parameter layouts of the decoder layer. "fused": q/k/v in one output-major projection and gate/up in
# another (the target's: fast on XLA:CPU, whole kv-head groups per tensor-parallel shard). "split":
# separate NNX Linear layers with [in, out] kernels (the draft heads': the layout their checkpoints use).
LAYOUTS = ("fused", "split")
INPUT_NORMS = ("rms", "none", "eagle3")


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def project(weight: jax.Array, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """weight [*out, I] (output-major, the PyTorch layout), x [..., I] -> [..., *out] in out_dtype (None:
    the weight's dtype), accumulated in out_dtype when it is wider (the LM head: float32 logits from
    bfloat16 weights).

    One dot_general with the weight as its left operand, then the output axes moved last. XLA:CPU runs
    this faster than `einsum("oi,...i->...o")` (which lowers to x @ weight.T): SmolLM2's forward over 4
    new tokens 1.21x, 16 and 64 rows 1.17x / 1.12x, 128 1.14x, 1, 17 and 33 the same on an AMD EPYC VM
    (`scripts/bench_small_row_product.py`, docs/bench/small_row_product). The weight is never
    reshaped: merging a sharded inner dimension (gate_up's f) would gather it.
    """
    k = weight.ndim - 1
    y = jax.lax.dot_general(
        weight, x.astype(weight.dtype), (((k,), (x.ndim - 1,)), ((), ())),
        preferred_element_type=weight.dtype if out_dtype is None else out_dtype,
    )  # fmt: skip  # [*out, ...]
    return jnp.moveaxis(y, tuple(range(k)), tuple(range(x.ndim - 1, x.ndim - 1 + k)))


class Projection(nnx.Module):
    """A linear map whose weight is stored output-major: weight [*out_shape, in] (the PyTorch layout),
    optional bias [*out_shape].

    x [..., in] -> [..., *out_shape]. On XLA:CPU the weight as the dot's row-major left operand reads
    faster at decode shapes than NNX Linear's [in, out] kernel, and several projections fused into one
    weight (q/k/v, gate/up) make one larger product instead of several small ones.
    """

    def __init__(self, din: int, out_shape: tuple[int, ...], bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.out_shape = tuple(out_shape)
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (*self.out_shape, din), dtype))
        if bias:
            self.bias = nnx.Param(jnp.zeros(self.out_shape, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = project(self.weight[...], x)
        if hasattr(self, "bias"):
            y = y + self.bias[...]
        return y


def split_linear(din: int, dout: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """An NNX Linear (kernel [din, dout]) initialised like `Projection`: the "split" layout's layers."""
    init = nnx.initializers.normal(0.02)
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=init, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query attention; the step over keys and values is the caller's (`Attend`).

    layout "fused": qkv_proj.weight is [Hkv, G + 2, D, d] (G = Hq // Hkv): for each kv head, the G query
    heads it serves (Hugging Face order: query head h * G + g), then its key, then its value. A
    tensor-parallel shard over kv heads therefore holds whole groups. o_proj.weight is [d, Hq * D].
    layout "split": q_proj, k_proj, v_proj, o_proj NNX Linear layers; their input may be wider than d
    (`input_size`, EAGLE-3: 2d).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        *,
        layout: str = "fused",
        input_size: int | None = None,
    ):
        c = config
        self.config = c
        self.layout = layout
        din = c.hidden_size if input_size is None else input_size
        if layout == "fused":
            group = c.num_heads // c.num_kv_heads
            self.qkv_proj = Projection(
                din, (c.num_kv_heads, group + 2, c.head_dim), c.attention_bias, dtype, rngs
            )
            self.o_proj = Projection(c.num_heads * c.head_dim, (c.hidden_size,), False, dtype, rngs)
        else:
            self.q_proj = split_linear(din, c.num_heads * c.head_dim, c.attention_bias, dtype, rngs)
            self.k_proj = split_linear(din, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
            self.v_proj = split_linear(din, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
            self.o_proj = split_linear(c.num_heads * c.head_dim, c.hidden_size, False, dtype, rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    def rotated_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, N, Din], cos/sin [B, N, D] -> q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D]; q and
        k normalised per head when config.qk_norm (Qwen3), then rotated."""
        c = self.config
        b, n, _ = x.shape
        if self.layout == "fused":
            qkv = self.qkv_proj(x)  # [B, N, Hkv, G + 2, D]
            group = c.num_heads // c.num_kv_heads
            q = qkv[:, :, :, :group].reshape(b, n, c.num_heads, c.head_dim).transpose(0, 2, 1, 3)
            k = qkv[:, :, :, group].transpose(0, 2, 1, 3)
            v = qkv[:, :, :, group + 1].transpose(0, 2, 1, 3)
        else:
            q = self.q_proj(x).reshape(b, n, c.num_heads, c.head_dim).transpose(0, 2, 1, 3)
            k = self.k_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: Attend
    ) -> tuple[jax.Array, tuple]:
        """x [B, N, Din] -> (out [B, N, d], what `attend` carries)."""
        c = self.config
        b, n, _ = x.shape
        out, carried = attend(*self.rotated_qkv(x, cos, sin))
        out = out.transpose(0, 2, 1, 3).reshape(b, n, c.num_heads * c.head_dim)
        return self.o_proj(out), carried


def cached_attend(
    attention_fn: AttentionFn,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    scale: float,
) -> Attend:
    """The target's step for one layer: attention_fn (`jaxspec.model.forward.cached_attention`) writes the
    N new keys/values into the caches [B, Hkv, S, D] at [lengths, lengths + N) and attends over prefix +
    visible new tokens; carries (k_cache, v_cache)."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple]:
        out, k_cache_, v_cache_ = attention_fn(q, k_cache, v_cache, lengths, k, v, tree_mask, scale=scale)
        return out, (k_cache_, v_cache_)

    return attend


class MLP(nnx.Module):
    """SwiGLU. layout "fused": gate and up in one projection, gate_up_proj.weight [2, f, d], down_proj.weight
    [d, f]; "split": gate_proj, up_proj, down_proj NNX Linear layers (kernels [in, out])."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, *, layout: str = "fused"):
        d, f = config.hidden_size, config.intermediate_size
        self.layout = layout
        if layout == "fused":
            self.gate_up_proj = Projection(d, (2, f), False, dtype, rngs)
            self.down_proj = Projection(f, (d,), False, dtype, rngs)
        else:
            self.gate_proj = split_linear(d, f, False, dtype, rngs)
            self.up_proj = split_linear(d, f, False, dtype, rngs)
            self.down_proj = split_linear(f, d, False, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.layout == "split":
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        return self.down_proj(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])


class DecoderLayer(nnx.Module):
    """One Llama decoder layer: the target's and every draft head's (one implementation).

    layout: "fused" (the target) or "split" (heads), see `LAYOUTS`. input_norm: "rms" (standard:
    input_layernorm(x)), "none" (EAGLE-1's layer 0: x as is) or "eagle3" ([input_layernorm(embeddings);
    hidden_norm(x)], a 2d-wide attention input). The residual is x.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        *,
        layout: str = "fused",
        input_norm: str = "rms",
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"DecoderLayer: layout must be one of {LAYOUTS}, got {layout!r}")
        if input_norm not in INPUT_NORMS:
            raise ValueError(f"DecoderLayer: input_norm must be rms|none|eagle3, got {input_norm!r}")
        d = config.hidden_size
        self.input_norm = input_norm
        if input_norm != "none":
            self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        if input_norm == "eagle3":
            self.hidden_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        attn_in = 2 * d if input_norm == "eagle3" else d
        self.self_attn = Attention(config, dtype, rngs, layout=layout, input_size=attn_in)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs, layout=layout)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        attend: Attend,
        embeddings: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """x [B, N, d] (embeddings [B, N, d] for "eagle3") -> (out [B, N, d], *what `attend` carries): the
        target's (out, k_cache, v_cache), a head's (out, own keys, own values)."""
        if self.input_norm == "rms":
            attn_in = self.input_layernorm(x)
        elif self.input_norm == "none":
            attn_in = x
        else:
            attn_in = jnp.concatenate([self.input_layernorm(embeddings), self.hidden_norm(x)], axis=-1)
        attn, carried = self.self_attn(attn_in, cos, sin, attend)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, *carried


class LlamaModel(nnx.Module):
    """Decoder stack + (tied or untied) LM head."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
        )  # fmt: skip
        self.layers = nnx.List(self.decoder_layers(config, dtype, rngs))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Projection(config.hidden_size, (config.vocab_size,), False, dtype, rngs)

    def decoder_layers(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> list[nnx.Module]:
        """The decoder stack (subclasses with other layers override this: `jaxspec.model.deepseek_v3`)."""
        return [DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)]

    def rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [B, N] -> (cos, sin) of the rotary embedding, as the decoder layers take them."""
        return rope_cos_sin(positions, inverse_frequencies(self.config))

    def layer_runner(self, lengths: jax.Array, tree_mask: jax.Array, attention_fn: AttentionFn) -> Callable:
        """One forward's per-layer step: (layer, x [B, N, d], cos, sin, layer's two cache buffers) ->
        (x, the buffers with the N new entries written). Subclasses whose layers keep another cache
        (`jaxspec.model.deepseek_v3`: latents and rope keys) override this and `rotary`."""

        scale = self.config.head_dim**-0.5

        def run(layer, x, cos, sin, k_cache, v_cache):
            x, k_cache, v_cache = layer(
                x, cos, sin, cached_attend(attention_fn, k_cache, v_cache, lengths, tree_mask, scale)
            )
            return x, k_cache, v_cache

        return run

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, N] -> embeddings [B, N, d]."""
        return self.embed_tokens(tokens)

    def lm_head_rows(self) -> jax.Array:
        """[V, d] the LM head's rows: the token embedding when tied."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...]
        return self.lm_head.weight[...]

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] (after the final norm) -> float32 logits [..., V]."""
        return project(self.lm_head_rows(), hidden, jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        tree_mask: jax.Array,
        attention_fn: AttentionFn,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
        """One forward over N new tokens per row.

        Args:
          tokens: [B, N] int32 new tokens (a prompt chunk, one decode token, or a draft tree).
          positions: [B, N] int32 rotary positions (cache length + depth for trees).
          cache: committed KV; new keys/values are written at [lengths, lengths + N).
          tree_mask: [B, N, N] bool visibility among the new tokens (causal for a chain).
          attention_fn: cache write + tree attention (`jaxspec.model.forward.cached_attention`).
          capture_layers: indices of decoder layers whose outputs are returned (for draft heads).
        Returns:
          final hidden [B, N, d] (after the final norm), captured layer outputs (each [B, N, d]),
          and the cache with the window written (lengths unchanged; commit advances them).
        """
        cos, sin = self.rotary(positions)
        run_layer = self.layer_runner(cache.lengths, tree_mask, attention_fn)
        x = self.embed(tokens)
        new_keys, new_values, captured = [], [], {}
        for i, layer in enumerate(self.layers):
            x, k_cache, v_cache = run_layer(layer, x, cos, sin, cache.keys[i], cache.values[i])
            new_keys.append(k_cache)
            new_values.append(v_cache)
            if i in capture_layers:
                captured[i] = x
        cache = KVCache(keys=tuple(new_keys), values=tuple(new_values), lengths=cache.lengths)
        return self.norm(x), tuple(captured[i] for i in capture_layers), cache
