"""Draft heads inside the speculative engine (tiny random target, random untrained heads).

One compiled program per (head, draft shape) serves three runs, because the logits hook's data travels
in draft_params (a second call must not retrace):
  * plain: the head's own drafts. Greedy speculative output == greedy autoregressive output.
  * oracle: head logits replaced by the target's own greedy continuation (`ForcedTokens`): every draft
    is accepted, mean accepted length == depth + 1, accepted_by_depth == rounds at every depth.
  * partial: the oracle forces all but every third index, so rounds accept 0..depth drafts.
The hook also records every draft logits array the head produced. Each one whose inputs are committed
tokens is recomputed from scratch (one teacher-forced pass over the final sequence with the target's
true features) and must match: this pins the heads' own KV caches, the feature hand-over after
verification and the chunked re-run of accepted tokens, across rounds with every acceptance length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.decoding.speculative import speculative_loop
from jaxspec.drafters.heads import registry
from jaxspec.drafters.heads.drafting import ForcedTokens, forced_tokens_params
from jaxspec.drafters.heads.eagle.eagle import eagle_sequence_forward
from jaxspec.drafters.heads.medusa.module import medusa_logits
from jaxspec.drafters.heads.mtp.module import mtp_sequence_forward
from jaxspec.model.forward import causal_mask, model_forward
from jaxspec.model.kv_cache import KVCache
from tests.tiny_models import save_tiny

PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 3, 14],
    [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [7, 7, 7, 100, 200, 300],
    list(range(30, 45)),
]
DEPTH = 3
ROUNDS = 3
MAX_NEW = 1 + ROUNDS * (DEPTH + 1)  # the prefill's token, then ROUNDS rounds of DEPTH + 1 tokens
TABLE_WIDTH = 64
MEDUSA_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))
VOCAB3 = (("draft_vocab_size", 96),)

SHAPES = {
    "medusa-chain": {"method": "medusa", "head": "random", "num_speculative_tokens": DEPTH},
    "medusa-tree": {
        "method": "medusa",
        "head": "random",
        "tree_choices": MEDUSA_TREE,
        "extra": (("medusa_own_lm_head", True),),
    },
    "eagle-chain": {"method": "eagle", "head": "random", "num_speculative_tokens": DEPTH},
    "eagle-tree": {
        "method": "eagle",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "topk": 3,
        "num_draft_tokens": 7,
    },
    "eagle3-chain": {"method": "eagle3", "head": "random", "num_speculative_tokens": DEPTH, "extra": VOCAB3},
    "eagle3-tree": {
        "method": "eagle3",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "topk": 2,
        "extra": VOCAB3,
    },
    # vLLM's multi-layer EAGLE-3: one key set per decoder layer in the cache and the round's buffers.
    "eagle3-2layers-chain": {
        "method": "eagle3",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "extra": VOCAB3 + (("eagle3_num_layers", 2),),
    },
    "eagle3-2layers-tree": {
        "method": "eagle3",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "topk": 2,
        "extra": VOCAB3 + (("eagle3_num_layers", 2),),
    },
    "mtp-chain": {
        "method": "mtp",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "extra": (("mtp_num_modules", 2),),
    },
    "mtp-tree": {
        "method": "mtp",
        "head": "random",
        "num_speculative_tokens": DEPTH,
        "topk": 2,
        "num_draft_tokens": 5,
    },
}

RECORDS: list[tuple[np.ndarray, np.ndarray]] = []


def _record(index, logits):
    RECORDS.append((np.asarray(index), np.asarray(logits)))


@dataclasses.dataclass(frozen=True)
class RecordingForcedTokens(ForcedTokens):
    """ForcedTokens that also sends every (predicted index, raw head logits) to RECORDS."""

    def __call__(self, params, logits, predicted_index):
        jax.debug.callback(_record, predicted_index, logits, ordered=True)
        return super().__call__(params, logits, predicted_index)


HOOK = RecordingForcedTokens()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_heads")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


def sequences(prompts, continuations) -> np.ndarray:
    """[B, TABLE_WIDTH] prompt + continuation per row (history coordinates), zero padded."""
    table = np.zeros((len(prompts), TABLE_WIDTH), np.int32)
    for b, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        table[b, : len(p) + len(c)] = list(p) + list(c)
    return table


def run(monkeypatch, model, prompts, spec, hook_params):
    original = registry.make_head_drafter
    monkeypatch.setattr(
        registry,
        "make_head_drafter",
        lambda m, s: original(m, s, logits_hook=HOOK, hook_params=hook_params),
    )
    RECORDS.clear()
    out = jaxspec.generate(model, prompts, max_new_tokens=MAX_NEW, spec=spec)
    jax.effects_barrier()
    monkeypatch.setattr(registry, "make_head_drafter", original)
    return out, list(RECORDS)


# ---------------------------------------------------------------------------------------------------
# Recomputing recorded draft logits from scratch
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "layers"))
def target_features(graphdef, params, tokens, *, config, layers):
    """Full causal target pass over [B, N] tokens -> (final hidden [B, N, d], captured layer outputs)."""
    b, n = tokens.shape
    cache = KVCache.zeros(config, b, n, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    hidden, captured, _ = model_forward(
        graphdef,
        params,
        tokens,
        positions,
        cache,
        causal_mask(b, n),
        attention="reference",
        capture_layers=layers,
    )
    return hidden, captured


def drafted_tokens(calls, table_row, c, hook_params, b):
    """Drafts of one chain round: forced where the hook forced, else the head's argmax."""
    out = []
    for index, logits in calls:
        p = int(index[b])
        forced = bool(hook_params["enabled"]) and not (
            int(hook_params["period"]) > 1 and p % int(hook_params["period"]) == 0
        )
        out.append(int(table_row[p]) if forced else int(np.argmax(logits[b])))
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "project"))
def eagle_pass(graphdef, params, embeddings, features, project):
    return eagle_sequence_forward(graphdef, params, embeddings[None], features[None], project=project)[0]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def mtp_pass(graphdef, params, module, embeddings, hidden, first_position):
    passed, normed = mtp_sequence_forward(
        graphdef, params, module, embeddings[None], hidden[None], first_position
    )
    return passed[0], normed[0]


def padded(x: np.ndarray) -> np.ndarray:
    """Rows padded with zeros to TABLE_WIDTH (causal passes: trailing rows cannot change earlier ones)."""
    out = np.zeros((TABLE_WIDTH,) + x.shape[1:], x.dtype)
    out[: len(x)] = x
    return out


class Reference:
    """From-scratch draft logits for one row of one run (fixed shapes: one compile per head)."""

    def __init__(self, model, drafter, head_params, row):
        self.model, self.drafter, self.head_params, self.row = model, drafter, head_params, row
        layers = drafter.capture_layers
        hidden, captured = target_features(
            model.graphdef, model.params, jnp.asarray(row[None]), config=model.config, layers=layers
        )
        self.hidden = np.asarray(hidden[0])
        self.raw = np.concatenate([np.asarray(c[0]) for c in captured], -1) if layers else self.hidden
        self.target = nnx.merge(model.graphdef, model.params)
        self.embeddings = np.asarray(self.target.embed(jnp.asarray(row, jnp.int32)))  # [N, d] of row's tokens

    def lm(self, hidden_row: np.ndarray) -> np.ndarray:
        return np.asarray(self.target.lm_logits(jnp.asarray(hidden_row)))

    def logits(self, c: int, depth: int) -> np.ndarray:
        """Logits of the token at index c + depth given committed tokens 0..c and drafts = row[c+1..]."""
        name = type(self.drafter).__name__
        if name == "MedusaDrafter":
            logits = medusa_logits(
                self.drafter.head_graphdef,
                self.head_params,
                jnp.asarray(self.hidden[c - 1]),
                self.target.lm_logits,
            )
            return np.asarray(logits)[depth - 1]
        if name == "EagleDrafter":
            graphdef = self.drafter.head_graphdef
            head = nnx.merge(graphdef, self.head_params)
            projected = np.asarray(head.project_target_features(jnp.asarray(self.raw)))[:c]
            hidden = projected
            for k in range(depth):
                emb = padded(self.embeddings[1 : c + k + 1])
                out = np.asarray(eagle_pass(graphdef, self.head_params, emb, padded(hidden), project=False))
                prediction = out[c + k - 1]
                hidden = np.concatenate([hidden, prediction[None]], 0)
            return np.asarray(head.logits(jnp.asarray(prediction), self.target.lm_logits))
        hidden = padded(self.hidden[:c])
        for k in range(depth):
            emb = padded(self.embeddings[k + 1 : k + 1 + c])
            module = k % self.drafter.config.num_modules
            passed, normed = mtp_pass(
                self.drafter.module_graphdef, self.head_params, module, emb, hidden, k + 1
            )
            hidden = np.asarray(passed)
        return self.lm(np.asarray(normed)[c - 1])


def check_recorded_logits(model, drafter, head_params, prompts, table, records, hook_params) -> int:
    """Compare every recorded draft logits array whose inputs are all committed; returns how many."""
    is_medusa = type(drafter).__name__ == "MedusaDrafter"
    per_round = 1 if is_medusa else drafter.max_depth
    if not is_medusa:  # MTP runs one window per path: [B, 1] / [B, 1, V] calls are plain rows
        records = [(i[:, 0], g[:, 0]) if i.ndim == 2 and i.shape[1] == 1 else (i, g) for i, g in records]
    assert len(records) % per_round == 0
    rounds = [records[i : i + per_round] for i in range(0, len(records), per_round)]
    checked = 0
    for b in range(len(prompts)):
        reference = Reference(model, drafter, head_params, table[b])
        end = len(prompts[b]) + MAX_NEW  # history length at the end
        seen = set()
        for calls in rounds:
            c = int(calls[0][0][b].reshape(-1)[0]) - 1  # root index
            if c + 1 >= end or c in seen:
                continue  # finished row (its round repeats)
            seen.add(c)
            if is_medusa:
                index, logits = calls[0]
                for d in range(1, drafter.max_depth + 1):
                    np.testing.assert_allclose(logits[b, d - 1], reference.logits(c, d), rtol=1e-3, atol=1e-3)
                    checked += 1
                continue
            chain = calls[0][0].ndim == 1 and all(index.ndim == 1 for index, _ in calls)
            drafts = drafted_tokens(calls, table[b], c, hook_params, b) if chain else []
            for depth, (_, logits) in enumerate(calls, start=1):
                if depth > 1 and (not chain or drafts[: depth - 1] != list(table[b, c + 1 : c + depth])):
                    break  # the input path holds a rejected draft (or a tree frontier)
                if c + depth >= end:
                    break
                np.testing.assert_allclose(logits[b], reference.logits(c, depth), rtol=1e-3, atol=1e-3)
                checked += 1
    return checked


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


def check_runs(monkeypatch, tiny, name, prompts):
    spec = SHAPES[name]
    reference = [c.token_ids for c in jaxspec.generate(tiny, prompts, max_new_tokens=MAX_NEW)]
    table = sequences(prompts, reference)
    drafter, params = registry.make_head_drafter(tiny, jaxspec.SpecConfig.from_dict(dict(spec)))
    head_params = params["head"]

    off = forced_tokens_params(table, enabled=False)
    plain, records = run(monkeypatch, tiny, prompts, spec, off)
    assert [c.token_ids for c in plain] == reference
    compiled = speculative_loop._cache_size()
    assert check_recorded_logits(tiny, drafter, head_params, prompts, table, records, off) >= len(prompts)

    oracle, records = run(monkeypatch, tiny, prompts, spec, forced_tokens_params(table))
    for c, ref in zip(oracle, reference, strict=True):
        assert c.token_ids == ref
        assert c.stats["rounds"] == ROUNDS
        assert c.stats["mean_accepted_length"] == pytest.approx(DEPTH + 1)
        assert c.stats["accepted_by_depth"] == [ROUNDS] * DEPTH

    partial_params = forced_tokens_params(table, period=3)
    partial, records = run(monkeypatch, tiny, prompts, spec, partial_params)
    assert [c.token_ids for c in partial] == reference
    accepted = [c.stats["accepted_by_depth"] for c in partial]
    assert any(a[0] > 0 for a in accepted) and any(c.stats["rounds"] > ROUNDS for c in partial)
    assert check_recorded_logits(tiny, drafter, head_params, prompts, table, records, partial_params) > len(
        prompts
    )
    assert speculative_loop._cache_size() == compiled  # new hook data, same program


FAST = {"eagle-chain"}  # the rest compile one program each (~30-60 s on 2 shared cores): slow


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(SHAPES)]
)
def test_heads_batch4_plain_oracle_partial(monkeypatch, tiny, name):
    check_runs(monkeypatch, tiny, name, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle-chain", "mtp-tree"])
def test_heads_batch1_plain_oracle_partial(monkeypatch, tiny, name):
    check_runs(monkeypatch, tiny, name, PROMPTS[1:2])


@pytest.mark.slow
def test_medusa_typical_acceptance_is_greedy_at_temperature_zero(tiny):
    """Typical acceptance (lossy in general) only passes the argmax of a one-hot target: greedy output."""
    spec = dict(SHAPES["medusa-tree"], acceptance="typical_lossy")
    out = jaxspec.generate(tiny, PROMPTS, max_new_tokens=MAX_NEW, spec=spec)
    reference = jaxspec.generate(tiny, PROMPTS, max_new_tokens=MAX_NEW)
    assert [c.token_ids for c in out] == [c.token_ids for c in reference]


def test_a_head_method_without_a_head_names_the_missing_head_argument(tiny):
    """The API follows the CLI's rule: no head given and none shipped for this model -> an error naming
    `head=` (never a silent random head); head="random" asks for one on purpose."""
    for method in ("medusa", "eagle", "eagle3", "mtp"):
        with pytest.raises(jaxspec.InputError, match=r"needs a trained draft head.*pass head=DIR"):
            jaxspec.generate(tiny, PROMPTS[:1], max_new_tokens=4, spec={"method": method})
    (out,) = jaxspec.generate(tiny, PROMPTS[:1], max_new_tokens=4, spec=dict(SHAPES["eagle-chain"]))
    assert len(out.token_ids) == 4
