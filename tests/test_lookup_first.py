"""Prompt lookup in front of a head's chain (`SpecConfig.lookup_min_match`, `drafters.lookup_first`).

The sampled-distribution test of the same drafter through the engine's round is in
tests/test_heads_exactness.py (`test_lookup_first_keeps_the_target_distribution`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sampling
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.drafters.lookup_first import LookupFirstDrafter
from jaxspec.drafters.make import make_drafter
from jaxspec.drafters.ngram import ngram_chain
from jaxspec.drafters.protocol import RoundContext
from tests.tiny_models import save_tiny

CHAIN = SpecConfig(method="eagle", head="random", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lookup_first")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


def two_rows(tiny, head, params, sampling_params: SamplingParams) -> tuple:
    """(the head's state, the round's context) for two rows after prefill: row 0's history ends with
    "2 3", which occurred before (continuation 4 1 2); row 1 repeats nothing."""
    history = jnp.asarray([[1, 2, 3, 4, 1, 2, 3], [10, 11, 12, 13, 14, 15, 16]], jnp.int32)
    requests = Requests(
        prompt_tokens=history[:, :-1], prompt_lengths=jnp.full((2,), 6, jnp.int32),
        max_new_tokens=jnp.full((2,), 8, jnp.int32), seeds=jnp.zeros((2,), jnp.int32),
        request_ids=jnp.arange(2, dtype=jnp.int32),
        sampling=sampling.SamplingArrays.from_params(sampling_params, 2),
    )  # fmt: skip
    pre = prefill(tiny.graphdef, tiny.params, tiny.config, requests, 32, capture_layers=head.capture_layers)
    state = head.init(params, tiny.params, pre, requests, 32)
    ctx = RoundContext(
        history=history, history_len=jnp.full((2,), 7, jnp.int32), cache_lengths=jnp.full((2,), 6, jnp.int32),
        keys=sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_DRAFT),
        sampling=requests.sampling,
    )  # fmt: skip
    return state, ctx


def test_rows_with_a_lookup_match_draft_its_continuation_and_the_others_the_heads_chain(tiny):
    head, params = make_drafter(tiny, CHAIN)
    hybrid, _ = make_drafter(tiny, dataclasses.replace(CHAIN, lookup_min_match=2))
    assert hybrid == LookupFirstDrafter(head=head, min_match=2, max_match=CHAIN.ngram_max)
    state, ctx = two_rows(tiny, head, params, SamplingParams(temperature=0.7))
    own, _ = head.propose(params, tiny.params, state, ctx)
    tree, _ = hybrid.propose(params, tiny.params, state, ctx)
    chain = dict(num_tokens=3, ngram_min=2, ngram_max=CHAIN.ngram_max)
    looked_up = ngram_chain(ctx.history, ctx.history_len, **chain)
    np.testing.assert_array_equal(tree.tokens, [[3, 4, 1, 2], np.asarray(own.tokens[1])])
    np.testing.assert_array_equal(tree.tokens[0], looked_up.tokens[0])
    np.testing.assert_array_equal(tree.valid, own.valid)
    vocab = own.q_probs.shape[-1]
    one_hot = np.eye(vocab, dtype=np.float32)[[4, 1, 2]]
    np.testing.assert_array_equal(tree.q_probs[0, 1:], one_hot)  # deterministic drafts: q is one-hot
    np.testing.assert_array_equal(tree.q_probs[1], own.q_probs[1])  # the head's row keeps its own q


TREE = SpecConfig(method="eagle", head="random", num_speculative_tokens=3, topk=2, num_draft_tokens=4)


def path_to(tree, row: int, node: int) -> list[int]:
    """The tokens from the root's child down to `node` (following parents)."""
    tokens = []
    while node > 0:
        tokens.append(int(tree.tokens[row, node]))
        node = int(tree.parent[row, node])
    return tokens[::-1]


def test_a_head_tree_gets_the_lookup_chain_merged_in_after_its_nodes(tiny):
    """With a dynamic tree the head's N nodes stay as they are and the lookup's chain is merged in after
    them: a path from the root spells its whole continuation, every valid appended node lies on it; a row
    without a match leaves the appended nodes invalid."""
    head, params = make_drafter(tiny, TREE)
    hybrid, _ = make_drafter(tiny, dataclasses.replace(TREE, lookup_min_match=2))
    assert hybrid == LookupFirstDrafter(head=head, min_match=2, max_match=TREE.ngram_max, branch=True)
    n, k = head.num_nodes, TREE.num_speculative_tokens
    assert hybrid.num_nodes == n + k and hybrid.max_depth == head.max_depth == k
    state, ctx = two_rows(tiny, head, params, SamplingParams())
    own, _ = head.propose(params, tiny.params, state, ctx)
    tree, _ = hybrid.propose(params, tiny.params, state, ctx)
    for field in ("tokens", "parent", "depth", "valid"):
        np.testing.assert_array_equal(getattr(tree, field)[:, :n], getattr(own, field))
    assert tree.q_probs is None and own.q_probs is None  # top-k trees: deterministic drafts
    valid = np.asarray(tree.valid)
    paths = [path_to(tree, 0, i) for i in range(n + k) if valid[0, i]]
    assert [4, 1, 2] in paths  # "2 3" occurred before: its continuation is a path of the merged tree
    assert all(
        path_to(tree, 0, i) == [4, 1, 2][: len(path_to(tree, 0, i))] for i in range(n, n + k) if valid[0, i]
    )
    assert not valid[1, n:].any()


def test_the_lookup_chain_continues_the_heads_path_where_the_tree_has_its_first_tokens():
    """The exact walk descends only into the first accepted child: a chain whose first tokens the tree
    already holds is hung under the tree's node for them (a duplicate root child would never be
    reached once the head's is accepted)."""
    from jaxspec.drafters.lookup_first import append_branch
    from jaxspec.sampling.tree import DraftTree

    # root 9; children 4 (node 1) and 5 (node 2); node 1's child 1 (node 3), node 2's child 7 (node 4).
    tree = DraftTree(
        tokens=jnp.asarray([[9, 4, 5, 1, 7]] * 3, jnp.int32),
        parent=jnp.asarray([[-1, 0, 0, 1, 2]] * 3, jnp.int32),
        depth=jnp.asarray([[0, 1, 1, 2, 2]] * 3, jnp.int32),
        valid=jnp.asarray([[True] * 5] * 3),
    )
    chains = jnp.asarray([[9, 4, 1, 2], [9, 5, 8, 3], [9, 6, 4, 1]], jnp.int32)
    chain_valid = jnp.asarray([[True] * 4, [True] * 4, [True, True, True, False]])
    merged = append_branch(tree, chains, chain_valid)
    # row 0: 4 and 1 are nodes 1 and 3, so only 2 is new, under node 3
    # row 1: 5 is node 2, 8 is new under it, 3 under 8
    # row 2: nothing shared, a branch of the root (its last token invalid)
    np.testing.assert_array_equal(
        merged.valid[:, 5:], [[False, False, True], [False, True, True], [True, True, False]]
    )
    np.testing.assert_array_equal(merged.parent[:, 5:], [[0, 1, 3], [0, 2, 6], [0, 5, 6]])
    np.testing.assert_array_equal(merged.depth[:, 5:], [[1, 2, 3]] * 3)
    np.testing.assert_array_equal(merged.tokens[:, 5:], chains[:, 1:])
    np.testing.assert_array_equal(merged.parent[:, :5], tree.parent)  # the head's nodes stay as they are
    assert path_to(merged, 0, 7) == [4, 1, 2] and path_to(merged, 1, 7) == [5, 8, 3]


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_lookup_first_greedy_output_equals_autoregressive(tiny, spec):
    """Batch 4, prompts with and without repeats; the lookup chains are verified (more drafts accepted
    than with the random head alone) and the output is the autoregressive one."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [250, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7], list(range(30, 45))]
    reference = [c.token_ids for c in jaxspec.generate(tiny, prompts, max_new_tokens=24)]
    plain = jaxspec.generate(tiny, prompts, max_new_tokens=24, spec=spec)
    hybrid = jaxspec.generate(
        tiny, prompts, max_new_tokens=24, spec=dataclasses.replace(spec, lookup_min_match=1)
    )
    assert [c.token_ids for c in plain] == reference == [c.token_ids for c in hybrid]
    accepted = lambda out: sum(c.stats["accepted_by_depth"][0] for c in out)  # noqa: E731
    assert accepted(hybrid) > accepted(plain)


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"method": "ngram", "lookup_min_match": 2}, "method must be one of"),
        ({"method": "medusa", "topk": 2, "num_draft_tokens": 5, "lookup_min_match": 2}, "with a chain"),
        ({"method": "eagle", "tree_choices": [[0], [1]], "lookup_min_match": 2}, "with a dynamic tree"),
        ({"method": "eagle", "lookup_min_match": -1}, "lookup_min_match must be >= 0"),
    ],
)
def test_lookup_first_needs_a_head_chain_or_a_dynamic_tree(spec, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig.from_dict(spec)


def test_lookup_first_refuses_a_medusa_tree_preset(tiny):
    """A Medusa tree from extra 'tree_preset' passes SpecConfig's own checks (topk 1, no tree_choices):
    `make_drafter` names the problem instead of failing inside the compiled round."""
    spec = SpecConfig(method="medusa", head="random", lookup_min_match=2, extra=(("tree_preset", "tree_16"),))
    with pytest.raises(jaxspec.JaxspecError, match="lookup_min_match needs a head chain; this medusa spec"):
        make_drafter(tiny, spec)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_a_lookup_branch_deeper_than_the_heads_tree_decodes_what_autoregressive_decoding_does(tiny, method):
    """SpecConfig.branch_tokens 8 beside a tree of depth 3: the repeating prompts' lookup chains are
    accepted past depth 3 (paths of up to 8 drafts a round, which the head commits), and the output is
    the autoregressive one."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [250, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7], list(range(30, 45))]
    reference = [c.token_ids for c in jaxspec.generate(tiny, prompts, max_new_tokens=24)]
    spec = dataclasses.replace(TREE, method=method, lookup_min_match=1, branch_tokens=8)
    drafter, _ = make_drafter(tiny, spec)
    assert (drafter.max_depth, drafter.num_nodes) == (8, drafter.head.num_nodes + 8)
    deeper = jaxspec.generate(tiny, prompts, max_new_tokens=24, spec=spec)
    assert [c.token_ids for c in deeper] == reference
    by_depth = np.sum([c.stats["accepted_by_depth"] for c in deeper], axis=0)
    assert len(by_depth) == 8 and by_depth[3:].sum() > 0, by_depth


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle", "lookup_min_match": 2, "branch_tokens": 8},  # a chain
        {"method": "eagle", "topk": 2, "num_draft_tokens": 4, "branch_tokens": 8},  # no lookup, no datastore
    ],
)
def test_branch_tokens_needs_a_lookup_or_datastore_branch_of_a_dynamic_tree(spec):
    with pytest.raises(ValueError, match="SpecConfig.branch_tokens sets the length of the prompt-lookup"):
        SpecConfig.from_dict(spec)


def test_the_bench_runs_each_lookup_and_datastore_tree_at_each_branch_length():
    from jaxspec.bench.runner import build_variants

    variants, _ = build_variants(
        [("eagle3", ())], tree_sizes=[19], tree_topk=8, tree_depth=6, lookup_min_matches=[2],
        datastore="shipped", branch_tokens=[6, 12], heads={"eagle3": "HEAD"},
    )  # fmt: skip
    got = {v.label: v.spec.branch_tokens for v in variants if v.spec is not None}
    shape = "eagle3 tree 19 (top-8, depth 6)"
    assert got == {
        shape: None,
        **{
            f"{shape}{what}, branch {n}": n
            for what in (", lookup ≥ 2", ", datastore", ", lookup ≥ 2, datastore")
            for n in (6, 12)
        },
    }
