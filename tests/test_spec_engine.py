"""The speculative engine: greedy equality with autoregressive decoding, stateless randomness, no retrace."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.decoding.speculative as engine
from jaxspec.bench.step_costs import single_request
from jaxspec.decoding.speculative import speculative_loop
from jaxspec.drafters.make import make_drafter
from jaxspec.model.kv_cache import KVCache, _read_rows, _write_rows
from tests.tiny_models import save_tiny

REPETITIVE = [3, 14, 15, 92, 65, 35, 89, 79]
PROMPTS = [REPETITIVE * 3, [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], REPETITIVE * 2 + [1, 2], list(range(30, 60))]

SPECS = {
    "ngram_chain": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 3, "topk": 3},
    "draft_model_chain": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_autoregressive_tiny(tiny, name, batch):
    prompts = PROMPTS[:batch]
    reference = jaxspec.generate(tiny, prompts, max_new_tokens=40)
    speculative = jaxspec.generate(tiny, prompts, max_new_tokens=40, spec=SPECS[name])
    for ref, spec in zip(reference, speculative, strict=True):
        assert spec.token_ids == ref.token_ids
        assert spec.stats["rounds"] >= 1
        assert sum(spec.stats["accepted_by_depth"][:1]) <= spec.stats["rounds"]


def test_self_drafting_accepts_every_draft(tiny):
    """Oracle: the target drafting for itself must have every draft accepted (tau = depth + 1)."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    out = jaxspec.generate(tiny, PROMPTS, max_new_tokens=41, spec=spec)
    for c in out:
        assert c.stats["rounds"] == 10
        assert c.stats["mean_accepted_length"] == pytest.approx(4.0)
        assert c.stats["accepted_by_depth"] == [10, 10, 10]


def test_ngram_accepts_on_repetitive_text(tiny):
    (c,) = jaxspec.generate(tiny, [REPETITIVE * 4], max_new_tokens=40, spec=SPECS["ngram_chain"])
    (ar,) = jaxspec.generate(tiny, [REPETITIVE * 4], max_new_tokens=40)
    assert c.token_ids == ar.token_ids
    assert c.stats["rounds"] < 39  # some drafts were accepted


def test_sampled_request_alone_equals_inside_a_batch(tiny):
    sampling = jaxspec.SamplingParams(temperature=1.0, top_k=50, top_p=0.95)
    spec = SPECS["ngram_tree"]
    batch = jaxspec.generate(
        tiny,
        PROMPTS,
        max_new_tokens=24,
        sampling=sampling,
        seed=[7, 8, 9, 10],
        spec=spec,
        request_ids=[1, 2, 3, 4],
    )
    for i in (0, 2):
        (alone,) = jaxspec.generate(
            tiny,
            [PROMPTS[i]],
            max_new_tokens=24,
            sampling=sampling,
            seed=7 + i,
            spec=spec,
            request_ids=[1 + i],
        )
        assert alone.token_ids == batch[i].token_ids
    again = jaxspec.generate(
        tiny,
        PROMPTS,
        max_new_tokens=24,
        sampling=sampling,
        seed=[7, 8, 9, 10],
        spec=spec,
        request_ids=[1, 2, 3, 4],
    )
    assert [c.token_ids for c in again] == [c.token_ids for c in batch]
    other_seed = jaxspec.generate(
        tiny,
        PROMPTS,
        max_new_tokens=24,
        sampling=sampling,
        seed=[1, 2, 3, 4],
        spec=spec,
        request_ids=[1, 2, 3, 4],
    )
    assert [c.token_ids for c in other_seed] != [c.token_ids for c in batch]


def test_no_retrace_across_rounds_and_repeated_calls(tiny):
    spec = SPECS["ngram_chain"]
    jaxspec.generate(tiny, PROMPTS[:2], max_new_tokens=30, spec=spec)
    before = speculative_loop._cache_size()
    jaxspec.generate(tiny, PROMPTS[2:], max_new_tokens=20, spec=spec, seed=3)
    jaxspec.generate(tiny, [[4] * 20, [5] * 17], max_new_tokens=32, spec=spec)
    assert speculative_loop._cache_size() == before


def _first_divergence_margin(model, prompt, ours, reference):
    """Logit margin (top-1 minus top-2) of the target at the first position where outputs differ."""
    for j, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            logits = model.logits(list(prompt) + reference[:j])[-1]
            top2 = np.sort(logits)[-2:]
            return j, float(top2[1] - top2[0])
    return None, None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_speculative_equals_autoregressive_smollm2(smollm2, name):
    spec = dict(SPECS[name])
    if spec["method"] == "draft_model":
        spec["draft_num_layers"] = 6
    texts = [
        "Summarize: the cat sat on the mat because the mat was warm and the cat was cold.",
        "Write a Python function that returns the sum of a list.",
        "List three colors.",
        "Rewrite formally: gonna be late, traffic is bad.",
    ]
    prompts = [smollm2.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    reference = jaxspec.generate(smollm2, prompts, max_new_tokens=48)
    for batch in (1, 4):
        speculative = jaxspec.generate(smollm2, prompts[:batch], max_new_tokens=48, spec=spec)
        for prompt, ref, out in zip(prompts, reference, speculative, strict=False):
            step, margin = _first_divergence_margin(smollm2, prompt, out.token_ids, ref.token_ids)
            assert step is None, f"{name} batch {batch}: diverged at step {step}, logit margin {margin:.2e}"


@pytest.mark.slow
def test_pallas_attention_equals_reference_end_to_end(tiny):
    """Greedy speculative decoding with the Pallas kernel (interpret mode on CPU) == the jnp reference."""
    base = {"method": "ngram", "num_speculative_tokens": 3, "topk": 2}
    reference = jaxspec.generate(
        tiny, PROMPTS[:2], max_new_tokens=16, spec={**base, "attention": "reference"}
    )
    pallas = jaxspec.generate(tiny, PROMPTS[:2], max_new_tokens=16, spec={**base, "attention": "pallas"})
    assert [c.token_ids for c in pallas] == [c.token_ids for c in reference]


def test_spec_config_round_trips_through_json_as_a_hashable_config():
    import dataclasses
    import json

    spec = jaxspec.SpecConfig(
        method="medusa", num_speculative_tokens=3, tree_choices=((0,), (0, 1)),
        extra=(("tree_preset", "medusa_63"), ("eagle3_layers", (1, 2))),
    )  # fmt: skip
    again = jaxspec.SpecConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(spec))))
    assert again == spec and hash(again) == hash(spec)
    assert jaxspec.SpecConfig.from_dict({"method": "mtp", "extra": {"mtp_num_modules": 2}}).extra == (
        ("mtp_num_modules", 2),
    )


MIXED_SAMPLING = [
    jaxspec.SamplingParams(temperature=0.0),
    jaxspec.SamplingParams(temperature=0.9),
    jaxspec.SamplingParams(temperature=1.0, top_k=20),
    jaxspec.SamplingParams(temperature=1.0, top_p=0.5),
    jaxspec.SamplingParams(temperature=1.2, top_p=0.95),  # a nucleus beyond the 64 largest: radix path
]


@pytest.mark.parametrize("name", ["autoregressive", "ngram_chain", "ngram_tree"])
def test_mixed_sampling_request_alone_equals_inside_any_batch(tiny, name):
    """Every request keeps its tokens alone and next to requests with any other sampling parameters
    (greedy, temperature only, top-k, top-p 0.5 and 0.95: one batch holds every pair of neighbours, a
    second one the reverse order)."""
    spec = None if name == "autoregressive" else SPECS[name]
    prompts = PROMPTS + [REPETITIVE + [7, 7, 7]]
    n = len(prompts)
    kwargs = {"max_new_tokens": 20, "spec": spec}
    alone = [
        jaxspec.generate(tiny, [prompts[i]], sampling=MIXED_SAMPLING[i], seed=i, request_ids=[i], **kwargs)[0]
        for i in range(n)
    ]
    for order in (list(range(n)), list(reversed(range(n)))):
        batch = jaxspec.generate(
            tiny,
            [prompts[i] for i in order],
            sampling=[MIXED_SAMPLING[i] for i in order],
            seed=order,
            request_ids=order,
            **kwargs,
        )
        for completion, i in zip(batch, order, strict=True):
            assert completion.token_ids == alone[i].token_ids, (name, i, order)


def _speculative_program_cache_copies(model, spec, extra_len: int) -> int:
    """Copies of whole KV-cache layer buffers in the compiled speculative loop (batch 4)."""
    drafter, draft_params = make_drafter(model, spec)
    requests = single_request([5, 17, 99, 3], 16, jaxspec.SamplingParams())
    requests = jax.tree.map(lambda a: jnp.concatenate([a] * 4) if jnp.ndim(a) else a, requests)
    c = model.config
    capacity = 17 + drafter.max_depth + 1
    max_len = 16 + capacity + drafter.num_nodes + extra_len
    hlo = speculative_loop.lower(
        model.graphdef, model.params, draft_params, requests, config=c, drafter=drafter, spec=spec,
        max_len=max_len, capacity=capacity, eos_ids=(),
    ).compile().as_text()  # fmt: skip
    return len(re.findall(rf"f32\[4,{c.num_kv_heads},{max_len},{c.head_dim}\]\{{[0-9,]+\}} copy\(", hlo))


def test_speculative_commit_path_updates_the_kv_cache_in_place(tiny, monkeypatch):
    """The speculative loop's verify write and `commit_path` (read the window, keep the accepted path,
    write it back) leave every layer's cache in place: no copy of a whole cache buffer. A commit that
    reads the old buffer after writing it makes XLA copy each buffer, and the check sees it."""
    spec = jaxspec.SpecConfig(method="ngram", num_speculative_tokens=3)
    assert _speculative_program_cache_copies(tiny, spec, extra_len=4) == 0

    def read_after_write_commit(cache, path, num_committed, window):
        safe_path, starts = jnp.clip(path, 0, window - 1), cache.lengths

        def move(buffer):
            kept = jnp.take_along_axis(
                _read_rows(buffer, starts, window), safe_path[:, None, :, None], axis=2
            )
            return _write_rows(buffer, kept, starts) + 0.0 * buffer  # the old buffer read after the write

        keys, values = tuple(map(move, cache.keys)), tuple(map(move, cache.values))
        return KVCache(keys=keys, values=values, lengths=cache.lengths + num_committed)

    monkeypatch.setattr(engine, "commit_path", read_after_write_commit)
    assert _speculative_program_cache_copies(tiny, spec, extra_len=12) >= 2 * tiny.config.num_layers
