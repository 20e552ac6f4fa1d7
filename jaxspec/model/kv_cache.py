"""The target's KV cache: a pytree of per-layer arrays plus per-row committed lengths.

Layout per layer: [batch, kv_heads, max_len, head_dim]. Slots [0, lengths[b]) of row b hold committed
tokens. A forward over N new (tree or prompt) tokens writes their keys/values into the window
[lengths[b], lengths[b] + N); `commit_path` then moves the accepted path to the front of that window
and advances the lengths. Nothing outside the window is copied.

What a decode run holds in memory, as bytes: `kv_cache_bytes` (the cache `KVCache.zeros` allocates),
`decode_memory_bytes` (that plus the weights); what the machine has free: `available_memory_bytes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


def kv_cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> int:
    """Bytes of `KVCache.zeros(config, batch, max_len, dtype)`, nothing allocated: per layer a key
    buffer [batch, key heads, max_len, key dim] and a value buffer [batch, value heads, max_len,
    value dim] (`ModelConfig.kv_cache_dims`: kv heads x head dim each for Llama), plus the [batch] int32
    lengths."""
    (key_heads, key_dim), (value_heads, value_dim) = config.kv_cache_dims()
    per_position = config.num_layers * (key_heads * key_dim + value_heads * value_dim)
    return batch * max_len * per_position * jnp.dtype(dtype).itemsize + batch * jnp.dtype(jnp.int32).itemsize


def weights_bytes(params: Any) -> int:
    """Bytes of every array in a parameter pytree (shapes and dtypes only: nothing is read)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(params))


def decode_memory_bytes(config: ModelConfig, params: Any, batch: int, max_len: int) -> int:
    """The memory a decode run over `batch` rows holds for its whole length: the target's weights
    (`params`) and its KV cache of `max_len` positions a row in the weights' dtype (`kv_cache_bytes`).
    Activations, logits and output buffers are left out (they are small next to the cache at long
    lengths; callers keep a margin). The cache length is the decoding loop's to choose
    (`jaxspec.decoding.generate.cache_length`)."""
    dtype = jax.tree.leaves(params)[0].dtype
    return weights_bytes(params) + kv_cache_bytes(config, batch, max_len, dtype)


def available_memory_bytes() -> int | None:
    """Free memory on the first local device: bytes_limit - bytes_in_use of its `memory_stats()` on an
    accelerator; on CPU (no memory stats) MemAvailable of /proc/meminfo. None when neither is known."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == "MemAvailable":  # "MemAvailable:   123456 kB"
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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
    """A head's committed keys/values: [B, Hkv, S, D], or [M, B, Hkv, S, D] with one per MTP module or
    per EAGLE decoder layer."""

    keys: jax.Array
    values: jax.Array

    @property
    def batch_axis(self) -> int:
        """The axis of the rows: 0, or 1 in the per-module layout [M, B, Hkv, S, D]."""
        return self.keys.ndim - 4
