"""Building blocks shared by the attention-based heads (EAGLE-1, EAGLE-3, MTP).

One masked-attention function serves every shape of head work: a chunk of newly committed tokens
(causal), one draft step of a chain, the frontier of a dynamic tree (each node sees its ancestors), or
a window of MTP positions per tree path. Queries attend to three key sets, each under its own mask:

  cache [B, Hkv, S, D]   committed keys (cache_visible [B, N or 1, S])
  extra [B, Hkv, M, D]   keys of earlier draft steps of this round (extra_visible [B, N, M]), optional
  own   [B, Hkv, N, D]   the queries' own keys (own_visible [B, N, N] or [N, N]); the diagonal is
                         always visible, so no row is empty.

The head's KV cache holds committed tokens only; speculative keys live in per-round buffers (`extra`)
and are dropped after the round, so rejected drafts never pollute the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.config import ModelConfig
from jaxspec.model.llama import RMSNorm
from jaxspec.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

_MASKED = -1e30


class VocabMap(nnx.Variable):
    """Integer / boolean lookup tables of a head (EAGLE-3's d2t, t2d): loaded, never trained."""


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """What the queries of one head forward may attend to (see the module docstring for shapes)."""

    cache_keys: jax.Array
    cache_values: jax.Array
    cache_visible: jax.Array
    own_visible: jax.Array
    extra_keys: jax.Array | None = None
    extra_values: jax.Array | None = None
    extra_visible: jax.Array | None = None


def empty_cache_inputs(batch: int, num_kv_heads: int, head_dim: int, own_visible: jax.Array, dtype):
    """AttentionInputs without committed keys (training over whole sequences, prompt prefill)."""
    empty = jnp.zeros((batch, num_kv_heads, 0, head_dim), dtype)
    return AttentionInputs(empty, empty, jnp.zeros((batch, 1, 0), bool), own_visible)


def causal_visible(n: int) -> jax.Array:
    """[N, N] lower-triangular visibility."""
    return jnp.tril(jnp.ones((n, n), bool))


def masked_attention(
    q: jax.Array, own_keys: jax.Array, own_values: jax.Array, inputs: AttentionInputs, scale: float
) -> jax.Array:
    """q [B, Hq, N, D], own keys/values [B, Hkv, N, D] -> [B, Hq, N, D] (grouped-query attention)."""
    b, hq, n, d = q.shape
    hkv = own_keys.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, n, d).astype(jnp.float32)
    own_visible = jnp.broadcast_to(inputs.own_visible, (b, n, n)) | jnp.eye(n, dtype=bool)[None]
    parts = [(inputs.cache_keys, inputs.cache_values, inputs.cache_visible)]
    if inputs.extra_keys is not None:
        parts.append((inputs.extra_keys, inputs.extra_values, inputs.extra_visible))
    parts.append((own_keys, own_values, own_visible))

    scores, masks, values = [], [], []
    for keys, vals, visible in parts:
        scores.append(jnp.einsum("bhgnd,bhsd->bhgns", qg, keys.astype(jnp.float32)))
        masks.append(jnp.broadcast_to(visible, (b, n, keys.shape[2])))
        values.append(vals.astype(jnp.float32))
    logits = jnp.concatenate(scores, axis=-1) * scale
    mask = jnp.concatenate(masks, axis=-1)[:, None, None]
    probs = jax.nn.softmax(jnp.where(mask, logits, _MASKED), axis=-1)
    out = jnp.einsum("bhgns,bhsd->bhgnd", probs, jnp.concatenate(values, axis=2))
    return out.reshape(b, hq, n, d).astype(q.dtype)


def head_linear(din: int, dout: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.initializers.normal(0.02)
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=init, rngs=rngs)


def rope_for(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, N] -> cos, sin [B, N, head_dim]."""
    return rope_cos_sin(positions, inverse_frequencies(config))


class HeadMLP(nnx.Module):
    """SwiGLU with separate gate/up/down NNX Linear layers (kernels [in, out]), the layout head
    checkpoints are stored in."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = head_linear(d, f, False, dtype, rngs)
        self.up_proj = head_linear(d, f, False, dtype, rngs)
        self.down_proj = head_linear(f, d, False, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadAttention(nnx.Module):
    """Llama attention whose projections may read a wider input (EAGLE-3: 2d)."""

    def __init__(self, config: ModelConfig, input_size: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.q_proj = head_linear(input_size, c.num_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.k_proj = head_linear(input_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.v_proj = head_linear(input_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.o_proj = head_linear(c.num_heads * c.head_dim, c.hidden_size, False, dtype, rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    def rotated_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, N, Din], cos/sin [B, N, D] -> q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D]; q and
        k normalised per head when config.qk_norm (Qwen3), then rotated."""
        c = self.config
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, c.num_heads, c.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, c.num_kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, N, Din] -> (out [B, N, d], own keys [B, Hkv, N, D], own values [B, Hkv, N, D])."""
        c = self.config
        b, n, _ = x.shape
        q, k, v = self.rotated_qkv(x, cos, sin)
        out = masked_attention(q, k, v, inputs, c.head_dim**-0.5)
        out = out.transpose(0, 2, 1, 3).reshape(b, n, c.num_heads * c.head_dim)
        return self.o_proj(out), k, v


class HeadDecoderLayer(nnx.Module):
    """One Llama decoder layer with a choice of attention input.

    input_norm: "rms" (standard: input_layernorm(x)), "none" (EAGLE-1's layer 0: x as is) or "eagle3"
    ([input_layernorm(embeddings); hidden_norm(x)], a 2d-wide attention input). The residual is x.
    """

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, *, input_norm: str = "rms"):
        if input_norm not in ("rms", "none", "eagle3"):
            raise ValueError(f"HeadDecoderLayer: input_norm must be rms|none|eagle3, got {input_norm!r}")
        d = config.hidden_size
        self.input_norm = input_norm
        if input_norm != "none":
            self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        if input_norm == "eagle3":
            self.hidden_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        attn_in = 2 * d if input_norm == "eagle3" else d
        self.self_attn = HeadAttention(config, attn_in, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.mlp = HeadMLP(config, dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        inputs: AttentionInputs,
        embeddings: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, N, d] (embeddings [B, N, d] for "eagle3") -> (out [B, N, d], own keys, own values)."""
        if self.input_norm == "rms":
            attn_in = self.input_layernorm(x)
        elif self.input_norm == "none":
            attn_in = x
        else:
            attn_in = jnp.concatenate([self.input_layernorm(embeddings), self.hidden_norm(x)], axis=-1)
        attn, k, v = self.self_attn(attn_in, cos, sin, inputs)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v
