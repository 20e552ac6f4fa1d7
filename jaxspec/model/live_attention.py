"""Decode attention that reads only the live part of a padded KV cache.

A continuous-batching loop pads every slot's cache to the longest prompt bucket plus the largest budget
(e.g. 385 positions) while most slots hold far fewer tokens; the jnp reference attention
(`pallas_kernels.reference`) reads, scores and softmaxes all S positions of every row, which made
attention the largest cost of a 64-row decode step on CPU. Shapes are static inside `lax.while_loop`,
so the live length cannot be a shape; here the number of key blocks read is a traced scalar instead:
`ceil(max(lengths) / block)` blocks of `block` keys, folded in with an online softmax (flash-attention
style: running max, denominator and unnormalised output), after the N new tokens' own keys.

The result equals the reference within float32 rounding (the softmax is summed in another order); rows
whose length is below the batch's longest skip nothing (the block count is per batch, not per row),
but every key at or past a row's length is masked out exactly. Rows with length 0 (free slots) see only
their own new tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.online_softmax import MASKED_SCORE, normalized, online_softmax_step

LIVE_BLOCK = 128


def live_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float,
    block: int = LIVE_BLOCK,
) -> jax.Array:
    """Tree attention (same contract as `pallas_kernels.tree_attention`) reading ceil(max(lengths) /
    block) key blocks of the cache instead of all S positions.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D] (only [0, lengths[b]) is visible);
      lengths: [B] int32; k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool.
      scale: softmax scale. block: keys per block (clipped to S).
    Returns:
      [B, Hq, N, D] in q's dtype; scores and softmax in float32.
    """
    b, hq, n, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    group, m_rows = hq // hkv, hq // hkv * n
    block = min(block, s)
    f32 = jnp.float32
    qg = q.reshape(b, hkv, m_rows, d).astype(f32) * scale  # row g * N + i: query head h * G + g, node i
    fold = jax.vmap(jax.vmap(online_softmax_step))  # over rows and kv heads
    state = (
        jnp.full((b, hkv, m_rows, 1), MASKED_SCORE, f32),
        jnp.zeros((b, hkv, m_rows, 1), f32),
        jnp.zeros((b, hkv, m_rows, d), f32),
    )
    # The new tokens first: every row sees itself (tree_mask's diagonal).
    visible = jnp.broadcast_to(jnp.tile(tree_mask, (1, group, 1))[:, None], (b, hkv, m_rows, n))
    scores = jnp.einsum("bhmd,bhkd->bhmk", qg, k_tree.astype(f32))
    state = fold(scores, visible, v_tree.astype(f32), *state)

    def fold_block(i, state):
        nominal = i * block
        start = jnp.minimum(nominal, s - block)  # the last block may overlap the one before it...
        keys = jax.lax.dynamic_slice_in_dim(k_cache, start, block, axis=2).astype(f32)
        values = jax.lax.dynamic_slice_in_dim(v_cache, start, block, axis=2).astype(f32)
        # Keys as the dot's left operand ([K, D] rows times the G * N queries), as in the reference:
        # XLA:CPU runs that several times faster than q @ k.T at decode shapes.
        scores = jnp.einsum("bhkd,bhmd->bhkm", keys, qg).transpose(0, 1, 3, 2)  # [B, Hkv, M, K]
        position = start + jnp.arange(block)
        seen = (position >= nominal)[None, :] & (position[None, :] < lengths[:, None])  # ...counted once
        seen = jnp.broadcast_to(seen[:, None, None, :], scores.shape)
        return fold(scores, seen, values, *state)

    live_blocks = (jnp.minimum(jnp.max(lengths), s) + block - 1) // block
    _, denom, acc = jax.lax.fori_loop(0, live_blocks, fold_block, state)
    return jax.vmap(jax.vmap(normalized))(acc, denom).reshape(b, hq, n, d).astype(q.dtype)
