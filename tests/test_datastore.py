"""The n-gram datastore (`drafters.datastore`, `SpecConfig.datastore`): the table keeps the most frequent
continuation of each n-gram of the answers, a chain follows the longest suffix the table holds, and a
head's tree with the datastore's chain merged in decodes exactly what autoregressive decoding does.

The sampled-distribution test of the same drafter is in tests/test_heads_exactness.py
(`test_datastore_branch_of_a_tree_keeps_the_target_distribution`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import SpecConfig
from jaxspec.drafters.datastore import build_table, datastore_chain, load_table, ngram_keys
from jaxspec.drafters.lookup_first import LookupFirstDrafter
from jaxspec.drafters.make import make_drafter
from jaxspec.loading.dataset import DistilledDataset
from tests.tiny_models import save_tiny

TREE = SpecConfig(method="eagle", head="random", num_speculative_tokens=3, topk=2, num_draft_tokens=4)


def chain(table, history: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, history))
    padded = jnp.asarray([h + [0] * (width - len(h)) for h in history], jnp.int32)
    tokens, valid = datastore_chain(table, padded, jnp.asarray([len(h) for h in history], jnp.int32), k)
    return np.asarray(tokens), np.asarray(valid)


def test_the_table_keeps_the_most_frequent_continuation_and_the_smaller_id_on_ties():
    # after 5: 7 twice, 8 once -> 7; after 6: 9 and 3 once each -> 3 (the smaller id)
    table = build_table([([5, 7], 0), ([5, 7], 0), ([5, 8], 0), ([6, 9], 0), ([6, 3], 0)], max_match=2)
    tokens, valid = chain(table, [[1, 5], [1, 6]], 1)
    np.testing.assert_array_equal(tokens[:, 1], [7, 3])
    assert valid.all()


def test_the_longest_suffix_in_the_table_decides_and_a_prompt_is_context_only():
    # "2 4" -> 9 (the 2-gram), while "4" alone is followed by 5 more often; the prompt's 4 -> 1 is never
    # a continuation (first = 2: tokens[:2] are the prompt's end), though 4 is context for the answer's 6
    table = build_table(
        [([2, 4, 9], 0), ([4, 5], 0), ([3, 4, 5], 0), ([4, 1, 4, 6], 2)], max_match=3
    )  # fmt: skip
    tokens, valid = chain(table, [[7, 2, 4], [7, 8, 4], [0, 1, 4]], 1)
    np.testing.assert_array_equal(tokens[:, 1], [9, 5, 6])
    assert valid.all()
    assert table.size == len(np.unique(np.asarray(table.keys)))


def test_a_chain_follows_its_own_drafts_and_stops_where_the_table_has_nothing():
    table = build_table([([1, 2, 3, 4], 0)], max_match=2)
    tokens, valid = chain(table, [[9, 1], [9, 3], [9, 11]], 3)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4], [3, 4, 0, 0], [11, 0, 0, 0]])
    np.testing.assert_array_equal(
        valid, [[True, True, True, True], [True, True, False, False], [True, False, False, False]]
    )


def test_host_and_device_hash_the_same_ngrams():
    """`ngram_keys` (numpy) finds the keys that `build_table` stored for every suffix of a sequence."""
    sequence = [40_000, 3, 17, 17, 49_151, 0, 8]
    table = build_table([(sequence, 0)], max_match=4)
    stored = set(np.asarray(table.keys).tolist())
    for end in range(1, len(sequence)):  # every window that is followed by a token
        keys = ngram_keys(sequence[:end], 4)
        assert set(keys.tolist()) <= stored, end


def dataset_of(path, rows: list[tuple[list[int], list[int]]], vocab_size: int) -> str:
    data = DistilledDataset.open_or_create(path, model="tiny", vocab_size=vocab_size)
    writer = data.writer(prompt_source="test", seed=0)
    writer.append(
        [{"id": f"r{i}", "prompt_ids": p, "response_ids": r} for i, (p, r) in enumerate(rows)]
    )  # fmt: skip
    writer.finish()
    return str(path)


def test_load_table_names_a_missing_data_set_and_another_models(tmp_path):
    with pytest.raises(jaxspec.JaxspecError, match="not a distilled data set"):
        load_table(str(tmp_path / "nowhere"), 4, 100)
    path = dataset_of(tmp_path / "d", [([1, 2], [3, 4, 5])], vocab_size=100)
    with pytest.raises(jaxspec.InputError, match="100-token vocabulary; the model has 256"):
        load_table(path, 4, 256)
    tokens, valid = chain(load_table(path, 4, 100), [[1, 2]], 3)
    np.testing.assert_array_equal(tokens, [[2, 3, 4, 5]])
    assert valid.all()


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle", "datastore": "shipped"},  # a chain
        {"method": "ngram", "topk": 2, "datastore": "shipped"},
        {"method": "medusa", "topk": 2, "num_draft_tokens": 5, "datastore": "shipped"},
    ],
)
def test_the_datastore_needs_a_dynamic_head_tree(spec):
    with pytest.raises(ValueError, match="SpecConfig.datastore merges the datastore's chain into a head's"):
        SpecConfig.from_dict(spec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_datastore")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


@pytest.mark.parametrize("lookup", [0, 2], ids=["datastore", "lookup-then-datastore"])
def test_a_tree_with_the_datastore_decodes_what_autoregressive_decoding_does(tiny, tmp_path, lookup):
    """The data set holds the tiny target's own greedy answers to these prompts, so the datastore's
    chains are accepted (more than the random head's tree alone), and the output is the AR one."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [250, 1, 2, 3, 4, 5], list(range(30, 45))]
    reference = [c.token_ids for c in jaxspec.generate(tiny, prompts, max_new_tokens=24)]
    path = dataset_of(tmp_path / "own", list(zip(prompts, reference, strict=True)), tiny.config.vocab_size)
    spec = dataclasses.replace(TREE, lookup_min_match=lookup, datastore=path)
    drafter, params = make_drafter(tiny, spec)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.datastore
    assert drafter.num_nodes == drafter.head.num_nodes + spec.num_speculative_tokens
    plain = jaxspec.generate(tiny, prompts, max_new_tokens=24, spec=TREE)
    stored = jaxspec.generate(tiny, prompts, max_new_tokens=24, spec=spec)
    assert [c.token_ids for c in plain] == reference == [c.token_ids for c in stored]
    accepted = lambda out: sum(c.stats["accepted_by_depth"][0] for c in out)  # noqa: E731
    assert accepted(stored) > accepted(plain)
