"""Decode attention that reads only the live part of a padded KV cache.

A continuous-batching loop pads every slot's cache to the longest prompt bucket plus the largest budget
(e.g. 385 positions) while most slots hold far fewer tokens; the jnp reference attention
(`pallas_kernels.reference`) reads, scores and softmaxes all S positions of every row. Shapes are static
inside `lax.while_loop`, so the live length cannot be a shape; here it picks one of a few static widths
instead: `lax.switch` over the cache prefixes [0, W) for W = block, 2 * block, ... up to S / 2, then S
(`live_widths`: past half the cache, slicing costs more than it saves), each branch the reference
attention itself over that prefix, and the branch taken is the narrowest W >= max(lengths).

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


def cache_prefix_attention(width: int) -> Callable:
    """The reference tree attention reading only cache positions [0, width) (a static int) besides the
    new tokens; right wherever every row's length is <= width, since the positions it skips are masked
    out of the whole-cache reference. Same contract as `pallas_kernels.tree_attention` (q [B, Hq, N, D],
    caches [B, Hkv, S, D], lengths [B], new keys/values [B, Hkv, N, D], tree_mask [B, N, N])."""

    def attend(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, *, scale):
        k_prefix, v_prefix = k_cache[:, :, :width], v_cache[:, :, :width]
        return tree_attention_reference(q, k_prefix, v_prefix, lengths, k_new, v_new, tree_mask, scale=scale)

    return attend


def live_widths(cache_len: int, block: int = LIVE_BLOCK) -> list[int]:
    """The cache prefixes `live_attention` compiles a branch for: the multiples of `block` up to half the
    cache, then the whole cache.

    A narrower branch's slice of the cache is a copy (XLA:CPU materialises the dot's operand): reading
    the prefix twice and writing it once costs more than scoring the masked tail once the prefix is past
    about half the cache. 64 rows, SmolLM2-135M, S = 385, paired forwards (README, "Continuous
    batching"): a 128-position prefix 1.3-1.4x faster than the whole cache, a 256-position one ~8%
    slower, a 384-position one ~35% slower.
    """
    narrow = [w for w in range(block, cache_len, block) if 2 * w <= cache_len]
    return [*narrow, cache_len]


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
    widths: tuple[int, ...] | None = None,
) -> jax.Array:
    """Tree attention (same contract as `pallas_kernels.tree_attention`) reading the cache only up to the
    narrowest of `live_widths(S, block)` that holds max(lengths), instead of all S positions.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D] (only [0, lengths[b]) is visible);
      lengths: [B] int32; k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool.
      scale: softmax scale. block: the step between the widths compiled (one switch branch each).
      widths: the cache prefixes to compile a branch for, ascending, the last = S (default
        `live_widths(S, block)`; `scripts/profile_batch_step.py --attention-ab` times other choices).
    Returns:
      [B, Hq, N, D] in q's dtype; scores and softmax in float32.
    """
    s = k_cache.shape[2]
    widths = list(widths) if widths is not None else live_widths(s, block)
    if widths[-1] != s:
        raise ValueError(f"live_attention: the widest branch must be the cache ({s}), got {widths}")
    longest = jnp.minimum(jnp.max(lengths), s)
    branch = jnp.sum(longest > jnp.asarray(widths[:-1], jnp.int32))  # the narrowest width >= longest

    def attend_up_to(width: int) -> Callable[[], jax.Array]:
        attend = cache_prefix_attention(width)
        return lambda: attend(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, scale=scale)

    return jax.lax.switch(branch, [attend_up_to(w) for w in widths])


def runs_reference(attention: str) -> bool:
    """Whether SpecConfig.attention resolves to the jnp reference on this backend (the CPU default);
    elsewhere a Pallas kernel runs, which already stops at each row's length."""
    return resolve_impl(attention, jax.default_backend()) == "reference"


def live_attention_for(attention: str) -> Callable | None:
    """The `attend` a decode or verify forward passes to `model_forward` for SpecConfig.attention:
    `live_attention` where the jnp reference runs, None (the Pallas kernel) elsewhere."""
    return live_attention if runs_reference(attention) else None


def prompt_attention_for(attention: str, prefix_len: int) -> Callable | None:
    """The `attend` of a prompt forward whose rows all start at cache position prefix_len (a static
    int: 0, or a shared prefix's length): `cache_prefix_attention(prefix_len)` where the jnp reference
    runs, so a whole-prompt prefill into an empty cache of S slots does not score N x S masked keys
    (`scripts/bench_prefill_attention.py`); None (the Pallas kernel) elsewhere."""
    return cache_prefix_attention(prefix_len) if runs_reference(attention) else None
