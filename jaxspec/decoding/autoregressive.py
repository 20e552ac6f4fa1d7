"""Plain autoregressive decoding: prefill, then one token per step inside one jitted while_loop."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxspec import sampling
from jaxspec.decoding.output_buffer import OutputBuffer, append_tokens, first_output, stream_first_row
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import live_attention_for
from jaxspec.sharding import constrain_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Carried through the while_loop: cache, pending token [B] (emitted, KV not yet written),
    output buffer and the step counter (scalar; step s draws keys of round s)."""

    cache: KVCache
    pending: jax.Array
    out: OutputBuffer
    step: jax.Array


def autoregressive_buffer_sizes(prompt_len: int, new_bucket: int) -> tuple[int, int]:
    """(output capacity, cache max_len) of an autoregressive run over prompts padded to prompt_len with
    budgets up to new_bucket: the budget plus the prefill's first token, after the prompt."""
    capacity = new_bucket + 1
    return capacity, prompt_len + capacity


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "config", "max_len", "capacity", "eos_ids", "attention", "mesh", "stream"),
)
def generate_autoregressive(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    requests: Requests,
    *,
    config: ModelConfig,
    max_len: int,
    capacity: int,
    eos_ids: tuple[int, ...],
    attention: str = "auto",
    mesh: Mesh | None = None,
    stream: bool = False,
) -> tuple[OutputBuffer, jax.Array]:
    """Prefill + decode loop, one compiled program per (batch, prompt, length) bucket.

    Returns the output buffer ([B, capacity] tokens, counts, EOS flags) and steps [B], the number of
    target forwards each row used after prefill. mesh: keep the KV cache sharded over it (None = one
    device). stream: hand row 0's tokens to the host after every step (`output_buffer.streaming_to`).
    """
    batch = requests.prompt_tokens.shape[0]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    pre = prefill(graphdef, params, config, requests, max_len, attention=attention, mesh=mesh)
    out = first_output(pre.first_token, capacity, requests.max_new_tokens, eos, stream)
    one_node_mask = jnp.ones((batch, 1, 1), dtype=bool)

    def step(state: DecodeState) -> DecodeState:
        positions = state.cache.lengths[:, None]
        hidden, _, cache = model_forward(
            graphdef, params, state.pending[:, None], positions, state.cache, one_node_mask,
            attention=attention, mesh=mesh, attend=live_attention_for(attention),
        )  # fmt: skip
        cache = constrain_cache(dataclasses.replace(cache, lengths=cache.lengths + 1), mesh)
        keys = sampling.derive_key(requests.seeds, requests.request_ids, state.step, sampling.PURPOSE_BONUS)
        token = sampling.sample_logits(lm_logits(graphdef, params, hidden[:, 0]), requests.sampling, keys)
        out, _ = append_tokens(state.out, token[:, None], jnp.ones((batch,), jnp.int32),
                               requests.max_new_tokens, eos)  # fmt: skip
        if stream:
            stream_first_row(out)
        return DecodeState(cache=cache, pending=token, out=out, step=state.step + 1)

    state = DecodeState(cache=pre.cache, pending=pre.first_token, out=out, step=jnp.int32(1))
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), step, state)
    return state.out, jnp.maximum(state.out.count - 1, 0)
