"""Live-block attention: the reference's values while reading only the blocks that hold some row's
prefix (a padded cache's tail is never read)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.live_attention import cache_prefix_attention, live_attention, live_widths
from pallas_kernels.reference import tree_attention_reference


def operands(b, hq, hkv, n, s, d, lengths, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, hq, n, d))
    k_cache = jax.random.normal(keys[1], (b, hkv, s, d)) * 2.0
    v_cache = jax.random.normal(keys[2], (b, hkv, s, d))
    k_tree = jax.random.normal(keys[3], (b, hkv, n, d))
    v_tree = jax.random.normal(keys[4], (b, hkv, n, d))
    tril = jnp.tril(jnp.ones((n, n), bool))
    # A tree: node i sees itself and its ancestors (a few branches cut).
    mask = jnp.broadcast_to(
        tril & ~((jnp.arange(n)[:, None] == n - 1) & (jnp.arange(n)[None, :] == 1)), (b, n, n)
    )
    return q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_tree, v_tree, mask


@pytest.mark.parametrize(
    "n, s, block, lengths",
    [
        (1, 385, 128, [0, 5, 127, 128, 129, 300, 385, 200]),  # S not a multiple of the block
        (1, 256, 128, [3, 17, 0, 1, 2, 4, 9, 100]),  # one live block of two
        (4, 96, 32, [60, 0, 92, 31, 32, 33, 1, 7]),  # a 4-node tree over the prefix
        (1, 64, 128, [10, 64, 0, 63, 1, 2, 3, 4]),  # block clipped to S
    ],
)
def test_live_attention_equals_the_reference(n, s, block, lengths):
    args = operands(8, 6, 2, n, s, 16, lengths)
    scale = 16**-0.5
    want = jax.jit(lambda *a: tree_attention_reference(*a, scale=scale))(*args)
    got = jax.jit(lambda *a: live_attention(*a, scale=scale, block=block))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_blocks_past_the_longest_row_are_never_read():
    lengths = [0, 5, 40, 100, 17, 99, 64, 1]  # longest 100: blocks [0, 128) only
    q, k_cache, v_cache, lengths, k_tree, v_tree, mask = operands(8, 6, 2, 1, 385, 16, lengths, seed=1)
    scale = 16**-0.5
    want = tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree, mask, scale=scale)
    poisoned = [c.at[:, :, 128:].set(jnp.nan) for c in (k_cache, v_cache)]
    got = live_attention(q, *poisoned, lengths, k_tree, v_tree, mask, scale=scale, block=128)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # The same poison inside a live block would be read (0 * NaN): the check above is not vacuous.
    inside = [c.at[:, :, 120:].set(jnp.nan) for c in (k_cache, v_cache)]
    got = live_attention(q, *inside, lengths, k_tree, v_tree, mask, scale=scale, block=128)
    assert not np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("prefix_len", [0, 1, 24])
def test_cache_prefix_attention_reads_only_the_rows_common_prefix(prefix_len):
    """A prompt forward's attention (every row at cache position prefix_len, a causal chain of new
    tokens): the full-cache reference's values, with the padded cache past the prefix never read; one
    position fewer than the prefix gives other values (the slice is not vacuous)."""
    n, s = 12, 96
    q, k_cache, v_cache, _, k_tree, v_tree, _ = operands(4, 6, 2, n, s, 16, [0] * 4, seed=2)
    lengths = jnp.full((4,), prefix_len, jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (4, n, n))
    scale = 16**-0.5
    want = tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree, causal, scale=scale)
    poisoned = [c.at[:, :, prefix_len:].set(jnp.nan) for c in (k_cache, v_cache)]
    attend = jax.jit(cache_prefix_attention(prefix_len), static_argnames="scale")
    got = attend(q, *poisoned, lengths, k_tree, v_tree, causal, scale=scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    if prefix_len:
        short = cache_prefix_attention(prefix_len - 1)(
            q, k_cache, v_cache, lengths, k_tree, v_tree, causal, scale=scale
        )
        assert not np.allclose(np.asarray(short), np.asarray(want), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "cache_len, block, want",
    [
        (385, 128, [128, 385]),
        (384, 128, [128, 384]),
        (1024, 128, [128, 256, 384, 512, 1024]),
        (64, 128, [64]),
    ],
)
def test_no_branch_slices_more_than_half_the_cache(cache_len, block, want):
    """A branch narrower than the cache copies its prefix; past half the cache that costs more than
    scoring the masked tail (`live_widths` docstring), so those lengths take the whole-cache branch."""
    assert live_widths(cache_len, block) == want
