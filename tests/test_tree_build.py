"""Static (Medusa) and dynamic (EAGLE-2) tree builders."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.tree_build import (
    TREE_PRESETS_PATH,
    FrontierExpansion,
    calibrated_tree_choices,
    candidate_pool_offset,
    candidate_pool_size,
    expand_frontier,
    expected_accepted_drafts,
    fill_static_tree,
    load_tree_preset,
    root_frontier,
    select_dynamic_tree,
    stack_candidates,
    static_tree_from_choices,
)
from jaxspec.sampling.tree import ancestor_mask, chain_tree


def brute_force_ancestors(parent, valid):
    """[N, N] bool from walking parent pointers."""
    n = len(parent)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask & valid[:, None] & valid[None, :]


def assert_well_formed(tree):
    """parents before children, depth = parent depth + 1, ancestor_mask equals a pointer walk."""
    mask = np.asarray(jax.jit(ancestor_mask)(tree))
    tree = jax.tree.map(np.asarray, tree)
    for b in range(tree.tokens.shape[0]):
        parent, depth, valid = tree.parent[b], tree.depth[b], tree.valid[b]
        assert parent[0] == -1 and depth[0] == 0 and valid[0]
        for i in range(1, len(parent)):
            assert 0 <= parent[i] < i
            assert depth[i] == depth[parent[i]] + 1
        np.testing.assert_array_equal(mask[b], brute_force_ancestors(parent, valid))


# ------------------------------------------------------------------------------------------------
# Static trees
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], [0, 1, 0]], r"\(0, 1, 0\) has no parent path \(0, 1\)"),
        ([[0], [1], [0]], r"\(0,\) appears twice"),
        ([[0], []], "empty path"),
        ([[0], [0, -1]], r"\(0, -1\) has a negative rank"),
        ([], "at least one path"),
    ],
)
def test_choices_validation_names_the_bad_path(choices, message):
    with pytest.raises(ValueError, match=message):
        static_tree_from_choices(choices)


def test_static_tree_order_and_fields():
    rng = np.random.default_rng(0)
    choices = [
        list(p) for p in json.loads(TREE_PRESETS_PATH.read_text())["presets"]["mc_sim_7b_63"]["choices"]
    ]
    shuffled = [choices[i] for i in rng.permutation(len(choices))]
    static = static_tree_from_choices(shuffled)
    assert static == static_tree_from_choices(choices)  # order of the input does not matter
    hash(static)
    assert static.num_nodes == 64 and static.max_depth == 4 and static.top_k == 10
    assert list(static.choices) == sorted(static.choices, key=lambda p: (len(p), p))
    paths = [()] + list(static.choices)
    for i in range(1, static.num_nodes):
        assert static.parent[i] < i
        assert paths[static.parent[i]] == paths[i][:-1]
        assert static.depth[i] == len(paths[i]) and static.rank[i] == paths[i][-1]


def test_presets_load():
    expected = {
        "chain_4": (5, 4, 1),
        "tree_16": (17, 3, 6),
        "tree_26": (27, 3, 10),
        "mc_sim_7b_63": (64, 4, 10),
    }
    for name, (nodes, depth, top_k) in expected.items():
        static = load_tree_preset(name)
        assert (static.num_nodes, static.max_depth, static.top_k) == (nodes, depth, top_k), name
    with pytest.raises(ValueError, match="unknown tree preset 'nope'"):
        load_tree_preset("nope")


def test_fill_static_tree_takes_head_topk_by_rank():
    static = load_tree_preset("tree_26")
    batch, heads, k = 2, 3, 10
    # token = 1000 * b + 100 * head + rank, so every node's token spells out where it came from.
    code = (1000 * np.arange(batch)[:, None, None] + 100 * np.arange(heads)[None, :, None]
            + np.arange(k)[None, None, :])  # fmt: skip
    root = jnp.asarray([7, 8], jnp.int32)
    tree = fill_static_tree(static, root, jnp.asarray(code, jnp.int32))
    tokens = np.asarray(tree.tokens)
    np.testing.assert_array_equal(tokens[:, 0], [7, 8])
    for b in range(batch):
        for i, path in enumerate(static.choices, start=1):
            assert tokens[b, i] == 1000 * b + 100 * (len(path) - 1) + path[-1]
    assert tree.q_probs is None and bool(tree.valid.all())
    assert_well_formed(tree)
    with pytest.raises(ValueError, match="needs 3 heads x top-10"):
        fill_static_tree(static, root, jnp.zeros((2, 3, 5), jnp.int32))


def test_chain_preset_equals_chain_tree():
    topk = jnp.asarray(np.random.default_rng(1).integers(0, 50, (3, 4, 2)), jnp.int32)
    root = jnp.asarray([1, 2, 3], jnp.int32)
    a = fill_static_tree(load_tree_preset("chain_4"), root, topk)
    b = chain_tree(root, topk[:, :, 0])
    for name in ("tokens", "parent", "depth", "valid"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# ------------------------------------------------------------------------------------------------
# Dynamic trees
# ------------------------------------------------------------------------------------------------


def reference_select(root, tokens, parent, score, num_draft_tokens, valid):
    """One row, plain Python: rank by path-min score (ties: lower index), take the best, pool order."""
    m = len(tokens)
    path_min, depth, alive = [], [], []
    for j in range(m):
        s = score[j] if valid[j] else -np.inf
        p = parent[j]
        path_min.append(s if p < 0 else min(s, path_min[p]))
        depth.append(1 if p < 0 else depth[p] + 1)
        alive.append(bool(valid[j]) and (p < 0 or alive[p]))
    picked = sorted(sorted(range(m), key=lambda j: (-path_min[j], j))[:num_draft_tokens])
    node = {j: i + 1 for i, j in enumerate(picked)}
    return (
        [root] + [tokens[j] for j in picked],
        [-1] + [0 if parent[j] < 0 else node[parent[j]] for j in picked],
        [0] + [depth[j] for j in picked],
        [True] + [alive[j] for j in picked],
    )


def random_pool(rng, batch, m, *, integer_scores):
    """Random forests in pool order (parent < index) with arbitrary (not monotone) scores."""
    parent = np.full((batch, m), -1, np.int32)
    for j in range(1, m):
        parent[:, j] = rng.integers(-1, j, batch)
    score = rng.integers(-3, 1, (batch, m)) if integer_scores else rng.normal(size=(batch, m))
    tokens = rng.integers(0, 1000, (batch, m)).astype(np.int32)
    valid = rng.random((batch, m)) > 0.1
    return tokens, parent, score.astype(np.float32), valid


@pytest.mark.parametrize("integer_scores", [False, True])
def test_select_dynamic_tree_matches_reference(integer_scores):
    rng = np.random.default_rng(int(integer_scores))
    batch, m, n = 16, 30, 12
    tokens, parent, score, valid = random_pool(rng, batch, m, integer_scores=integer_scores)
    root = np.arange(batch, dtype=np.int32)
    tree = select_dynamic_tree(
        jnp.asarray(root), jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(score), n, jnp.asarray(valid)
    )
    assert tree.num_nodes == n + 1 and tree.q_probs is None
    got = jax.tree.map(np.asarray, tree)
    for b in range(batch):
        want = reference_select(int(root[b]), tokens[b], parent[b], score[b], n, valid[b])
        for name, expected in zip(("tokens", "parent", "depth", "valid"), want, strict=True):
            np.testing.assert_array_equal(getattr(got, name)[b], expected, err_msg=f"{name} row {b}")
    assert_well_formed(tree)  # ancestors of every selected node were selected too


def test_ties_keep_ancestors():
    # Every score equal: selection falls back to pool order, which lists parents first.
    parent = jnp.asarray([[-1, 0, 1, 2, -1, 4]], jnp.int32)
    tree = select_dynamic_tree(
        jnp.asarray([9]), jnp.arange(6)[None] + 10, parent, jnp.zeros((1, 6)), 3
    )  # fmt: skip
    np.testing.assert_array_equal(tree.tokens[0], [9, 10, 11, 12])
    np.testing.assert_array_equal(tree.parent[0], [-1, 0, 1, 2])
    # A child scoring above its parent still needs the parent: both come in, in pool order.
    score = jnp.asarray([[-5.0, 0.0, -9.0, -9.0, -1.0, -9.0]])
    tree = select_dynamic_tree(jnp.asarray([9]), jnp.arange(6)[None] + 10, parent, score, 3)
    np.testing.assert_array_equal(tree.tokens[0], [9, 10, 11, 14])
    np.testing.assert_array_equal(tree.parent[0], [-1, 0, 1, 0])


def test_pool_layout():
    assert candidate_pool_size(4, 1) == 4 and candidate_pool_size(4, 3) == 4 + 2 * 16
    assert [candidate_pool_offset(s, 4) for s in range(4)] == [0, 4, 20, 36]
    assert int(candidate_pool_offset(jnp.asarray(2), 4)) == 20


def eagle_reference(root, table, topk, num_steps, num_draft_tokens):
    """EAGLE-2 with a fake head whose log-probs depend only on the node's token: table[token] -> [V]."""
    pool = []  # (token, parent pool index, score)
    frontier = [(root, -1, 0.0)]  # (token, pool index, score)
    for _step in range(num_steps):
        cands = []
        for tok, pool_index, s in frontier:
            for child in np.argsort(-table[tok], kind="stable")[:topk]:
                cands.append((int(child), pool_index, s + float(table[tok, child])))
        offset = len(pool)
        pool.extend(cands)
        best = sorted(range(len(cands)), key=lambda j: (-cands[j][2], j))[:topk]
        frontier = [(cands[j][0], offset + j, cands[j][2]) for j in best]
    tokens, parent, score = (list(x) for x in zip(*pool, strict=True))
    return reference_select(root, tokens, parent, score, num_draft_tokens, [True] * len(pool))


def test_eagle_draft_loop_building_blocks_match_reference():
    rng = np.random.default_rng(3)
    vocab, topk, num_steps, n = 9, 3, 4, 10
    roots = np.array([0, 4, 7], np.int32)
    table = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(vocab, vocab)) * 2), axis=-1))
    tab = jnp.asarray(table, jnp.float32)

    score, index = root_frontier(len(roots))
    tokens = jnp.asarray(roots)[:, None]
    steps = []
    for step in range(num_steps):  # the drafter would run the head here; the fake head is a lookup
        exp = expand_frontier(score, index, tab[tokens], topk=topk, step=step)
        steps.append(exp)
        score, index, tokens = exp.next_score, exp.next_pool_index, exp.next_tokens
    assert steps[0].cand_tokens.shape == (3, topk) and steps[1].cand_tokens.shape == (3, topk * topk)
    pooled = stack_candidates(steps[0], steps[1:])
    assert pooled[0].shape == (3, candidate_pool_size(topk, num_steps))
    # The lax.scan form (a leading step axis) pools identically.
    scanned = jax.tree.map(lambda *xs: jnp.stack(xs), *steps[1:])
    assert isinstance(scanned, FrontierExpansion)
    for x, y in zip(pooled, stack_candidates(steps[0], scanned), strict=True):
        np.testing.assert_array_equal(x, y)

    tree = select_dynamic_tree(jnp.asarray(roots), *pooled, n)
    got = jax.tree.map(np.asarray, tree)
    for b, root in enumerate(roots):
        want = eagle_reference(int(root), table, topk, num_steps, n)
        for name, expected in zip(("tokens", "parent", "depth", "valid"), want, strict=True):
            np.testing.assert_array_equal(getattr(got, name)[b], expected, err_msg=f"{name} row {b}")
    assert got.depth.max() >= 2
    # Each node's token is one of its parent's top-k children under the fake head.
    for b in range(len(roots)):
        for i in range(1, n + 1):
            parent_token = got.tokens[b, got.parent[b, i]]
            assert got.tokens[b, i] in np.argsort(-table[parent_token])[:topk]
    assert_well_formed(tree)


def all_trees(depth: int, ranks: int, size: int):
    """Every prefix-closed set of `size` Medusa paths over `depth` heads x top-`ranks` (brute force)."""
    import itertools

    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    for subset in itertools.combinations(paths, size):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield subset


@pytest.mark.parametrize("depth,ranks,seed", [(2, 3, 0), (3, 2, 1), (3, 2, 2)])
def test_calibrated_tree_is_the_best_tree_of_its_size(depth, ranks, seed):
    """Medusa's calibrated tree has the largest expected accepted length of every tree of its size
    (brute force over all prefix-closed path sets), for sizes 1 to all paths, and is a valid tree."""
    acc = np.random.default_rng(seed).uniform(0.0, 1.0, (depth, ranks))
    acc /= acc.sum(1, keepdims=True) * 1.05  # a head's ranks cannot be right more than once in all
    total = sum(ranks**d for d in range(1, depth + 1))
    for size in range(1, total + 1):
        choices = calibrated_tree_choices(acc, size)
        best = max(expected_accepted_drafts(t, acc) for t in all_trees(depth, ranks, size))
        assert expected_accepted_drafts(choices, acc) == pytest.approx(best, rel=1e-12), size
        assert static_tree_from_choices(choices).num_nodes == size + 1


@pytest.mark.parametrize("depth,ranks,joint_heads,seed", [(2, 3, 2, 0), (3, 2, 3, 1), (3, 2, 2, 2)])
def test_calibrated_tree_from_joint_ranks_is_the_best_tree_of_its_size(depth, ranks, joint_heads, seed):
    """With the heads' joint rank frequencies (heads wrong together), the calibrated tree still has the
    largest expected accepted length of every tree of its size, now valued by the joint table (up to
    its depth, independent accuracies below it)."""
    rng = np.random.default_rng(seed)
    r = ranks + 1  # the last index: "rank R or worse"
    joint = rng.dirichlet(np.full(r**joint_heads, 0.3)).reshape((r,) * joint_heads)
    marginals = [
        joint.sum(tuple(a for a in range(joint_heads) if a != j))[:ranks] for j in range(joint_heads)
    ]
    acc = np.stack(marginals + [rng.uniform(0, 1 / ranks, ranks) for _ in range(depth - joint_heads)])
    total = sum(ranks**d for d in range(1, depth + 1))
    for size in range(1, total + 1):
        choices = calibrated_tree_choices(acc, size, joint)
        best = max(expected_accepted_drafts(t, acc, joint) for t in all_trees(depth, ranks, size))
        assert expected_accepted_drafts(choices, acc, joint) == pytest.approx(best, rel=1e-12), size


def test_joint_ranks_value_a_path_by_how_often_its_heads_are_right_together():
    acc = np.array([[0.5, 0.2], [0.3, 0.2]])
    joint = np.zeros((3, 3))
    joint[0, 0], joint[0, 2], joint[1, 1], joint[2, 2] = 0.3, 0.2, 0.2, 0.3  # head 2 right only with head 1
    assert expected_accepted_drafts(((0,), (0, 0)), acc) == pytest.approx(0.5 + 0.15)  # independent
    assert expected_accepted_drafts(((0,), (0, 0)), acc, joint) == pytest.approx(0.5 + 0.3)
    assert calibrated_tree_choices(acc, 3, joint) == ((0,), (0, 0), (1,))  # (0, 0) before (1,) now
    assert calibrated_tree_choices(acc, 3) == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="joint must be"):
        calibrated_tree_choices(acc, 2, np.zeros((2, 2)))  # no "or worse" rank
    with pytest.raises(ValueError, match="sum to <= 1"):
        calibrated_tree_choices(acc, 2, joint * 2)


def test_calibrated_tree_takes_paths_best_first_and_refuses_what_does_not_fit():
    acc = np.array([[0.5, 0.25, 0.1], [0.6, 0.28, 0.0]])
    # values: (0,) .5, (0, 0) .3, (1,) .25, (1, 0) .15, (0, 1) .14, (2,) .1, ...
    assert calibrated_tree_choices(acc, 5) == ((0,), (0, 0), (1,), (1, 0), (0, 1))
    assert expected_accepted_drafts(((0,), (0, 0)), acc) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="13 paths do not fit 2 heads x top-3"):
        calibrated_tree_choices(acc, 13)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        calibrated_tree_choices(acc * 3, 2)
