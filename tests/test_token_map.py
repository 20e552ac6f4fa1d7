"""Drafting over a token map (`SpecConfig.token_map`, FR-Spec) for heads that draft through the target's
LM head (EAGLE-1, MTP).

The sampled-distribution test of the same drafters through the engine's round is in
tests/test_heads_exactness.py (`test_token_map_keeps_the_target_distribution`).
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.config import SpecConfig
from jaxspec.drafters.heads.drafting import read_token_map, token_map_logits, token_map_params
from jaxspec.drafters.heads.registry import make_head_drafter
from jaxspec.drafters.heads.shipped import TOKEN_MAP_FILE, resolve_token_map, shipped_heads_dir
from jaxspec.errors import InputError
from jaxspec.model.forward import lm_logits
from tests.tiny_models import save_tiny

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 3, 14], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(30, 45))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_token_map")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


@pytest.fixture()
def token_map(tiny, tmp_path):
    """Every other token id, shuffled on disk (the reader sorts them)."""
    ids = np.arange(0, tiny.config.vocab_size, 2)
    path = tmp_path / "map.npy"
    np.save(path, np.random.default_rng(0).permutation(ids))
    return path, ids


def test_token_map_logits_are_the_lm_heads_logits_of_the_maps_tokens(tiny, token_map):
    path, ids = token_map
    read = read_token_map(path, tiny.config.vocab_size)
    np.testing.assert_array_equal(read, ids)
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(3, tiny.config.hidden_size)), jnp.float32)
    params = {"token_map": token_map_params(read, nnx.merge(tiny.graphdef, tiny.params).lm_head_rows())}
    full = np.asarray(lm_logits(tiny.graphdef, tiny.params, hidden))
    np.testing.assert_allclose(
        np.asarray(token_map_logits(params, hidden)), full[:, ids], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("method", ["eagle", pytest.param("mtp", marks=pytest.mark.slow)])
def test_greedy_output_with_a_token_map_equals_autoregressive(tiny, token_map, method):
    """Greedy, batch 3, a random head drafting over half the vocabulary: the same tokens as plain
    decoding, and every draft the rounds made is a token of the map."""
    path, ids = token_map
    spec = SpecConfig(method=method, head="random", num_speculative_tokens=3, token_map=str(path))
    reference = [c.token_ids for c in jaxspec.generate(tiny, PROMPTS, max_new_tokens=24)]
    out = jaxspec.generate(tiny, PROMPTS, max_new_tokens=24, spec=spec)
    assert [c.token_ids for c in out] == reference
    drafter, params = make_head_drafter(tiny, spec)
    assert drafter.token_map and set(np.asarray(params["token_map"]["ids"]).tolist()) == set(ids.tolist())


def test_bad_token_maps_are_refused_with_the_file_and_the_problem(tiny, tmp_path):
    vocab = tiny.config.vocab_size
    cases = {
        "empty.npy": (np.zeros((0,), np.int32), "non-empty 1-D array"),
        "floats.npy": (np.asarray([1.0, 2.0]), "non-empty 1-D array"),
        "range.npy": (np.asarray([0, vocab]), f"ids must lie in [0, {vocab})"),
        "repeats.npy": (np.asarray([4, 5, 4]), "1 repeated ids"),
    }
    for name, (ids, message) in cases.items():
        np.save(tmp_path / name, ids)
        expected = re.escape(f"token map {tmp_path / name}: ") + ".*" + re.escape(message)
        with pytest.raises(InputError, match=expected):
            read_token_map(tmp_path / name, vocab)
    (tmp_path / "torn.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(InputError, match="torn.npy: not a readable .npy file"):
        read_token_map(tmp_path / "torn.npy", vocab)
    with pytest.raises(InputError, match="no token map is shipped for model"):
        make_head_drafter(tiny, SpecConfig(method="eagle", head="random", token_map="shipped"))


def test_token_map_is_for_heads_that_draft_through_the_targets_lm_head():
    for method in ("eagle3", "medusa", "ngram", None):
        with pytest.raises(ValueError, match="token_map restricts the drafts of heads"):
            SpecConfig(method=method, token_map="map.npy")
    assert dataclasses.replace(SpecConfig(method="mtp"), token_map="x.npy").token_map == "x.npy"


def test_the_shipped_token_map_is_the_models_and_holds_what_its_readme_says():
    path = resolve_token_map("smollm2-135m", "shipped")
    assert path == str(shipped_heads_dir() / "smollm2-135m" / TOKEN_MAP_FILE)
    ids = read_token_map(path, 49152)
    assert ids.shape == (8192,)
