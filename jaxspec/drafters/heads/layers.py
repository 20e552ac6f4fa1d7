"""Building blocks shared by the attention-based heads (EAGLE-1, EAGLE-3, MTP).

Their decoder layer is the target's (`jaxspec.model.llama.DecoderLayer`, layout "split"); what differs is
the attention step it is handed: an `AttentionInputs` (callable as `jaxspec.model.llama.Attend`).

One masked-attention function serves every shape of head work: a chunk of newly committed tokens
(causal), one draft step of a chain, the frontier of a dynamic tree (each node sees its ancestors), or
a window of MTP positions per tree path. Queries attend to three key sets, each under its own mask:

  cache [B, Hkv, S, D]   committed keys (cache_visible [B, N or 1, S])
  extra [B, Hkv, M, D]   keys of earlier draft steps of this round (extra_visible [B, N, M]), optional
  own   [B, Hkv, N, D]   the queries' own keys (own_visible [B, N, N] or [N, N]); the diagonal is
                         always visible, so no row is empty.

A head of several decoder layers (EAGLE-3 with `layer.num_layers` > 1) keeps one key set per layer:
cache and extra keys/values then carry a leading layer axis [L, B, Hkv, ., D] (the visibility masks are
the same for every layer), and `AttentionInputs.layer(i)` is what layer i attends with.

The head's KV cache holds committed tokens only; speculative keys live in per-round buffers (`extra`)
and are dropped after the round, so rejected drafts never pollute the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.config import ModelConfig
from jaxspec.model.rope import inverse_frequencies, rope_cos_sin

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

    def layer(self, index: int) -> AttentionInputs:
        """The key sets of decoder layer `index`: key/value arrays with a leading layer axis
        [L, B, Hkv, ., D] are indexed there; 4-D ones (one layer, or empty sets) are every layer's."""

        def pick(x: jax.Array | None) -> jax.Array | None:
            return x[index] if x is not None and x.ndim == 5 else x

        return dataclasses.replace(
            self,
            cache_keys=pick(self.cache_keys),
            cache_values=pick(self.cache_values),
            extra_keys=pick(self.extra_keys),
            extra_values=pick(self.extra_values),
        )

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The heads' attention step (`jaxspec.model.llama.Attend`): q [B, Hq, N, D] over these key sets
        plus the queries' own k, v [B, Hkv, N, D] -> (out [B, Hq, N, D], (k, v))."""
        return masked_attention(q, k, v, self, q.shape[-1] ** -0.5), (k, v)


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


def rope_for(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, N] -> cos, sin [B, N, head_dim]."""
    return rope_cos_sin(positions, inverse_frequencies(config))
