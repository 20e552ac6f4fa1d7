"""Exact verification stays lossless with each head's REAL draft distributions (invariant 1).

A tiny target over a 16-token vocabulary, random heads, temperature 1.0 with top-p 0.9 on both sides.
Every sample is one request (its own keys) that drafts with the head from the same context, is
verified against the real target forward over the tree, and emits its first two tokens (the second
from the target itself when the round stopped after one). The joint of those two tokens must match
the target's p(x1) p(x2 | x1) within the Bernstein bound of tests/test_sampling_exactness.py, and no
token outside the nucleus may ever appear.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sampling
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.drafters.heads.registry import make_head_drafter
from jaxspec.drafters.lookup_first import LookupFirstDrafter
from jaxspec.drafters.make import make_drafter
from jaxspec.drafters.protocol import RoundContext
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.sampling.tree import DraftTree, ancestor_mask, tree_positions
from tests.test_sampling_exactness import NUM_SAMPLES, bernstein_excess
from tests.tiny_models import save_tiny

VOCAB = 16
PROMPT = [3, 9, 4, 11, 2, 7]
CHUNK = 20_000
MAX_LEN = 32  # the cache: the longest prompt (16) + the first token + a round's nodes
PARAMS = SamplingParams(temperature=1.0, top_p=0.9)
SPECS = {
    "medusa": SpecConfig(
        method="medusa", head="random", num_speculative_tokens=2, extra=(("medusa_own_lm_head", True),)
    ),
    "eagle": SpecConfig(method="eagle", head="random", num_speculative_tokens=2),
    "eagle3": SpecConfig(
        method="eagle3", head="random", num_speculative_tokens=2, extra=(("draft_vocab_size", 12),)
    ),
    "mtp": SpecConfig(method="mtp", head="random", num_speculative_tokens=2, extra=(("mtp_num_modules", 2),)),
}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vocab16")
    save_tiny(
        "llama",
        path,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return jaxspec.load(str(path))


def tile(tree, rows):
    return jax.tree.map(lambda x: jnp.repeat(x, rows, axis=0), tree)


def requests_for(rows: int, first_request: jax.Array, prompt: tuple[int, ...] = tuple(PROMPT)) -> Requests:
    tokens = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (rows, len(prompt)))
    return Requests(
        prompt_tokens=tokens,
        prompt_lengths=jnp.full((rows,), len(prompt), jnp.int32),
        max_new_tokens=jnp.full((rows,), 8, jnp.int32),
        seeds=jnp.zeros((rows,), jnp.int32),
        request_ids=first_request + jnp.arange(rows, dtype=jnp.int32),
        sampling=sampling.SamplingArrays.from_params(PARAMS, rows),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "drafter", "prompt"))
def two_tokens(graphdef, params, draft_params, first_request, *, config, drafter, prompt=tuple(PROMPT)):
    """[CHUNK, 2] first two emitted tokens after the (fixed) first token, one request per row."""
    requests = requests_for(CHUNK, first_request, prompt)
    pre = prefill(
        graphdef,
        params,
        config,
        requests_for(1, 0, prompt),
        MAX_LEN,
        attention="reference",
        capture_layers=drafter.capture_layers,
    )
    pre = tile(pre, CHUNK)
    state = drafter.init(draft_params, params, pre, requests, MAX_LEN)
    history = jnp.concatenate([requests.prompt_tokens, pre.first_token[:, None]], axis=1)
    ctx = RoundContext(
        history=history,
        history_len=jnp.full((CHUNK,), len(prompt) + 1, jnp.int32),
        cache_lengths=pre.cache.lengths,
        keys=sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_DRAFT),
        sampling=requests.sampling,
    )
    tree, _ = drafter.propose(draft_params, params, state, ctx)
    hidden, _, _ = model_forward(
        graphdef,
        params,
        tree.tokens,
        tree_positions(tree, pre.cache.lengths),
        pre.cache,
        ancestor_mask(tree),
        attention="reference",
    )
    target_probs = sampling.process_logits(lm_logits(graphdef, params, hidden), requests.sampling)
    keys = sampling.round_key(requests.seeds, requests.request_ids, 1)
    result = sampling.verify_tree(tree, target_probs, keys, mode="exact", max_depth=drafter.max_depth)
    x1 = result.emitted_tokens[:, 0]
    # the second token: from the round when it accepted the first draft, else from the target itself
    p2 = target_after(graphdef, params, pre.cache, history[:, -1], x1, requests.sampling)
    own = sampling.sample_from_probs(p2, sampling.fold_in_rows(keys, 99))
    x2 = jnp.where(result.num_accepted >= 1, result.emitted_tokens[:, 1], own)
    return jnp.stack([x1, x2], axis=1)


def target_after(graphdef, params, cache, root, x1, processor):
    """Processed target distribution after (context, x1): [B, V]."""
    tree = DraftTree(
        tokens=jnp.stack([root, x1], axis=1),
        parent=jnp.broadcast_to(jnp.asarray([-1, 0], jnp.int32), (root.shape[0], 2)),
        depth=jnp.broadcast_to(jnp.asarray([0, 1], jnp.int32), (root.shape[0], 2)),
        valid=jnp.ones((root.shape[0], 2), bool),
    )
    hidden, _, _ = model_forward(
        graphdef,
        params,
        tree.tokens,
        tree_positions(tree, cache.lengths),
        cache,
        ancestor_mask(tree),
        attention="reference",
    )
    return sampling.process_logits(lm_logits(graphdef, params, hidden[:, 1]), processor)


def target_joint(model, prompt: tuple[int, ...] = tuple(PROMPT)) -> np.ndarray:
    """p(x1) p(x2 | x1) after the fixed context, [V, V] float64."""
    requests = requests_for(1, jnp.int32(0), prompt)
    pre = prefill(model.graphdef, model.params, model.config, requests, MAX_LEN, attention="reference")
    processor = sampling.SamplingArrays.from_params(PARAMS, VOCAB)
    cache = tile(pre.cache, VOCAB)
    roots = jnp.full((VOCAB,), pre.first_token[0])
    p2 = np.asarray(
        target_after(model.graphdef, model.params, cache, roots, jnp.arange(VOCAB), processor), np.float64
    )
    root_tree_hidden, _, _ = model_forward(
        model.graphdef,
        model.params,
        pre.first_token[:, None],
        pre.cache.lengths[:, None],
        pre.cache,
        jnp.ones((1, 1, 1), bool),
        attention="reference",
    )
    p1 = sampling.process_logits(
        lm_logits(model.graphdef, model.params, root_tree_hidden[:, 0]),
        sampling.SamplingArrays.from_params(PARAMS, 1),
    )
    return np.asarray(p1[0], np.float64)[:, None] * p2


def deviation(model, drafter, draft_params, prompt: tuple[int, ...] = tuple(PROMPT)) -> float:
    """NUM_SAMPLES requests' first two tokens (`two_tokens`) against the target's joint: the largest
    deviation in units of the Bernstein bound (first token alone and both); no sample in a zero cell."""
    samples = np.concatenate(
        [
            np.asarray(
                two_tokens(
                    model.graphdef,
                    model.params,
                    draft_params,
                    jnp.int32(i * CHUNK),
                    config=model.config,
                    drafter=drafter,
                    prompt=prompt,
                )
            )
            for i in range(NUM_SAMPLES // CHUNK)
        ]
    )
    joint = target_joint(model, prompt)
    assert np.count_nonzero(joint) < joint.size  # top-p removed tokens: zero cells are tested too
    excess, in_zero_cells = bernstein_excess(samples, joint)
    first_excess, first_zero = bernstein_excess(samples[:, :1], joint.sum(axis=1))
    assert in_zero_cells == 0 and first_zero == 0
    return max(excess, first_excess)


@pytest.mark.parametrize(
    "name", [n if n == "eagle" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(SPECS)]
)
def test_head_drafts_keep_the_target_distribution(small_vocab, name):
    drafter, draft_params = make_head_drafter(small_vocab, SPECS[name])
    excess = deviation(small_vocab, drafter, draft_params)
    assert excess <= 1.0, f"{name}: deviation {excess:.2f}x the bound"


def test_lookup_first_keeps_the_target_distribution(small_vocab):
    """`SpecConfig.lookup_min_match`: the prompt holds every token, so each row's root occurred before and
    every row drafts the lookup's continuation, verified with a one-hot q. Verifying those drafts with the
    head's q instead fails (checked)."""
    prompt = (3, 9, 4, 11, 2, 7, 0, 1, 5, 6, 8, 10, 12, 13, 14, 15)
    drafter, draft_params = make_drafter(small_vocab, dataclasses.replace(SPECS["eagle"], lookup_min_match=1))
    assert isinstance(drafter, LookupFirstDrafter)
    excess = deviation(small_vocab, drafter, draft_params, prompt)
    assert excess <= 1.0, f"deviation {excess:.2f}x the bound"


@pytest.mark.parametrize("name", ["eagle", pytest.param("mtp", marks=pytest.mark.slow)])
def test_token_map_keeps_the_target_distribution(small_vocab, tmp_path, name):
    """`SpecConfig.token_map`: drafts sampled over 10 of the 16 tokens, their q put back on the whole
    vocabulary (zero outside the map) for verification. Verifying them with q over the map's own indices
    instead fails (checked: 21x the bound)."""
    path = tmp_path / "map.npy"
    np.save(path, np.asarray([0, 2, 3, 4, 7, 9, 10, 11, 13, 15]))
    spec = dataclasses.replace(SPECS[name], token_map=str(path))
    drafter, draft_params = make_head_drafter(small_vocab, spec)
    assert drafter.token_map
    excess = deviation(small_vocab, drafter, draft_params)
    assert excess <= 1.0, f"{name}: deviation {excess:.2f}x the bound"


def test_lookup_branch_of_a_tree_keeps_the_target_distribution(small_vocab):
    """`SpecConfig.lookup_min_match` with an EAGLE tree: every row's root occurred before (the prompt holds
    every token), so each row verifies the head's tree with the lookup's chain merged in (drafted
    deterministically: one-hot q, like the head's top-k children). Merging it from the head's first
    child instead of the root fails (checked: samples in zero cells)."""
    prompt = (3, 9, 4, 11, 2, 7, 0, 1, 5, 6, 8, 10, 12, 13, 14, 15)
    spec = dataclasses.replace(SPECS["eagle"], topk=2, num_draft_tokens=3, lookup_min_match=1)
    drafter, draft_params = make_drafter(small_vocab, spec)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.branch
    assert drafter.num_nodes == drafter.head.num_nodes + spec.num_speculative_tokens
    excess = deviation(small_vocab, drafter, draft_params, prompt)
    assert excess <= 1.0, f"deviation {excess:.2f}x the bound"


@pytest.mark.parametrize("branch_tokens", [None, 4], ids=["chain-of-depth", "deeper-chain"])
def test_datastore_branch_of_a_tree_keeps_the_target_distribution(small_vocab, tmp_path, branch_tokens):
    """`SpecConfig.datastore` with an EAGLE tree: the data set holds every token of the vocabulary in
    context, so each row verifies the head's tree with the datastore's chain merged in (deterministic
    drafts: one-hot q, like the head's top-k children); also with the chain twice the tree's depth
    (`branch_tokens`). Merging the chain from the head's first child instead of the root fails
    (checked: 45 samples in zero cells)."""
    from jaxspec.loading.dataset import DistilledDataset

    rng = np.random.default_rng(0)
    data = DistilledDataset.open_or_create(tmp_path, model="tiny", vocab_size=VOCAB)
    writer = data.writer(prompt_source="test", seed=0)
    writer.append(
        [
            {"id": f"r{i}", "prompt_ids": [1], "response_ids": rng.integers(0, VOCAB, 64).tolist()}
            for i in range(8)
        ]
    )
    writer.finish()
    spec = dataclasses.replace(
        SPECS["eagle"], topk=2, num_draft_tokens=3, datastore=str(tmp_path), branch_tokens=branch_tokens
    )
    drafter, draft_params = make_drafter(small_vocab, spec)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.datastore and not drafter.min_match
    assert drafter.max_depth == (branch_tokens or spec.num_speculative_tokens)
    excess = deviation(small_vocab, drafter, draft_params)
    assert excess <= 1.0, f"deviation {excess:.2f}x the bound"
