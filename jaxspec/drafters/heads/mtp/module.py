"""MiMo-style multi-token prediction modules (the DeepSeek-V3 paper's chained MTP), as a draft head.

Module k (k = 1..D) at position i reads h_i^(k-1) (h^0 = the target's post-norm final hidden state)
and the embedding of token t_(i+k):
  x = eh_proj([enorm(Emb(t_(i+k))); hnorm(h_i^(k-1))])     (MiMo: [hnorm(h); enorm(Emb)])
  h_i^k = block(x)       one decoder layer, causal over positions i, its own KV cache
  logits of t_(i+k+1) = target LM head(final_norm(h_i^k))
The modules' weights are stacked along a leading axis [num_modules, ...] so a `lax.scan` over draft
steps picks module k mod num_modules with a dynamic index (`module_params`).

`MtpModule` runs a Llama-family block (MiMo); `DeepseekMtpModule` runs DeepSeek-V3's MLA + MoE block,
whose attention caches latents and rope keys like the target's (`HeadCache.keys` / `.values`:
[.., B, 1, S, r] / [.., B, 1, S, dr]); `module_class` picks one from the head's layer config.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import MtpConfig
from jaxspec.drafters.heads.layers import (
    AttentionInputs,
    causal_visible,
    empty_cache_inputs,
    rope_for,
)
from jaxspec.model.config import ModelConfig
from jaxspec.model.deepseek_v3.config import DeepseekV3Config
from jaxspec.model.deepseek_v3.model import (
    DeepseekV3DecoderLayer,
    latent_attention,
    rope_cos_sin,
    softmax_scale,
)
from jaxspec.model.llama import DecoderLayer, RMSNorm, split_linear


class MtpModule(nnx.Module):
    def __init__(self, config: MtpConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config.layer
        d = c.hidden_size
        self.config = config
        self.enorm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.eh_proj = split_linear(2 * d, d, False, dtype, rngs)
        self.block = self.make_block(c, dtype, rngs)
        self.final_norm = RMSNorm(d, c.rms_norm_eps, dtype)

    def make_block(self, layer: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The module's decoder block (a Llama-family layer; DeepSeek-V3's MTP overrides it)."""
        return DecoderLayer(layer, dtype, rngs, layout="split", input_norm="rms")

    def run_block(
        self, x: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, N, d], positions [B, N] -> (block output [B, N, d], own keys, own values)."""
        cos, sin = rope_for(self.config.layer, positions)
        return self.block(x, cos, sin, inputs)

    def __call__(
        self, embeddings: jax.Array, hidden: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """embeddings/hidden [B, N, d], positions [B, N] ->
        (h^k to pass on [B, N, d], final-normed h^k for the LM head [B, N, d], own keys, own values)."""
        e = self.enorm(embeddings)
        h = self.hnorm(hidden.astype(embeddings.dtype))
        pair = [e, h] if self.config.embedding_first else [h, e]
        x = self.eh_proj(jnp.concatenate(pair, axis=-1))
        out, k, v = self.run_block(x, positions, inputs)
        normed = self.final_norm(out)
        return (normed if self.config.recycle_normed else out), normed, k, v


def module_params(stacked: nnx.State, index: jax.Array | int) -> nnx.State:
    """The parameters of module `index` from the stacked [num_modules, ...] state."""
    return jax.tree.map(lambda x: x[index], stacked)


def mtp_module_forward(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    index: jax.Array | int,
    embeddings: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    inputs: AttentionInputs,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure function for drafting and training: module `index` (see `MtpModule.__call__`)."""
    return nnx.merge(graphdef, module_params(stacked, index))(embeddings, hidden, positions, inputs)


def mtp_logits(normed: jax.Array, target_lm: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The shared output head: the target's LM head over the module's final-normed output."""
    return target_lm(normed).astype(jnp.float32)


def stack_modules(states: list[nnx.State]) -> nnx.State:
    """Stack per-module states (same structure) along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def module_class(config: MtpConfig) -> type[nnx.Module]:
    """MtpModule (Llama-family block), or DeepSeek-V3's MLA + MoE module for a DeepSeek-V3 target."""
    if isinstance(config.layer, DeepseekV3Config):
        return DeepseekMtpModule
    return MtpModule


def abstract_module(config: MtpConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, shape-only params) of ONE module."""
    return nnx.split(nnx.eval_shape(lambda: module_class(config)(config, dtype, nnx.Rngs(0))))


def init_mtp(config: MtpConfig, dtype: jnp.dtype, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Seeded random modules: (graphdef of one module, stacked params [num_modules, ...])."""
    graphdef, states = None, []
    for k in range(config.num_modules):
        graphdef, state = nnx.split(module_class(config)(config, dtype, nnx.Rngs(seed + 1000 * k)))
        states.append(state)
    return graphdef, stack_modules(states)


def mtp_sequence_forward(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    index: int,
    embeddings: jax.Array,
    hidden: jax.Array,
    first_position: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Module `index` over whole sequences (training, tests): embeddings [B, N, d] of t_(i+k), hidden
    [B, N, d] = h^(k-1); causal, no cache; rotary position of row i = i + first_position.
    Returns (h^k to pass on, final-normed h^k for the LM head), each [B, N, d]."""
    batch, n, _ = embeddings.shape
    module = nnx.merge(graphdef, module_params(stacked, index))
    layer = module.config.layer
    inputs = empty_cache_inputs(
        batch, layer.num_kv_heads, layer.head_dim, causal_visible(n), embeddings.dtype
    )
    positions = jnp.broadcast_to(jnp.arange(n)[None, :] + first_position, (batch, n))
    passed, normed, _, _ = module(embeddings, hidden, positions, inputs)
    return passed, normed


def head_attention(inputs: AttentionInputs, scale: float):
    """An MLA attention step over a head's key sets: the committed cache, this round's earlier draft
    steps (optional) and the queries' own new entries (`jaxspec.drafters.heads.layers` for the masks)."""

    def attend(q_lat, q_pe, latent, k_pe):
        n = latent.shape[1]
        own_visible = jnp.broadcast_to(inputs.own_visible, (latent.shape[0], n, n)) | jnp.eye(n, dtype=bool)
        parts = [(inputs.cache_keys[:, 0], inputs.cache_values[:, 0], inputs.cache_visible)]
        if inputs.extra_keys is not None:
            parts.append((inputs.extra_keys[:, 0], inputs.extra_values[:, 0], inputs.extra_visible))
        parts.append((latent, k_pe, own_visible))
        return latent_attention(q_lat, q_pe, parts, scale), (latent[:, None], k_pe[:, None])

    return attend


class DeepseekMtpModule(MtpModule):
    """One DeepSeek-V3 MTP module: `MtpModule` (enorm, hnorm, eh_proj, final_norm = shared_head.norm)
    with an MLA + MoE block; its own keys / values are latents [B, 1, N, r] / rope keys [B, 1, N, dr]."""

    def make_block(self, layer: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        # The MTP layers sit at index num_hidden_layers, past the first dense layers: always MoE (a head's
        # layer config may carry num_layers=1, `head_layer_config`, so the index is not read from it).
        return DeepseekV3DecoderLayer(layer, dtype, rngs, moe=True)

    def run_block(
        self, x: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        layer = self.config.layer
        cos, sin = rope_cos_sin(layer, positions)
        out, (latent, k_pe) = self.block(x, cos, sin, head_attention(inputs, softmax_scale(layer)))
        return out, latent, k_pe
