"""Medusa heads (Cai et al. 2024): K residual SiLU blocks over the target's last hidden state.

All heads' weights are stacked so every head runs in one batched contraction:
  res_kernel [K, L, d, d], res_bias [K, L, d]   block j of head i: x <- x + silu(x @ W[i, j] + b[i, j])
  lm_kernel  [K, d, V] (own LM heads) or none   (the target's LM head, Medusa-2 style)
Head i reads the post-norm final hidden state at position t (the one whose LM head gives t + 1) and
predicts token t + 2 + i.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import MedusaConfig


class MedusaHeads(nnx.Module):
    def __init__(self, config: MedusaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        k, layers, d, v = config.num_heads, config.num_layers, config.hidden_size, config.vocab_size
        init = nnx.initializers.normal(0.02)
        self.config = config
        self.res_kernel = nnx.Param(init(rngs.params(), (k, layers, d, d), dtype))
        self.res_bias = nnx.Param(jnp.zeros((k, layers, d), dtype))
        if config.own_lm_head:
            self.lm_kernel = nnx.Param(init(rngs.params(), (k, d, v), dtype))

    def features(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] -> per-head features [..., K, d] after the residual blocks."""
        k = self.config.num_heads
        x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (k, hidden.shape[-1]))
        for j in range(self.config.num_layers):
            w, b = self.res_kernel[:, j], self.res_bias[:, j]
            x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w) + b)
        return x

    def __call__(self, hidden: jax.Array, target_lm: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """hidden [..., d] -> float32 logits [..., K, V]; target_lm is the target's LM head."""
        x = self.features(hidden)
        if self.config.own_lm_head:
            return jnp.einsum("...kd,kdv->...kv", x, self.lm_kernel[...]).astype(jnp.float32)
        return target_lm(x).astype(jnp.float32)


def medusa_logits(
    graphdef: nnx.GraphDef, params: nnx.State, hidden: jax.Array, target_lm: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """Pure function for drafting and training: hidden [..., d] -> logits [..., K, V] (head i at [i])."""
    return nnx.merge(graphdef, params)(hidden, target_lm)


def init_medusa(config: MedusaConfig, dtype: jnp.dtype, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """Seeded random heads (graphdef, params)."""
    return nnx.split(MedusaHeads(config, dtype, nnx.Rngs(seed)))
