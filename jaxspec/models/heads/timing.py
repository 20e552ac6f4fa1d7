"""Timing a head's draft step against the target's verify step (for benchmarks).

`draft_step_fn(model, spec)` prepares one speculative round after a prefill and returns two jitted,
blocking callables: `draft()` runs drafter.propose (the whole draft loop of one round) and `target()`
runs the target's verify forward over the same number of tree nodes plus its logits processing. The
benchmark command reports their medians (`time_draft_and_target`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.forward import lm_logits, model_forward
from jaxspec.prefill import Requests, prefill
from jaxspec.spec import sampling
from jaxspec.spec.drafters import make_drafter
from jaxspec.spec.round_context import RoundContext
from jaxspec.spec.tree import ancestor_mask, tree_positions


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    draft: Callable[[], object]
    target: Callable[[], object]
    num_nodes: int


def draft_step_fn(
    model, spec: SpecConfig, *, batch: int = 1, prompt_len: int = 64, seed: int = 0
) -> StepFunctions:
    """Jitted draft and verify steps of one round for `batch` random prompts of `prompt_len` tokens."""
    drafter, draft_params = make_drafter(model, spec)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, prompt_len)), jnp.int32)
    requests = Requests(
        prompt_tokens=tokens,
        prompt_lengths=jnp.full((batch,), prompt_len, jnp.int32),
        max_new_tokens=jnp.full((batch,), 64, jnp.int32),
        seeds=jnp.arange(batch, dtype=jnp.int32),
        request_ids=jnp.arange(batch, dtype=jnp.int32),
        sampling=sampling.SamplingArrays.from_params(SamplingParams(), batch),
    )
    max_len = prompt_len + 2 * drafter.num_nodes + 8

    @jax.jit
    def start(params, draft_params, requests):
        pre = prefill(
            model.graphdef,
            params,
            model.config,
            requests,
            max_len,
            attention=spec.attention,
            capture_layers=drafter.capture_layers,
        )
        state = drafter.init(draft_params, params, pre, requests, max_len)
        history = jnp.concatenate([requests.prompt_tokens, pre.first_token[:, None]], axis=1)
        ctx = RoundContext(
            history=history,
            history_len=requests.prompt_lengths + 1,
            cache_lengths=pre.cache.lengths,
            keys=sampling.derive_key(requests.seeds, requests.request_ids, 1, sampling.PURPOSE_DRAFT),
            sampling=requests.sampling,
        )
        return pre.cache, state, ctx

    cache, state, ctx = start(model.params, draft_params, requests)

    @jax.jit
    def draft_step(draft_params, params, state, ctx):
        tree, _ = drafter.propose(draft_params, params, state, ctx)
        return tree

    tree = draft_step(draft_params, model.params, state, ctx)

    @jax.jit
    def target_step(params, tree, cache, processor):
        hidden, _, _ = model_forward(
            model.graphdef,
            params,
            tree.tokens,
            tree_positions(tree, cache.lengths),
            cache,
            ancestor_mask(tree),
            attention=spec.attention,
            capture_layers=drafter.capture_layers,
        )
        return sampling.process_logits(lm_logits(model.graphdef, params, hidden), processor)

    def draft():
        return jax.block_until_ready(draft_step(draft_params, model.params, state, ctx))

    def target():
        return jax.block_until_ready(target_step(model.params, tree, cache, requests.sampling))

    return StepFunctions(draft=draft, target=target, num_nodes=drafter.num_nodes)


def time_draft_and_target(
    model, spec: SpecConfig, *, batch: int = 1, prompt_len: int = 64, repeats: int = 10
):
    """Median milliseconds of one draft step and one target verify step (compile excluded)."""
    steps = draft_step_fn(model, spec, batch=batch, prompt_len=prompt_len)
    result = {}
    for name, fn in (("draft_ms", steps.draft), ("target_ms", steps.target)):
        fn()  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        result[name] = statistics.median(times)
    result["draft_over_target"] = result["draft_ms"] / result["target_ms"]
    result["num_nodes"] = steps.num_nodes
    return result
