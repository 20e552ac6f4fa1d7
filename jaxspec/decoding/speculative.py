"""The speculative engine: prefill, then draft -> one verify forward -> accept -> commit, repeated in
one jitted `lax.while_loop` (one compiled program per batch bucket, length bucket and method config).
"""

from __future__ import annotations

import dataclasses
import functools
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
from jaxspec.sampling.tree import ancestor_mask, gather_nodes, tree_positions
from jaxspec.sampling.verify import emitted_tokens
from jaxspec.sharding import constrain_cache, constrain_caches, shard_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    """Loop carry. history [B, H] (prompt + emitted), history_len [B]; rounds [B] verify forwards per
    row; accepted_by_depth [B, D] how often the draft at depth d+1 was accepted; round_idx scalar."""

    cache: KVCache
    out: OutputBuffer
    history: jax.Array
    history_len: jax.Array
    drafter_state: Any
    rounds: jax.Array
    accepted_by_depth: jax.Array
    round_idx: jax.Array


def write_history(history: jax.Array, history_len: jax.Array, tokens: jax.Array) -> jax.Array:
    """Write tokens [B, K] at history_len; the caller advances history_len by the number kept."""
    return jax.vmap(lambda h, t, at: jax.lax.dynamic_update_slice(h, t, (at,)))(
        history, tokens.astype(jnp.int32), history_len
    )


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
    batch, prompt_len = requests.prompt_tokens.shape
    depth = drafter.max_depth
    n_nodes = drafter.num_nodes
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    pre = prefill(
        graphdef, params, config, requests, max_len,
        attention=spec.attention, capture_layers=drafter.capture_layers, mesh=mesh,
    )  # fmt: skip
    out = first_output(pre.first_token, capacity, requests.max_new_tokens, eos, stream)
    history = jnp.zeros((batch, prompt_len + capacity), jnp.int32)
    history = history.at[:, :prompt_len].set(requests.prompt_tokens)
    history = write_history(history, requests.prompt_lengths, pre.first_token[:, None])
    state = SpecState(
        cache=pre.cache,
        out=out,
        history=history,
        history_len=requests.prompt_lengths + 1,
        drafter_state=constrain_caches(drafter.init(draft_params, params, pre, requests, max_len), mesh),
        rounds=jnp.zeros((batch,), jnp.int32),
        accepted_by_depth=jnp.zeros((batch, depth), jnp.int32),
        round_idx=jnp.int32(1),
    )

    def one_round(s: SpecState) -> SpecState:
        active = ~s.out.done
        ctx = RoundContext(
            history=s.history,
            history_len=s.history_len,
            cache_lengths=s.cache.lengths,
            keys=sampling.derive_key(
                requests.seeds, requests.request_ids, s.round_idx, sampling.PURPOSE_DRAFT
            ),
            sampling=requests.sampling,
        )
        tree, drafter_state = drafter.propose(draft_params, params, s.drafter_state, ctx)
        hidden, captured, cache = model_forward(
            graphdef, params, tree.tokens, tree_positions(tree, s.cache.lengths), s.cache,
            ancestor_mask(tree), attention=spec.attention, capture_layers=drafter.capture_layers,
            mesh=mesh,
        )  # fmt: skip
        target_probs = sampling.process_logits(lm_logits(graphdef, params, hidden), requests.sampling)
        # verify_tree folds in its own purposes (accept coins, residual, bonus) onto the round key.
        accept_keys = sampling.round_key(requests.seeds, requests.request_ids, s.round_idx)
        result = sampling.verify_tree(
            tree, target_probs, accept_keys, mode=spec.acceptance, max_depth=depth,
            posterior_threshold=spec.posterior_threshold, posterior_alpha=spec.posterior_alpha,
        )  # fmt: skip
        num_accepted = jnp.where(active, result.num_accepted, 0)
        cache = commit_path(cache, result.path, jnp.where(active, num_accepted + 1, 0), window=n_nodes)
        cache = constrain_cache(cache, mesh)
        emitted = emitted_tokens(result, num_accepted, pad=0)
        out, _ = append_tokens(s.out, emitted, num_accepted + 1, requests.max_new_tokens, eos)
        if stream:
            stream_first_row(out)
        history = write_history(s.history, s.history_len, emitted)
        history_len = s.history_len + jnp.where(active, num_accepted + 1, 0)
        features = {
            "hidden": gather_nodes(hidden, result.path),
            "captured": tuple(gather_nodes(c, result.path) for c in captured),
        }
        drafter_state = drafter.update(
            draft_params, params, drafter_state, ctx, tree, result, features, active
        )
        drafter_state = constrain_caches(drafter_state, mesh)
        by_depth = (jnp.arange(depth)[None, :] < num_accepted[:, None]) & active[:, None]
        return SpecState(
            cache=cache,
            out=out,
            history=history,
            history_len=history_len,
            drafter_state=drafter_state,
            rounds=s.rounds + active.astype(jnp.int32),
            accepted_by_depth=s.accepted_by_depth + by_depth.astype(jnp.int32),
            round_idx=s.round_idx + 1,
        )

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), one_round, state)
    return state.out, state.rounds, state.accepted_by_depth


def generate_speculative(
    model, requests: Requests, spec: SpecConfig, prompt_len: int, new_bucket: int, stream: bool = False
):
    """Run the speculative loop for a bucketed batch; returns (out, rounds, extra per-row stats)."""
    drafter, draft_params = make_drafter(model, spec)
    if model.mesh is not None:  # draft / head weights follow the same rules table as the target's
        own_config = getattr(drafter, "config", None)  # an independent draft model's ModelConfig
        draft_config = own_config if isinstance(own_config, ModelConfig) else model.config
        draft_params = shard_params(draft_params, model.mesh, config=draft_config)
    slack = drafter.max_depth + 1
    capacity = new_bucket + slack
    max_len = prompt_len + capacity + drafter.num_nodes + slack
    out, rounds, by_depth = speculative_loop(
        model.graphdef, model.params, draft_params, requests,
        config=model.config, drafter=drafter, spec=spec, max_len=max_len, capacity=capacity,
        eos_ids=model.eos_token_ids, mesh=model.mesh, stream=stream,
    )  # fmt: skip
    return out, rounds, {"accepted_by_depth": by_depth}
