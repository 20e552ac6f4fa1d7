"""Continuous batching: slots refilled inside one compiled loop give each request exactly the tokens it
gets alone (greedy and sampled), whatever its slot, neighbours or refill order."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec.config import SamplingParams
from jaxspec.decoding.continuous import (
    admit_width,
    generate_continuous,
    init_state,
    prefill_widths,
    run_continuous,
)
from jaxspec.decoding.generate import check_requests, padded_requests
from jaxspec.errors import InputError
from tests.tiny_models import save_tiny

# Prompts of 1-20 tokens with budgets from 1 to 60 new tokens: requests finish at very different steps
# (three by EOS: ids 131 and 169), so slots are refilled at different times.
PROMPTS = [
    [5, 17, 99, 3], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42], list(range(30, 50)), [9, 9, 9],
    [100, 101], [3] * 13, [77, 78, 79, 80], [11, 12], [200, 150, 100, 50, 25],
]  # fmt: skip
BUDGETS = [60, 1, 3, 45, 17, 2, 30, 9, 52, 5]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_continuous")
    save_tiny("llama", path, eos_token_id=[131, 169])
    return jaxspec.load(str(path))


def alone(model, sampling=None, seeds=None, ids=None):
    out = []
    for i, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS, strict=True)):
        kwargs = {}
        if sampling is not None:
            kwargs = dict(sampling=sampling[i], seed=seeds[i], request_ids=[ids[i]])
        (c,) = jaxspec.generate(model, [prompt], max_new_tokens=budget, **kwargs)
        out.append(c)
    return out


def test_greedy_refilled_slots_equal_each_request_alone(tiny):
    finished_order = []
    together = generate_continuous(
        tiny, PROMPTS, max_new_tokens=BUDGETS, slots=3, admit_rows=2, steps_per_call=7,
        on_finished=lambda batch: finished_order.extend(i for i, _ in batch),
    )  # fmt: skip
    reference = alone(tiny)
    for i, (a, c) in enumerate(zip(reference, together, strict=True)):
        assert c.token_ids == a.token_ids, f"request {i}"
        assert c.finish_reason == a.finish_reason
        assert c.stats["rounds"] == a.stats["rounds"]
    assert {c.finish_reason for c in together} == {"stop", "length"}  # EOS and budget ends both covered
    assert sorted(finished_order) == list(range(len(PROMPTS)))  # every request streamed exactly once
    assert finished_order != list(range(len(PROMPTS)))  # short requests came out before long ones


def test_sampled_tokens_depend_on_seed_and_request_id_not_on_slot(tiny):
    sampling = [
        SamplingParams(temperature=t, top_k=k)
        for t, k in zip([1.0, 0.7, 1.3, 0.0, 0.9] * 2, [0, 5] * 5, strict=True)
    ]
    seeds = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    ids = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]
    reference = alone(tiny, sampling, seeds, ids)
    for slots, admit in ((4, 1), (2, 2)):
        together = generate_continuous(
            tiny, PROMPTS, max_new_tokens=BUDGETS, sampling=sampling, seed=seeds, request_ids=ids,
            slots=slots, admit_rows=admit, steps_per_call=1000,
        )  # fmt: skip
        for i, (a, c) in enumerate(zip(reference, together, strict=True)):
            assert c.token_ids == a.token_ids, f"request {i}, slots {slots}"
    # Reversed bank order: every request lands in another slot next to other neighbours.
    order = list(range(len(PROMPTS)))[::-1]
    reversed_run = generate_continuous(
        tiny, [PROMPTS[i] for i in order], max_new_tokens=[BUDGETS[i] for i in order],
        sampling=[sampling[i] for i in order], seed=[seeds[i] for i in order],
        request_ids=[ids[i] for i in order], slots=3, admit_rows=2,
    )  # fmt: skip
    for i, c in zip(order, reversed_run, strict=True):
        assert c.token_ids == reference[i].token_ids


def test_admits_at_one_and_a_half_widths_equal_each_request_alone(tiny):
    """Prompts of 33-48 and 65-96 tokens are prefilled at widths 48 and 96 (not 64 and 128); the bank
    runs longest budget first. Each request still gets its tokens alone."""
    assert prefill_widths(128) == (16, 32, 48, 64, 96, 128)
    lengths, widths = (1, 16, 17, 33, 48, 49, 65, 96, 97), [16, 16, 32, 48, 48, 64, 96, 96, 128]
    assert [admit_width(n, 128) for n in lengths] == widths
    prompts = [list(range(1, 41)), list(range(60, 130)), [7] * 45, list(range(200, 290)), [3, 4, 5]]
    budgets = [12, 30, 5, 20, 25]
    together = generate_continuous(tiny, prompts, max_new_tokens=budgets, slots=2, admit_rows=2)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        (a,) = jaxspec.generate(tiny, [prompt], max_new_tokens=budget)
        assert together[i].token_ids == a.token_ids, f"request {i}"


def test_one_compiled_program_serves_every_call(tiny):
    checked = check_requests(tiny, PROMPTS, BUDGETS, None, 0, None)
    bank = padded_requests(checked, len(PROMPTS), 32)
    state = init_state(tiny.config, bank, 3, 32 + 64 + 1, 65, tiny.dtype)
    kwargs = dict(config=tiny.config, admit_rows=2, eos_ids=tiny.eos_token_ids)
    state = run_continuous(tiny.graphdef, tiny.params, bank, state, jnp.int32(4), **kwargs)
    assert int(state.iterations) == 4 and int(state.next_request) > 0
    before = run_continuous._cache_size()
    while not bool(state.results.done.all()):
        state = run_continuous(tiny.graphdef, tiny.params, bank, state, jnp.int32(5), **kwargs)
    assert run_continuous._cache_size() == before
    assert [int(c) for c in state.results.count] == [len(c.token_ids) for c in alone(tiny)]


def test_bad_continuous_input_names_the_problem(tiny):
    with pytest.raises(InputError, match="slots"):
        generate_continuous(tiny, PROMPTS, slots=0)
    with pytest.raises(InputError, match="max_new_tokens for prompt 1"):
        generate_continuous(tiny, [[1], [2]], max_new_tokens=[1, 0])
    with pytest.raises(InputError, match="prompt 0 has 500 tokens .* beyond the model's context of 512"):
        generate_continuous(tiny, [[1] * 500], max_new_tokens=20)
