"""EAGLE-1/2 head (Li et al. 2024): feature-level autoregression with one decoder layer.

Pair i of a sequence is (f_i, t_(i+1)): the target's post-norm final hidden state at token i and the
token after it. The head maps fc([Emb(t_(i+1)); f_i]) through one decoder layer to a predicted f_(i+1),
whose logits come from the target's frozen LM head (token t_(i+2)). Drafting feeds the predicted
feature back as the next pair's feature. The rotary position of pair i is i.

Interface shared with the EAGLE-3 head (the drafter only uses these):
  embed(tokens, target_embed) -> [..., d]          token embeddings (the target's, frozen)
  project_target_features(features) -> [..., d]    identity here (EAGLE-3 fuses three layers)
  __call__(embeddings, hidden, positions, inputs)  -> (next hidden [B, N, d], own keys, own values
                                                      [L, B, Hkv, N, D], one per decoder layer: L = 1)
  logits(hidden, target_lm) -> [..., V]            target-vocabulary logits
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import EagleConfig
from jaxspec.drafters.heads.layers import (
    AttentionInputs,
    causal_visible,
    empty_cache_inputs,
    rope_for,
)
from jaxspec.model.llama import DecoderLayer, split_linear


class EagleHead(nnx.Module):
    def __init__(self, config: EagleConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = config.layer.hidden_size
        self.config = config
        self.fc = split_linear(2 * d, d, config.fc_bias, dtype, rngs)
        self.layer = DecoderLayer(
            config.layer, dtype, rngs, layout="split", input_norm="rms" if config.input_norm else "none"
        )

    def embed(self, tokens: jax.Array, target_embed: Callable[[jax.Array], jax.Array]) -> jax.Array:
        return target_embed(tokens)

    def project_target_features(self, features: jax.Array) -> jax.Array:
        return features

    def __call__(
        self, embeddings: jax.Array, hidden: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """embeddings/hidden [B, N, d], positions [B, N] -> (next features [B, N, d], keys, values
        [1, B, Hkv, N, D])."""
        x = self.fc(jnp.concatenate([embeddings, hidden.astype(embeddings.dtype)], axis=-1))
        cos, sin = rope_for(self.config.layer, positions)
        out, k, v = self.layer(x, cos, sin, inputs.layer(0))
        return out, k[None], v[None]

    def logits(self, hidden: jax.Array, target_lm: Callable[[jax.Array], jax.Array]) -> jax.Array:
        return target_lm(hidden).astype(jnp.float32)


def init_eagle(config: EagleConfig, dtype: jnp.dtype, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Seeded random head (graphdef, params)."""
    return nnx.split(EagleHead(config, dtype, nnx.Rngs(seed)))


def eagle_sequence_forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    embeddings: jax.Array,
    features: jax.Array,
    project: bool = True,
) -> jax.Array:
    """Teacher-forced pass over whole sequences (training, tests), EAGLE-1 or EAGLE-3 head.

    embeddings [B, N, d]: embeddings of t_(i+1); features [B, N, F]: raw target features of token i
    (F = d, or 3 d_target for EAGLE-3), or with project=False features already in the head's width
    (e.g. the head's own predictions). Pair i sits at rotary position i; causal attention, no cache.
    Returns the predicted features [B, N, d] (logits: `head.logits`).
    """
    head = nnx.merge(graphdef, params)
    batch, n, _ = embeddings.shape
    layer = head.config.layer
    inputs = empty_cache_inputs(
        batch, layer.num_kv_heads, layer.head_dim, causal_visible(n), embeddings.dtype
    )
    positions = jnp.broadcast_to(jnp.arange(n)[None, :], (batch, n))
    hidden = head.project_target_features(features) if project else features
    out, _, _ = head(embeddings, hidden, positions, inputs)
    return out
