"""Continuous batching: slots refilled inside one compiled loop give each request exactly the tokens it
gets alone (greedy and sampled), whatever its slot, neighbours or refill order, decoding
autoregressively or speculating with any drafter (n-gram prompt lookup, a draft model, the heads)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

import jaxspec
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.continuous import (
    _set_rows,
    admit_width,
    generate_continuous,
    init_state,
    prefill_widths,
    prepare_continuous,
    recurring_prompts,
    run_continuous,
    shared_prefix_length,
)
from jaxspec.decoding.generate import check_requests, padded_requests
from jaxspec.errors import InputError
from jaxspec.model.kv_cache import HeadCache
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


# Every prompt behind the same 12-token "system turn" (one of them is that turn + 1 token): an admit
# copies the turn's keys/values, prefilled once, and prefills only the rest of each prompt.
SYSTEM = list(range(180, 192))
PREFIXED = [SYSTEM + prompt for prompt in PROMPTS]


def test_admits_after_a_shared_prefix_equal_each_request_alone(tiny):
    """Greedy and sampled rows (temperature 0.9, top-k 5) through 3 refilled slots with the shared
    prefix copied at each admit: each request gets the tokens it gets alone (`jaxspec.generate`
    prefills its whole prompt), and the same as with sharing off."""
    assert shared_prefix_length(PREFIXED) == len(SYSTEM)
    assert shared_prefix_length(PREFIXED, share_prefix=False) == 0 and shared_prefix_length(PROMPTS) == 0
    sampling = [SamplingParams(temperature=0.9, top_k=5) if i % 2 else SamplingParams() for i in range(10)]
    seeds, ids = list(range(40, 50)), list(range(900, 910))
    kwargs = dict(max_new_tokens=BUDGETS, sampling=sampling, seed=seeds, request_ids=ids)
    together = generate_continuous(
        tiny, PREFIXED, slots=3, admit_rows=2, steps_per_call=6, share_prefix=True, **kwargs
    )
    unshared = generate_continuous(tiny, PREFIXED, slots=3, admit_rows=2, **kwargs)  # the default
    for i, prompt in enumerate(PREFIXED):
        (a,) = jaxspec.generate(
            tiny,
            [prompt],
            max_new_tokens=BUDGETS[i],
            sampling=sampling[i],
            seed=seeds[i],
            request_ids=[ids[i]],
        )
        assert together[i].token_ids == a.token_ids, f"request {i}"
        assert together[i].finish_reason == a.finish_reason
        assert unshared[i].token_ids == a.token_ids, f"request {i}, sharing off"
    assert [c.token_ids for c in together] != [
        c.token_ids for c in generate_continuous(tiny, PREFIXED, BUDGETS)
    ]
    # The admits ran fewer prompt positions through the target (suffixes of 1-20 tokens, not prompts of
    # 13-32); the decode steps are the same.
    ran = {
        key: max(c.stats[f"batch_{key}"] for c in together) for key in ("prefill_positions", "decode_steps")
    }
    unshared_ran = {key: max(c.stats[f"batch_{key}"] for c in unshared) for key in ran}
    assert ran["prefill_positions"] < unshared_ran["prefill_positions"]
    assert ran["decode_steps"] == unshared_ran["decode_steps"]


# Each of five prompts asked three times (different budgets, greedy and sampled rows, their own seeds
# and request ids), among five prompts asked once: 20 requests, 5 prompts recur.
REPEATED = [PROMPTS[i % 5] for i in range(15)] + PROMPTS[5:]
REPEATED_BUDGETS = [BUDGETS[i % 5] + 7 * (i // 5) for i in range(15)] + BUDGETS[5:]


def test_recurring_prompts_are_the_ones_asked_twice_most_frequent_first():
    index = recurring_prompts([[1], [2], [1], [3], [2], [1], [4]], max_rows=8)
    assert index == [0, 1, 0, -1, 1, 0, -1]  # [1] three times, [2] twice; [3] and [4] once
    assert recurring_prompts([[1], [2], [1], [3], [2], [1]], max_rows=1) == [0, -1, 0, -1, -1, 0]
    assert recurring_prompts([[1], [2], [3]], max_rows=8) == [-1, -1, -1]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_repeated_prompts_are_prefilled_once_and_each_request_gets_its_tokens_alone(tiny, sampled):
    """20 requests, 15 of them on 5 recurring prompts, through 3 refilled slots: with the prompt cache
    (the default) the recurring prompts are prefilled once and admits of cached requests only copy
    their rows and draw their own first token; each request still gets exactly the tokens it gets
    alone (greedy; sampled at temperature 0.9 / top-k 5 on every other row, its own seed and id),
    and the same as with the cache off, in fewer prefilled prompt positions."""
    n = len(REPEATED)
    sampling = [
        SamplingParams(temperature=0.9, top_k=5) if sampled and i % 2 else SamplingParams() for i in range(n)
    ]
    kwargs = dict(
        max_new_tokens=REPEATED_BUDGETS, sampling=sampling, seed=list(range(60, 60 + n)),
        request_ids=list(range(700, 700 + n)),
    )  # fmt: skip
    cached = generate_continuous(tiny, REPEATED, slots=3, admit_rows=2, steps_per_call=6, **kwargs)
    uncached = generate_continuous(tiny, REPEATED, slots=3, admit_rows=2, prompt_cache=False, **kwargs)
    for i, prompt in enumerate(REPEATED):
        (a,) = jaxspec.generate(
            tiny, [prompt], max_new_tokens=REPEATED_BUDGETS[i], sampling=sampling[i], seed=60 + i,
            request_ids=[700 + i],
        )  # fmt: skip
        assert cached[i].token_ids == a.token_ids, f"request {i}"
        assert cached[i].finish_reason == a.finish_reason
        assert uncached[i].token_ids == a.token_ids, f"request {i}, prompt cache off"
    if sampled:  # it really sampled, and the same prompt drew different tokens for different requests
        assert [c.token_ids for c in cached] != [c.token_ids for c in generate_continuous(tiny, REPEATED, 60)]
        assert cached[1].token_ids[:8] != cached[11].token_ids[:8]
    positions = {
        name: max(c.stats["batch_prefill_positions"] for c in run)
        for name, run in (("cached", cached), ("uncached", uncached))
    }
    assert positions["cached"] < positions["uncached"] / 2  # 2 of 3 requests per prompt copied it


def test_bad_continuous_input_names_the_problem(tiny):
    with pytest.raises(InputError, match="slots"):
        generate_continuous(tiny, PROMPTS, slots=0)
    with pytest.raises(InputError, match="max_new_tokens for prompt 1"):
        generate_continuous(tiny, [[1], [2]], max_new_tokens=[1, 0])
    with pytest.raises(InputError, match="prompt 0 has 500 tokens .* beyond the model's context of 512"):
        generate_continuous(tiny, [[1] * 500], max_new_tokens=20)


# ---------------------------------------------------------------------------------------------------
# Speculation (n-gram prompt lookup) inside the continuous loop
# ---------------------------------------------------------------------------------------------------

# Prompts that repeat themselves (prompt lookup finds continuations) with budgets from 2 to 40: more
# requests than slots, finishing at very different rounds (some by EOS), so slots are refilled.
SPEC_PROMPTS = [
    [242, 287, 52, 242, 287, 52, 242, 287, 52], [314] * 8, [125, 167, 33, 125, 167, 33, 125],
    [123, 73] * 6, [155] * 8, [295, 124, 149, 295, 124, 149], [24, 294] * 7, [77, 20, 77, 20, 77],
]  # fmt: skip
SPEC_BUDGETS = [40, 3, 33, 5, 25, 2, 17, 40]
NGRAM = SpecConfig(method="ngram", num_speculative_tokens=3, ngram_max=3)
HOT = SamplingParams(temperature=0.8, top_p=0.9)
SPEC_SEEDS = [21, 22, 23, 24, 25, 26, 27, 28]
SPEC_IDS = [501, 502, 503, 504, 505, 506, 507, 508]


@pytest.fixture(scope="module")
def confident(tmp_path_factory):
    """The tiny model with its LM head scaled by 4: sharper next-token distributions, so sampled n-gram
    drafts get accepted too (greedy tokens are the same as the plain tiny model's)."""
    path = tmp_path_factory.mktemp("tiny_confident")
    torch_model = save_tiny("llama", path, eos_token_id=[131, 169])
    with torch.no_grad():
        torch_model.lm_head.weight.mul_(4.0)
    torch_model.save_pretrained(path, safe_serialization=True)
    return jaxspec.load(str(path))


def sampled_kwargs(sampled: bool) -> dict:
    return dict(sampling=HOT, seed=SPEC_SEEDS, request_ids=SPEC_IDS) if sampled else {}


@pytest.fixture(scope="module")
def spec_alone(confident):
    """{sampled: [Completion of each SPEC_PROMPTS request run alone with `jaxspec.generate`]}."""
    out = {}
    for sampled in (False, True):
        out[sampled] = []
        for i, (prompt, budget) in enumerate(zip(SPEC_PROMPTS, SPEC_BUDGETS, strict=True)):
            kwargs = dict(sampling=HOT, seed=SPEC_SEEDS[i], request_ids=[SPEC_IDS[i]]) if sampled else {}
            (c,) = jaxspec.generate(confident, [prompt], max_new_tokens=budget, spec=NGRAM, **kwargs)
            out[sampled].append(c)
    return out


def assert_same_as_alone(together, reference, what: str) -> None:
    for i, (a, c) in enumerate(zip(reference, together, strict=True)):
        assert c.token_ids == a.token_ids, f"{what}: request {i}"
        assert c.finish_reason == a.finish_reason, f"{what}: request {i}"
        assert c.stats["rounds"] == a.stats["rounds"], f"{what}: request {i}"
        assert c.stats["accepted_by_depth"] == a.stats["accepted_by_depth"], f"{what}: request {i}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_ngram_continuous_equals_each_request_alone(confident, spec_alone, sampled):
    """n-gram speculation in 3 refilled slots: each request gets the tokens, rounds and acceptance it
    gets alone (greedy: the same tokens; sampled at temperature 0.8, top-p 0.9: the same tokens for the
    same seed and request id), and drafts were accepted (or this would prove nothing)."""
    reference = spec_alone[sampled]
    together = generate_continuous(
        confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, spec=NGRAM, slots=3, admit_rows=2,
        steps_per_call=5, **sampled_kwargs(sampled),
    )  # fmt: skip
    assert_same_as_alone(together, reference, "sampled" if sampled else "greedy")
    accepting = [c for c in together if sum(c.stats["accepted_by_depth"]) > 0]
    assert len(accepting) >= 3  # several requests had rounds that accepted >= 1 draft token
    assert any(c.stats["accepted_by_depth"][1] > 0 for c in together)  # some accepted 2+ at once
    if sampled:  # it really sampled: not the greedy tokens
        assert [c.token_ids for c in together] != [c.token_ids for c in spec_alone[False]]
    else:
        assert {c.finish_reason for c in together} == {"stop", "length"}
        # Speculation is lossless: greedy tokens equal greedy autoregressive decoding.
        plain = generate_continuous(confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, slots=3)
        assert [c.token_ids for c in together] == [c.token_ids for c in plain]


def test_request_in_a_refilled_slot_equals_itself_alone(confident, spec_alone):
    """Step the loop one iteration at a time and watch the slots: requests admitted into a slot another
    request held before (its history, drafter state, round index and stats must all start afresh) get
    their tokens alone, sampled; one compiled program serves every call."""
    order = [1, 5, 3, 0, 2, 4, 6, 7]  # short budgets first: their slots are refilled early
    checked = check_requests(
        confident, [SPEC_PROMPTS[i] for i in order], [SPEC_BUDGETS[i] for i in order],
        [HOT] * len(order), [SPEC_SEEDS[i] for i in order], [SPEC_IDS[i] for i in order],
    )  # fmt: skip
    state, run = prepare_continuous(confident, checked, slots=3, admit_rows=2, spec=NGRAM)
    held: dict[int, list[int]] = {slot: [] for slot in range(3)}  # bank indices each slot held, in order
    state = run(state, 1)
    compiled = run_continuous._cache_size()
    while not bool(state.results.done.all()):
        for slot, request in enumerate(state.slot_request.tolist()):
            if request >= 0 and (not held[slot] or held[slot][-1] != request):
                held[slot].append(request)
        state = run(state, 1)
    assert run_continuous._cache_size() == compiled
    refilled = [request for requests in held.values() for request in requests[1:]]
    assert len(refilled) >= 3
    tokens, counts = state.results.tokens.tolist(), state.results.count.tolist()
    for bank_index in refilled:
        alone = spec_alone[True][order[bank_index]]
        assert tokens[bank_index][: counts[bank_index]] == alone.token_ids, f"bank row {bank_index}"
        assert int(state.result_rounds[bank_index]) == alone.stats["rounds"]
        assert state.result_accepted_by_depth[bank_index].tolist() == alone.stats["accepted_by_depth"]
    assert sum(sum(spec_alone[True][order[i]].stats["accepted_by_depth"]) for i in refilled) > 0


def test_ngram_continuous_stats_are_consistent_with_the_tokens(confident):
    """Per request: every round keeps >= 1 token and at most 1 + its accepted drafts, so rounds <=
    new tokens - 1 <= rounds + accepted; a draft at depth d + 1 is accepted only after depth d's; the
    mean accepted length is tokens per round after the first token."""
    together = generate_continuous(
        confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, spec=NGRAM, slots=3, admit_rows=2
    )
    for i, c in enumerate(together):
        rounds, by_depth, new = c.stats["rounds"], c.stats["accepted_by_depth"], len(c.token_ids)
        assert len(by_depth) == NGRAM.num_speculative_tokens
        assert rounds <= new - 1 <= rounds + sum(by_depth), f"request {i}"
        assert all(a >= b for a, b in zip(by_depth[:-1], by_depth[1:], strict=True)), f"request {i}"
        assert c.stats["mean_accepted_length"] == pytest.approx((new - 1) / rounds if rounds else 0.0)
    assert max(c.stats["mean_accepted_length"] for c in together) > 1.0


# ---------------------------------------------------------------------------------------------------
# Every other drafter inside the continuous loop: a draft model, and the four head families (random
# untrained heads, chains and trees), whose own caches and feature windows an admit must reset
# ---------------------------------------------------------------------------------------------------

DRAFTERS = {
    # the target drafting for itself: greedy drafts are all accepted, its own KV cache must be exact
    "draft_model-self": SpecConfig(method="draft_model", num_speculative_tokens=3),
    "draft_model-1layer": SpecConfig(method="draft_model", num_speculative_tokens=2, draft_num_layers=1),
    "eagle3-chain": SpecConfig(
        method="eagle3", head="random", num_speculative_tokens=3, extra=(("draft_vocab_size", 96),)
    ),
    # prompt lookup in front of the head's chain (`SpecConfig.lookup_min_match`)
    "eagle3-chain-lookup": SpecConfig(
        method="eagle3",
        head="random",
        num_speculative_tokens=3,
        extra=(("draft_vocab_size", 96),),
        lookup_min_match=1,
    ),  # fmt: skip
    "eagle-tree": SpecConfig(
        method="eagle", head="random", num_speculative_tokens=3, topk=3, num_draft_tokens=7
    ),
    # prompt lookup as one more branch of the head's tree
    "eagle-tree-lookup": SpecConfig(
        method="eagle",
        head="random",
        num_speculative_tokens=3,
        topk=3,
        num_draft_tokens=7,
        lookup_min_match=1,
    ),  # fmt: skip
    "medusa-tree": SpecConfig(
        method="medusa", head="random", tree_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    ),
    "mtp-chain": SpecConfig(
        method="mtp", head="random", num_speculative_tokens=3, extra=(("mtp_num_modules", 2),)
    ),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_in_refilled_slots_equals_each_request_alone(confident, name):
    """Each request in 3 refilled slots gets the tokens, rounds and acceptance it gets from
    `jaxspec.generate` with the same drafter, greedy and sampled (a sampled round's tokens depend on the
    drafts' q: a drafter state carried over from a slot's previous request changes them even when
    nothing is accepted); greedy tokens equal autoregressive decoding. The reference is one static batch
    of all 8 requests, whose rows are each request alone
    (`tests/test_spec_engine.py::test_mixed_sampling_request_alone_equals_inside_any_batch`)."""
    spec = DRAFTERS[name]
    greedy = None
    for sampled in (False, True):
        reference = jaxspec.generate(
            confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, spec=spec, **sampled_kwargs(sampled)
        )
        together = generate_continuous(
            confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, spec=spec, slots=3, admit_rows=2,
            steps_per_call=5, **sampled_kwargs(sampled),
        )  # fmt: skip
        assert_same_as_alone(together, reference, f"{name} {'sampled' if sampled else 'greedy'}")
        if not sampled:
            greedy = together
            plain = generate_continuous(confident, SPEC_PROMPTS, max_new_tokens=SPEC_BUDGETS, slots=3)
            assert [c.token_ids for c in together] == [c.token_ids for c in plain]
    if name == "draft_model-self":  # greedy self-drafting: every round accepts every draft
        for c in greedy:
            full_rounds = (len(c.token_ids) - 1) // (spec.num_speculative_tokens + 1)
            assert min(c.stats["accepted_by_depth"]) >= full_rounds


@pytest.mark.parametrize("name", ["ngram", "eagle3-chain", "eagle-tree", "mtp-chain"])
def test_drafters_after_a_shared_prefix_equal_each_request_alone(confident, name):
    """Speculating with the shared prefix copied at admits: the drafters that read the prompt's hidden
    states (EAGLE-1) or captured layers (EAGLE-3), the prompt's tokens (n-gram, the draft model's own
    prefill) or per-module caches (MTP) get the same tokens, rounds and acceptance per request as one
    static batch (each row = the request alone) that prefills whole prompts; greedy and sampled."""
    spec = NGRAM if name == "ngram" else DRAFTERS[name]
    prompts = [SYSTEM + prompt for prompt in SPEC_PROMPTS]
    for sampled in (False, True):
        kwargs = dict(max_new_tokens=SPEC_BUDGETS, spec=spec, **sampled_kwargs(sampled))
        reference = jaxspec.generate(confident, prompts, **kwargs)
        together = generate_continuous(
            confident, prompts, slots=3, admit_rows=2, steps_per_call=5, share_prefix=True, **kwargs
        )
        assert_same_as_alone(together, reference, f"{name} {'sampled' if sampled else 'greedy'}")


@pytest.mark.parametrize("modules", [None, 2], ids=["head-cache", "mtp-per-module-cache"])
def test_an_admit_writes_whole_rows_of_head_caches_in_either_layout(modules):
    """`_set_rows` (what an admit resets a slot's drafter state with) writes rows [R] of a HeadCache
    along its batch axis: [B, H, S, D], or MTP's [M, B, H, S, D]; other rows are left alone and a row
    index == B is dropped. (Random heads' drafts barely depend on their caches, so the end-to-end test
    above alone would not pin this.)"""
    lead = () if modules is None else (modules,)
    old = HeadCache(keys=jnp.zeros(lead + (4, 2, 6, 3)), values=-jnp.ones(lead + (4, 2, 6, 3)))
    fresh = HeadCache(
        keys=jnp.arange(2 * 36, dtype=jnp.float32).reshape(2, 2, 6, 3) + 1, values=jnp.full((2, 2, 6, 3), 7.0)
    )
    if modules is not None:
        fresh = HeadCache(keys=jnp.stack([fresh.keys, 2 * fresh.keys]), values=jnp.stack([fresh.values] * 2))
    state = {"cache": old, "length": jnp.zeros((4,), jnp.int32)}
    new = _set_rows(state, jnp.asarray([2, 4]), {"cache": fresh, "length": jnp.asarray([5, 6])})
    axis = old.batch_axis
    assert axis == len(lead)
    rows = lambda x, i: jnp.take(x, jnp.asarray(i), axis=axis)  # noqa: E731
    assert jnp.array_equal(rows(new["cache"].keys, 2), rows(fresh.keys, 0))
    assert jnp.array_equal(rows(new["cache"].values, 2), rows(fresh.values, 0))
    for untouched in (0, 1, 3):
        assert jnp.array_equal(rows(new["cache"].keys, untouched), rows(old.keys, untouched))
        assert jnp.array_equal(rows(new["cache"].values, untouched), rows(old.values, untouched))
    assert new["length"].tolist() == [0, 0, 5, 0]


def test_every_speculative_method_runs_in_continuous_batching():
    """No method is refused: each SpecConfig method has a continuous-batching case above."""
    from jaxspec.config import SPEC_METHODS

    tested = {spec.method for spec in DRAFTERS.values()} | {NGRAM.method}
    assert tested == set(SPEC_METHODS)


@pytest.mark.parametrize("name", ["ngram", "eagle3-chain", "eagle-tree", "mtp-chain"])
def test_drafters_from_cached_prompts_equal_each_request_alone(confident, name):
    """Speculating with every prompt asked twice: an admit from the prompt cache hands the drafter the
    cached prompt's hidden states, captured layers and tokens; each request gets the tokens, rounds and
    acceptance of one static batch (each row = the request alone), greedy and sampled."""
    spec = NGRAM if name == "ngram" else DRAFTERS[name]
    prompts, budgets = SPEC_PROMPTS * 2, SPEC_BUDGETS + [b + 3 for b in SPEC_BUDGETS]
    for sampled in (False, True):
        extra = dict(sampling=HOT, seed=SPEC_SEEDS * 2, request_ids=SPEC_IDS + [i + 50 for i in SPEC_IDS])
        kwargs = dict(max_new_tokens=budgets, spec=spec, **(extra if sampled else {}))
        reference = jaxspec.generate(confident, prompts, **kwargs)
        together = generate_continuous(confident, prompts, slots=3, admit_rows=2, steps_per_call=5, **kwargs)
        assert_same_as_alone(together, reference, f"{name} {'sampled' if sampled else 'greedy'}")
