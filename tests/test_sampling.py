"""Unit tests of jaxspec.sampling: logits processing, keys, sampling and tree verification."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import config as jaxspec_config
from jaxspec import sampling
from jaxspec.config import SamplingParams
from jaxspec.sampling.processors import SamplingArrays, process_logits
from jaxspec.sampling.tree import DraftTree, chain_tree
from jaxspec.sampling.verify import verify_tree


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sort-based numpy reference of one row's processing (float64)."""
    logits = np.asarray(logits, np.float64)
    if params.temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits)]
    x = logits / params.temperature
    if 0 < params.top_k < x.size:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1:
        desc = np.sort(p)[::-1]
        mass_before = np.cumsum(desc) - desc
        kept = int(np.sum(mass_before < params.top_p))
        p = np.where(p >= desc[kept - 1], p, 0.0)
        p /= p.sum()
    return p


def arrays(params, batch):
    return SamplingArrays.from_params(params, batch)


# ---------------------------------------------------------------------------------------------------
# SamplingArrays and process_logits
# ---------------------------------------------------------------------------------------------------


def test_from_params_single_list_and_mismatch():
    one = arrays(SamplingParams(0.7, 5, 0.9), 3)
    np.testing.assert_allclose(one.temperature, [0.7] * 3)
    np.testing.assert_array_equal(one.top_k, [5] * 3)
    assert one.top_k.dtype == jnp.int32 and one.top_p.dtype == jnp.float32
    mixed = arrays([SamplingParams(), SamplingParams(1.0, top_p=0.5)], 2)
    np.testing.assert_allclose(mixed.top_p, [1.0, 0.5])
    with pytest.raises(ValueError, match="batch 3"):
        arrays([SamplingParams()], 3)


def test_temperature_only_is_softmax():
    logits = jax.random.normal(jax.random.key(0), (3, 100)) * 3
    probs = process_logits(logits, arrays(SamplingParams(0.7), 3))
    np.testing.assert_allclose(probs, jax.nn.softmax(logits / 0.7), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_greedy_rows_are_one_hot_first_index_on_ties():
    logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    probs = process_logits(logits, arrays(SamplingParams(0.0, top_k=3, top_p=0.5), 2))
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("top_k", [1, 3, 64, 80, 99])  # <= 64: lax.top_k path; > 64: radix search
def test_top_k_matches_reference(top_k):
    logits = np.asarray(jax.random.normal(jax.random.key(top_k), (3, 100)) * 2)
    params = SamplingParams(0.9, top_k=top_k)
    probs = np.asarray(process_logits(jnp.asarray(logits), arrays(params, 3)))
    for row in range(3):
        np.testing.assert_allclose(probs[row], reference_probs(logits[row], params), rtol=1e-5, atol=1e-7)
        assert np.count_nonzero(probs[row]) == top_k


def test_top_k_keeps_ties_with_kth_value():
    logits = jnp.array([[4.0, 2.0, 2.0, 2.0, 0.0]])
    probs = np.asarray(process_logits(logits, arrays(SamplingParams(1.0, top_k=2), 1)))
    assert np.count_nonzero(probs) == 4 and probs[0, 4] == 0.0


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: nucleus in the top 64; flat: radix search
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_matches_reference(scale, top_p):
    logits = np.asarray(jax.random.normal(jax.random.key(7), (3, 100)) * scale)
    params = SamplingParams(1.0, top_p=top_p)
    probs = np.asarray(process_logits(jnp.asarray(logits), arrays(params, 3)))
    for row in range(3):
        ref = reference_probs(logits[row], params)
        np.testing.assert_array_equal(probs[row] > 0, ref > 0)
        np.testing.assert_allclose(probs[row], ref, rtol=1e-4, atol=1e-7)
    if scale < 1 and top_p > 0.5:
        assert np.count_nonzero(probs[0]) > 64  # the radix path really ran


def test_top_p_always_keeps_the_top_token():
    logits = jax.random.normal(jax.random.key(3), (3, 100))
    probs = process_logits(logits, arrays(SamplingParams(1.0, top_p=1e-6), 3))
    np.testing.assert_array_equal(probs, jax.nn.one_hot(jnp.argmax(logits, -1), 100))


def test_top_k_then_top_p_matches_reference():
    logits = np.asarray(jax.random.normal(jax.random.key(11), (3, 100)) * 1.5)
    params = SamplingParams(0.8, top_k=20, top_p=0.7)
    probs = np.asarray(process_logits(jnp.asarray(logits), arrays(params, 3)))
    for row in range(3):
        np.testing.assert_allclose(probs[row], reference_probs(logits[row], params), rtol=1e-5, atol=1e-7)


def test_mixed_per_row_params_match_rows_alone_and_broadcast_over_nodes():
    params = [
        SamplingParams(0.0),
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=4),
        SamplingParams(1.3, top_p=0.6),
        SamplingParams(0.5, top_k=70, top_p=0.95),
    ]
    logits = jax.random.normal(jax.random.key(5), (5, 3, 90)) * 2  # [B, N, V]
    batched = np.asarray(process_logits(logits, arrays(params, 5)))
    for row, p in enumerate(params):
        alone = np.asarray(process_logits(logits[row : row + 1], arrays(p, 1)))[0]
        np.testing.assert_allclose(batched[row], alone, rtol=1e-6, atol=1e-8)
        for node in range(3):
            ref = reference_probs(np.asarray(logits[row, node]), p)
            np.testing.assert_allclose(batched[row, node], ref, rtol=1e-5, atol=1e-7)


def _boundary_rows(num_rows: int, vocab: int) -> tuple[np.ndarray, list[SamplingParams]]:
    """Peaked rows whose top_p equals a float32 partial sum of their largest probabilities: the nucleus
    mass lands within float rounding of top_p, where sums in different orders disagree."""
    logits = np.asarray(jax.random.normal(jax.random.key(21), (num_rows, vocab)) * 3.0, np.float32)
    params = []
    for row in range(num_rows):
        desc = np.sort(np.asarray(jax.nn.softmax(jnp.asarray(logits[row]))))[::-1]
        top_p = float(np.cumsum(desc, dtype=np.float32)[2 + row % 20])
        params.append(SamplingParams(1.0, top_p=min(top_p, 0.999)))
    return logits, params


@pytest.mark.parametrize("force", ["radix_top_p", "radix_top_k"])
def test_a_row_is_bit_identical_whichever_path_its_batch_takes(force):
    # Next to a benign last row, every row below is decided within its 64 largest values (the
    # lax.top_k path). Next to a row that forces the radix search (a flat row whose nucleus spans > 64
    # tokens, or top_k > 64) the batch takes the other path; each row must come out bit-identical.
    # Same batch shape on both sides: XLA:CPU's float reductions may differ in the last bit between
    # batch shapes, which is not a property of the path.
    vocab = 300
    logits, params = _boundary_rows(48, vocab)
    logits = np.concatenate([logits, logits[:8]])
    params += [SamplingParams(0.8, top_k=k) for k in (1, 2, 5, 17, 40, 63, 64, 3)]
    flat_row = np.asarray(jax.random.normal(jax.random.key(22), (1, vocab)) * 0.05, np.float32)
    forcing = SamplingParams(1.0, top_p=0.95) if force == "radix_top_p" else SamplingParams(1.0, top_k=200)
    batch = len(params) + 1

    def run(last: SamplingParams) -> np.ndarray:
        rows = jnp.asarray(np.concatenate([logits, flat_row]))
        return np.asarray(process_logits(rows, arrays(params + [last], batch)))

    benign, forced = run(SamplingParams(1.0, top_p=0.01)), run(forcing)
    assert np.count_nonzero(benign[-1]) <= 64 < np.count_nonzero(forced[-1])
    assert all(1 <= np.count_nonzero(row) <= 64 for row in benign[:-1])
    np.testing.assert_array_equal(forced[:-1], benign[:-1])


def test_sample_from_probs_one_hot_rows_draw_the_same_token_next_to_soft_rows():
    one_hot = jax.nn.one_hot(jnp.array([3, 7]), 10)
    soft = jnp.full((1, 10), 0.1)
    keys = sampling.derive_key(jnp.array([0, 1, 2]), jnp.array([0, 0, 0]), 0, sampling.PURPOSE_BONUS)
    alone = sampling.sample_from_probs(one_hot, keys[:2])
    mixed = sampling.sample_from_probs(jnp.concatenate([one_hot, soft]), keys)
    np.testing.assert_array_equal(alone, [3, 7])
    np.testing.assert_array_equal(mixed[:2], [3, 7])


@pytest.mark.parametrize(
    "temperatures",
    [(0.0, 0.0, 0.0, 0.0), (0.0, 0.7, 0.0, 1.3), (0.9, 0.9, 0.9, 0.9)],
    ids=["all greedy", "mixed", "all sampled"],
)
def test_sample_logits_equals_process_then_sample(temperatures):
    """The greedy fast path gives the tokens of the full path, ties included (first index), and a
    batch with sampled rows is not shortcut."""
    logits = jax.random.normal(jax.random.key(3), (4, 50)) * 3.0
    logits = logits.at[0, 7].set(20.0).at[0, 31].set(20.0)  # a tie: the first index wins
    params = arrays([SamplingParams(t, 5 if t else 0, 0.9 if t else 1.0) for t in temperatures], 4)
    for seed in range(8):
        keys = sampling.derive_key(jnp.full((4,), seed), jnp.arange(4), 0, sampling.PURPOSE_BONUS)
        full = sampling.sample_from_probs(process_logits(logits, params), keys)
        np.testing.assert_array_equal(sampling.sample_logits(logits, params, keys), full)
    if temperatures[0] == 0.0:
        assert int(full[0]) == 7


def test_process_logits_parameters_are_traced():
    traces = []

    @jax.jit
    def run(logits, params):
        traces.append(1)
        return process_logits(logits, params)

    logits = jnp.zeros((2, 10))
    run(logits, arrays(SamplingParams(1.0, 3, 0.5), 2))
    run(logits, arrays([SamplingParams(0.0), SamplingParams(0.2, 0, 1.0)], 2))
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------------
# Keys and sampling
# ---------------------------------------------------------------------------------------------------


def key_bytes(keys) -> list[bytes]:
    data = np.asarray(jax.random.key_data(keys))
    return [row.tobytes() for row in data.reshape(data.shape[0], -1)]


def test_derive_key_distinct_over_seed_request_round_purpose():
    purposes = [sampling.PURPOSE_DRAFT, sampling.PURPOSE_ACCEPT, sampling.PURPOSE_RESIDUAL]
    purposes += [sampling.PURPOSE_BONUS]
    assert len(set(purposes)) == 4
    seed, request, rnd = (a.ravel() for a in np.meshgrid(np.arange(3), np.arange(4), np.arange(5)))
    seen = []
    for purpose in purposes:
        seen += key_bytes(sampling.derive_key(seed, request, rnd, purpose))
    round_keys = sampling.round_key(seed, request, rnd)
    seen += key_bytes(round_keys)
    for node in range(3):  # per-node sub-keys of one purpose
        seen += key_bytes(sampling.fold_in_rows(sampling.derive_key(seed, request, rnd, 1), node))
    assert len(seen) == len(set(seen)) == 60 * 8


def test_derive_key_is_deterministic_and_row_independent():
    seed, request = jnp.array([7, 7, 9]), jnp.array([0, 1, 0])
    batch = key_bytes(sampling.derive_key(seed, request, 3, sampling.PURPOSE_DRAFT))
    again = key_bytes(sampling.derive_key(seed, request, jnp.array([3, 3, 3]), sampling.PURPOSE_DRAFT))
    alone = key_bytes(sampling.derive_key(seed[1:2], request[1:2], 3, sampling.PURPOSE_DRAFT))
    assert batch == again and batch[1] == alone[0]


def test_sample_from_probs_one_hot_and_support():
    probs = jnp.array([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.5]])
    keys = sampling.round_key(jnp.zeros(2, jnp.int32), jnp.arange(2), 0)
    assert sampling.sample_from_probs(probs, keys).dtype == jnp.int32
    many = jnp.repeat(probs, 2000, axis=0)
    many_keys = sampling.round_key(jnp.zeros(4000, jnp.int32), jnp.arange(4000), 0)
    draws = np.asarray(sampling.sample_from_probs(many, many_keys)).reshape(2, 2000)
    assert np.all(draws[0] == 2)
    assert set(np.unique(draws[1])) == {0, 3}
    assert abs(np.mean(draws[1] == 0) - 0.5) < 0.05  # 4.5 sigma
    again = np.asarray(sampling.sample_from_probs(many, many_keys)).reshape(2, 2000)
    np.testing.assert_array_equal(draws, again)


# ---------------------------------------------------------------------------------------------------
# Tree verification
# ---------------------------------------------------------------------------------------------------

VOCAB = 10


def hand_tree(tokens, parents, valid=None, q_probs=None):
    """One-row DraftTree from python lists (depth derived from parents)."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    valid = [True] * len(tokens) if valid is None else valid
    return DraftTree(
        tokens=jnp.array([tokens], jnp.int32),
        parent=jnp.array([parents], jnp.int32),
        depth=jnp.array([depth], jnp.int32),
        valid=jnp.array([valid]),
        q_probs=q_probs,
    )


def one_hot_targets(argmaxes):
    return jax.nn.one_hot(jnp.array([argmaxes]), VOCAB, dtype=jnp.float32)


def keys_for(batch, round_idx=0):
    return sampling.round_key(jnp.full((batch,), 1, jnp.int32), jnp.arange(batch), round_idx)


# Nodes: 0 root(3) -> 1 (5), 2 (7); 2 -> 3 (1); 3 -> 4 (2); 1 -> 5 (4)
HAND_TOKENS = [3, 5, 7, 1, 2, 4]
HAND_PARENTS = [-1, 0, 0, 2, 3, 1]


@pytest.mark.parametrize("mode", ["greedy", "exact", "typical_lossy"])
def test_one_hot_targets_follow_argmax_path(mode):
    # argmax at root = 7 (node 2), at node 2 = 1 (node 3), at node 3 = 9 (node 4 has token 2: mismatch)
    targets = one_hot_targets([7, 0, 1, 9, 0, 0])
    result = verify_tree(hand_tree(HAND_TOKENS, HAND_PARENTS), targets, keys_for(1), mode=mode, max_depth=3)
    np.testing.assert_array_equal(result.path, [[0, 2, 3, -1]])
    np.testing.assert_array_equal(result.num_accepted, [2])
    np.testing.assert_array_equal(result.accepted_tokens, [[7, 1, -1]])
    np.testing.assert_array_equal(result.next_token, [9])
    np.testing.assert_array_equal(result.emitted_tokens, [[7, 1, 9, -1]])
    np.testing.assert_array_equal(result.last_node, [3])


@pytest.mark.parametrize("mode", ["greedy", "exact"])
def test_full_acceptance_gives_bonus_and_nothing_accepted_gives_correction(mode):
    tree = hand_tree(HAND_TOKENS, HAND_PARENTS)
    full = verify_tree(tree, one_hot_targets([7, 0, 1, 2, 6, 0]), keys_for(1), mode=mode, max_depth=3)
    np.testing.assert_array_equal(full.path, [[0, 2, 3, 4]])
    np.testing.assert_array_equal(full.emitted_tokens, [[7, 1, 2, 6]])
    none = verify_tree(tree, one_hot_targets([8, 0, 1, 2, 6, 0]), keys_for(1), mode=mode, max_depth=3)
    np.testing.assert_array_equal(none.path, [[0, -1, -1, -1]])
    np.testing.assert_array_equal(none.num_accepted, [0])
    np.testing.assert_array_equal(none.emitted_tokens, [[8, -1, -1, -1]])


@pytest.mark.parametrize("mode", ["greedy", "exact"])
def test_invalid_and_too_deep_nodes_are_never_accepted(mode):
    targets = one_hot_targets([7, 0, 1, 2, 6, 0])
    invalid = hand_tree(HAND_TOKENS, HAND_PARENTS, valid=[True, True, True, False, True, True])
    result = verify_tree(invalid, targets, keys_for(1), mode=mode, max_depth=3)
    np.testing.assert_array_equal(result.path, [[0, 2, -1, -1]])
    np.testing.assert_array_equal(result.next_token, [1])
    shallow = verify_tree(hand_tree(HAND_TOKENS, HAND_PARENTS), targets, keys_for(1), mode=mode, max_depth=2)
    np.testing.assert_array_equal(shallow.path, [[0, 2, 3]])
    np.testing.assert_array_equal(shallow.emitted_tokens, [[7, 1, 2]])


def test_greedy_prefers_the_deepest_matching_duplicate():
    # two children with the argmax token 4; only the second has a matching grandchild
    tree = hand_tree([0, 4, 4, 6], [-1, 0, 0, 2])
    result = verify_tree(tree, one_hot_targets([4, 6, 6, 2]), keys_for(1), mode="greedy", max_depth=2)
    np.testing.assert_array_equal(result.path, [[0, 2, 3]])
    np.testing.assert_array_equal(result.emitted_tokens, [[4, 6, 2]])


def random_tree_batch(seed, batch, vocab, branching, soft_q):
    """Random trees (BFS layout from a branching tuple), distinct sibling tokens, optional q_probs."""
    parents = [-1]
    frontier = [0]
    for b in branching:
        frontier_next = []
        for node in frontier:
            for _ in range(b):
                parents.append(node)
                frontier_next.append(len(parents) - 1)
        frontier = frontier_next
    n = len(parents)
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    rng = np.random.default_rng(seed)
    # distinct sibling tokens: one random permutation per (row, parent), the i-th child takes entry i
    perms = np.argsort(rng.random((batch, n, vocab)), axis=-1)
    rank = [sum(1 for j in range(i) if parents[j] == parents[i]) for i in range(n)]
    tokens = perms[:, np.maximum(parents, 0), rank]
    tokens[:, 0] = 0
    q = rng.dirichlet(np.ones(vocab), size=(batch, n)).astype(np.float32) if soft_q else None
    tree = DraftTree(
        tokens=jnp.asarray(tokens, jnp.int32),
        parent=jnp.asarray(np.broadcast_to(parents, (batch, n)), jnp.int32),
        depth=jnp.asarray(np.broadcast_to(depth, (batch, n)), jnp.int32),
        valid=jnp.ones((batch, n), bool),
        q_probs=None if q is None else jnp.asarray(q),
    )
    return tree, jnp.asarray(rng.normal(size=(batch, n, vocab)), jnp.float32)


@pytest.mark.parametrize("soft_q", [False, True])
@pytest.mark.parametrize("branching", [(1, 1, 1), (3, 2, 1)])
def test_exact_with_one_hot_targets_equals_greedy(branching, soft_q):
    batch, vocab = 512, 4  # small vocabulary: plenty of argmax matches at every depth
    tree, logits = random_tree_batch(len(branching), batch, vocab, branching, soft_q)
    targets = process_logits(logits, arrays(SamplingParams(0.0), batch))
    depth = len(branching)
    greedy = verify_tree(tree, targets, keys_for(batch), mode="greedy", max_depth=depth)
    for round_idx in range(3):  # different keys: exact must still be deterministic
        exact = verify_tree(tree, targets, keys_for(batch, round_idx), mode="exact", max_depth=depth)
        for field in ("path", "num_accepted", "next_token", "accepted_tokens"):
            np.testing.assert_array_equal(getattr(exact, field), getattr(greedy, field), err_msg=field)
    assert int(jnp.max(greedy.num_accepted)) == depth and int(jnp.min(greedy.num_accepted)) == 0


def test_exact_residual_update_between_siblings():
    # p_root = 1/2 on tokens 5 and 7, deterministic children 5 then 7: if child 5 is rejected the
    # residual is one-hot on 7, so child 7 is always accepted -> exactly one token accepted, 50/50.
    batch = 4000
    tree = hand_tree([3, 5, 7], [-1, 0, 0])
    tree = jax.tree.map(lambda a: jnp.repeat(a, batch, axis=0), tree)
    targets = jnp.zeros((batch, 3, VOCAB)).at[:, 0, jnp.array([5, 7])].set(0.5).at[:, 1:, 0].set(1.0)
    result = verify_tree(tree, targets, keys_for(batch), mode="exact", max_depth=1)
    np.testing.assert_array_equal(result.num_accepted, 1)
    np.testing.assert_array_equal(result.next_token, 0)
    first = np.asarray(result.accepted_tokens[:, 0])
    assert set(np.unique(first)) == {5, 7}
    assert abs(np.mean(first == 5) - 0.5) < 0.04  # 5 sigma


def test_exact_rejection_with_soft_q_draws_from_residual():
    # p = (0.5, 0.5, 0, ...), q = (0.1, 0.9, 0, ...), child token 1: accept w.p. 0.5/0.9; on rejection the
    # residual is one-hot on token 0 (bonus never happens at the root).
    batch = 6000
    q = jnp.zeros((1, 2, VOCAB)).at[0, 1, :2].set(jnp.array([0.1, 0.9]))
    tree = jax.tree.map(lambda a: jnp.repeat(a, batch, axis=0), hand_tree([3, 1], [-1, 0], q_probs=q))
    targets = jnp.zeros((batch, 2, VOCAB)).at[:, 0, :2].set(0.5).at[:, 1, 4].set(1.0)
    result = verify_tree(tree, targets, keys_for(batch), mode="exact", max_depth=1)
    accepted = np.asarray(result.num_accepted) == 1
    np.testing.assert_array_equal(np.asarray(result.next_token)[~accepted], 0)
    np.testing.assert_array_equal(np.asarray(result.next_token)[accepted], 4)
    assert abs(accepted.mean() - 5 / 9) < 5 * np.sqrt(0.25 / batch)


def test_typical_acceptance_rule():
    # root distribution: entropy H, threshold min(0.09, 0.3 exp(-H)). Children 1 (token 0, p=0.45) and
    # 2 (token 1, p=0.4) pass; 3 (token 2, p=0.01) fails. Both depth-2 grandchildren pass; the tie in
    # depth is broken by the path likelihood: 0.45 * 0.5 (node 4) < 0.4 * 0.9 (node 5).
    p_root = np.array([0.45, 0.4, 0.01] + [0.14 / 7] * 7)
    threshold = min(0.09, 0.3 * np.exp(np.sum(p_root * np.log(p_root))))
    assert 0.01 < threshold < 0.4
    targets = np.zeros((1, 6, VOCAB))
    targets[0, 0] = p_root
    targets[0, 1, [3, 4]] = [0.5, 0.5]
    targets[0, 2, [5, 6]] = [0.9, 0.1]
    targets[0, 3, 0] = 1.0
    targets[0, 4, 8] = 1.0
    targets[0, 5, 9] = 1.0
    tree = hand_tree([3, 0, 1, 2, 3, 5], [-1, 0, 0, 0, 1, 2])
    result = verify_tree(tree, jnp.asarray(targets), keys_for(1), mode="typical_lossy", max_depth=2)
    np.testing.assert_array_equal(result.path, [[0, 2, 5]])
    np.testing.assert_array_equal(result.emitted_tokens, [[1, 5, 9]])
    # posterior_threshold 0.5 with a huge alpha: threshold 0.5, nothing passes, next token ~ p_root
    strict = verify_tree(
        tree,
        jnp.asarray(targets),
        keys_for(1),
        mode="typical_lossy",
        max_depth=2,
        posterior_threshold=0.5,
        posterior_alpha=100.0,
    )
    np.testing.assert_array_equal(strict.path, [[0, -1, -1]])
    assert int(strict.next_token[0]) in np.flatnonzero(p_root)


@pytest.mark.parametrize(
    "row, token, passes",
    [
        # Low entropy, p = (0.83, 0.1, 0.07): H = 0.83*0.18633 + 0.1*2.30259 + 0.07*2.65926 = 0.57106,
        # 0.3 * exp(-H) = 0.16947, threshold = min(0.09, 0.16947) = 0.09: the cap binds.
        ("low", 1, True),  # p = 0.1 > 0.09
        ("low", 2, False),  # p = 0.07 <= 0.09 (the swapped rule, min(0.3, 0.09 exp(-H)) = 0.0508, passed it)
        # High entropy, p = (0.012, 19 x 0.052): H = 0.012*4.42285 + 19*0.052*2.95651 = 2.97411,
        # threshold = min(0.09, 0.3 * exp(-H) = 0.015328) = 0.015328: the entropy term binds.
        ("high", 1, True),  # p = 0.052 > 0.0153 (a fixed 0.09 cap would reject it)
        ("high", 0, False),  # p = 0.012 <= 0.0153 (the swapped rule's 0.0046 passed it)
    ],
)
def test_typical_acceptance_defaults_follow_medusa_by_hand(row, token, passes):
    vocab = 24
    p = np.zeros(vocab)
    if row == "low":
        p[:3] = [0.83, 0.1, 0.07]
        hand_threshold = 0.09
    else:
        p[:20] = [0.012] + [0.052] * 19
        hand_threshold = 0.015328
    entropy = -np.sum(p[p > 0] * np.log(p[p > 0]))
    assert abs(min(0.09, 0.3 * np.exp(-entropy)) - hand_threshold) < 2e-6
    targets = np.zeros((1, 2, vocab), np.float32)
    targets[0, 0] = p
    targets[0, 1, 23] = 1.0
    tree = hand_tree([5, token], [-1, 0])
    result = verify_tree(tree, jnp.asarray(targets), keys_for(1), mode="typical_lossy", max_depth=1)
    assert int(result.num_accepted[0]) == int(passes)
    if passes:
        assert int(result.next_token[0]) == 23
    spec = jaxspec_config.SpecConfig(method="medusa", acceptance="typical_lossy")
    assert (spec.posterior_threshold, spec.posterior_alpha) == (0.09, 0.3)


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        verify_tree(hand_tree([0, 1], [-1, 0]), one_hot_targets([1, 2]), keys_for(1), mode="x", max_depth=1)


def test_verify_tree_jits_without_retracing():
    traces = []

    @jax.jit
    def run(tree, targets, keys):
        traces.append(1)
        return verify_tree(tree, targets, keys, mode="exact", max_depth=3)

    tree = chain_tree(jnp.array([1, 2]), jnp.array([[3, 4, 5], [6, 7, 8]]))
    logits = jax.random.normal(jax.random.key(0), (2, 4, VOCAB))
    for round_idx, temperature in enumerate([1.0, 0.5, 0.0]):
        targets = process_logits(logits * (round_idx + 1), arrays(SamplingParams(temperature), 2))
        result = run(tree, targets, keys_for(2, round_idx))
        assert result.path.shape == (2, 4) and result.accepted_tokens.shape == (2, 3)
    assert len(traces) == 1
