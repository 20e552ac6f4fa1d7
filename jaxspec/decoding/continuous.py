"""Continuous batching: a fixed number of slots refilled from an on-device request bank, all inside one
compiled `lax.while_loop`.

The bank holds every request of a run (prompts padded to one length bucket, budgets, seeds, request ids,
sampling parameters). Each iteration of the loop does one of two things:

* admit: when at least `admit_rows` slots are free (or every remaining request fits in the free
  slots), the next `admit_rows` requests of the bank are prefilled together (one [admit_rows, P]
  forward) and their keys/values, first token and parameters are written into free slots;
* decode: otherwise one autoregressive token for every slot, or, with a speculative config
  (`generate_continuous(..., spec=SpecConfig(method="eagle3", ...))`, any method), one speculative
  round for every slot: `decoding.speculative.speculative_round`, the round the speculative loop runs.

After either, a slot whose request is finished (EOS or budget) writes its output row into the result
bank (`[N, capacity]`) and becomes free. No host round trip per token: the host calls `run_continuous`
for a bounded number of iterations, reads which requests finished (to stream them out), and calls it
again with the donated state until every request is done.

A request's tokens do not depend on its slot or its neighbours: its first token is drawn with the key of
round 0 at prefill, and its j-th token with the key of round j (`sampling.derive_key(seed, request id,
j, PURPOSE_BONUS)`), exactly as `jaxspec.generate` draws them for the request alone; every operation
of a step is row-wise. Speculating, each slot carries its request's history (prompt + emitted tokens),
drafter state, round index and acceptance stats (`DraftRows`), all set afresh when a request is admitted
into the slot: the slot's r-th round draws the keys of round r of (seed, request id), as the request's
r-th round alone does. An admit writes whole rows of the drafter state (the draft model's KV cache, a
head's own cache and pending features, MTP's per-module caches along their batch axis), so nothing of a
slot's previous request survives in it.

With share_prefix=True, when every prompt of the run starts with the same tokens (a chat template's
system turn: 24 of the dev prompts' ~84 tokens with SmolLM2's template), that prefix is prefilled once
before the loop
(`SharedPrefix`) and an admit copies its keys/values into the slots and prefills only the rest of each
prompt (`prefill(..., prefix=...)`), the way vLLM's and SGLang's prefix caches serve a shared system
prompt. A request's tokens are the same either way (`tests/test_continuous.py`). It is off by default:
on this CPU it ran fewer prompt positions (-11% at 64 slots, -19% at 16 on the dev workload) but no
faster (README, "Continuous batching"; an admit after the prefix was slower than a whole-prompt admit
of the same width).

With prompt_cache=True (the default), a prompt that recurs in the run (several samples of one prompt,
the same question at several budgets) is prefilled once before the loop (`PromptCache`, the repeated
prompts' keys/values, hidden states and captured layers, up to PROMPT_CACHE_BYTES): an admit whose
requests all hold cached prompts copies their rows instead of running the target, and draws each
request's first token with its own key from the cached final hidden state, as vLLM's automatic prefix
caching serves a repeated prompt. A request's tokens are the same either way (`tests/test_continuous.py`).
The bank puts the cached requests of each budget first, so admit groups are cached or not as a whole.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.autoregressive import autoregressive_buffer_sizes
from jaxspec.decoding.generate import (
    CheckedRequests,
    Completion,
    Prompt,
    check_requests,
    check_spec,
    completion,
    padded_requests,
)
from jaxspec.decoding.output_buffer import OutputBuffer, append_tokens, first_output
from jaxspec.decoding.prefill import (
    PrefillResult,
    Requests,
    SharedPrefix,
    first_tokens,
    longest_shared_prefix,
    prefill,
    prefill_shared_prefix,
)
from jaxspec.decoding.speculative import DraftRows, SpecState, spec_buffer_sizes, speculative_round
from jaxspec.drafters.make import make_drafter
from jaxspec.drafters.protocol import Drafter
from jaxspec.errors import InputError
from jaxspec.model.buckets import length_bucket
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import HeadCache, KVCache, kv_cache_bytes
from jaxspec.model.live_attention import live_attention_for
from jaxspec.model.target import Model


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContinuousState:
    """Loop carry of continuous batching (B slots, N requests in the bank).

    cache: the slots' KV cache [B, ...]; pending [B]: last emitted token (KV not yet written);
    out: the slots' output rows [B, capacity] (done = True for a free slot); slot_request [B]: bank
    index of the request in each slot, -1 when free; params: the request in each slot (a bank row);
    next_request: scalar, bank index of the next request to admit; results: the bank's output rows
    [N, capacity] (done = finished and written); iterations: scalar, loop iterations so far (admits +
    decode steps); decode_steps: scalar, decode steps (speculative rounds) so far; prefill_positions:
    scalar, prompt positions the admits ran through the target so far (admit rows x prefill width,
    padding included, a shared prefix not).

    Speculating (None otherwise): draft: the slots' `DraftRows` (history [B, P + capacity], drafter
    state, rounds, accepted_by_depth [B, D], round index), reset for a slot when a request is admitted
    into it; result_rounds [N] and result_accepted_by_depth [N, D]: each finished request's stats.
    pending is the autoregressive decode's input; a speculative round's root is the history's last token.
    """

    cache: KVCache
    pending: jax.Array
    out: OutputBuffer
    slot_request: jax.Array
    params: Requests
    next_request: jax.Array
    results: OutputBuffer
    iterations: jax.Array
    decode_steps: jax.Array
    prefill_positions: jax.Array
    draft: DraftRows | None = None
    result_rounds: jax.Array | None = None
    result_accepted_by_depth: jax.Array | None = None


def init_state(
    config: ModelConfig,
    bank: Requests,
    slots: int,
    max_len: int,
    capacity: int,
    dtype,
    *,
    drafter: Drafter | None = None,
    drafter_state: Any = (),
) -> ContinuousState:
    """Every slot free, nothing admitted; the cache is [slots, ..., max_len, ...] zeros.

    drafter: speculate with it (None: autoregressive); drafter_state: its state for `slots` free rows
    (every leaf [slots, ...]; `idle_drafter_state`).
    """
    n = bank.prompt_tokens.shape[0]
    idle = OutputBuffer.empty(slots, capacity)
    idle = dataclasses.replace(idle, done=jnp.ones((slots,), bool))

    def zeros() -> jax.Array:  # a fresh buffer per leaf: the state is donated leaf by leaf
        return jnp.zeros((slots,), jnp.int32)

    placeholders = jax.tree.map(lambda x: x[zeros()], bank)  # the bank's first row in every slot
    draft, result_rounds, result_by_depth = None, None, None
    if drafter is not None:
        width = bank.prompt_tokens.shape[1] + capacity
        draft = DraftRows.after_prefill(placeholders, zeros(), width, drafter_state, drafter.max_depth)
        result_rounds = jnp.zeros((n,), jnp.int32)
        result_by_depth = jnp.zeros((n, drafter.max_depth), jnp.int32)
    return ContinuousState(
        cache=KVCache.zeros(config, slots, max_len, dtype),
        pending=zeros(),
        out=idle,
        slot_request=jnp.full((slots,), -1, jnp.int32),
        params=placeholders,
        next_request=jnp.int32(0),
        results=OutputBuffer.empty(n, capacity),
        iterations=jnp.int32(0),
        decode_steps=jnp.int32(0),
        prefill_positions=jnp.int32(0),
        draft=draft,
        result_rounds=result_rounds,
        result_accepted_by_depth=result_by_depth,
    )


def idle_drafter_state(
    model: Model, drafter: Drafter, draft_params: Any, rows: Requests, max_len: int
) -> Any:
    """Zeros shaped like `drafter`'s state for `rows` ([B] requests): what free slots hold until an
    admit initialises their rows from the admitted requests' prefill. Shapes only, nothing is run."""

    def init() -> Any:
        pre = prefill(
            model.graphdef, model.params, model.config, rows, max_len, capture_layers=drafter.capture_layers
        )
        return drafter.init(draft_params, model.params, pre, rows, max_len)

    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(init))


def _set_rows(tree, rows: jax.Array, values):
    """Write values [R, ...] into rows [R] of every leaf of tree [B, ...] (a `HeadCache`'s buffers: rows
    on its batch_axis, e.g. MTP's [M, B, ...]); rows == B are dropped."""

    def put(x: jax.Array, v: jax.Array, axis: int = 0) -> jax.Array:
        return x.at[(slice(None),) * axis + (rows,)].set(v.astype(x.dtype), mode="drop")

    def write(x, v):
        if isinstance(x, HeadCache):
            axis = x.batch_axis
            return HeadCache(keys=put(x.keys, v.keys, axis), values=put(x.values, v.values, axis))
        return put(x, v)

    return jax.tree.map(write, tree, values, is_leaf=lambda x: isinstance(x, HeadCache))


def prefill_widths(prompt_len: int) -> tuple[int, ...]:
    """The prompt widths an admit prefills at, up to the bank's prompt_len (a power of two): 16, 32,
    48, 64, 96, 128, 192, 256, ... (powers of two and 1.5 times powers of two). With the bank ordered
    by budget an admit group mixes prompt lengths; steps of 1.5x instead of 2x keep its padding about
    where power-of-two widths left the length-ordered bank (README, "Continuous batching"; each prompt
    token costs as much as a decoded one). Each width is one more branch of the compiled admit."""
    widths, power = [length_bucket(1)], length_bucket(1)
    while widths[-1] < prompt_len:
        if power >= 32:
            widths.append(power * 3 // 2)
        power *= 2
        widths.append(power)
    return tuple(widths)


MIN_SHARED_PREFIX = 8  # shorter shared prefixes are prefilled with each prompt (not worth a program)


def shared_prefix_length(token_lists: Sequence[Sequence[int]], share_prefix: bool = True) -> int:
    """Tokens of the prefix an admit copies instead of prefilling (`longest_shared_prefix`), or 0 when
    sharing is off or the prefix is shorter than MIN_SHARED_PREFIX."""
    length = longest_shared_prefix(token_lists) if share_prefix else 0
    return length if length >= MIN_SHARED_PREFIX else 0


def admit_width(prompt_length: int, prompt_len: int) -> int:
    """The smallest of `prefill_widths(prompt_len)` that holds a prompt of prompt_length tokens."""
    return next(w for w in prefill_widths(prompt_len) if w >= prompt_length)


PROMPT_CACHE_BYTES = 1 << 30  # at most this much memory holds recurring prompts' prefills,
PROMPT_CACHE_FRACTION = 1.0  # and at most this share of the slots' own KV cache
PROMPT_CACHE_CAPTURES = 4  # hidden states [P, d] a cached row is budgeted for: final + EAGLE-3's 3 layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptCache:
    """The prompts that recur in a run's bank, prefilled once before the loop.

    prefill: their `PrefillResult` rows [U, ...]: cache of max_len = the bank's prompt width P (lengths
    = prompt lengths), hidden and captured [U, P, d]; its first_token is not used (each request draws
    its own). index [N]: each bank request's row in it, -1 where the prompt is prefilled at its admit.
    """

    prefill: PrefillResult
    index: jax.Array


def prompt_cache_budget(config: ModelConfig, slots: int, max_len: int, dtype) -> int:
    """Bytes the prompt cache may hold beside `slots` slots of max_len positions: PROMPT_CACHE_BYTES, at
    most PROMPT_CACHE_FRACTION of the slots' KV cache (what the batch job's memory check adds)."""
    return min(PROMPT_CACHE_BYTES, int(PROMPT_CACHE_FRACTION * kv_cache_bytes(config, slots, max_len, dtype)))


def prompt_cache_row_bytes(config: ModelConfig, prompt_len: int, dtype) -> int:
    """Bytes of one prompt cache row of width prompt_len: the keys/values of prompt_len positions
    (`kv_cache_bytes`) and PROMPT_CACHE_CAPTURES hidden states [prompt_len, d]."""
    hidden = PROMPT_CACHE_CAPTURES * prompt_len * config.hidden_size * jnp.dtype(dtype).itemsize
    return kv_cache_bytes(config, 1, prompt_len, dtype) + hidden


def prompt_cache_plan(
    config: ModelConfig, token_lists: Sequence[Sequence[int]], slots: int, max_len: int, dtype
) -> tuple[list[int], int]:
    """(each request's prompt cache row or -1 (`recurring_prompts`), the cache's bytes) for a run of
    these prompts (bank order) through `slots` slots of max_len positions, within `prompt_cache_budget`."""
    prompt_len = length_bucket(max(len(t) for t in token_lists))
    row_bytes = prompt_cache_row_bytes(config, prompt_len, dtype)
    index = recurring_prompts(token_lists, prompt_cache_budget(config, slots, max_len, dtype) // row_bytes)
    return index, (max(index, default=-1) + 1) * row_bytes


def recurring_prompts(token_lists: Sequence[Sequence[int]], max_rows: int) -> list[int]:
    """Each request's row in a prompt cache of the prompts that occur at least twice (the most frequent
    first, at most max_rows of them), -1 for a prompt left out."""
    counts = collections.Counter(tuple(t) for t in token_lists)
    recurring = [prompt for prompt, count in counts.most_common() if count >= 2][: max(max_rows, 0)]
    row = {prompt: r for r, prompt in enumerate(recurring)}
    return [row.get(tuple(t), -1) for t in token_lists]


def build_prompt_cache(
    model: Model, bank: Requests, index: Sequence[int], *, attention: str, capture_layers: tuple[int, ...]
) -> PromptCache | None:
    """Prefill every cached prompt once (`recurring_prompts` rows of the bank, [N] index); None when no
    prompt recurs. Each cached row is prefilled from the first bank request that holds its prompt."""
    rows = max(index, default=-1) + 1
    if rows == 0:
        return None
    first = [index.index(r) for r in range(rows)]
    requests = jax.tree.map(lambda x: x[jnp.asarray(first, jnp.int32)], bank)
    pre = _jit_prefill(
        model.graphdef, model.params, model.config, requests, bank.prompt_tokens.shape[1],
        attention=attention, capture_layers=capture_layers,
    )  # fmt: skip
    return PromptCache(prefill=pre, index=jnp.asarray(index, jnp.int32))


_jit_prefill = jax.jit(
    prefill, static_argnames=("graphdef", "config", "max_len", "attention", "capture_layers")
)


def _from_prompt_cache(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: PromptCache,
    admitted: Requests,
    rows: jax.Array,
    max_len: int,
) -> PrefillResult:
    """What `prefill` gives the admitted requests ([R]; rows [R]: their prompt cache rows), read from the
    prompt cache: keys/values widened to max_len positions, each request's own first token."""
    stored = jax.tree.map(lambda x: x[rows], cache.prefill)

    def widen(buffer: jax.Array) -> jax.Array:  # [R, H, P, D] -> [R, H, max_len, D]
        return jnp.pad(buffer, ((0, 0), (0, 0), (0, max_len - buffer.shape[2]), (0, 0)))

    kv = KVCache(
        keys=tuple(widen(k) for k in stored.cache.keys),
        values=tuple(widen(v) for v in stored.cache.values),
        lengths=admitted.prompt_lengths.astype(jnp.int32),
    )
    first = first_tokens(graphdef, params, stored.hidden, admitted)
    return PrefillResult(cache=kv, first_token=first, hidden=stored.hidden, captured=stored.captured)


def _retire(state: ContinuousState) -> ContinuousState:
    """Copy finished slots' output rows into the result bank and free those slots."""
    n = state.results.tokens.shape[0]
    finished = (state.slot_request >= 0) & state.out.done
    target = jnp.where(finished, state.slot_request, n)
    results = _set_rows(state.results, target, state.out)
    if state.draft is not None:
        stats = (state.result_rounds, state.result_accepted_by_depth)
        rows = (state.draft.rounds, state.draft.accepted_by_depth)
        rounds, by_depth = _set_rows(stats, target, rows)
        state = dataclasses.replace(state, result_rounds=rounds, result_accepted_by_depth=by_depth)
    # A free slot's length drops to 0, so the longest length is the longest live request's: what
    # live attention reads up to.
    cache = dataclasses.replace(state.cache, lengths=jnp.where(finished, 0, state.cache.lengths))
    return dataclasses.replace(
        state, cache=cache, results=results, slot_request=jnp.where(finished, -1, state.slot_request)
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "config", "admit_rows", "eos_ids", "attention", "drafter", "spec"),
    donate_argnames=("state",),
)
def run_continuous(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    bank: Requests,
    state: ContinuousState,
    max_iterations: jax.Array,
    *,
    config: ModelConfig,
    admit_rows: int,
    eos_ids: tuple[int, ...],
    attention: str = "auto",
    drafter: Drafter | None = None,
    spec: SpecConfig | None = None,
    draft_params: Any = (),
    prefix: SharedPrefix | None = None,
    prompt_cache: PromptCache | None = None,
) -> ContinuousState:
    """Run the continuous-batching loop until every request is finished or `max_iterations` more
    iterations (admits + decode steps) have run; returns the state to pass back in (donated).

    bank: every request of the run ([N, P] prompts, [N] parameters). state: from `init_state` or the
    previous call. admit_rows: requests prefilled together in one admit (<= slots). prefix: the L
    tokens every bank prompt starts with, prefilled (`SharedPrefix`, with the drafter's capture layers;
    every prompt longer than L); None: prefill whole prompts. prompt_cache: recurring prompts prefilled
    once (`build_prompt_cache`): an admit of cached requests only copies their rows. drafter, spec,
    draft_params: speculate (one `speculative_round` per decode step; the state from `init_state` with
    the same drafter); None = autoregressive. The drafter's state must be per row (leaves [B, ...]):
    an admit replaces the admitted slots' rows with `drafter.init` of their own prefill.
    """
    n = bank.prompt_tokens.shape[0]
    slots = state.pending.shape[0]
    max_len = state.cache.max_len
    capacity = state.out.tokens.shape[1]
    rows = min(admit_rows, slots)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    one_node_mask = jnp.ones((slots, 1, 1), dtype=bool)
    stop_at = state.iterations + max_iterations
    capture = drafter.capture_layers if drafter is not None else ()
    shared = 0 if prefix is None else prefix.length
    if (drafter is None) != (spec is None) or (drafter is None) != (state.draft is None):
        raise ValueError("run_continuous: give drafter and spec together, with a state made for the drafter")

    def admit(state: ContinuousState) -> ContinuousState:
        free = state.slot_request < 0
        take = jnp.minimum(jnp.minimum(jnp.sum(free), n - state.next_request), rows)
        index = jnp.arange(rows, dtype=jnp.int32)
        valid = index < take
        target = jnp.where(valid, jnp.nonzero(free, size=rows, fill_value=slots)[0], slots)
        request = jnp.minimum(state.next_request + index, n - 1)
        admitted = jax.tree.map(lambda x: x[request], bank)
        # Prefill at the smallest width that holds the admitted prompts past the shared prefix, not at
        # the bank's longest prompt: padding would cost as much as real tokens.
        needed = jnp.max(jnp.where(valid, admitted.prompt_lengths - shared, 1))
        widths = prefill_widths(bank.prompt_tokens.shape[1] - shared)
        branch = jnp.sum(needed > jnp.asarray(widths[:-1], jnp.int32))
        run_widths = [min(w, bank.prompt_tokens.shape[1] - shared) for w in widths]  # positions run

        def init_drafter(pre: PrefillResult, requests: Requests) -> tuple[KVCache, jax.Array, Any]:
            if drafter is None:
                return pre.cache, pre.first_token, ()
            return pre.cache, pre.first_token, drafter.init(draft_params, params, pre, requests, max_len)

        def prefill_at(width: int):
            def run(admitted: Requests) -> tuple[KVCache, jax.Array, Any]:
                whole = admitted.prompt_tokens[:, : shared + width]
                narrow = dataclasses.replace(admitted, prompt_tokens=whole)
                pre = prefill(
                    graphdef, params, config, narrow, max_len, attention=attention, capture_layers=capture,
                    prefix=prefix,
                )  # fmt: skip
                return init_drafter(pre, narrow)

            return run

        branches = [prefill_at(w) for w in widths]
        if prompt_cache is not None:  # branch 0: every admitted request's prompt is cached, copy it
            cached = prompt_cache.index[request]
            branch = jnp.where(jnp.all(jnp.where(valid, cached >= 0, True)), 0, branch + 1)

            def copy(admitted: Requests) -> tuple[KVCache, jax.Array, Any]:
                rows_read = jnp.maximum(cached, 0)
                pre = _from_prompt_cache(graphdef, params, prompt_cache, admitted, rows_read, max_len)
                return init_drafter(pre, admitted)

            branches, run_widths = [copy, *branches], [0, *run_widths]
        pre_cache, first_token, drafter_state = jax.lax.switch(branch, branches, admitted)
        first = first_output(first_token, capacity, admitted.max_new_tokens, eos)
        admitted_state = dataclasses.replace(
            state,
            cache=_set_rows(state.cache, target, pre_cache),  # whole rows: keys, values, lengths
            pending=_set_rows(state.pending, target, first_token),
            out=_set_rows(state.out, target, first),
            slot_request=_set_rows(state.slot_request, target, request),
            params=_set_rows(state.params, target, admitted),
            next_request=state.next_request + take,
            prefill_positions=state.prefill_positions + rows * jnp.asarray(run_widths, jnp.int32)[branch],
        )
        if drafter is None:
            return admitted_state
        # The admitted slots' draft rows start afresh: their own history, drafter state, round 1.
        width = state.draft.history.shape[1]
        fresh = DraftRows.after_prefill(admitted, first_token, width, drafter_state, drafter.max_depth)
        return dataclasses.replace(admitted_state, draft=_set_rows(state.draft, target, fresh))

    # Where attention would read the whole padded cache (the jnp reference), read it only up to the
    # longest live request; the Pallas kernels already stop at each row's length.
    attend = live_attention_for(attention)

    def decode(state: ContinuousState) -> ContinuousState:
        cache = state.cache
        hidden, _, cache = model_forward(
            graphdef, params, state.pending[:, None], cache.lengths[:, None], cache, one_node_mask,
            attention=attention, attend=attend,
        )  # fmt: skip
        active = state.slot_request >= 0
        cache = dataclasses.replace(cache, lengths=jnp.minimum(cache.lengths + active, max_len - 1))
        p = state.params
        # A request's j-th token is drawn with the key of round j, as when it runs alone.
        keys = sampling.derive_key(p.seeds, p.request_ids, state.out.count, sampling.PURPOSE_BONUS)
        token = sampling.sample_logits(lm_logits(graphdef, params, hidden[:, 0]), p.sampling, keys)
        out, _ = append_tokens(
            state.out, token[:, None], jnp.ones((slots,), jnp.int32), p.max_new_tokens, eos
        )
        return dataclasses.replace(
            state, cache=cache, pending=token, out=out, decode_steps=state.decode_steps + 1
        )

    def speculate(state: ContinuousState) -> ContinuousState:
        # Free slots are done, so the round changes nothing of theirs that an admit does not reset.
        after = speculative_round(
            graphdef, params, draft_params, state.params, SpecState(state.cache, state.out, state.draft),
            drafter=drafter, spec=spec, eos=eos, attend=attend,
        )  # fmt: skip
        return dataclasses.replace(
            state, cache=after.cache, out=after.out, draft=after.draft, decode_steps=state.decode_steps + 1
        )

    def body(state: ContinuousState) -> ContinuousState:
        free = jnp.sum(state.slot_request < 0)
        remaining = n - state.next_request
        should_admit = (remaining > 0) & (free >= jnp.minimum(rows, remaining))
        state = jax.lax.cond(should_admit, admit, decode if drafter is None else speculate, state)
        return dataclasses.replace(_retire(state), iterations=state.iterations + 1)

    def running(state: ContinuousState) -> jax.Array:
        unfinished = (state.next_request < n) | jnp.any(state.slot_request >= 0)
        return unfinished & (state.iterations < stop_at)

    return jax.lax.while_loop(running, body, state)


def prepare_continuous(
    model: Model,
    checked: CheckedRequests,
    slots: int,
    admit_rows: int | None,
    spec: SpecConfig | None = None,
    share_prefix: bool = False,
    prompt_cache: bool = True,
) -> tuple[ContinuousState, Callable[[ContinuousState, int], ContinuousState]]:
    """(initial state, run(state, max_iterations) -> state) for the checked requests, in bank order.

    spec: a checked SpecConfig (`check_spec`), or None / method None for autoregressive decoding.
    Speculating, the output rows and caches get the speculative loop's room (`spec_buffer_sizes`).
    share_prefix: prefill the prompts' shared prefix once (`shared_prefix_length`) and copy it at admits.
    prompt_cache: prefill the prompts that recur in the bank once (`recurring_prompts`, `PromptCache`).
    """
    n = len(checked.token_lists)
    prompt_len = length_bucket(max(len(t) for t in checked.token_lists))
    new_bucket = length_bucket(max(checked.max_new))
    bank = padded_requests(checked, n, prompt_len)
    admit = admit_rows if admit_rows is not None else max(1, slots // 8)
    if admit < 1:
        raise InputError(f"generate_continuous: admit_rows must be >= 1, got {admit}")
    attention = spec.attention if spec is not None else "auto"
    if spec is None or spec.method is None:
        spec, drafter, draft_params, drafter_state = None, None, (), ()
        capacity, max_len = autoregressive_buffer_sizes(prompt_len, new_bucket)
    else:
        drafter, draft_params = make_drafter(model, spec)
        capacity, max_len = spec_buffer_sizes(drafter, prompt_len, new_bucket)
        rows = jax.tree.map(lambda x: x[jnp.zeros((slots,), jnp.int32)], bank)
        drafter_state = idle_drafter_state(model, drafter, draft_params, rows, max_len)
    state = init_state(
        model.config, bank, slots, max_len, capacity, model.dtype,
        drafter=drafter, drafter_state=drafter_state,
    )  # fmt: skip
    shared = shared_prefix_length(checked.token_lists, share_prefix)
    capture = drafter.capture_layers if drafter is not None else ()
    prefix = None
    if shared:
        prefix = _jit_shared_prefix(
            model.graphdef, model.params, config=model.config, attention=attention, capture_layers=capture,
            tokens=jnp.asarray(checked.token_lists[0][:shared], jnp.int32),
        )  # fmt: skip

    cached = None
    if prompt_cache:
        index, _ = prompt_cache_plan(model.config, checked.token_lists, slots, max_len, model.dtype)
        cached = build_prompt_cache(model, bank, index, attention=attention, capture_layers=capture)

    def run(state: ContinuousState, max_iterations: int) -> ContinuousState:
        return run_continuous(
            model.graphdef, model.params, bank, state, jnp.int32(max_iterations), config=model.config,
            admit_rows=admit, eos_ids=model.eos_token_ids, attention=attention, drafter=drafter, spec=spec,
            draft_params=draft_params, prefix=prefix, prompt_cache=cached,
        )  # fmt: skip

    return state, run


_jit_shared_prefix = jax.jit(
    prefill_shared_prefix, static_argnames=("graphdef", "config", "attention", "capture_layers")
)


def compile_continuous(
    model: Model, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int], *, slots: int = 64,
    admit_rows: int | None = None, spec: SpecConfig | dict | None = None, share_prefix: bool = False,
    prompt_cache: bool = True,
) -> None:  # fmt: skip
    """Compile the program `generate_continuous` runs for these requests without generating (for
    benchmarks that exclude compilation)."""
    spec = check_spec(model, spec)
    checked = check_requests(model, prompts, max_new_tokens, None, 0, None)
    state, run = prepare_continuous(model, checked, slots, admit_rows, spec, share_prefix, prompt_cache)
    jax.block_until_ready(run(state, 0))


def generate_continuous(
    model: Model,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int] = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    seed: int | Sequence[int] = 0,
    request_ids: Sequence[int] | None = None,
    *,
    slots: int = 64,
    admit_rows: int | None = None,
    steps_per_call: int = 64,
    on_finished: Callable[[list[tuple[int, Completion]]], None] | None = None,
    spec: SpecConfig | dict | None = None,
    share_prefix: bool = False,
    prompt_cache: bool = True,
) -> list[Completion]:
    """`jaxspec.generate` for many requests through `slots` continuously refilled slots; the same tokens
    per request as `jaxspec.generate` gives it alone with the same spec (greedy and sampled).

    Args:
      model, prompts, max_new_tokens, sampling, seed, request_ids: as `jaxspec.generate`.
      spec: None = autoregressive; a SpecConfig (or vLLM-style dict) with any method = one
        speculative round per decode step (each slot's drafter state is set afresh
        when a request is admitted into it).
      slots: rows decoded together. admit_rows: requests prefilled together when slots free up
        (default slots // 8, at least 1).
      steps_per_call: loop iterations per compiled call; between calls the host collects the requests
        finished so far and passes them to `on_finished` as (prompt index, Completion) pairs.
      share_prefix: when every prompt starts with the same >= MIN_SHARED_PREFIX tokens, prefill them
        once and copy their keys/values at each admit (the same tokens; default False: prefill whole
        prompts, which measured as fast or faster on CPU).
      prompt_cache: prefill each prompt that recurs in the requests once and copy its keys/values at
        its requests' admits (`PromptCache`; the same tokens; default True).
    Returns:
      one Completion per prompt, in order. stats["batch_time_s"] is the time from the start to the
      end of the call that finished the request, stats["batch_decode_steps"] and
      stats["batch_prefill_positions"] the run's decode steps and prefilled prompt positions by then;
      speculating, stats["rounds"] and stats["accepted_by_depth"] are the request's own, as
      `jaxspec.generate` reports them.
    """
    if slots < 1 or steps_per_call < 1:
        raise InputError(
            f"generate_continuous: slots ({slots}) and steps_per_call ({steps_per_call}) must be >= 1"
        )
    if model.mesh is not None:
        raise InputError("generate_continuous: a model loaded with a mesh is not supported; use generate")
    spec = check_spec(model, spec)
    checked = check_requests(model, prompts, max_new_tokens, sampling, seed, request_ids)
    n = len(checked.token_lists)
    # The bank in decreasing budget order (longest first: the last requests admitted are short, so
    # few slots idle while the longest finish); within a budget the requests with cached prompts first,
    # then by prefill width, so requests admitted together are all cached or share a prefill width. The
    # order changes no request's tokens.
    prompt_len = length_bucket(max(len(t) for t in checked.token_lists))
    shared = shared_prefix_length(checked.token_lists, share_prefix)
    cached = recurring_prompts(checked.token_lists, n if prompt_cache else 0)  # (the cache may hold fewer)
    order = sorted(
        range(n),
        key=lambda i: (
            -checked.max_new[i],
            cached[i] < 0,
            admit_width(len(checked.token_lists[i]) - shared, prompt_len - shared),
            i,
        ),
    )
    checked = CheckedRequests(
        *([getattr(checked, f.name)[i] for i in order] for f in dataclasses.fields(CheckedRequests))
    )
    state, run = prepare_continuous(model, checked, slots, admit_rows, spec, share_prefix, prompt_cache)
    completions: list[Completion | None] = [None] * n  # in bank order
    start = time.perf_counter()
    emitted = 0
    while emitted < n:
        state = run(state, steps_per_call)
        done, counts, stopped = jax.device_get(
            (state.results.done, state.results.count, state.results.stopped)
        )
        new = [i for i in range(n) if done[i] and completions[i] is None]
        if not new:
            continue
        tokens = jax.device_get(state.results.tokens)
        if state.draft is not None:  # speculative rounds and acceptance per request
            rounds, by_depth = jax.device_get((state.result_rounds, state.result_accepted_by_depth))
        else:  # one decode step per token after the first
            rounds, by_depth = [max(int(c) - 1, 0) for c in counts], None
        elapsed = time.perf_counter() - start
        emitted += len(new)
        finished_tokens = sum(int(counts[i]) for i in range(n) if done[i])
        steps, positions = jax.device_get((state.decode_steps, state.prefill_positions))
        stats = {
            "batch_time_s": elapsed, "batch_tokens_per_s": finished_tokens / elapsed,
            "batch_decode_steps": int(steps), "batch_prefill_positions": int(positions),
        }  # fmt: skip
        batch = []
        for i in new:
            own = stats if by_depth is None else {**stats, "accepted_by_depth": by_depth[i].tolist()}
            completions[i] = completion(model, tokens[i, : counts[i]], bool(stopped[i]), int(rounds[i]), own)
            batch.append((i, completions[i]))
        if on_finished is not None:
            on_finished([(order[i], c) for i, c in batch])
    by_prompt: list[Completion | None] = [None] * n
    for i, c in enumerate(completions):
        by_prompt[order[i]] = c
    return by_prompt  # type: ignore[return-value]
