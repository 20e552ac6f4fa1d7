"""Statistical proof of DESIGN invariant 1: exact tree verification is lossless.

A toy "language model" over a small vocabulary: the processed target distribution of the token after
position t is P[t, x_t] (a random table, so the target is context dependent), the draft's is Q[t, x_t]
(the target's logits plus noise). Each sample runs a few speculative rounds: draft a tree (children
sampled i.i.d. from Q with q_probs, or the deterministic top-k tokens of Q with q_probs=None), verify it
with `verify_tree(mode="exact")` against P at every node, emit accepted drafts + next token, continue
from the last emitted token. The distribution of the first L emitted tokens must equal the target's
joint P[0, x0](x1) P[1, x1](x2) [P[2, x2](x3)].

Bound (stated once, used everywhere): 100k samples, one jitted call. For every cell of the joint (and
of the first-token marginal) with probability p, Bernstein's inequality gives
    P(|count - n p| >= t) <= delta  for  t = a/3 + sqrt(a^2/9 + 2 a n p (1 - p)),  a = ln(2 / delta),
with delta = 1e-6 / (number of cells) (Bonferroni): a correct sampler fails a check with probability
< 1e-6. Cells of probability exactly 0 (removed by top-k / top-p) must have count 0. The seeds are
fixed, so the tests are deterministic. The same check must FAIL for deliberately broken variants
(test-local copies of the exact walk built from the production helpers, with one line changed).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import sampling
from jaxspec.config import SamplingParams
from jaxspec.sampling import verify
from jaxspec.sampling.processors import SamplingArrays
from jaxspec.sampling.tree import DraftTree

NUM_SAMPLES = 100_000
FAILURE_PROBABILITY = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    vocab: int
    branching: tuple[int, ...]  # children per node at each depth (1, 1, ...) = chain
    sampled: bool  # children i.i.d. from q (q_probs given) or the top-k tokens of q (q_probs None)
    params: SamplingParams
    num_tokens: int  # length of the emitted prefix whose joint distribution is checked
    draft_noise: float = 1.0  # draft logits = target logits + draft_noise * N(0, 1)
    seed: int = 0


def topology(branching: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(parents, depths, sibling ranks) of the BFS-ordered tree with the given branching per depth."""
    parents, depths, ranks, frontier = [-1], [0], [0], [0]
    for children in branching:
        next_frontier = []
        for node in frontier:
            for rank in range(children):
                parents.append(node)
                depths.append(depths[node] + 1)
                ranks.append(rank)
                next_frontier.append(len(parents) - 1)
        frontier = next_frontier
    return tuple(parents), tuple(depths), tuple(ranks)


def toy_model(case: Case) -> tuple[jax.Array, jax.Array]:
    """Processed target P and draft Q tables [T, V, V]: row [t, x] = next-token distribution."""
    positions = case.num_tokens * (len(case.branching) + 1) + 1  # never clipped
    rng = np.random.default_rng(case.seed)
    target = rng.normal(size=(positions, case.vocab, case.vocab)) * 1.5
    draft = target + case.draft_noise * rng.normal(size=target.shape)
    params = SamplingArrays.from_params(case.params, 1)

    def process(logits):
        flat = jnp.asarray(logits.reshape(1, -1, case.vocab), jnp.float32)
        return sampling.process_logits(flat, params).reshape(target.shape)

    return process(target), process(draft)


def exact_verify(tree, target_probs, keys, *, max_depth):
    return sampling.verify_tree(tree, target_probs, keys, mode="exact", max_depth=max_depth)


@functools.partial(jax.jit, static_argnames=("case", "verify"))
def speculative_samples(target: jax.Array, draft: jax.Array, *, case: Case, verify=exact_verify):
    """[NUM_SAMPLES, num_tokens] emitted tokens; every sample is one request with its own keys."""
    parents, depths, ranks = topology(case.branching)
    max_depth, num_nodes = len(case.branching), len(parents)
    seeds = jnp.full((NUM_SAMPLES,), case.seed, jnp.int32)
    requests = jnp.arange(NUM_SAMPLES, dtype=jnp.int32)
    parent_row, depth_row = jnp.asarray(parents, jnp.int32), jnp.asarray(depths, jnp.int32)
    rank_row = jnp.asarray(ranks, jnp.int32)

    def one_round(carry, round_idx):
        out, count, root = carry  # the root (last emitted token) sits at position `count`
        draft_keys = sampling.derive_key(seeds, requests, round_idx, sampling.PURPOSE_DRAFT)

        def draft_node(node, drafted):  # parents come first, so tokens[:, parent] is already drafted
            tokens, q_probs = drafted
            parent = parent_row[node]
            q = draft[count + depth_row[parent], tokens[:, parent]]  # [S, V]
            if case.sampled:
                token = sampling.sample_from_probs(q, sampling.fold_in_rows(draft_keys, node))
            else:  # the rank-th most likely draft token (distinct siblings)
                token = jnp.argsort(-q, axis=-1, stable=True)[:, rank_row[node]]
            return tokens.at[:, node].set(token), q_probs.at[:, node].set(q)

        tokens = jnp.zeros((NUM_SAMPLES, num_nodes), jnp.int32).at[:, 0].set(root)
        q_probs = jnp.zeros((NUM_SAMPLES, num_nodes, case.vocab), jnp.float32)
        tokens, q_probs = jax.lax.fori_loop(1, num_nodes, draft_node, (tokens, q_probs))
        tree = DraftTree(
            tokens=tokens,
            parent=jnp.broadcast_to(parent_row, tokens.shape),
            depth=jnp.broadcast_to(depth_row, tokens.shape),
            valid=jnp.ones(tokens.shape, bool),
            q_probs=q_probs if case.sampled else None,
        )
        target_probs = target[count[:, None] + depth_row[None, :], tokens]  # [S, N, V]
        keys = sampling.round_key(seeds, requests, round_idx)
        result = verify(tree, target_probs, keys, max_depth=max_depth)
        out = jax.vmap(jax.lax.dynamic_update_slice)(out, result.emitted_tokens, count[:, None])
        return (out, count + result.num_accepted + 1, result.next_token), None

    capacity = case.num_tokens * (max_depth + 1)  # writes never clip
    init = (
        jnp.full((NUM_SAMPLES, capacity), -1, jnp.int32),
        jnp.zeros((NUM_SAMPLES,), jnp.int32),
        jnp.zeros((NUM_SAMPLES,), jnp.int32),
    )
    (out, _, _), _ = jax.lax.scan(one_round, init, jnp.arange(case.num_tokens))
    return out[:, : case.num_tokens]


def target_joint(target: np.ndarray, num_tokens: int) -> np.ndarray:
    """[V] * num_tokens joint of the first emitted tokens, starting from token 0 at position 0."""
    target = np.asarray(target, np.float64)
    joint = target[0, 0]
    for position in range(1, num_tokens):
        joint = joint[..., None] * target[position]  # [..., x_position, x_next]
    return joint


def bernstein_excess(samples: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """(max over cells of |count - n p| / t, total count in zero-probability cells)."""
    n = samples.shape[0]
    cells = expected.size
    counts = np.bincount(np.ravel_multi_index(samples.T, expected.shape), minlength=cells)
    p = expected.ravel()
    a = math.log(2.0 / (FAILURE_PROBABILITY / cells))
    bound = a / 3 + np.sqrt(a * a / 9 + 2 * a * n * p * (1 - p))
    return float(np.max(np.abs(counts - n * p) / bound)), int(counts[p == 0].sum())


def check(case: Case, verify=exact_verify) -> tuple[float, int]:
    """Worst (excess, zero-cell count) over the first-token marginal and the joint of case.num_tokens."""
    target, draft = toy_model(case)
    samples = np.asarray(speculative_samples(target, draft, case=case, verify=verify))
    assert samples.min() >= 0 and samples.max() < case.vocab
    joint = target_joint(np.asarray(target), case.num_tokens)
    first = bernstein_excess(samples[:, :1], joint.sum(axis=tuple(range(1, joint.ndim))))
    full = bernstein_excess(samples, joint)
    return max(first[0], full[0]), first[1] + full[1]


T07, T10 = 0.7, 1.0
CASES = {
    "chain1-sampled": Case(16, (1,), True, SamplingParams(T10), 2),
    "chain4-sampled-topk": Case(8, (1, 1, 1, 1), True, SamplingParams(T07, top_k=5), 3, 0.5, seed=1),
    "chain3-topk-children-topp": Case(8, (1, 1, 1), False, SamplingParams(T10, top_p=0.8), 3, 0.5, 2),
    "tree2-topk-children": Case(24, (2,), False, SamplingParams(T07), 2, seed=3),
    "tree3x2-sampled-topk-topp": Case(8, (3, 2), True, SamplingParams(T10, top_k=6, top_p=0.9), 3, seed=4),
    "tree4x2x1-topk-children-topp": Case(8, (4, 2, 1), False, SamplingParams(T07, top_p=0.8), 3, seed=5),
    "tree2x2x2x2-sampled": Case(8, (2, 2, 2, 2), True, SamplingParams(T07), 3, 0.5, seed=6),
    "tree3x3-sampled-topp": Case(16, (3, 3), True, SamplingParams(T07, top_p=0.8), 2, seed=7),
    "tree4-sampled-topk-topp-v32": Case(32, (4,), True, SamplingParams(T10, top_k=24, top_p=0.95), 2, seed=9),
    "tree4x1x1-topk-children-topk": Case(12, (4, 1, 1), False, SamplingParams(T10, top_k=4), 3, 0.5, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_verification_is_lossless(name):
    excess, in_zero_cells = check(CASES[name])
    assert in_zero_cells == 0
    assert excess <= 1.0, f"{name}: deviation {excess:.2f}x the 1e-6 Bernstein bound"


# ---------------------------------------------------------------------------------------------------
# Broken variants: the same check must catch them.
# ---------------------------------------------------------------------------------------------------


def exact_walk(tree, target_probs, keys, *, max_depth, variant=None):
    """Test-local copy of the production exact walk from its helpers; `variant` breaks one step.

    None: identical to verify_tree(mode="exact") (pinned by test_local_walk_matches_production).
    "resample_from_p": after a rejection draw the next token from p, not from the residual.
    "shared_key": one accept coin key for every child and depth.
    "no_sibling_update": test every sibling against p (the residual is not carried between siblings).
    """
    batch, num_nodes, vocab = target_probs.shape
    candidate = tree.valid & (tree.depth >= 1) & (tree.depth <= max_depth)
    accept_keys = sampling.fold_in_rows(keys, sampling.PURPOSE_ACCEPT)

    def visit(c, carry):
        node, residual, rejected_here = carry
        p_node = jnp.take_along_axis(target_probs, node[:, None, None], axis=1)[:, 0]
        tested = p_node if variant == "no_sibling_update" else residual
        is_child = candidate[:, c] & (tree.parent[:, c] == node)
        token = tree.tokens[:, c]
        draft_q = verify._draft_distribution(tree, c, vocab)
        coin_key = 0 if variant == "shared_key" else c
        coin = verify._uniform_rows(sampling.fold_in_rows(accept_keys, coin_key))
        accept = is_child & verify._accept_test(tested, draft_q, token, coin)
        reject = is_child & ~accept
        residual = jnp.where(
            accept[:, None],
            target_probs[:, c],
            jnp.where(reject[:, None], verify._residual_distribution(tested, draft_q), residual),
        )
        node = jnp.where(accept, c, node)
        rejected_here = jnp.where(accept, False, rejected_here | reject)
        return node, residual, rejected_here

    init = (jnp.zeros((batch,), jnp.int32), target_probs[:, 0], jnp.zeros((batch,), bool))
    last, residual, rejected_here = jax.lax.fori_loop(1, num_nodes, visit, init)
    if variant == "resample_from_p":
        residual = jnp.take_along_axis(target_probs, last[:, None, None], axis=1)[:, 0]
    next_token = verify._sample_next_token(residual, keys, rejected_here)
    return verify._result_from_last_node(tree, last, next_token, max_depth)


@pytest.mark.parametrize("sampled", [True, False])
def test_local_walk_matches_production(sampled):
    """With variant=None the local copy is the production walk, bit for bit (same keys, same draws)."""
    batch, vocab = 4096, 6
    parents, depths, _ = topology((3, 2, 1))
    rng = np.random.default_rng(41)
    shape = (batch, len(parents))
    q_probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=shape), jnp.float32)
    tree = DraftTree(
        tokens=jnp.asarray(rng.integers(0, vocab, size=shape), jnp.int32),
        parent=jnp.broadcast_to(jnp.asarray(parents, jnp.int32), shape),
        depth=jnp.broadcast_to(jnp.asarray(depths, jnp.int32), shape),
        valid=jnp.asarray(rng.random(shape) < 0.9).at[:, 0].set(True),
        q_probs=q_probs if sampled else None,
    )
    target_probs = jnp.asarray(rng.dirichlet(np.ones(vocab) * 0.5, size=shape), jnp.float32)
    keys = sampling.round_key(jnp.zeros(batch, jnp.int32), jnp.arange(batch), 0)
    production = exact_verify(tree, target_probs, keys, max_depth=3)
    local = jax.jit(exact_walk, static_argnames="max_depth")(tree, target_probs, keys, max_depth=3)
    for name in ("path", "num_accepted", "next_token", "accepted_tokens"):
        np.testing.assert_array_equal(getattr(local, name), getattr(production, name), err_msg=name)
    assert 0 < float(jnp.mean(production.num_accepted > 0)) < 1


# Each variant runs on a case of CASES where it matters (the production walk passes it above).
BROKEN = {
    "resample_from_p": "chain4-sampled-topk",
    "shared_key": "tree4x1x1-topk-children-topk",
    "no_sibling_update": "tree2-topk-children",
}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variants_fail_the_same_check(variant):
    verify = functools.partial(exact_walk, variant=variant)
    excess, _ = check(CASES[BROKEN[variant]], verify=verify)
    assert excess > 2.0, f"{variant}: deviation only {excess:.2f}x the bound: the check lacks power"


def test_bonus_token_marginal_of_a_single_draw():
    """sample_from_probs alone reproduces a processed distribution within the same bound."""
    case = Case(32, (1,), True, SamplingParams(T07, top_k=20, top_p=0.9), 1, seed=31)
    target, _ = toy_model(case)
    probs = jnp.broadcast_to(target[0, 0], (NUM_SAMPLES, case.vocab))
    keys = sampling.derive_key(jnp.zeros(NUM_SAMPLES, jnp.int32), jnp.arange(NUM_SAMPLES), 0, 4)
    samples = np.asarray(sampling.sample_from_probs(probs, keys))[:, None]
    excess, in_zero_cells = bernstein_excess(samples, np.asarray(target[0, 0], np.float64))
    assert in_zero_cells == 0 and excess <= 1.0
    assert np.count_nonzero(np.asarray(target[0, 0])) < case.vocab  # the filters did remove tokens
