"""Shared operand layout for the tree-attention kernels: grouped query rows, padding, block sizes.

Both kernels give one program (TPU grid point / GPU program) one KV head and all Hq // Hkv query heads
that read it. The G query heads' N tree queries are stacked into M = G * N "rows", so one KV block
loaded from memory serves the whole group in a single [M, D] x [D, block] matmul. Row r is query head
g = r // N, node n = r % N; its tree mask row is tree_mask[b, n]. Rows are padded (M -> M_pad) to what
the hardware tiles want, tree keys likewise (N -> N_keys); padded rows see no key and are cut off
again, padded keys are seen by no row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def next_power_of_two(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def group_query_rows(q: jax.Array, num_kv_heads: int, padded_rows: int) -> jax.Array:
    """q [B, Hq, N, D] -> [B, Hkv, M_pad, D]; row g * N + n holds query head h * G + g, node n."""
    b, hq, n, d = q.shape
    rows = q.reshape(b, num_kv_heads, (hq // num_kv_heads) * n, d)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, padded_rows - rows.shape[2]), (0, 0)))


def ungroup_query_rows(rows: jax.Array, num_q_heads: int, num_nodes: int) -> jax.Array:
    """Inverse of group_query_rows: [B, Hkv, M_pad, D] -> [B, Hq, N, D]."""
    b, hkv, _, d = rows.shape
    group = num_q_heads // hkv
    return rows[:, :, : group * num_nodes].reshape(b, num_q_heads, num_nodes, d)


def row_tree_mask(tree_mask: jax.Array, group: int, padded_rows: int, padded_keys: int) -> jax.Array:
    """tree_mask [B, N, N] bool -> [B, M_pad, N_keys] int32 (1 = visible), one mask row per query row."""
    rows = jnp.tile(tree_mask, (1, group, 1)).astype(jnp.int32)  # [B, G * N, N]
    n = tree_mask.shape[1]
    return jnp.pad(rows, ((0, 0), (0, padded_rows - rows.shape[1]), (0, padded_keys - n)))


def pad_tree_kv(kv_tree: jax.Array, padded_keys: int) -> jax.Array:
    """[B, Hkv, N, D] -> [B, Hkv, N_keys, D] with zero keys/values appended (masked off by the mask)."""
    return jnp.pad(kv_tree, ((0, 0), (0, 0), (0, padded_keys - kv_tree.shape[2]), (0, 0)))


def pad_cache(kv_cache: jax.Array, padded_len: int) -> jax.Array:
    """[B, Hkv, S, D] -> [B, Hkv, S_pad, D]. Copies the whole cache: only for sizes no block divides."""
    if padded_len == kv_cache.shape[2]:
        return kv_cache
    return jnp.pad(kv_cache, ((0, 0), (0, 0), (0, padded_len - kv_cache.shape[2]), (0, 0)))


def largest_dividing_block(size: int, cap: int, multiple: int) -> int | None:
    """Largest power-of-two block <= cap that divides size and is a multiple of `multiple`, or None."""
    block = 1 << (max(cap, 1).bit_length() - 1)
    while block >= multiple:
        if size % block == 0 and block % multiple == 0:
            return block
        block //= 2
    return None


def sublane_multiple(dtype: jnp.dtype) -> int:
    """Rows per native TPU tile for this dtype: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_shapes(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
) -> None:
    """Raise ValueError naming the first inconsistent operand of a tree-attention call."""
    b, hq, n, d = q.shape
    _, hkv, s, _ = k_cache.shape
    expected = {
        "k_cache": (k_cache.shape, (b, hkv, s, d)),
        "v_cache": (v_cache.shape, (b, hkv, s, d)),
        "lengths": (lengths.shape, (b,)),
        "k_tree": (k_tree.shape, (b, hkv, n, d)),
        "v_tree": (v_tree.shape, (b, hkv, n, d)),
        "tree_mask": (tree_mask.shape, (b, n, n)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"tree attention: {name} has shape {tuple(got)}, expected {want}")
    if hq % hkv:
        raise ValueError(f"tree attention: Hq={hq} is not a multiple of Hkv={hkv}")
