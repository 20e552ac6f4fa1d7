"""Stateless PRNG keys: every random draw's key derived with `fold_in` (DESIGN invariant 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Purposes: the last fold_in before an (optional) node index. Distinct small ints, never reused.
PURPOSE_DRAFT = 1  # draft tokens sampled by a drafter (fold in the node / depth index next)
PURPOSE_ACCEPT = 2  # accept coins of exact verification (the child index is folded in next)
PURPOSE_RESIDUAL = 3  # next token drawn from the residual after a rejection
PURPOSE_BONUS = 4  # next token drawn from the full target distribution (no rejection at the last node)


# ----------------------------------------------------------------------------------------------------
# Keys and sampling
# ----------------------------------------------------------------------------------------------------


@jax.jit
def fold_in_rows(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """keys [B] (typed key array), data [B] or scalar int -> [B] keys, row b = fold_in(keys[b], data[b])."""
    data = jnp.broadcast_to(jnp.asarray(data, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, data)


@jax.jit
def round_key(seed: jax.Array, request_id: jax.Array, round_idx: jax.Array | int) -> jax.Array:
    """[B] keys of one round: key(seed[b]) -> fold_in(request_id[b]) -> fold_in(round_idx[b]).

    seed, request_id: [B] int32; round_idx: [B] or scalar int32. `verify_tree` takes these round keys.
    """
    seed = jnp.asarray(seed, jnp.int32)
    request_id = jnp.broadcast_to(jnp.asarray(request_id, jnp.int32), seed.shape)
    round_idx = jnp.broadcast_to(jnp.asarray(round_idx, jnp.int32), seed.shape)
    base = jax.vmap(jax.random.key)(seed)
    return fold_in_rows(fold_in_rows(base, request_id), round_idx)


@jax.jit
def derive_key(seed: jax.Array, request_id: jax.Array, round_idx: jax.Array | int, purpose: int) -> jax.Array:
    """[B] keys for one purpose of one round: fold_in(round_key(seed, request_id, round_idx), purpose).

    Sub-keys per node / depth: `fold_in_rows(derive_key(...), node_index)`.
    """
    return fold_in_rows(round_key(seed, request_id, round_idx), purpose)
