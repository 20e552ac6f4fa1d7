"""Tree-attention operands at verify-step shapes and the bytes a kernel must read: shared by
scripts/bench_kernels.py and the accelerator check (`jaxspec.bench.accelerator`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.sampling.tree import DraftTree, ancestor_mask

DEFAULT_PEAK_GBPS = {"gpu": 4800.0, "tpu": 819.0}  # H200 HBM3e, TPU v5e


def make_inputs(
    batch: int,
    prefix: int,
    nodes: int,
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str | jnp.dtype,
    seed: int = 0,
) -> dict[str, jax.Array]:
    """Verify-step operands: full caches of `prefix` positions and one random tree per row
    (q [B, Hq, N, D], caches [B, Hkv, prefix, D], tree keys/values [B, Hkv, N, D], mask [B, N, N])."""
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 6)

    def normal(key: jax.Array, *shape: int) -> jax.Array:
        return jax.random.normal(key, shape, dtype)

    parent = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, nodes)] for _ in range(batch)])
    depth = np.zeros_like(parent)
    for i in range(1, nodes):
        depth[:, i] = depth[np.arange(batch), parent[:, i]] + 1
    tree = DraftTree(
        tokens=jnp.zeros((batch, nodes), jnp.int32),
        parent=jnp.asarray(parent, jnp.int32),
        depth=jnp.asarray(depth, jnp.int32),
        valid=jnp.ones((batch, nodes), bool),
    )
    return dict(
        q=normal(keys[0], batch, q_heads, nodes, head_dim),
        k_cache=normal(keys[1], batch, kv_heads, prefix, head_dim),
        v_cache=normal(keys[2], batch, kv_heads, prefix, head_dim),
        lengths=jnp.full((batch,), prefix, jnp.int32),
        k_tree=normal(keys[3], batch, kv_heads, nodes, head_dim),
        v_tree=normal(keys[4], batch, kv_heads, nodes, head_dim),
        tree_mask=jax.jit(ancestor_mask)(tree),
    )


def kv_bytes(inputs: dict[str, jax.Array]) -> int:
    """Bytes of K and V a perfect kernel reads: each row's prefix [0, length) plus the tree block."""
    _, hkv, _, d = inputs["k_cache"].shape
    itemsize = inputs["k_cache"].dtype.itemsize
    prefix_positions = int(jnp.sum(inputs["lengths"]))
    tree_positions = inputs["k_tree"].shape[0] * inputs["k_tree"].shape[2]
    return 2 * hkv * d * itemsize * (prefix_positions + tree_positions)


# Working sets smaller than this are rotated through several copies so that a timing loop reads
# device memory, not the last-level cache (H200: 60 MB of L2).
CACHE_DEFEATING_BYTES = 128 * 2**20
MAX_INPUT_COPIES = 16


def input_copies(
    inputs: dict[str, jax.Array], make_copy: Callable[[int], dict[str, jax.Array]]
) -> list[dict]:
    """`inputs` plus enough fresh copies (make_copy(seed)) that their K/V together exceed
    CACHE_DEFEATING_BYTES (at most MAX_INPUT_COPIES in all)."""
    count = min(MAX_INPUT_COPIES, max(1, -(-CACHE_DEFEATING_BYTES // kv_bytes(inputs))))
    return [inputs] + [make_copy(seed) for seed in range(1, count)]


def loop_seconds(
    attention: Callable[..., jax.Array], copies: list[dict[str, jax.Array]], iters: int
) -> float:
    """Device seconds per call of `attention(**inputs)`, timed inside one compiled loop.

    Each loop step calls attention once on every copy in turn (distinct buffers, so the K/V read
    comes from device memory, not cache), and each call's q depends on the previous output, so no
    call is hoisted or merged; host dispatch is paid once per loop, not per call. `iters` calls in
    all (rounded up to a multiple of the copies); median of 3 timed loops after a warm-up loop.
    """
    steps = max(1, -(-iters // len(copies)))
    q = copies[0]["q"]
    rest = [{k: v for k, v in c.items() if k != "q"} for c in copies]

    @jax.jit
    def loop(q: jax.Array, rest: list[dict[str, jax.Array]]) -> jax.Array:
        def body(_, q):
            for operands in rest:
                q = q + (attention(q=q, **operands) * 1e-3).astype(q.dtype)
            return q

        return jax.lax.fori_loop(0, steps, body, q)

    return median_seconds(lambda: loop(q, rest), 3) / (steps * len(copies))


def median_seconds(fn: Callable[[], Any], iters: int) -> float:
    """Median wall seconds of `fn()` (blocked until ready) over `iters` calls after one warm-up call."""
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)
