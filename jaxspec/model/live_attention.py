"""Decode attention that reads only the live part of a padded KV cache.

A continuous-batching loop pads every slot's cache to the longest prompt bucket plus the largest budget
(e.g. 385 positions) while most slots hold far fewer tokens; the jnp reference attention
(`pallas_kernels.reference`) reads, scores and softmaxes all S positions of every row. Shapes are static
inside `lax.while_loop`, so the live length cannot be a shape; here it picks one of a few static widths
instead: `lax.switch` over the cache prefixes [0, W) for W = block, 2 * block, ..., S, each branch the
reference attention itself over that prefix, and the branch taken is the narrowest W >= max(lengths).

The result is the reference's (to float32 rounding: every key at or past a row's length is masked out of
both, and the keys a narrower branch leaves out are such keys); rows whose length is below the batch's
longest skip nothing (the width is per batch, not per row). Rows with length 0 (free slots) see only
their own new tokens. An earlier version folded `ceil(max(lengths) / block)` blocks in a `fori_loop`
with an online softmax: a little faster with one live block, but slower than the whole-cache reference
with three, the common case of a long-prompt workload (`scripts/profile_batch_step.py --fill`, README,
"Continuous batching").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.reference import tree_attention_reference

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
    """Tree attention (same contract as `pallas_kernels.tree_attention`) reading the cache only up to the
    smallest multiple of `block` (or S) that holds max(lengths), instead of all S positions.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D] (only [0, lengths[b]) is visible);
      lengths: [B] int32; k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool.
      scale: softmax scale. block: the step between the widths compiled (one switch branch each).
    Returns:
      [B, Hq, N, D] in q's dtype; scores and softmax in float32.
    """
    s = k_cache.shape[2]
    widths = sorted({min(w, s) for w in range(block, s + block, block)})
    longest = jnp.minimum(jnp.max(lengths), s)
    branch = jnp.sum(longest > jnp.asarray(widths[:-1], jnp.int32))  # the narrowest width >= longest

    def attend_up_to(width: int):
        def attend() -> jax.Array:
            k, v = k_cache[:, :, :width], v_cache[:, :, :width]
            return tree_attention_reference(q, k, v, lengths, k_tree, v_tree, tree_mask, scale=scale)

        return attend

    return jax.lax.switch(branch, [attend_up_to(w) for w in widths])


def live_attention_for(attention: str) -> Callable | None:
    """The `attend` a decode or verify forward passes to `model_forward` for SpecConfig.attention:
    `live_attention` where the jnp reference runs (CPU), None (the Pallas kernels, which already stop
    at each row's length) elsewhere."""
    return live_attention if resolve_impl(attention, jax.default_backend()) == "reference" else None
