"""The speculative engine: prefill, then draft -> one verify forward -> accept -> commit, repeated in
one jitted `lax.while_loop` (one compiled program per batch bucket, length bucket and method config).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxspec import sampling
from jaxspec.config import SpecConfig
from jaxspec.decoding.output_buffer import OutputBuffer, append_tokens, first_output, stream_first_row
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.drafters.make import make_drafter
from jaxspec.drafters.protocol import Drafter, RoundContext
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache, commit_path
from jaxspec.model.live_attention import live_attention_for
from jaxspec.sampling.tree import ancestor_mask, gather_nodes, tree_positions
from jaxspec.sampling.verify import emitted_tokens
from jaxspec.sharding import constrain_cache, constrain_caches, shard_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftRows:
    """Each row's speculative state besides its target cache and output (B rows, D = draft depth).

    history [B, H]: prompt + emitted tokens; history_len [B]; drafter_state: the drafter's (rows lead
    every leaf); rounds [B]: verify forwards so far; accepted_by_depth [B, D]: how often the draft at
    depth d + 1 was accepted; round_idx [B]: the round whose keys the row draws next (1 after prefill:
    prefill drew round 0), so a row's randomness depends only on its own request and progress.
    """

    history: jax.Array
    history_len: jax.Array
    drafter_state: Any
    rounds: jax.Array
    accepted_by_depth: jax.Array
    round_idx: jax.Array

    @classmethod
    def after_prefill(
        cls, requests: Requests, first_token: jax.Array, width: int, drafter_state: Any, depth: int
    ) -> DraftRows:
        """Rows just prefilled: history [B, width] = prompt (requests.prompt_tokens [B, P], P <= width)
        + first_token [B], no rounds yet, round 1 next."""
        batch, prompt_len = requests.prompt_tokens.shape
        history = jnp.zeros((batch, width), jnp.int32).at[:, :prompt_len].set(requests.prompt_tokens)
        history = write_history(history, requests.prompt_lengths, first_token[:, None])
        return cls(
            history=history,
            history_len=requests.prompt_lengths + 1,
            drafter_state=drafter_state,
            rounds=jnp.zeros((batch,), jnp.int32),
            accepted_by_depth=jnp.zeros((batch, depth), jnp.int32),
            round_idx=jnp.ones((batch,), jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Carry of speculative rounds: the target cache [B, ...], the output buffer [B, T] and the rows'
    draft state."""

    cache: KVCache
    out: OutputBuffer
    draft: DraftRows


def write_history(history: jax.Array, history_len: jax.Array, tokens: jax.Array) -> jax.Array:
    """Write tokens [B, K] at history_len; the caller advances history_len by the number kept."""
    return jax.vmap(lambda h, t, at: jax.lax.dynamic_update_slice(h, t, (at,)))(
        history, tokens.astype(jnp.int32), history_len
    )


def speculative_round(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    draft_params: Any,
    requests: Requests,
    state: SpecState,
    *,
    drafter: Drafter,
    spec: SpecConfig,
    eos: jax.Array,
    mesh: Mesh | None = None,
    stream: bool = False,
    attend: Callable | None = None,
) -> SpecState:
    """One speculative round for every row of `state` (the one implementation both the speculative
    loop and continuous batching run): drafter.propose -> one target forward over the draft tree ->
    `sampling.verify_tree` -> commit the accepted path's KV -> append the emitted tokens -> history ->
    drafter.update.

    requests: the rows' requests (seeds, request_ids, sampling, max_new_tokens [B]; prompts unused).
    Row b draws its draft and verify keys for round state.draft.round_idx[b] of (seed, request id), so
    its tokens do not depend on the other rows. Rows whose output is done commit and emit nothing.
    eos: [E] stop ids. mesh: keep the caches sharded over it; stream: hand row 0's tokens to the host;
    attend: the verify forward's attention (`model_forward`), None = spec.attention's.
    Returns the state after the round (round_idx + 1 for every row).
    """
    depth = drafter.max_depth
    d = state.draft
    active = ~state.out.done
    ctx = RoundContext(
        history=d.history,
        history_len=d.history_len,
        cache_lengths=state.cache.lengths,
        keys=sampling.derive_key(requests.seeds, requests.request_ids, d.round_idx, sampling.PURPOSE_DRAFT),
        sampling=requests.sampling,
    )
    tree, drafter_state = drafter.propose(draft_params, params, d.drafter_state, ctx)
    hidden, captured, cache = model_forward(
        graphdef, params, tree.tokens, tree_positions(tree, state.cache.lengths), state.cache,
        ancestor_mask(tree), attention=spec.attention, capture_layers=drafter.capture_layers, mesh=mesh,
        attend=attend,
    )  # fmt: skip
    target_probs = sampling.process_logits(lm_logits(graphdef, params, hidden), requests.sampling)
    # verify_tree folds in its own purposes (accept coins, residual, bonus) onto the round key.
    accept_keys = sampling.round_key(requests.seeds, requests.request_ids, d.round_idx)
    result = sampling.verify_tree(
        tree, target_probs, accept_keys, mode=spec.acceptance, max_depth=depth,
        posterior_threshold=spec.posterior_threshold, posterior_alpha=spec.posterior_alpha,
    )  # fmt: skip
    num_accepted = jnp.where(active, result.num_accepted, 0)
    cache = commit_path(cache, result.path, jnp.where(active, num_accepted + 1, 0), window=drafter.num_nodes)
    cache = constrain_cache(cache, mesh)
    emitted = emitted_tokens(result, num_accepted, pad=0)
    out, _ = append_tokens(state.out, emitted, num_accepted + 1, requests.max_new_tokens, eos)
    if stream:
        stream_first_row(out)
    history = write_history(d.history, d.history_len, emitted)
    history_len = d.history_len + jnp.where(active, num_accepted + 1, 0)
    features = {
        "hidden": gather_nodes(hidden, result.path),
        "captured": tuple(gather_nodes(c, result.path) for c in captured),
    }
    drafter_state = drafter.update(draft_params, params, drafter_state, ctx, tree, result, features, active)
    drafter_state = constrain_caches(drafter_state, mesh)
    by_depth = (jnp.arange(depth)[None, :] < num_accepted[:, None]) & active[:, None]
    draft = DraftRows(
        history=history,
        history_len=history_len,
        drafter_state=drafter_state,
        rounds=d.rounds + active.astype(jnp.int32),
        accepted_by_depth=d.accepted_by_depth + by_depth.astype(jnp.int32),
        round_idx=d.round_idx + 1,
    )
    return SpecState(cache=cache, out=out, draft=draft)


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "config",
        "drafter",
        "spec",
        "max_len",
        "capacity",
        "eos_ids",
        "mesh",
        "stream",
    ),
)
def speculative_loop(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    draft_params: Any,
    requests: Requests,
    *,
    config: ModelConfig,
    drafter: Drafter,
    spec: SpecConfig,
    max_len: int,
    capacity: int,
    eos_ids: tuple[int, ...],
    mesh: Mesh | None = None,
    stream: bool = False,
) -> tuple[OutputBuffer, jax.Array, jax.Array]:
    """Prefill + speculative rounds. Returns (output buffer, rounds [B], accepted_by_depth [B, D]).

    mesh: keep the target's KV cache (and any KVCache in the drafter state) sharded over it every
    round; None = one device. stream: hand row 0's tokens to the host after every round
    (`output_buffer.streaming_to`).
    """
    prompt_len = requests.prompt_tokens.shape[1]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    pre = prefill(
        graphdef, params, config, requests, max_len,
        attention=spec.attention, capture_layers=drafter.capture_layers, mesh=mesh,
    )  # fmt: skip
    drafter_state = constrain_caches(drafter.init(draft_params, params, pre, requests, max_len), mesh)
    state = SpecState(
        cache=pre.cache,
        out=first_output(pre.first_token, capacity, requests.max_new_tokens, eos, stream),
        draft=DraftRows.after_prefill(
            requests, pre.first_token, prompt_len + capacity, drafter_state, drafter.max_depth
        ),
    )

    def one_round(s: SpecState) -> SpecState:
        return speculative_round(
            graphdef, params, draft_params, requests, s,
            drafter=drafter, spec=spec, eos=eos, mesh=mesh, stream=stream,
            attend=live_attention_for(spec.attention),
        )  # fmt: skip

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), one_round, state)
    return state.out, state.draft.rounds, state.draft.accepted_by_depth


def spec_buffer_sizes(drafter: Drafter, prompt_len: int, new_bucket: int) -> tuple[int, int]:
    """(output capacity, cache max_len) of a speculative run: the last round may write depth + 1 tokens
    past the budget, and the verify forward writes num_nodes keys past the committed ones."""
    slack = drafter.max_depth + 1
    capacity = new_bucket + slack
    return capacity, prompt_len + capacity + drafter.num_nodes + slack


def generate_speculative(
    model, requests: Requests, spec: SpecConfig, prompt_len: int, new_bucket: int, stream: bool = False
):
    """Run the speculative loop for a bucketed batch; returns (out, rounds, extra per-row stats)."""
    drafter, draft_params = make_drafter(model, spec)
    if model.mesh is not None:  # draft / head weights follow the same rules table as the target's
        own_config = getattr(drafter, "config", None)  # an independent draft model's ModelConfig
        draft_config = own_config if isinstance(own_config, ModelConfig) else model.config
        draft_params = shard_params(draft_params, model.mesh, config=draft_config)
    capacity, max_len = spec_buffer_sizes(drafter, prompt_len, new_bucket)
    out, rounds, by_depth = speculative_loop(
        model.graphdef, model.params, draft_params, requests,
        config=model.config, drafter=drafter, spec=spec, max_len=max_len, capacity=capacity,
        eos_ids=model.eos_token_ids, mesh=model.mesh, stream=stream,
    )  # fmt: skip
    return out, rounds, {"accepted_by_depth": by_depth}
