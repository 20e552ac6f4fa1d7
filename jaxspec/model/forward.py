"""Pure forward functions over split (graphdef, params): the building blocks of every jitted step."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.model.kv_cache import KVCache, write_window_flat
from jaxspec.sharding import shard_attention
from pallas_kernels import tree_attention


def attention_for(impl: str, mesh: jax.sharding.Mesh | None = None):
    """The verify/prefill attention function for SpecConfig.attention ("auto" | "reference" | "pallas").

    With a mesh it runs per shard (`jaxspec.sharding.shard_attention`): local rows and kv heads, no
    collective, and Pallas kernels see unsharded local arrays.
    """

    def attention_fn(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, *, scale):
        return tree_attention(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, scale=scale, impl=impl)

    if mesh is not None:
        return shard_attention(attention_fn, mesh)
    return attention_fn


def cached_attention(impl: str, mesh: jax.sharding.Mesh | None = None, attend: Callable | None = None):
    """A decoder layer's cache step: write the N new keys/values into the window
    [lengths, lengths + N), then tree attention over prefix + new tokens (`attention_for(impl)`, or
    `attend` when given: a function with `tree_attention`'s contract, e.g.
    `jaxspec.model.live_attention.live_attention`).

    (q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, *, scale) -> (out [B, Hq, N, D], k_cache,
    v_cache). Writing before attending leaves the in-place update as the only reader of the old cache
    buffer, so XLA updates each layer's cache in place; read-then-write made XLA:CPU copy every layer's
    buffer twice per step (~10 ms of a 45 ms SmolLM2 decode step). With a mesh, write and attention run
    per shard, so the cache is never gathered.
    """

    attend = attend or attention_for(impl)

    def write_and_attend(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, *, scale):
        k_cache = write_window_flat(k_cache, k_new, lengths)
        v_cache = write_window_flat(v_cache, v_new, lengths)
        out = attend(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, scale=scale)
        return out, k_cache, v_cache

    if mesh is not None:
        return shard_attention(write_and_attend, mesh, returns_cache=True)
    return write_and_attend


def model_forward(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array,
    *,
    attention: str = "auto",
    capture_layers: tuple[int, ...] = (),
    mesh: jax.sharding.Mesh | None = None,
    attend: Callable | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """tokens/positions [B, N], tree_mask [B, N, N] -> (final hidden [B, N, d], captured, cache).

    The new tokens' keys/values are written at [cache.lengths, cache.lengths + N); lengths unchanged.
    mesh: the mesh params and cache are sharded over (attention then runs per shard); None = one device.
    attend: replaces `attention`'s implementation (`cached_attention`).
    """
    model = nnx.merge(graphdef, params)
    layer_step = cached_attention(attention, mesh, attend)
    return model(tokens, positions, cache, tree_mask, layer_step, capture_layers)


def lm_logits(graphdef: nnx.GraphDef, params: nnx.State, hidden: jax.Array) -> jax.Array:
    """hidden [..., d] -> float32 logits [..., V]."""
    return nnx.merge(graphdef, params).lm_logits(hidden)


def embed_tokens(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array) -> jax.Array:
    """tokens [...] -> embeddings [..., d] (draft heads reuse the target's frozen embedding)."""
    return nnx.merge(graphdef, params).embed(tokens)


def causal_mask(batch: int, n: int) -> jax.Array:
    """[B, N, N] lower-triangular mask of a chain (prefill)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), dtype=bool)), (batch, n, n))


def last_valid(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """x [B, N, ...], lengths [B] (>= 1) -> x[b, lengths[b] - 1]  ([B, ...])."""
    idx = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
