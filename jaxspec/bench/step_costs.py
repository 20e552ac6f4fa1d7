"""Per-step costs, each step jitted on its own: target decode step, verify step, draft round.

The draft/target cost ratio of the speedup model is c = draft round time / (γ · verify step time):
γc is then the draft's share of a round relative to one target (verify) forward. The verify step
covers what a round spends on the target: the forward over the N tree nodes, the LM head, logits
processing and tree verification; the decode step is one autoregressive token (forward over 1 node,
LM head, sampling). Their ratio v = verify / decode says how much a wider forward costs on this
hardware (the speedup model assumes v = 1).

The draft round is `drafter.propose` with a RoundContext built from a real prefill of a real prompt,
so any drafter that follows the protocol in jaxspec/drafters/make.py is timed the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding.prefill import PrefillResult, Requests, prefill
from jaxspec.drafters.protocol import RoundContext
from jaxspec.model.buckets import length_bucket
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.sampling.tree import DraftTree, ancestor_mask, tree_positions


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Median seconds per call: prefill_s (the prompt, batch 1), decode_s (1 autoregressive token),
    verify_s (target side of a round over num_nodes nodes), draft_s (one drafter.propose);
    gamma = drafter.max_depth. Without speculation: verify_s = decode_s, draft_s = 0, gamma = 1."""

    prefill_s: float
    decode_s: float
    verify_s: float
    draft_s: float
    num_nodes: int
    gamma: int

    @property
    def c(self) -> float:
        """Draft step over target step: draft_s / (γ · verify_s)."""
        return self.draft_s / (self.gamma * self.verify_s) if self.verify_s > 0 else 0.0

    @property
    def verify_over_decode(self) -> float:
        """v = verify_s / decode_s (1.0 when a forward over N nodes costs what one token costs)."""
        return self.verify_s / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "c": self.c, "verify_over_decode": self.verify_over_decode}


def single_request(
    prompt_ids: Sequence[int], max_new_tokens: int, sampling_params: SamplingParams
) -> Requests:
    """A batch of one request padded to its length bucket, as `jaxspec.generate` builds it."""
    p = length_bucket(len(prompt_ids))
    tokens = np.zeros((1, p), np.int32)
    tokens[0, : len(prompt_ids)] = prompt_ids
    return Requests(
        prompt_tokens=jnp.asarray(tokens),
        prompt_lengths=jnp.asarray([len(prompt_ids)], jnp.int32),
        max_new_tokens=jnp.asarray([max_new_tokens], jnp.int32),
        seeds=jnp.zeros((1,), jnp.int32),
        request_ids=jnp.zeros((1,), jnp.int32),
        sampling=sampling.SamplingArrays.from_params(sampling_params, 1),
    )


def median_call_time(step: Callable[[Any], Any], carry: Any, iters: int) -> float:
    """Run `carry = step(carry)` once to compile, then `iters` times; median wall seconds per call.

    The carry is threaded through so that donated buffers (KV caches) are never reused.
    """
    carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def step_loop(
    step: Callable[..., Any], iters: int, num_params: int = 0
) -> Callable[[Any, tuple, jax.Array], Any]:
    """jit((carry, inputs, zero) -> carry after `iters` steps `carry = step(carry, *inputs)` in one
    `lax.fori_loop`), carry donated; `zero` must be a runtime int32 0.

    Every integer leaf of `inputs` (tokens, lengths, tree structure, prompt history) reaches the step as
    `leaf + zero * i` (i the loop counter): the same values, but XLA cannot prove them loop-invariant,
    so it cannot hoist work that does not depend on the carry (a drafter without state, the first
    layer's projections of fixed tokens) out of the loop. (An optimization barrier does not stop that on
    XLA:CPU.) Float leaves (weights) stay invariant, as they are in the compiled generate loop, and so
    does every leaf of the first `num_params` inputs (parameters: weights and integer tables alike, such
    as a head's token maps or a datastore's 8 M keys, whose offsetting would itself cost a pass over
    them in every step).
    """

    def run(carry, inputs, zero):
        def body(i, c):
            offset = zero * i
            fresh = jax.tree.map(
                lambda x: x + offset.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else x,
                inputs[num_params:],
            )
            return step(c, *inputs[:num_params], *fresh)

        return jax.lax.fori_loop(0, iters, body, carry)

    return jax.jit(run, donate_argnums=0)


def median_loop_step_time(
    step: Callable[..., Any],
    carry: Any,
    inputs: tuple = (),
    *,
    iters: int,
    repeats: int = 5,
    num_params: int = 0,
) -> float:
    """Median seconds per step when `iters` steps `carry = step(carry, *inputs)` run inside one
    compiled `lax.fori_loop` (timed `repeats` times after a compiling run).

    This is what a step costs inside the compiled generate loop. Everything the step computes must reach
    its returned carry: XLA removes work whose result leaves the loop nowhere. Timing separate jitted
    calls instead adds the host's dispatch cost to every call (~10 ms per call for these steps on a
    2-core CPU), which inflates small steps more than large ones and so biases v = verify / decode
    towards 1. `step_loop` keeps XLA from hoisting loop-invariant parts of a step out of the loop.
    """

    loop = step_loop(step, iters, num_params)
    zero = jnp.zeros((), jnp.int32)
    carry = jax.block_until_ready(loop(carry, inputs, zero))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        carry = jax.block_until_ready(loop(carry, inputs, zero))
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def paired_loop_step_times(
    loops: dict[str, Callable[[Any, tuple, jax.Array], Any]],
    carries: dict[str, Any],
    inputs: tuple,
    *,
    iters: int,
    rounds: int,
) -> dict[str, list[float]]:
    """Seconds per step of each compiled `step_loop` (name -> loop, each run once already: `carries`
    holds what that run returned), timed in turn for `rounds` rounds, so a drifting machine load hits
    every variant alike: name -> one time per round (pair them by index)."""
    zero = jnp.zeros((), jnp.int32)
    carries = dict(carries)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            start = time.perf_counter()
            carries[name] = jax.block_until_ready(loop(carries[name], inputs, zero))
            times[name].append((time.perf_counter() - start) / iters)
    return times


@functools.partial(jax.jit, static_argnames=("drafter",), donate_argnames=("state",))
def _propose(drafter, draft_params, params, state, ctx: RoundContext):
    """One draft round -> (tree, drafter state)."""
    return drafter.propose(draft_params, params, state, ctx)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "spec", "max_depth", "capture_layers"), donate_argnames=("cache",)
)
def _verify(graphdef, params, cache: KVCache, tree: DraftTree, requests: Requests, *, spec: SpecConfig,
            max_depth: int, capture_layers: tuple[int, ...]):  # fmt: skip
    """Target side of one round over the tree: forward, LM head, logits processing, verification.

    Writes the tree window of the cache but does not advance its lengths (repeatable)."""
    hidden, _, cache = model_forward(
        graphdef, params, tree.tokens, tree_positions(tree, cache.lengths), cache, ancestor_mask(tree),
        attention=spec.attention, capture_layers=capture_layers,
    )  # fmt: skip
    probs = sampling.process_logits(lm_logits(graphdef, params, hidden), requests.sampling)
    keys = sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_ACCEPT)
    result = sampling.verify_tree(tree, probs, keys, mode=spec.acceptance, max_depth=max_depth)
    return cache, result.next_token


@functools.partial(jax.jit, static_argnames=("graphdef", "attention"), donate_argnames=("cache",))
def _decode(graphdef, params, cache: KVCache, token: jax.Array, requests: Requests, *, attention: str):
    """One autoregressive step for token [B]: forward over 1 node, LM head, sampling (lengths kept)."""
    one_node = jnp.ones((token.shape[0], 1, 1), bool)
    hidden, _, cache = model_forward(
        graphdef, params, token[:, None], cache.lengths[:, None], cache, one_node, attention=attention
    )
    probs = sampling.process_logits(lm_logits(graphdef, params, hidden[:, 0]), requests.sampling)
    keys = sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_BONUS)
    return cache, sampling.sample_from_probs(probs, keys)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "max_len", "attention", "capture_layers"))
def _prefill(graphdef, params, requests: Requests, *, config, max_len: int, attention: str,
             capture_layers: tuple[int, ...]) -> PrefillResult:  # fmt: skip
    return prefill(
        graphdef, params, config, requests, max_len, attention=attention, capture_layers=capture_layers
    )


def round_context(requests: Requests, pre: PrefillResult, prompt_len: int, capacity: int) -> RoundContext:
    """The context of round 1 after a prefill: history = prompt + first token."""
    bucket = requests.prompt_tokens.shape[1]
    history = jnp.zeros((1, bucket + capacity), jnp.int32)
    history = history.at[:, :bucket].set(requests.prompt_tokens)
    history = history.at[0, prompt_len].set(pre.first_token[0])
    return RoundContext(
        history=history,
        history_len=requests.prompt_lengths + 1,
        cache_lengths=pre.cache.lengths,
        keys=sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_DRAFT),
        sampling=requests.sampling,
    )


def measure_step_costs(
    model,
    spec: SpecConfig | None,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 128,
    sampling_params: SamplingParams | None = None,
    iters: int = 10,
) -> StepCosts:
    """Time the prefill, the decode step, the verify step and the draft round of `spec` (None or
    method None: autoregressive, no draft) after a real prefill of `prompt_ids` (batch 1, shapes as
    `jaxspec.generate` would bucket them)."""
    from jaxspec.drafters.make import make_drafter

    spec = spec or SpecConfig()
    requests = single_request(prompt_ids, max_new_tokens, sampling_params or SamplingParams())
    speculative = spec.method is not None
    drafter, draft_params = make_drafter(model, spec) if speculative else (None, ())
    depth, nodes = (drafter.max_depth, drafter.num_nodes) if speculative else (1, 1)
    bucket = requests.prompt_tokens.shape[1]
    capacity = length_bucket(max_new_tokens) + depth + 1
    # Bucketed so that variants with similar trees share the compiled prefill and decode steps.
    max_len = bucket + length_bucket(max_new_tokens) + length_bucket(nodes + 2 * (depth + 1))
    graphdef, params = model.graphdef, model.params
    layers = tuple(drafter.capture_layers) if speculative else ()

    def fresh_prefill() -> PrefillResult:
        return _prefill(
            graphdef, params, requests, config=model.config, max_len=max_len, attention=spec.attention,
            capture_layers=layers,
        )  # fmt: skip

    prefill_s = median_call_time(lambda _: fresh_prefill().first_token, None, max(iters // 3, 1))
    pre = fresh_prefill()
    token = pre.first_token
    # Steps carry their sampled/verified token as well as the cache: an output that leaves the loop
    # nowhere would be dead code to XLA (the LM head, sampling and verification would not be timed).
    decode_s = median_loop_step_time(
        lambda carry, params, token, requests: _decode(
            graphdef, params, carry[0], token, requests, attention=spec.attention
        ),
        _decode(graphdef, params, fresh_prefill().cache, token, requests, attention=spec.attention),
        (params, token, requests),
        iters=iters,
        num_params=1,
    )
    if not speculative:
        return StepCosts(prefill_s=prefill_s, decode_s=decode_s, verify_s=decode_s, draft_s=0.0,
                         num_nodes=1, gamma=1)  # fmt: skip
    ctx = round_context(requests, pre, len(prompt_ids), capacity)
    state = jax.jit(drafter.init, static_argnums=4)(draft_params, params, pre, requests, max_len)
    tree, state = _propose(drafter, draft_params, params, state, ctx)
    draft_s = median_loop_step_time(
        lambda carry, draft_params, params, ctx: _propose(drafter, draft_params, params, carry[1], ctx),
        (jax.tree.map(jnp.copy, tree), state),  # the loop donates its carry; `tree` is verified below
        (draft_params, params, ctx),
        iters=iters,
        num_params=2,
    )
    verify = functools.partial(
        _verify, graphdef, spec=spec, max_depth=drafter.max_depth, capture_layers=layers
    )
    verify_s = median_loop_step_time(
        lambda carry, params, tree, requests: verify(params, carry[0], tree, requests),
        verify(params, fresh_prefill().cache, tree, requests),
        (params, tree, requests),
        iters=iters,
        num_params=1,
    )
    return StepCosts(
        prefill_s=prefill_s, decode_s=decode_s, verify_s=verify_s, draft_s=draft_s, num_nodes=nodes,
        gamma=depth,
    )  # fmt: skip


def chain_tree(batch: int, nodes: int) -> DraftTree:
    """A chain of `nodes` nodes per row (node i's parent is i - 1), tokens 1..nodes."""
    idx = jnp.arange(nodes, dtype=jnp.int32)
    return DraftTree(
        tokens=jnp.broadcast_to(idx + 1, (batch, nodes)),
        parent=jnp.broadcast_to(idx - 1, (batch, nodes)),
        depth=jnp.broadcast_to(idx, (batch, nodes)),
        valid=jnp.ones((batch, nodes), bool),
    )


def forward_step_times(
    graphdef,
    params,
    config,
    *,
    batch: int,
    prefix: int,
    nodes: Sequence[int],
    attention: str = "auto",
    iters: int = 10,
    repeats: int = 3,
) -> dict[str, Any]:
    """Decode and verify step times at a synthetic state, each timed inside one compiled loop.

    The cache holds `prefix` committed positions per row (zeros: attention cost does not depend on
    the values); verify runs over a chain of N nodes for each N in `nodes` (the forward's cost depends
    on N, not on the tree's shape), with exact verification (greedy rows). Returns {"decode_s": float,
    "verify_s": {N: float}, "v": {N: verify_s[N] / decode_s}}.
    """
    max_len = prefix + length_bucket(max(nodes) + 1)
    dtype = jax.tree.leaves(params)[0].dtype
    requests = Requests(
        prompt_tokens=jnp.ones((batch, 16), jnp.int32),
        prompt_lengths=jnp.full((batch,), 16, jnp.int32),
        max_new_tokens=jnp.full((batch,), 128, jnp.int32),
        seeds=jnp.zeros((batch,), jnp.int32),
        request_ids=jnp.arange(batch, dtype=jnp.int32),
        sampling=sampling.SamplingArrays.from_params(SamplingParams(), batch),
    )

    def fresh_cache() -> KVCache:
        cache = KVCache.zeros(config, batch, max_len, dtype)
        return dataclasses.replace(cache, lengths=jnp.full((batch,), prefix, jnp.int32))

    token = jnp.ones((batch,), jnp.int32)
    decode_s = median_loop_step_time(
        lambda carry, params, token, requests: _decode(
            graphdef, params, carry[0], token, requests, attention=attention
        ),
        (fresh_cache(), jnp.ones((batch,), jnp.int32)),  # the loop donates its carry
        (params, token, requests),
        iters=iters,
        repeats=repeats,
        num_params=1,
    )
    spec = SpecConfig(attention=attention)
    verify_s = {}
    for n in nodes:
        verify = functools.partial(_verify, graphdef, spec=spec, max_depth=max(n - 1, 1), capture_layers=())
        verify_s[n] = median_loop_step_time(
            lambda carry, params, tree, requests, verify=verify: verify(params, carry[0], tree, requests),
            (fresh_cache(), jnp.ones((batch,), jnp.int32)),  # the loop donates its carry
            (params, chain_tree(batch, n), requests),
            iters=iters,
            repeats=repeats,
            num_params=1,
        )
    return {"decode_s": decode_s, "verify_s": verify_s, "v": {n: t / decode_s for n, t in verify_s.items()}}
