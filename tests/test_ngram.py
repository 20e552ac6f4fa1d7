"""Prompt-lookup drafting: matching rules, trie layout, truncation, batching, jit, brute-force reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.ngram import ngram_chain, ngram_tree
from jaxspec.sampling.tree import ancestor_mask

BATCH, WIDTH = 48, 24  # one shape for every test: each static config compiles once


def padded(rows, lengths):
    """[BATCH, WIDTH] history (padding 99, which no test uses, so it can never match) and [BATCH] lengths."""
    hist = np.full((BATCH, WIDTH), 99, np.int32)
    for b, r in enumerate(rows):
        hist[b, : len(r)] = r
    lens = np.ones(BATCH, np.int32)
    lens[: len(lengths)] = lengths
    return jnp.asarray(hist), jnp.asarray(lens)


def run(rows, lengths, **kw):
    tree = ngram_tree(*padded(rows, lengths), **kw)
    return jax.tree.map(lambda x: np.asarray(x)[: len(rows)], tree)


def reference_ngram(h, length, num_tokens, ngram_min, ngram_max, num_branches):
    """Plain-Python statement of the rules in jaxspec/drafters/ngram.py's module docstring."""
    ends = []
    for n in range(ngram_max, ngram_min - 1, -1):
        suffix = list(h[length - n : length])
        ends = [e for e in range(length - 2, n - 2, -1) if list(h[e - n + 1 : e + 1]) == suffix]
        if ends:
            break
    kept = []
    for e in ends:  # most recent first
        cont = tuple(int(t) for t in h[e + 1 : min(e + 1 + num_tokens, length)])
        if any(prev[: len(cont)] == cont for prev in kept):
            continue
        kept.append(cont)
        if len(kept) == num_branches:
            break
    n_nodes = 1 + num_branches * num_tokens
    tokens, parent = [int(h[length - 1])] + [0] * (n_nodes - 1), [-1] + [0] * (n_nodes - 1)
    depth, valid = [0] * n_nodes, [True] + [False] * (n_nodes - 1)
    node_of_prefix = {}
    for i in range(num_branches):
        cont = kept[i] if i < len(kept) else ()
        for d in range(num_tokens):
            node = 1 + i * num_tokens + d
            depth[node] = d + 1
            if d == 0:
                parent[node] = 0
            elif d <= len(cont):
                parent[node] = node_of_prefix[cont[:d]]
            else:
                parent[node] = node - 1
            if d < len(cont) and cont[: d + 1] not in node_of_prefix:
                node_of_prefix[cont[: d + 1]] = node
                valid[node], tokens[node] = True, cont[d]
    return tokens, parent, depth, valid


def test_exact_match_and_root():
    h = [5, 1, 2, 3, 9, 8, 6, 4, 1, 2]
    t = run([h], [10], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=1)
    np.testing.assert_array_equal(t.tokens[0], [2, 3, 9, 8])
    np.testing.assert_array_equal(t.parent[0], [-1, 0, 1, 2])
    np.testing.assert_array_equal(t.depth[0], [0, 1, 2, 3])
    assert t.valid[0].all()
    assert t.q_probs is None


def test_longest_ngram_preferred_over_more_recent_shorter():
    # "7 8 9" (n=3) occurred early; "9" alone (n=1) occurred more recently with another continuation.
    h = [7, 8, 9, 1, 2, 9, 5, 6, 7, 8, 9]
    longest = run([h], [11], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=1)
    np.testing.assert_array_equal(longest.tokens[0], [9, 1, 2, 9])
    unigram = run([h], [11], num_tokens=3, ngram_min=1, ngram_max=1, num_branches=1)
    np.testing.assert_array_equal(unigram.tokens[0], [9, 5, 6, 7])


def test_most_recent_match_preferred():
    h = [0, 1, 2, 3, 3, 3, 0, 1, 2, 4, 4, 4, 0, 1, 2]
    t = run([h], [15], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=1)
    np.testing.assert_array_equal(t.tokens[0], [2, 4, 4, 4])


def test_branches_share_prefix_and_siblings_differ():
    # "1 2" continues as 4 7 1 (latest), 4 8 2, 3 9 1 (oldest); no longer suffix matches.
    h = [1, 2, 3, 9, 1, 5, 1, 2, 4, 8, 2, 6, 1, 2, 4, 7, 1, 0, 1, 2]
    t = run([h], [20], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=3)
    valid = [True, True, True, True, False, True, True, True, True, True]
    np.testing.assert_array_equal(t.valid[0], valid)
    np.testing.assert_array_equal(t.tokens[0][t.valid[0]], [2, 4, 7, 1, 8, 2, 3, 9, 1])
    np.testing.assert_array_equal(t.parent[0], [-1, 0, 1, 2, 0, 1, 5, 0, 7, 8])
    np.testing.assert_array_equal(t.depth[0], [0, 1, 2, 3, 1, 2, 3, 1, 2, 3])


def test_repeated_continuation_counts_once():
    # Two matches of "1 2" continue with 5 5 7; the only other continuation is 6 6 7.
    h = [1, 2, 6, 6, 7, 3, 1, 2, 5, 5, 7, 4, 1, 2, 5, 5, 7, 0, 1, 2]
    t = run([h], [20], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=3)
    np.testing.assert_array_equal(t.valid[0], [True] * 7 + [False] * 3)
    np.testing.assert_array_equal(t.tokens[0, :7], [2, 5, 5, 7, 6, 6, 7])


def test_continuation_truncated_at_length():
    h = [1, 2, 3, 1, 2, 7, 7, 7]  # tokens from index 5 on are beyond length and must be ignored
    t = run([h], [5], num_tokens=4, ngram_min=2, ngram_max=4, num_branches=2)
    np.testing.assert_array_equal(t.valid[0], [True, True, True, True] + [False] * 5)
    np.testing.assert_array_equal(t.tokens[0, :4], [2, 3, 1, 2])
    np.testing.assert_array_equal(t.parent[0, :5], [-1, 0, 1, 2, 3])  # the cut tail keeps its slot
    # Periodic text: the latest match is cut short, an older one extends it; the trie merges them.
    t = run([[4, 5, 4, 5, 4, 5, 4, 5]], [8], num_tokens=4, ngram_min=2, ngram_max=4, num_branches=2)
    np.testing.assert_array_equal(t.valid[0], [True, True, True, False, False, False, False, True, True])
    np.testing.assert_array_equal(t.tokens[0, [1, 2, 7, 8]], [4, 5, 4, 5])
    np.testing.assert_array_equal(t.parent[0, [1, 2, 7, 8]], [0, 1, 2, 7])
    np.testing.assert_array_equal(t.depth[0, [1, 2, 7, 8]], [1, 2, 3, 4])


def test_no_match_only_root_valid():
    t = run([[1, 2, 3, 4, 5], [7]], [5, 1], num_tokens=3, ngram_min=1, ngram_max=3, num_branches=3)
    np.testing.assert_array_equal(t.valid[:, 1:], False)
    np.testing.assert_array_equal(t.valid[:, 0], True)
    np.testing.assert_array_equal(t.tokens[:, 0], [5, 7])
    assert (t.parent[:, 1:] < np.arange(1, 10)).all()


def test_batch_rows_independent():
    rows = [[5, 1, 2, 3, 9, 8, 6, 4, 1, 2], [3, 3, 3, 3], [1, 2, 3, 4], [4, 5, 4, 5, 4, 5, 1, 1]]
    lengths = [10, 4, 4, 6]
    kw = dict(num_tokens=3, ngram_min=1, ngram_max=3, num_branches=3)
    batched = run(rows, lengths, **kw)
    for b, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        single = run([row], [length], **kw)
        for name in ("tokens", "parent", "depth", "valid"):
            np.testing.assert_array_equal(getattr(batched, name)[b], getattr(single, name)[0], err_msg=name)
    assert batched.valid[:, 1:].any(axis=1).tolist() == [True, True, False, True]


def test_chain_helper_matches_one_branch():
    hist, lens = padded([[5, 1, 2, 3, 9, 8, 6, 4, 1, 2]], [10])
    a = ngram_chain(hist, lens, num_tokens=3, ngram_min=1, ngram_max=3)
    b = ngram_tree(hist, lens, num_tokens=3, ngram_min=1, ngram_max=3, num_branches=1)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_jit_does_not_retrace_for_new_values():
    traces = []

    def propose(hist, length):
        traces.append(1)
        return ngram_tree(hist, length, num_tokens=3, ngram_min=1, ngram_max=3, num_branches=3)

    jitted = jax.jit(propose)
    rng = np.random.default_rng(0)
    for _ in range(3):
        hist = jnp.asarray(rng.integers(0, 4, (BATCH, WIDTH)), jnp.int32)
        jitted(hist, jnp.asarray(rng.integers(1, WIDTH + 1, BATCH), jnp.int32)).tokens.block_until_ready()
    assert len(traces) == 1


def test_rejects_bad_ngram_range():
    with pytest.raises(ValueError, match="ngram_min"):
        ngram_tree(jnp.zeros((1, 4), jnp.int32), jnp.ones(1, jnp.int32), num_tokens=2, ngram_min=3,
                   ngram_max=2, num_branches=1)  # fmt: skip


@pytest.mark.parametrize(
    "num_tokens, ngram_min, ngram_max, num_branches",
    [(3, 1, 3, 3), (4, 2, 4, 2), (3, 1, 1, 1), (5, 1, 2, 4)],
)
def test_matches_brute_force_reference(num_tokens, ngram_min, ngram_max, num_branches):
    rng = np.random.default_rng(num_tokens * 100 + num_branches)
    batch = BATCH
    hist = rng.integers(0, 3 + num_branches % 2, (BATCH, WIDTH)).astype(np.int32)
    lengths = rng.integers(1, WIDTH + 1, BATCH).astype(np.int32)
    kw = dict(num_tokens=num_tokens, ngram_min=ngram_min, ngram_max=ngram_max, num_branches=num_branches)
    tree = ngram_tree(jnp.asarray(hist), jnp.asarray(lengths), **kw)
    mask = np.asarray(jax.jit(ancestor_mask)(tree))
    tree = jax.tree.map(np.asarray, tree)
    n_valid_drafts = 0
    for b in range(batch):
        tokens, parent, depth, valid = reference_ngram(hist[b], int(lengths[b]), **kw)
        np.testing.assert_array_equal(tree.tokens[b], tokens, err_msg=f"row {b}")
        np.testing.assert_array_equal(tree.parent[b], parent, err_msg=f"row {b}")
        np.testing.assert_array_equal(tree.depth[b], depth, err_msg=f"row {b}")
        np.testing.assert_array_equal(tree.valid[b], valid, err_msg=f"row {b}")
        n_valid_drafts += sum(valid) - 1
        # Tree invariants: valid nodes hang off valid parents; valid siblings carry distinct tokens.
        for i in range(1, len(tokens)):
            assert parent[i] < i and depth[i] == depth[parent[i]] + 1
            if valid[i]:
                assert valid[parent[i]]
                assert mask[b, i].sum() == depth[i] + 1
                siblings = [j for j in range(1, len(tokens)) if valid[j] and parent[j] == parent[i]]
                assert len({tokens[j] for j in siblings}) == len(siblings)
    assert n_valid_drafts > batch  # the random histories do produce drafts
