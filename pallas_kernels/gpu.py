"""Tree attention as a Pallas GPU kernel, lowered through Triton.

Backend choice (jax 0.10.2 ships both `jax.experimental.pallas.triton` and `...pallas.mosaic_gpu`):
Triton. Reasons:
  * Shape of the work. A verify step is decode-like: M = G * N query rows per KV head (8..512) against
    a long prefix, memory-bound whenever M is below H200's ~200 flop/byte ridge point. What matters is
    streaming K/V at full bandwidth from many SMs at once (split-KV, below) with overlapped loads
    (Triton's `num_stages` software pipelining); Triton also emits Hopper wgmma for `tl.dot` where
    shapes allow. Mosaic GPU's strengths (explicit TMA, warp specialisation, warpgroup MMA) pay off in
    compute-bound prefill attention, not here.
  * Fit with this stack. Triton keeps the `pl.pallas_call` + BlockSpec model the TPU kernel uses, with
    arbitrary row counts, masked tails and data-dependent loop bounds. In jax 0.10.2 Mosaic GPU
    kernels through `pl.pallas_call` are deprecated in favour of `plgpu.kernel` (a separate,
    lower-level programming model with 64/128-row warpgroup tiles and swizzled SMEM layouts).
  * Verifiability without a GPU. This kernel runs under the generic `interpret=True` on CPU and
    lowers to Triton IR off-GPU (`lowering_platforms=("cuda",)`), so both its numerics and its
    Triton-lowerability are tested here. Mosaic GPU's interpreter handles only single-block grids.
Note: plain `pl.pallas_call` now defaults to Mosaic GPU on CUDA; passing `pltriton.CompilerParams`
selects Triton explicitly.

Layout: grid (B * Hkv, row_blocks, kv_splits). A program owns `block_rows` of the grouped query rows
of one KV head (layout.py) and one contiguous split of the cache; it loops over its split in blocks of
`block_kv` positions with a `fori_loop` whose trip count stops at the row's length, so blocks past the
length are never loaded (skipped, not masked). Split 0 also folds in the tree keys under the ancestor
mask. Each program writes an unnormalised partial (acc, m, denom) in float32 and a few jnp ops merge
the splits (flash-decoding). Splitting the prefix keeps all SMs streaming when B * Hkv is small.

Long windows: prefill reaches this kernel in chunks of at most 128 tokens (decoding.prefill), so the tree
block has at most 128 keys whatever the prompt length. Per program the tiles are then q [64, D], one K
and one V block [64, D] per pipeline stage, tree K/V [128, D], mask [64, 128] int32 and scores /
probabilities [64, 128] float32: ~210 KiB at D = 128 in bf16 with num_stages = 2 if every tile sat in
shared memory (H200: 227 KiB per block); Triton keeps scores and masks in registers, so the shared
memory in use is smaller. The tree block is still computed by every split and masked off outside
split 0.

Measured on one H200 (jax 0.11.2, docs/bench/accelerator/kernel_tuning, Llama-3-8B heads, bf16, timed
inside a compiled loop): launch parameters block_kv 64, 4 warps, 3 stages are the best of a grid of
block_kv {32, 64, 128} x warps {4, 8} x stages {2, 3, 4} (block_kv 128 with 4 stages needs more than
the 227 KiB of shared memory); at prefix 32k the kernel reads K/V at 84% of the 4.8 TB/s HBM peak at
batch 8 and 90% at batch 32 for trees of <= 4 nodes, 45% at batch 1 (the launch and split-merge ops
around a 60 us kernel dominate). Trees of 64 nodes run at ~18%: 4 row blocks of 64 rows each read the
whole cache (a larger block_rows is the next thing to try).

Triton needs power-of-two tensor sizes: rows, tree keys and blocks are padded to powers of two (>= 16
for `tl.dot`), head_dim must be a power of two >= 16, and the cache is padded (copied) only when no
power-of-two block divides its length.

Tested on CPU in interpret mode and by lowering to Triton IR; run and timed on an H200 by
scripts/accelerator_check.py (max |error| vs the reference 2.4e-4 to 4.9e-4 in bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, layout
from pallas_kernels.online_softmax import MASKED_SCORE, normalized, online_softmax_step, scores_of

_MIN_DOT = 16  # smallest tl.dot dimension
_MAX_BLOCK_KV = 64
_TARGET_PROGRAMS = 264  # ~2 waves over H200's 132 SMs
_MIN_BLOCKS_PER_SPLIT = 4


def _tree_attention_kernel(
    length_ref,  # [] int32
    q_ref,  # [block_rows, D]
    k_ref,  # [split_len, D], this program's split of the cache
    v_ref,  # [split_len, D]
    k_tree_ref,  # [N_keys, D]
    v_tree_ref,  # [N_keys, D]
    mask_ref,  # [block_rows, N_keys] int32
    acc_ref,  # [block_rows, D] float32
    m_ref,  # [block_rows, 1] float32
    denom_ref,  # [block_rows, 1] float32
    *,
    scale: float,
    block_kv: int,
):
    split = pl.program_id(2)
    split_len, head_dim = k_ref.shape
    rows = q_ref.shape[0]
    length = length_ref[...]
    visible_in_split = _visible_in_split(length, split, split_len)
    num_blocks = blocks_to_visit(length, split, split_len, block_kv)
    q = q_ref[...]

    def fold_block(j, state):
        start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        value_pos = start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        v = jnp.where(value_pos < visible_in_split, v_ref[pl.ds(start, block_kv), :], 0)
        key_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        return online_softmax_step(scores_of(q, k, scale), key_pos < visible_in_split, v, *state)

    state = (
        jnp.full((rows, 1), MASKED_SCORE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    state = jax.lax.fori_loop(0, num_blocks, fold_block, state)
    # The tree block (<= 64 keys) is folded by split 0 only; a mask keeps this branch-free.
    tree_visible = (mask_ref[...] != 0) & (split == 0)
    m, denom, acc = online_softmax_step(
        scores_of(q, k_tree_ref[...], scale), tree_visible, v_tree_ref[...], *state
    )
    acc_ref[...] = acc
    m_ref[...] = m
    denom_ref[...] = denom


def _visible_in_split(length: jax.Array, split: jax.Array | int, split_len: int) -> jax.Array:
    """Number of cache positions below `length` inside split `split` (0 .. split_len)."""
    return jnp.clip(length - split * split_len, 0, split_len)


def blocks_to_visit(length: jax.Array, split: jax.Array | int, split_len: int, block_kv: int) -> jax.Array:
    """Loop trip count of split `split`: blocks holding a position below `length`; later ones are
    never loaded."""
    return jax.lax.div(_visible_in_split(length, split, split_len) + block_kv - 1, block_kv)


def _merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array) -> jax.Array:
    """Partials acc [..., splits, M, D], m / denom [..., splits, M, 1] -> normalised [..., M, D]."""
    m_max = jnp.max(m, axis=-3, keepdims=True)
    weight = jnp.exp(m - m_max)
    total_acc = jnp.sum(weight * acc, axis=-3)
    total_denom = jnp.sum(weight * denom, axis=-3)
    return normalized(total_acc, total_denom)


def _num_splits(num_kv_blocks: int, programs_per_split: int, requested: int | None) -> int:
    if requested is not None:
        if num_kv_blocks % requested:
            raise ValueError(f"num_splits={requested} must divide the {num_kv_blocks} KV blocks")
        return requested
    wanted = -(-_TARGET_PROGRAMS // programs_per_split)
    cap = max(min(wanted, num_kv_blocks // _MIN_BLOCKS_PER_SPLIT), 1)
    return max(d for d in range(1, cap + 1) if num_kv_blocks % d == 0)


def tree_attention_gpu(
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
    block_rows: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """Tree attention on GPU (Triton); same contract as reference.tree_attention_reference.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D]; lengths: [B] int32 in [0, S];
      k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool. D must be a power of two >= 16.
      scale: softmax scale.
      block_kv: cache positions per loop step, a power of two >= 16 (None: the largest <= 64 that
        divides S; S is padded, i.e. copied, when block_kv does not divide it).
      block_rows: grouped query rows per program (power of two >= 16).
      num_splits: cache splits per row (None: enough programs to fill the GPU).
      num_warps, num_stages: Triton launch parameters (the defaults measured best on an H200).
      interpret: run with Pallas' generic interpreter (CPU testing).
    Returns:
      [B, Hq, N, D] in q's dtype; rows that see no key at all are zero.
    """
    layout.check_shapes(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)
    batch, num_q_heads, num_nodes, head_dim = q.shape
    num_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    if head_dim < _MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"GPU tree attention needs a power-of-two head_dim >= 16, got {head_dim}")
    group = num_q_heads // num_kv_heads
    padded_rows = max(_MIN_DOT, layout.next_power_of_two(group * num_nodes))
    block_rows = min(block_rows, padded_rows)
    padded_keys = max(_MIN_DOT, layout.next_power_of_two(num_nodes))
    if block_kv is None:
        block_kv = layout.largest_dividing_block(cache_len, _MAX_BLOCK_KV, _MIN_DOT) or _MAX_BLOCK_KV
    elif block_kv < _MIN_DOT or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")
    padded_len = layout.round_up(cache_len, block_kv)
    row_blocks = padded_rows // block_rows
    splits = _num_splits(padded_len // block_kv, batch * num_kv_heads * row_blocks, num_splits)
    split_len = padded_len // splits

    q_rows = layout.group_query_rows(q, num_kv_heads, padded_rows)
    mask_rows = layout.row_tree_mask(tree_mask, group, padded_rows, padded_keys)
    k_tree = layout.pad_tree_kv(k_tree, padded_keys)
    v_tree = layout.pad_tree_kv(v_tree, padded_keys)
    k_cache = layout.pad_cache(k_cache, padded_len)
    v_cache = layout.pad_cache(v_cache, padded_len)

    sq = compat.squeezed
    hkv = num_kv_heads
    partial_shape = (batch, hkv, splits, padded_rows)
    in_specs = [
        pl.BlockSpec((sq,), lambda bh, r, s: (bh // hkv,)),
        pl.BlockSpec((sq, sq, block_rows, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, r, 0)),
        pl.BlockSpec((sq, sq, split_len, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, s, 0)),
        pl.BlockSpec((sq, sq, split_len, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, s, 0)),
        pl.BlockSpec((sq, sq, padded_keys, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, 0, 0)),
        pl.BlockSpec((sq, sq, padded_keys, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, 0, 0)),
        pl.BlockSpec((sq, block_rows, padded_keys), lambda bh, r, s: (bh // hkv, r, 0)),
    ]
    out_specs = [
        pl.BlockSpec((sq, sq, sq, block_rows, head_dim), lambda bh, r, s: (bh // hkv, bh % hkv, s, r, 0)),
        pl.BlockSpec((sq, sq, sq, block_rows, 1), lambda bh, r, s: (bh // hkv, bh % hkv, s, r, 0)),
        pl.BlockSpec((sq, sq, sq, block_rows, 1), lambda bh, r, s: (bh // hkv, bh % hkv, s, r, 0)),
    ]
    acc, m, denom = pl.pallas_call(
        functools.partial(_tree_attention_kernel, scale=scale, block_kv=block_kv),
        grid=(batch * hkv, row_blocks, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
            jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
        ],
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(lengths.astype(jnp.int32), q_rows, k_cache, v_cache, k_tree, v_tree, mask_rows)
    out_rows = _merge_splits(acc, m, denom).astype(q.dtype)
    return layout.ungroup_query_rows(out_rows, num_q_heads, num_nodes)
