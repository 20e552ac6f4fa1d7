"""The target's KV cache: a pytree of per-layer arrays plus per-row committed lengths.

Layout per layer: [batch, kv_heads, max_len, head_dim]. Slots [0, lengths[b]) of row b hold committed
tokens. A forward over N new (tree or prompt) tokens writes their keys/values into the window
[lengths[b], lengths[b] + N); `commit_path` then moves the accepted path to the front of that window
and advances the lengths. Nothing outside the window is copied.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """keys/values: tuple over layers of [B, Hkv, S, D]; lengths: [B] int32 committed tokens."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        (key_heads, key_dim), (value_heads, value_dim) = config.kv_cache_dims()
        keys = tuple(jnp.zeros((batch, key_heads, max_len, key_dim), dtype) for _ in range(config.num_layers))
        values = tuple(
            jnp.zeros((batch, value_heads, max_len, value_dim), dtype) for _ in range(config.num_layers)
        )
        return cls(keys=keys, values=values, lengths=jnp.zeros((batch,), jnp.int32))


def _write_rows(buffer: jax.Array, update: jax.Array, starts: jax.Array) -> jax.Array:
    """buffer [B, H, S, D], update [B, H, N, D], starts [B] -> buffer with update at [starts, starts+N)."""
    return jax.vmap(lambda buf, upd, s: jax.lax.dynamic_update_slice(buf, upd, (0, s, 0)))(
        buffer, update.astype(buffer.dtype), starts
    )


def _read_rows(buffer: jax.Array, starts: jax.Array, size: int) -> jax.Array:
    """buffer [B, H, S, D], starts [B] -> [B, H, size, D] window at [starts, starts+size)."""
    h, d = buffer.shape[1], buffer.shape[3]
    return jax.vmap(lambda buf, s: jax.lax.dynamic_slice(buf, (0, s, 0), (h, size, d)))(buffer, starts)


def write_window(layer_buffer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write the N new tokens' keys or values [B, H, N, D] at each row's current length."""
    return _write_rows(layer_buffer, new, lengths)


def write_window_flat(layer_buffer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """`write_window` done on the [B * H, S, D] view: the shape XLA gives attention's batched dots.

    When attention then reads the written buffer (`jaxspec.model.forward.cached_attention`), writer and reader
    share one buffer and the update stays in place; on the 4-D view XLA:CPU duplicated the update into
    each reader's fusion and copied the whole layer buffer twice per step. Merging B and H must not
    cross shards: with a mesh, call it per shard (inside shard_map).
    """
    b, h, s, d = layer_buffer.shape
    flat = _write_rows(
        layer_buffer.reshape(b * h, 1, s, d),
        new.reshape(b * h, 1, new.shape[2], d),
        jnp.repeat(lengths, h, total_repeat_length=b * h),
    )
    return flat.reshape(b, h, s, d)


def commit_path(cache: KVCache, path: jax.Array, num_committed: jax.Array, window: int) -> KVCache:
    """Keep the accepted path of the window just written and advance the lengths.

    Args:
      cache: cache whose slots [lengths, lengths + window) hold the tree nodes' keys/values.
      path: [B, P] int32 tree-node indices to keep, in order (path[:, 0] is the root); entries at or
        past num_committed are ignored (may be -1). P <= window.
      num_committed: [B] int32 number of path entries to commit (root + accepted drafts).
      window: N, the number of tree nodes written by the verify forward.
    Returns:
      cache with slot lengths + j holding node path[j] for j < num_committed, lengths advanced.
      Only the window is read and rewritten.
    """
    safe_path = jnp.clip(path, 0, window - 1)
    starts = cache.lengths

    def move(buffer: jax.Array) -> jax.Array:
        tree_kv = _read_rows(buffer, starts, window)
        kept = jnp.take_along_axis(tree_kv, safe_path[:, None, :, None], axis=2)
        return _write_rows(buffer, kept, starts)

    keys = tuple(move(k) for k in cache.keys)
    values = tuple(move(v) for v in cache.values)
    return KVCache(keys=keys, values=values, lengths=cache.lengths + num_committed.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadCache:
    """A head's committed keys/values: [B, Hkv, S, D] (or [M, B, Hkv, S, D], one per MTP module)."""

    keys: jax.Array
    values: jax.Array
