"""Prefill: run the padded prompts through the target as a causal chain and sample the first token.

Where attention runs through a Pallas kernel (TPU/GPU, or attention="pallas"), the prompt goes through
in chunks of PREFILL_CHUNK tokens inside one `lax.scan`: each chunk attends to the cache prefix written
by the chunks before it plus itself under a causal [C, C] mask, through the same tree-attention kernel
that decode and verify use. A kernel program then holds at most G * C query rows and a [G * C, C]
mask whatever the prompt length, so its VMEM / shared-memory footprint is bounded (see
`pallas_kernels.tpu.launch_vmem_bytes`); the whole prompt as one "tree" of P nodes would need
O(G * P^2) bytes per program (~64 MiB at P = 2048 for Llama-3-8B). Why chunks and not a dedicated
causal flash-attention kernel: one kernel source for prefill, decode and verify (one thing to tune and
test, one VMEM bound), and chunked prefill of a new request into a running batch's slots is the same
call (prefix of other tokens plus a causal chunk), which a from-scratch causal kernel cannot serve.
The cost is re-reading the prefix once per chunk: ~P^2 / (2C) K/V positions per layer: at P = 32k for
Llama-3-8B ~550 GB, ~0.1 s of H200 bandwidth, against ~0.85 s of weight streaming for the 256 chunks.
The jnp reference path (the CPU default) keeps one forward over the whole prompt.

A prefix that every prompt of a run shares (a chat template's system turn) can be prefilled once
(`prefill_shared_prefix`) and handed to `prefill`: its keys/values are copied into each row and only
the rest of each prompt runs through the target, as vLLM's and SGLang's prefix caches do. The result is
the one a full prefill gives (the prefix's keys/values and hidden states depend on the prefix alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxspec import sampling
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import causal_mask, last_valid, lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import prompt_attention_for, runs_reference
from jaxspec.sharding import constrain_cache

PREFILL_CHUNK = 128  # prompt tokens per forward on kernel paths


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Requests:
    """Per-row request data of one compiled batch (all arrays [B] unless stated).

    prompt_tokens: [B, P] int32 left-aligned prompts, padded with 0.
    prompt_lengths: prompt length per row (>= 1); padding rows use 1.
    max_new_tokens: per-row budget of new tokens.
    seeds, request_ids: inputs of the stateless key derivation.
    sampling: per-row logits-processing parameters.
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    max_new_tokens: jax.Array
    seeds: jax.Array
    request_ids: jax.Array
    sampling: sampling.SamplingArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillResult:
    """cache: prompts committed (lengths = prompt lengths); first_token [B]; hidden [B, P, d] final
    hidden states of the prompt; captured: chosen layers' outputs, each [B, P, d]."""

    cache: KVCache
    first_token: jax.Array
    hidden: jax.Array
    captured: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedPrefix:
    """A prompt prefix of L tokens that every prompt of a run starts with, prefilled once.

    cache: the prefix's keys/values, a `KVCache` of one row and max_len = L (lengths [1] = L);
    hidden [1, L, d]: its final hidden states; captured: chosen layers' outputs, each [1, L, d].
    """

    cache: KVCache
    hidden: jax.Array
    captured: tuple[jax.Array, ...]

    @property
    def length(self) -> int:
        return self.cache.max_len


def longest_shared_prefix(token_lists: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, at most the shortest prompt's length - 1 (each prompt keeps at
    least its last token to prefill, whose logits give the first new token)."""
    shortest = min(len(t) for t in token_lists)
    first = token_lists[0]
    length = 0
    while length < shortest - 1 and all(t[length] == first[length] for t in token_lists):
        length += 1
    return length


def prefill_shared_prefix(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    config: ModelConfig,
    tokens: jax.Array,
    *,
    attention: str = "auto",
    capture_layers: tuple[int, ...] = (),
) -> SharedPrefix:
    """tokens [L] (the shared prefix) through the target once: its keys/values, hidden states and
    captured layers, for `prefill(..., prefix=...)` to start every row from."""
    tokens = tokens[None, :]
    cache = jax.lax.optimization_barrier(KVCache.zeros(config, 1, tokens.shape[1], params_dtype(params)))
    chunk = prefill_chunk_size(attention, tokens.shape[1])
    hidden, captured, cache = _prompt_forward(
        graphdef, params, tokens, cache, 0, chunk, attention=attention, capture_layers=capture_layers,
        mesh=None,
    )  # fmt: skip
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), tokens.shape[1], jnp.int32))
    return SharedPrefix(cache=cache, hidden=hidden, captured=captured)


def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    config: ModelConfig,
    requests: Requests,
    max_len: int,
    *,
    attention: str = "auto",
    capture_layers: tuple[int, ...] = (),
    mesh: Mesh | None = None,
    chunk: int | None = None,
    prefix: SharedPrefix | None = None,
) -> PrefillResult:
    """Prefill the prompts into a fresh cache of max_len slots and sample the first new token.

    The first token is drawn with the key of round 0, purpose PURPOSE_BONUS, from the processed
    target distribution at each row's last prompt position. With a mesh the cache is created sharded
    (`jaxspec.sharding.cache_shardings`). chunk: prompt tokens per forward (None: `prefill_chunk_size`).
    prefix: every prompt starts with these L tokens (`prefill_shared_prefix`; each prompt longer than
    L): their keys/values are copied into every row and only prompt positions [L, P) run through the
    target; hidden and captured still cover all P positions.
    """
    tokens = requests.prompt_tokens
    batch, p = tokens.shape
    dtype = params_dtype(params)
    # The barrier keeps XLA from constant-folding attention over the all-zero cache (minutes of
    # compile time for a 30-layer model); it is an identity at run time.
    cache = constrain_cache(jax.lax.optimization_barrier(KVCache.zeros(config, batch, max_len, dtype)), mesh)
    offset = 0 if prefix is None else prefix.length
    if prefix is not None:
        cache = constrain_cache(_with_prefix(cache, prefix), mesh)
    chunk = prefill_chunk_size(attention, p - offset, chunk)
    hidden, captured, cache = _prompt_forward(
        graphdef, params, tokens[:, offset:], cache, offset, chunk, attention=attention,
        capture_layers=capture_layers, mesh=mesh,
    )  # fmt: skip
    if prefix is not None:  # the prefix positions' states, the same for every row

        def whole(shared: jax.Array, rest: jax.Array) -> jax.Array:  # [1, L, d], [B, P - L, d]
            rows = jnp.broadcast_to(shared, (batch,) + shared.shape[1:]).astype(rest.dtype)
            return jnp.concatenate([rows, rest], axis=1)

        hidden = whole(prefix.hidden, hidden)
        captured = tuple(whole(s, c) for s, c in zip(prefix.captured, captured, strict=True))
    first = first_tokens(graphdef, params, hidden, requests)
    cache = dataclasses.replace(cache, lengths=requests.prompt_lengths.astype(jnp.int32))
    cache = constrain_cache(cache, mesh)
    return PrefillResult(cache=cache, first_token=first, hidden=hidden, captured=captured)


def first_tokens(
    graphdef: nnx.GraphDef, params: nnx.State, hidden: jax.Array, requests: Requests
) -> jax.Array:
    """The first new token [B] of each request from its prompt's final hidden states [B, P, d]: drawn
    with the key of round 0, purpose PURPOSE_BONUS, from the processed target distribution at the
    row's last prompt position (what `jaxspec.generate` draws for the request alone)."""
    logits = lm_logits(graphdef, params, last_valid(hidden, requests.prompt_lengths))
    keys = sampling.derive_key(requests.seeds, requests.request_ids, 0, sampling.PURPOSE_BONUS)
    return sampling.sample_logits(logits, requests.sampling, keys)


def _with_prefix(cache: KVCache, prefix: SharedPrefix) -> KVCache:
    """cache [B, ..., max_len, ...] with the prefix's keys/values at positions [0, L) of every row."""

    def put(buffer: jax.Array, shared: jax.Array) -> jax.Array:
        rows = jnp.broadcast_to(shared, (buffer.shape[0],) + shared.shape[1:]).astype(buffer.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buffer, rows, 0, axis=2)

    return dataclasses.replace(
        cache,
        keys=tuple(put(k, s) for k, s in zip(cache.keys, prefix.cache.keys, strict=True)),
        values=tuple(put(v, s) for v, s in zip(cache.values, prefix.cache.values, strict=True)),
    )


def _prompt_forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    cache: KVCache,
    offset: int,
    chunk: int,
    *,
    attention: str,
    capture_layers: tuple[int, ...],
    mesh: Mesh | None,
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """tokens [B, S], prompt positions [offset, offset + S), through the target as a causal chain
    attending to cache positions [0, offset) (a shared prefix, or nothing); in one forward where
    chunk >= S, else `chunk` tokens at a time. Returns (hidden [B, S, d], captured, cache)."""
    batch, s = tokens.shape
    if chunk < s:
        return _chunked_forward(
            graphdef, params, tokens, cache, chunk, attention=attention, capture_layers=capture_layers,
            mesh=mesh, offset=offset,
        )  # fmt: skip
    positions = jnp.broadcast_to(offset + jnp.arange(s, dtype=jnp.int32), (batch, s))
    start = dataclasses.replace(cache, lengths=jnp.full((batch,), offset, jnp.int32))
    return model_forward(
        graphdef, params, tokens, positions, start, causal_mask(batch, s),
        attention=attention, capture_layers=capture_layers, mesh=mesh,
        attend=prompt_attention_for(attention, offset),
    )  # fmt: skip


def prefill_chunk_size(attention: str, prompt_len: int, chunk: int | None = None) -> int:
    """Prompt tokens per prefill forward: `chunk` if given, else PREFILL_CHUNK where attention runs a
    Pallas kernel and the whole prompt on the jnp reference path (the CPU default)."""
    if chunk is None:
        chunk = prompt_len if runs_reference(attention) else PREFILL_CHUNK
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    return min(chunk, prompt_len)


def _chunked_forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    cache: KVCache,
    chunk: int,
    *,
    attention: str,
    capture_layers: tuple[int, ...],
    mesh: Mesh | None,
    offset: int = 0,
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """tokens [B, P] (prompt positions [offset, offset + P)) through the target `chunk` tokens at a
    time (one `lax.scan`, one compiled forward).

    Chunk i writes its keys/values at offset + [i * chunk, (i + 1) * chunk) and attends to the slots
    before it plus itself causally. P is padded with token 0 to a multiple of chunk (after every prompt,
    so no prompt position sees it); the cache must hold offset + the padded length. Returns (hidden
    [B, P, d], captured (each [B, P, d]), cache with lengths unchanged), as `model_forward` over the
    whole prompt.
    """
    batch, p = tokens.shape
    num_chunks = -(-p // chunk)
    padded = num_chunks * chunk
    if offset + padded > cache.max_len:
        raise ValueError(
            f"prefill: {p} prompt tokens{f' after {offset}' if offset else ''} in chunks of {chunk} need "
            f"{offset + padded} cache slots, the cache has {cache.max_len}"
        )
    tokens = jnp.pad(tokens, ((0, 0), (0, padded - p)))
    chunks = tokens.reshape(batch, num_chunks, chunk).transpose(1, 0, 2)  # [num_chunks, B, C]
    lengths = cache.lengths
    mask = causal_mask(batch, chunk)

    def step(cache: KVCache, xs: tuple[jax.Array, jax.Array]):
        chunk_tokens, start = xs
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
        cache = dataclasses.replace(cache, lengths=jnp.full((batch,), start, jnp.int32))
        hidden, captured, cache = model_forward(
            graphdef, params, chunk_tokens, positions, cache, mask,
            attention=attention, capture_layers=capture_layers, mesh=mesh,
        )  # fmt: skip
        return constrain_cache(cache, mesh), (hidden, captured)

    starts = offset + jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    cache, (hidden, captured) = jax.lax.scan(step, cache, (chunks, starts))

    def unchunk(x: jax.Array) -> jax.Array:  # [num_chunks, B, C, d] -> [B, P, d]
        return x.transpose(1, 0, 2, 3).reshape(batch, padded, x.shape[-1])[:, :p]

    cache = dataclasses.replace(cache, lengths=lengths)
    return unchunk(hidden), tuple(unchunk(c) for c in captured), cache


def params_dtype(params: nnx.State) -> jnp.dtype:
    return jax.tree.leaves(params)[0].dtype
