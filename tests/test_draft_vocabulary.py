"""EAGLE-3 drafts over its draft vocabulary (`DraftVocabulary`) what it drafts over the target vocabulary
with -inf outside it: the same dynamic trees (greedy and sampled rows), the same greedy chains and the
same chain q over the target vocabulary (every depth of a greedy row, depth 1 of a sampled row). The
target-vocabulary path is the one a logits hook takes; an identity hook forces it here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sampling
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.drafters.heads.registry import make_head_drafter
from jaxspec.drafters.protocol import RoundContext
from tests.tiny_models import save_tiny

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [250, 1, 2, 3, 4, 5, 6, 7], [7, 7, 7, 100, 200, 300, 7, 7]]
ROWS_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=20),
]
MAX_LEN = 32


@dataclasses.dataclass(frozen=True)
class IdentityHook:
    """Leaves the logits alone: the drafter then drafts over the target vocabulary."""

    def __call__(self, params, logits, predicted_index):
        return logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_draft_vocab")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


def drafts(model, spec: SpecConfig, hook) -> tuple:
    """(tokens, parent, q_probs or None, the head's draft vocabulary as target ids) of one proposal for
    PROMPTS after a real prefill."""
    drafter, draft_params = make_head_drafter(model, spec, logits_hook=hook, hook_params={} if hook else ())
    rows = len(PROMPTS)
    requests = Requests(
        prompt_tokens=jnp.asarray(PROMPTS, jnp.int32),
        prompt_lengths=jnp.full((rows,), len(PROMPTS[0]), jnp.int32),
        max_new_tokens=jnp.full((rows,), 8, jnp.int32),
        seeds=jnp.zeros((rows,), jnp.int32),
        request_ids=jnp.arange(rows, dtype=jnp.int32),
        sampling=sampling.SamplingArrays.from_params(ROWS_PARAMS, rows),
    )

    @jax.jit
    def run(params, draft_params):
        pre = prefill(
            model.graphdef, params, model.config, requests, MAX_LEN, capture_layers=drafter.capture_layers
        )
        state = drafter.init(draft_params, params, pre, requests, MAX_LEN)
        history = jnp.concatenate([requests.prompt_tokens, pre.first_token[:, None]], axis=1)
        ctx = RoundContext(
            history=history,
            history_len=requests.prompt_lengths + 1,
            cache_lengths=pre.cache.lengths,
            keys=sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_DRAFT),
            sampling=requests.sampling,
        )
        tree, _ = drafter.propose(draft_params, params, state, ctx)
        return tree

    tree = run(model.params, draft_params)
    q = None if tree.q_probs is None else np.asarray(tree.q_probs)
    head_ids = np.nonzero(np.asarray(draft_params["head"]["t2d"][...]))[0]
    return np.asarray(tree.tokens), np.asarray(tree.parent), q, head_ids


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_vocabulary_drafts_what_the_target_vocabulary_drafts(tiny, shape):
    extra = (("draft_vocab_size", 96),)  # a random sorted subset of the 320 target ids
    spec = SpecConfig(method="eagle3", head="random", num_speculative_tokens=3, extra=extra)
    if shape == "tree":
        spec = dataclasses.replace(spec, topk=3, num_draft_tokens=7)
    tokens, parent, q, head_ids = drafts(tiny, spec, None)
    full_tokens, full_parent, full_q, _ = drafts(tiny, spec, IdentityHook())
    assert len(head_ids) == 96 and not np.array_equal(head_ids, np.arange(96))
    assert np.isin(tokens[:, 1:], head_ids).all()  # drafts are target ids inside the draft vocabulary
    np.testing.assert_array_equal(parent, full_parent)
    if shape == "tree":  # deterministic top-k drafts: every row, greedy or sampled
        np.testing.assert_array_equal(tokens, full_tokens)
        assert q is None and full_q is None
        return
    # Chains sample their drafts (Gumbel noise over the vocabulary the q lives on, so a sampled row may
    # draw other tokens for the same key): the greedy row gives the same tokens and q at every depth, a
    # sampled row the same depth-1 q (deeper ones are conditioned on its own drafts); q is over the
    # target vocabulary, zero outside the draft vocabulary.
    assert q.shape == full_q.shape == (3, 4, tiny.config.vocab_size)  # [rows, root + 3 drafts, V]
    np.testing.assert_array_equal(tokens[0], full_tokens[0])
    np.testing.assert_allclose(q[0], full_q[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(q[:, 1], full_q[:, 1], rtol=1e-5, atol=1e-7)
    outside = np.setdiff1d(np.arange(tiny.config.vocab_size), head_ids)
    assert (q[:, 1:, outside] == 0).all() and np.allclose(q[:, 1:].sum(-1), 1.0)
