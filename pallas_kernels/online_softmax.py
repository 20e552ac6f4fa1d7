"""One flash-attention step, shared by the TPU and GPU kernel bodies (plain jnp on loaded blocks).

The running state per query row is (m, denom, acc): the max score seen, the softmax denominator relative
to m, and the unnormalised output relative to m. Invisible scores are excluded with `where` (never by
adding a large negative number to a probability), so a row that sees no key at all keeps denom == 0 and
finishes as an all-zero output instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: exp(MASKED_SCORE - m) underflows to 0 for any real m, and
# MASKED_SCORE - MASKED_SCORE == 0 (no inf - inf NaN) while a row has seen nothing yet.
MASKED_SCORE = -1e30


def dot_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """float32 inputs get full-precision matmuls (no TF32 / bf16 passes); 16-bit inputs the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def scores_of(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """q [M, D] x k [K, D] -> scaled float32 scores [M, K] (inputs stay in their dtype for the MXU)."""
    s = jax.lax.dot_general(
        q,
        k,
        (((1,), (1,)), ((), ())),
        precision=dot_precision(q.dtype),
        preferred_element_type=jnp.float32,
    )
    return s * scale


def online_softmax_step(
    scores: jax.Array,
    visible: jax.Array,
    v: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    acc: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one key block into the running state.

    Args:
      scores: [M, K] float32 scaled scores of the block.
      visible: [M, K] bool, which (row, key) pairs count.
      v: [K, D] values of the block (rows of invisible keys must be finite: zero them if unsure).
      m, denom: [M, 1] float32 running max and softmax denominator.
      acc: [M, D] float32 running unnormalised output.
    Returns:
      The updated (m, denom, acc).
    """
    scores = jnp.where(visible, scores, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(scores - m_new), 0.0)
    denom_new = correction * denom + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=dot_precision(v.dtype),
        preferred_element_type=jnp.float32,
    )
    return m_new, denom_new, correction * acc + pv


def normalized(acc: jax.Array, denom: jax.Array) -> jax.Array:
    """acc [M, D] / denom [M, 1]; rows that saw no key (denom == 0) give zeros."""
    seen = denom > 0.0
    return jnp.where(seen, acc / jnp.where(seen, denom, 1.0), 0.0)
