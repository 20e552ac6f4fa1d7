"""Tree attention as a Pallas TPU (Mosaic) kernel.

Grid (B, Hkv, num_kv_blocks); the last axis walks the cache prefix in blocks of `block_kv` positions
and is the sequential ("arbitrary") reduction axis, B and Hkv are "parallel" (split across the two
TensorCores of megacore chips). One grid point holds the [M_pad, D] grouped query rows of one KV head
(all G = Hq // Hkv query heads times N tree nodes, see layout.py) and folds one [block_kv, D] K/V block
into a flash-attention state kept in VMEM scratch. The final grid step also folds in the tree's own
keys under the ancestor mask and writes the normalised output.

Skipping: `lengths` is scalar-prefetched into SMEM. A block at or past the row's length is skipped
with `pl.when` (no compute), and the K/V index_map clamps its block index to the row's last needed
block: consecutive grid steps that map to the same block are not copied again, so the skipped tail of
a short row costs neither DMA nor compute, only the fixed per-step overhead.

Tiling: query rows are padded to the dtype's sublane multiple (8 for float32, 16 for bfloat16), tree
keys to 128 lanes; head_dim is taken as the full array dimension (legal for any D, no padding, so a
D=64 cache is not copied to 128). Positions past a row's length inside its last block are masked and
their values zeroed, so garbage (even NaN) in unused cache slots never reaches the output.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, layout
from pallas_kernels.online_softmax import MASKED_SCORE, normalized, online_softmax_step, scores_of

_MAX_BLOCK_KV = 2048  # 2 x 2 x 2048 x D bf16 double-buffered K/V blocks: 2 MiB of VMEM at D=128
_MAX_SCORE_ELEMENTS = 256 * 1024  # [M_pad, block_kv] float32 scores (and probabilities) <= 1 MiB each
_LANES = 128
# Default scoped-VMEM limit of a Mosaic kernel on TPU v5e (v6e/v7x: 32 MiB); every launch must fit it.
VMEM_BUDGET_BYTES = 16 * 2**20


def _tree_attention_kernel(
    lengths_ref,  # SMEM [B] int32 (scalar prefetch)
    q_ref,  # [M_pad, D]
    k_ref,  # [block_kv, D]
    v_ref,  # [block_kv, D]
    k_tree_ref,  # [N_keys, D]
    v_tree_ref,  # [N_keys, D]
    mask_ref,  # [M_pad, N_keys] int32
    out_ref,  # [M_pad, D]
    m_ref,  # VMEM [M_pad, 1] float32
    denom_ref,  # VMEM [M_pad, 1] float32
    acc_ref,  # VMEM [M_pad, D] float32
    *,
    scale: float,
    block_kv: int,
):
    row, kv_block = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[row]
    block_start = kv_block * block_kv

    @pl.when(kv_block == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED_SCORE, jnp.float32)
        denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fold(k: jax.Array, v: jax.Array, visible: jax.Array) -> None:
        scores = scores_of(q_ref[...], k, scale)
        m, denom, acc = online_softmax_step(scores, visible, v, m_ref[...], denom_ref[...], acc_ref[...])
        m_ref[...] = m
        denom_ref[...] = denom
        acc_ref[...] = acc

    @pl.when(block_start < length)
    def _prefix_block():
        rows = q_ref.shape[0]
        key_pos = block_start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        value_pos = block_start + jax.lax.broadcasted_iota(jnp.int32, v_ref.shape, 0)
        v = jnp.where(value_pos < length, v_ref[...].astype(jnp.float32), 0.0).astype(v_ref.dtype)
        fold(k_ref[...], v, key_pos < length)

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def _tree_and_finish():
        fold(k_tree_ref[...], v_tree_ref[...], mask_ref[...] != 0)
        out_ref[...] = normalized(acc_ref[...], denom_ref[...]).astype(out_ref.dtype)


def launch_vmem_bytes(launch: compat.KernelLaunch) -> int:
    """VMEM one program of a `tree_attention_tpu` launch holds, from the launch's own BlockSpecs
    (`compat.kernel_launches` on a traced program): every input/output block twice (the pipeline
    double-buffers them), the scratch, and the body's float32 temporaries: scores, masked scores and
    probabilities [rows, max(block_kv, N_keys)], the value block upcast [block_kv, D] and the
    probabilities-times-values product [rows, D]."""
    if launch.name != "tree_attention_tpu":
        raise ValueError(f"not a tree_attention_tpu launch: {launch.name!r}")

    def nbytes(shape: tuple[int, ...], dtype: jnp.dtype) -> int:
        return math.prod(shape) * jnp.dtype(dtype).itemsize

    q_block, k_block, _, k_tree_block = launch.blocks[:4]
    rows, head_dim = q_block[0][-2:]
    block_kv, tree_keys = k_block[0][-2], k_tree_block[0][-2]
    blocks = 2 * sum(nbytes(shape, dtype) for shape, dtype in launch.blocks)
    scratch = sum(nbytes(shape, dtype) for shape, dtype in launch.scratch)
    temporaries = 4 * (3 * rows * max(block_kv, tree_keys) + block_kv * head_dim + rows * head_dim)
    return blocks + scratch + temporaries


def cache_block_index(lengths: Any, row: Any, step: Any, block_kv: int) -> jax.Array:
    """Cache block to fetch at grid step `step` of batch row `row`: the step itself, clamped to the
    row's last needed block, so the skipped steps past the length re-map to an already-fetched block
    and the pipeline issues no DMA for them. lengths: [B] int32 (an SMEM ref inside index_maps)."""
    # lax.div truncates (lengths are >= 0) and lowers to one scalar op, unlike floor-dividing `//`.
    last_needed = jnp.maximum(jax.lax.div(lengths[row] + block_kv - 1, block_kv) - 1, 0)
    return jnp.minimum(step, last_needed)


def choose_block_kv(
    cache_len: int, dtype: jnp.dtype, rows: int, block_kv: int | None = None
) -> tuple[int, int]:
    """(block_kv, padded cache length) for a cache of `cache_len` positions and `rows` query rows.

    Large blocks amortise the fixed per-grid-step cost (the kernel is bandwidth-bound), capped so the
    [rows, block_kv] float32 scores stay small in VMEM. Prefers a lane-dense power-of-two block
    (multiple of 128) dividing the cache; then one full-length block; then a sublane-multiple divisor;
    only if nothing divides does it pad the cache (a full copy per call: size caches in multiples of 128).
    """
    sublanes = layout.sublane_multiple(dtype)
    max_block = max(_LANES, min(_MAX_BLOCK_KV, _MAX_SCORE_ELEMENTS // rows))
    if block_kv is not None:
        if cache_len % block_kv or (block_kv % sublanes and block_kv != cache_len):
            raise ValueError(
                f"block_kv={block_kv} must divide the cache length {cache_len} and be a multiple of "
                f"{sublanes} (or equal it)"
            )
        return block_kv, cache_len
    lane_dense = layout.largest_dividing_block(cache_len, max_block, _LANES)
    if lane_dense is not None:
        return lane_dense, cache_len
    if cache_len <= max_block:
        return cache_len, cache_len
    divisor = layout.largest_dividing_block(cache_len, max_block, sublanes)
    if divisor is not None:
        return divisor, cache_len
    return _LANES, layout.round_up(cache_len, _LANES)


def tree_attention_tpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float,
    block_kv: int | None = None,
    interpret: Any = None,
) -> jax.Array:
    """Tree attention on TPU; same contract as reference.tree_attention_reference.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D]; lengths: [B] int32 in [0, S];
      k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool.
      scale: softmax scale.
      block_kv: cache positions per grid step (None: choose_block_kv picks).
      interpret: None/False to compile for TPU, or `compat.tpu_interpret_params(...)` (interpret mode).
    Returns:
      [B, Hq, N, D] in q's dtype. Rows that see no key at all (invalid padding nodes with an empty
      prefix) are zero, where the reference returns an arbitrary average.
    """
    layout.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
    batch, num_q_heads, num_nodes, head_dim = q.shape
    num_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    sublanes = max(layout.sublane_multiple(x.dtype) for x in (q, k_cache, k_tree))
    padded_rows = layout.round_up(group * num_nodes, sublanes)
    padded_keys = layout.round_up(num_nodes, _LANES)
    block_kv, padded_len = choose_block_kv(cache_len, k_cache.dtype, padded_rows, block_kv)

    q_rows = layout.group_query_rows(q, num_kv_heads, padded_rows)
    mask_rows = layout.row_tree_mask(tree_mask, group, padded_rows, padded_keys)
    k_tree = layout.pad_tree_kv(k_tree, padded_keys)
    v_tree = layout.pad_tree_kv(v_tree, padded_keys)
    k_cache = layout.pad_cache(k_cache, padded_len)
    v_cache = layout.pad_cache(v_cache, padded_len)

    def per_head(b, h, j, lengths_ref):
        return b, h, 0, 0

    def cache_block(b, h, j, lengths_ref):
        return b, h, cache_block_index(lengths_ref, b, j, block_kv), 0

    def per_row(b, h, j, lengths_ref):
        return b, 0, 0

    sq = compat.squeezed
    grid_spec = compat.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, num_kv_heads, padded_len // block_kv),
        in_specs=[
            pl.BlockSpec((sq, sq, padded_rows, head_dim), per_head),
            pl.BlockSpec((sq, sq, block_kv, head_dim), cache_block),
            pl.BlockSpec((sq, sq, block_kv, head_dim), cache_block),
            pl.BlockSpec((sq, sq, padded_keys, head_dim), per_head),
            pl.BlockSpec((sq, sq, padded_keys, head_dim), per_head),
            pl.BlockSpec((sq, padded_rows, padded_keys), per_row),
        ],
        out_specs=pl.BlockSpec((sq, sq, padded_rows, head_dim), per_head),
        scratch_shapes=[
            compat.VMEM((padded_rows, 1), jnp.float32),
            compat.VMEM((padded_rows, 1), jnp.float32),
            compat.VMEM((padded_rows, head_dim), jnp.float32),
        ],
    )
    out_rows = pl.pallas_call(
        functools.partial(_tree_attention_kernel, scale=scale, block_kv=block_kv),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, head_dim), q.dtype),
        compiler_params=compat.tpu_compiler_params(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(lengths.astype(jnp.int32), q_rows, k_cache, v_cache, k_tree, v_tree, mask_rows)
    return layout.ungroup_query_rows(out_rows, num_q_heads, num_nodes)
