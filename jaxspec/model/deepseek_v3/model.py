"""DeepSeek-V3 decoder as Flax NNX modules: Multi-head Latent Attention (MLA) and the mixture of experts.

MLA (absorbed form). Per token, x [d] gives
  q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) without q LoRA)   [H, qk_nope + qk_rope]
  [c, k_pe] = kv_a_proj_with_mqa(x); c = kv_a_layernorm(c)                  latent [r], rope key [dr]
and the keys/values of head h are k = [W_uk[h] c ; rope(k_pe)], v = W_uv[h] c (kv_b_proj = [W_uk; W_uv]
per head). Only c and rope(k_pe) are cached (`DeepseekV3Config.kv_cache_dims`). Attention is computed
without expanding the cache: q_lat = q_nope W_uk (per head, [r]), score = q_lat . c + rope(q_pe) .
rope(k_pe), out_h = W_uv[h] (sum_s p_s c_s) -- the same numbers as the expanded form, reading r + dr
features per cached token instead of H (2 qk_nope + ...) (vLLM / FlashMLA's decode form). This jnp
path is the reference for prefill, decode and tree verification; there is no Pallas MLA kernel yet.

Rope covers the last qk_rope_head_dim features, YaRN-scaled as configured (transformers'
`_compute_yarn_parameters`: ramped inverse frequencies, cos/sin times the attention factor, softmax
scale times mscale(factor, mscale_all_dim)^2). rope_interleave (DeepSeek's checkpoints): the rope
features are rotated in adjacent pairs; they are de-interleaved first (the same permutation on q and
k leaves every score unchanged).

MoE: sigmoid router scores s = sigmoid(W_g x) (float32); choice = s + e_score_correction_bias; the
n_group groups are ranked by the sum of their top two choices, the best topk_group kept, then the top
num_experts_per_tok experts among them; weights = s of the chosen (normalised when norm_topk_prob) x
routed_scaling_factor; output = sum_e w_e SwiGLU_e(x) + shared experts(x). Experts are computed for
all tokens and combined with zero weight where not chosen (the reference form: exact, and it shards
over an expert axis with one all-reduce; a grouped-matmul dispatch would save the E / k compute).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.model.deepseek_v3.config import DeepseekV3Config, yarn_mscale
from jaxspec.model.kv_cache import write_window
from jaxspec.model.llama import MLP, LlamaModel, Projection, RMSNorm, project

_MASKED = -1e30
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's RMSNorm default, not rms_norm_eps

# A layer's attention step: (q_lat [B, N, H, r], q_pe [B, N, H, dr], latent [B, N, r], k_pe [B, N, dr])
# -> (out_lat [B, N, H, r], whatever the caller carries out: the written caches, or the new entries).
Attend = Callable[..., tuple[jax.Array, tuple]]


# ---------------------------------------------------------------------------------------------------
# Rope (YaRN) and the softmax scale
# ---------------------------------------------------------------------------------------------------


def rope_frequencies(config: DeepseekV3Config) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dr / 2] float32, cos/sin factor) of the rope part, YaRN when configured."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    pos_freqs = base**exponents
    if config.yarn is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = config.yarn
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(config: DeepseekV3Config) -> float:
    scale = config.qk_head_dim**-0.5
    if config.yarn is not None and config.yarn[5]:
        mscale = yarn_mscale(config.yarn[0], config.yarn[5])
        scale = scale * mscale * mscale
    return scale


def rope_cos_sin(config: DeepseekV3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, N] -> cos, sin [B, N, dr] float32 (times YaRN's attention factor)."""
    inv_freq, factor = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x [B, N, ..., dr], cos/sin [B, N, dr] -> rotated x (rotate-half layout, float32)."""
    x = x.astype(jnp.float32)
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    extra = (None,) * (x.ndim - 3)
    cos, sin = cos[:, :, *extra, :], sin[:, :, *extra, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------------


def latent_attention(
    q_lat: jax.Array, q_pe: jax.Array, parts: list[tuple[jax.Array, jax.Array, jax.Array]], scale: float
) -> jax.Array:
    """Absorbed-form MLA over key sets given as (latent [B, S, r], rope key [B, S, dr], visible [B, N, S]).

    q_lat [B, N, H, r], q_pe [B, N, H, dr] -> out_lat [B, N, H, r] (float32): softmax over all parts
    of scale * (q_lat . c + q_pe . k_pe), then the probability-weighted latents. Parts with no slots
    are skipped.
    """
    q_lat, q_pe = q_lat.astype(jnp.float32), q_pe.astype(jnp.float32)
    parts = [part for part in parts if part[0].shape[1] > 0]
    scores = [
        jnp.einsum("bnhr,bsr->bhns", q_lat, latent.astype(jnp.float32))
        + jnp.einsum("bnhp,bsp->bhns", q_pe, rope.astype(jnp.float32))
        for latent, rope, _ in parts
    ]
    visible = jnp.concatenate(
        [jnp.broadcast_to(v, (*q_lat.shape[:2], lat.shape[1])) for lat, _, v in parts], -1
    )
    logits = jnp.where(visible[:, None], jnp.concatenate(scores, axis=-1) * scale, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    latents = jnp.concatenate([latent.astype(jnp.float32) for latent, _, _ in parts], axis=1)
    return jnp.einsum("bhns,bsr->bnhr", probs, latents)


def window_visibility(lengths: jax.Array, tree_mask: jax.Array, num_slots: int) -> jax.Array:
    """[B, N, S]: a new token sees the committed prefix [0, lengths) and, among the N new tokens written
    at [lengths, lengths + N), those tree_mask [B, N, N] allows (its ancestors and itself)."""
    n = tree_mask.shape[-1]
    relative = jnp.arange(num_slots)[None, :] - lengths[:, None]  # [B, S]
    in_window = (relative >= 0) & (relative < n)
    tree = jnp.take_along_axis(
        tree_mask,
        jnp.broadcast_to(jnp.clip(relative, 0, n - 1)[:, None, :], (*tree_mask.shape[:2], num_slots)),
        2,
    )
    return (relative < 0)[:, None, :] | (in_window[:, None, :] & tree)


class MultiHeadLatentAttention(nnx.Module):
    """MLA projections (module docstring). Weights ([*out, in], PyTorch order): q_a_proj [q_lora, d],
    q_b_proj [H, qk_head_dim, q_lora] (q_proj [H, qk_head_dim, d] without q LoRA), kv_a_proj_with_mqa
    [r + dr, d], kv_b_proj [H, qk_nope + v_head_dim, r], o_proj [d, H * v_head_dim]."""

    def __init__(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        d, h = c.hidden_size, c.num_heads
        if c.q_lora_rank is None:
            self.q_proj = Projection(d, (h, c.qk_head_dim), False, dtype, rngs)
        else:
            self.q_a_proj = Projection(d, (c.q_lora_rank,), False, dtype, rngs)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = Projection(c.q_lora_rank, (h, c.qk_head_dim), False, dtype, rngs)
        self.kv_a_proj_with_mqa = Projection(d, (c.kv_lora_rank + c.qk_rope_head_dim,), False, dtype, rngs)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = Projection(
            c.kv_lora_rank, (h, c.qk_nope_head_dim + c.v_head_dim), False, dtype, rngs
        )
        self.o_proj = Projection(h * c.v_head_dim, (d,), False, dtype, rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: Attend
    ) -> tuple[jax.Array, tuple]:
        """x [B, N, d], cos/sin [B, N, dr] -> (out [B, N, d], what `attend` carries out)."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, N, H, qk_head_dim]
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : c.kv_lora_rank])
        k_pe = apply_rope(kv[..., c.kv_lora_rank :], cos, sin, c.rope_interleave)
        q_pe = apply_rope(q_pe, cos, sin, c.rope_interleave)
        kv_b = self.kv_b_proj.weight[...]
        w_uk, w_uv = kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim :]  # [H, dn, r], [H, dv, r]
        q_lat = jnp.einsum("bnhk,hkr->bnhr", q_nope, w_uk, preferred_element_type=jnp.float32)
        out_lat, carried = attend(q_lat, q_pe, latent, k_pe.astype(latent.dtype))
        out = jnp.einsum("bnhr,hvr->bnhv", out_lat.astype(w_uv.dtype), w_uv)
        return self.o_proj(out.reshape(*x.shape[:2], -1)), carried


# ---------------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------------


class Router(nnx.Module):
    """weight [E, d], e_score_correction_bias [E] (the bias only ranks experts, never weights them)."""

    def __init__(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        e = config.n_routed_experts
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (e, config.hidden_size), dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, d] -> combine weights [T, E] float32 (zero for experts not chosen)."""
        c = self.config
        scores = jax.nn.sigmoid(project(self.weight[...].astype(jnp.float32), x, jnp.float32))
        choice = scores + self.e_score_correction_bias[...].astype(jnp.float32)
        t, e = choice.shape
        grouped = choice.reshape(t, c.n_group, e // c.n_group)
        group_scores = jax.lax.top_k(grouped, min(2, e // c.n_group))[0].sum(-1)  # [T, G]
        _, groups = jax.lax.top_k(group_scores, c.topk_group)
        group_kept = jnp.zeros((t, c.n_group), bool).at[jnp.arange(t)[:, None], groups].set(True)
        kept = jnp.repeat(group_kept, e // c.n_group, axis=1)
        _, chosen = jax.lax.top_k(jnp.where(kept, choice, -jnp.inf), c.num_experts_per_tok)  # [T, k]
        weights = jnp.take_along_axis(scores, chosen, axis=1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * c.routed_scaling_factor
        return jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], chosen].add(weights)


class Experts(nnx.Module):
    """Routed SwiGLU experts: gate_up_proj [E, 2, I, d], down_proj [E, d, I]."""

    def __init__(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, 2, i, d), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, d, i), dtype))

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """x [T, d], combine [T, E] -> sum_e combine[:, e] * expert_e(x)  [T, d]."""
        gate_up = self.gate_up_proj[...]
        h = jnp.einsum("td,ecfd->tecf", x.astype(gate_up.dtype), gate_up)
        act = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]  # [T, E, I]
        act = act * combine.astype(act.dtype)[:, :, None]
        return jnp.einsum("tei,edi->td", act, self.down_proj[...])


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = Router(config, dtype, rngs)
        self.experts = Experts(config, dtype, rngs)
        if config.n_shared_experts:
            shared = config.replace(intermediate_size=config.moe_intermediate_size * config.n_shared_experts)
            self.shared_experts = MLP(shared, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., d] -> [..., d]."""
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, self.gate(flat)).astype(x.dtype).reshape(x.shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


# ---------------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------------


class DeepseekV3DecoderLayer(nnx.Module):
    """RMSNorm -> MLA -> residual, RMSNorm -> (dense SwiGLU or MoE) -> residual."""

    def __init__(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs, *, moe: bool):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MultiHeadLatentAttention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MoE(config, dtype, rngs) if moe else MLP(config, dtype, rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, attend: Attend
    ) -> tuple[jax.Array, tuple]:
        attn, carried = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, carried


def cached_latent_attention(scale: float, lengths: jax.Array, tree_mask: jax.Array):
    """The target's attention step for one layer's (latent cache [B, 1, S, r], rope cache [B, 1, S, dr]):
    write the N new entries at [lengths, lengths + N), then attend over prefix + visible new tokens."""

    def for_layer(latent_cache: jax.Array, rope_cache: jax.Array) -> Attend:
        def attend(q_lat, q_pe, latent, k_pe):
            latent_cache_ = write_window(latent_cache, latent[:, None], lengths)
            rope_cache_ = write_window(rope_cache, k_pe[:, None], lengths)
            visible = window_visibility(lengths, tree_mask, latent_cache_.shape[2])
            out = latent_attention(q_lat, q_pe, [(latent_cache_[:, 0], rope_cache_[:, 0], visible)], scale)
            return out, (latent_cache_, rope_cache_)

        return attend

    return for_layer


class DeepseekV3Model(LlamaModel):
    """Embedding, decoder stack (first_k_dense_replace dense layers, then MoE), final norm, LM head.

    Same interface as `LlamaModel` (embed, lm_logits, __call__), so prefill, decode, tree verification
    and commit run unchanged; the cache holds latents and rope keys (see the module docstring).
    """

    def decoder_layers(self, config: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs) -> list[nnx.Module]:
        return [
            DeepseekV3DecoderLayer(config, dtype, rngs, moe=config.is_moe_layer(i))
            for i in range(config.num_layers)
        ]

    def rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [B, N] -> (cos, sin) of the (YaRN-scaled) rope part of MLA."""
        return rope_cos_sin(self.config, positions)

    def layer_runner(self, lengths: jax.Array, tree_mask: jax.Array, attention_fn: object) -> Callable:
        """`LlamaModel.layer_runner` for MLA layers (attention_fn is not used: MLA always runs its jnp
        absorbed form). A layer's two cache buffers are its latents [B, 1, S, r] and rope keys
        [B, 1, S, dr]; the N new entries are written at [lengths, lengths + N)."""
        step = cached_latent_attention(softmax_scale(self.config), lengths, tree_mask)

        def run(layer, x, cos, sin, latent_cache, rope_cache):
            x, (latent_cache, rope_cache) = layer(x, cos, sin, step(latent_cache, rope_cache))
            return x, latent_cache, rope_cache

        return run
