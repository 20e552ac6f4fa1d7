"""Tree masks, tree positions and the KV commit, checked against autoregressive feeding."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.model.forward import causal_mask, lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache, commit_path
from jaxspec.sampling.tree import DraftTree, ancestor_mask, tree_positions
from tests.tiny_models import save_tiny

# A tree of 7 nodes: root 0; children 1, 2; 1 -> 3, 4; 2 -> 5; 4 -> 6.
PARENT = np.array([-1, 0, 0, 1, 1, 2, 4], np.int32)
DEPTH = np.array([0, 1, 1, 2, 2, 2, 3], np.int32)
TOKENS = np.array([11, 22, 33, 44, 55, 66, 77], np.int32)


def make_tree(batch: int = 1) -> DraftTree:
    tile = lambda a: jnp.asarray(np.tile(a, (batch, 1)))  # noqa: E731
    return DraftTree(
        tokens=tile(TOKENS), parent=tile(PARENT), depth=tile(DEPTH), valid=jnp.ones((batch, 7), bool)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


def test_ancestor_mask_is_self_plus_ancestors():
    mask = np.asarray(ancestor_mask(make_tree())[0])
    for i in range(7):
        expected = {i}
        j = PARENT[i]
        while j >= 0:
            expected.add(int(j))
            j = PARENT[j]
        assert set(np.flatnonzero(mask[i]).tolist()) == expected


def test_invalid_nodes_are_masked_out():
    tree = dataclasses.replace(make_tree(), valid=jnp.asarray([[True] * 6 + [False]]))
    mask = np.asarray(ancestor_mask(tree)[0])
    assert not mask[6].any() and not mask[:, 6].any()


def test_positions_are_prefix_plus_depth_not_node_index():
    positions = np.asarray(tree_positions(make_tree(), jnp.asarray([10])))[0]
    assert positions.tolist() == (10 + DEPTH).tolist()
    assert positions.tolist() != (10 + np.arange(7)).tolist()


def _prefill(model, prompt):
    cfg = model.config
    cache = KVCache.zeros(cfg, 1, 64, jnp.float32)
    n = len(prompt)
    _, _, cache = model_forward(
        model.graphdef, model.params, jnp.asarray([prompt]), jnp.arange(n)[None], cache, causal_mask(1, n)
    )
    return dataclasses.replace(cache, lengths=jnp.asarray([n], jnp.int32))


@pytest.mark.parametrize("path", [[0, 1, 4, 6], [0, 2, 5], [0, 1, 3], [0]])
def test_tree_logits_and_committed_cache_match_autoregressive(tiny, path):
    prompt = [5, 9, 200, 31, 7]
    tree = make_tree()
    cache = _prefill(tiny, prompt)
    hidden, _, tree_cache = model_forward(
        tiny.graphdef, tiny.params, tree.tokens, tree_positions(tree, cache.lengths), cache,
        ancestor_mask(tree),
    )  # fmt: skip
    tree_logits = np.asarray(lm_logits(tiny.graphdef, tiny.params, hidden))[0]
    committed = commit_path(
        tree_cache, jnp.asarray([path + [-1] * (4 - len(path))]), jnp.asarray([len(path)]), window=7
    )

    sequence = prompt + [int(TOKENS[i]) for i in path]
    reference = tiny.logits(sequence)
    ref_cache = _prefill(tiny, sequence)
    for j, node in enumerate(path):
        np.testing.assert_allclose(tree_logits[node], reference[len(prompt) + j], atol=1e-4)
    assert int(committed.lengths[0]) == len(sequence)
    n = len(sequence)
    for layer in range(tiny.config.num_layers):
        np.testing.assert_allclose(
            committed.keys[layer][0, :, :n], ref_cache.keys[layer][0, :, :n], atol=1e-5
        )
        np.testing.assert_allclose(
            committed.values[layer][0, :, :n], ref_cache.values[layer][0, :, :n], atol=1e-5
        )


def test_index_positions_break_tree_logits(tiny):
    """The broken variant (position = flattened node index) must disagree with autoregressive logits."""
    prompt = [5, 9, 200, 31, 7]
    tree = make_tree()
    cache = _prefill(tiny, prompt)
    wrong_positions = cache.lengths[:, None] + jnp.arange(7)[None]
    hidden, _, _ = model_forward(
        tiny.graphdef, tiny.params, tree.tokens, wrong_positions, cache, ancestor_mask(tree)
    )
    logits = np.asarray(lm_logits(tiny.graphdef, tiny.params, hidden))[0]
    reference = tiny.logits(prompt + [11, 33, 66])  # path 0 -> 2 -> 5: node 5 sits at index 5, depth 2
    assert np.abs(logits[5] - reference[-1]).max() > 1e-2
