"""Pallas tree-attention kernels against the jnp reference, on CPU in interpret mode.

The TPU kernel runs under TPU interpret mode (simulated DMAs, race detection, out-of-bounds reads
raise, scratch starts as NaN); the GPU (Triton) kernel under Pallas' generic interpreter. Both are
also lowered for their real backend (Mosaic / Triton IR) to catch unsupported ops without hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

from jaxspec.decoding.prefill import PREFILL_CHUNK
from jaxspec.sampling.tree import DraftTree, ancestor_mask
from pallas_kernels import (
    compat,
    dispatch,
    gpu,
    tpu,
    tree_attention,
    tree_attention_gpu,
    tree_attention_reference,
    tree_attention_tpu,
)

HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
CHECKED_TPU_INTERPRET = compat.tpu_interpret_params(
    detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
)
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    q_heads: int
    kv_heads: int
    nodes: int
    cache_len: int
    lengths: tuple[int, ...]
    dtype: type
    block_kv: int | None = None  # None: the kernel's own choice
    gpu_splits: int | None = None  # None: the GPU kernel's own choice
    invalid_tail: int = 0  # trailing padding nodes (valid=False)


CASES = {
    "single_node_empty_prefix_g1": Case(1, 2, 2, 1, 64, (0,), jnp.float32, block_kv=16),
    "g3_ragged_split_past_length": Case(2, 3, 1, 7, 96, (50, 96), jnp.float32, block_kv=32, gpu_splits=3),
    "g8_64_nodes_bf16": Case(4, 8, 1, 64, 128, (0, 1, 33, 128), jnp.bfloat16, block_kv=32, gpu_splits=2),
    "g3_auto_blocks_bf16": Case(3, 6, 2, 17, 256, (0, 129, 255), jnp.bfloat16),
    "g8_cache_len_not_power_of_two": Case(2, 16, 2, 13, 200, (199, 3), jnp.float32),
    "g1_padding_nodes": Case(1, 4, 4, 33, 160, (77,), jnp.float32, block_kv=32, gpu_splits=5, invalid_tail=5),
}


def random_tree_mask(rng: np.random.Generator, batch: int, nodes: int, invalid_tail: int) -> jax.Array:
    """[B, N, N] ancestor mask of random trees with parent[i] < i (last `invalid_tail` nodes padding)."""
    parent = np.full((batch, nodes), -1, np.int32)
    depth = np.zeros((batch, nodes), np.int32)
    for i in range(1, nodes):
        parent[:, i] = rng.integers(0, i, size=batch)
        depth[:, i] = depth[np.arange(batch), parent[:, i]] + 1
    valid = np.ones((batch, nodes), bool)
    valid[:, nodes - invalid_tail :] = False
    tree = DraftTree(
        tokens=jnp.zeros((batch, nodes), jnp.int32),
        parent=jnp.asarray(parent),
        depth=jnp.asarray(depth),
        valid=jnp.asarray(valid),
    )
    return jax.jit(ancestor_mask)(tree)


def make_inputs(case: Case, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), case.dtype)

    b, hkv, n = case.batch, case.kv_heads, case.nodes
    return dict(
        q=normal(b, case.q_heads, n, HEAD_DIM),
        k_cache=normal(b, hkv, case.cache_len, HEAD_DIM),
        v_cache=normal(b, hkv, case.cache_len, HEAD_DIM),
        lengths=jnp.asarray(case.lengths, jnp.int32),
        k_tree=normal(b, hkv, n, HEAD_DIM),
        v_tree=normal(b, hkv, n, HEAD_DIM),
        tree_mask=random_tree_mask(rng, b, n, case.invalid_tail),
    )


def run_quickly_compiled(fn, *args, **kwargs) -> jax.Array:
    """jit(fn)(*args, **kwargs) with XLA's CPU optimisations off: interpreted kernels are large HLO
    programs whose compile time, not run time, dominates these tests."""
    compiled = jax.jit(fn).trace(*args, **kwargs).lower().compile(compiler_options=FAST_CPU_COMPILE)
    return jax.block_until_ready(compiled(*args, **kwargs))


def run_tpu(inputs: dict[str, jax.Array], interpret=CHECKED_TPU_INTERPRET, **kwargs) -> jax.Array:
    kernel = functools.partial(tree_attention_tpu, scale=SCALE, interpret=interpret, **kwargs)
    out = run_quickly_compiled(kernel, **inputs)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    return out


def run_gpu(inputs: dict[str, jax.Array], **kwargs) -> jax.Array:
    kernel = functools.partial(tree_attention_gpu, scale=SCALE, interpret=True, **kwargs)
    return run_quickly_compiled(kernel, **inputs)


def assert_matches_reference(out: jax.Array, inputs: dict[str, jax.Array], dtype: type) -> None:
    """Compare rows that see at least one key; rows that see none must be exactly zero."""
    reference = functools.partial(tree_attention_reference, scale=SCALE)
    expected = np.asarray(run_quickly_compiled(reference, **inputs), np.float32)
    got = np.asarray(out, np.float32)
    assert got.shape == expected.shape and out.dtype == dtype
    sees_a_key = np.asarray(inputs["tree_mask"].any(-1) | (inputs["lengths"] > 0)[:, None])  # [B, N]
    rows = np.broadcast_to(sees_a_key[:, None, :], got.shape[:3])
    np.testing.assert_allclose(got[rows], expected[rows], atol=TOLERANCE[dtype], rtol=0)
    np.testing.assert_array_equal(got[~rows], 0.0)


@pytest.mark.parametrize("name", CASES)
def test_tpu_kernel_matches_reference(name: str) -> None:
    case = CASES[name]
    inputs = make_inputs(case)
    assert_matches_reference(run_tpu(inputs, block_kv=case.block_kv), inputs, case.dtype)


@pytest.mark.parametrize("name", CASES)
def test_gpu_kernel_matches_reference(name: str) -> None:
    case = CASES[name]
    inputs = make_inputs(case)
    out = run_gpu(inputs, block_kv=case.block_kv, num_splits=case.gpu_splits)
    assert_matches_reference(out, inputs, case.dtype)


def test_tpu_kernel_on_two_simulated_cores() -> None:
    """B and Hkv are "parallel" grid axes: splitting them over two cores must not race or change results."""
    case = CASES["g3_ragged_split_past_length"]
    inputs = make_inputs(case, seed=1)
    params = dataclasses.replace(CHECKED_TPU_INTERPRET, num_cores_or_threads=2)
    out = run_tpu(inputs, interpret=params, block_kv=case.block_kv)
    assert_matches_reference(out, inputs, case.dtype)


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_garbage_past_length_never_reaches_output(kernel: str) -> None:
    """NaN in cache slots at or past each row's length (as in a never-written cache) is ignored."""
    case = CASES["g3_ragged_split_past_length"]
    inputs = make_inputs(case, seed=2)
    unused = np.arange(case.cache_len)[None, None, :, None] >= np.asarray(case.lengths)[:, None, None, None]
    dirty = dict(inputs)
    dirty["k_cache"] = jnp.where(unused, jnp.nan, inputs["k_cache"])
    dirty["v_cache"] = jnp.where(unused, jnp.nan, inputs["v_cache"])
    run = run_tpu if kernel == "tpu" else run_gpu
    out = run(dirty, block_kv=32)
    assert np.isfinite(np.asarray(out)).all()
    assert_matches_reference(out, inputs, case.dtype)


def test_tpu_skipped_blocks_reuse_last_needed_block_index() -> None:
    """The cache index_map never points past a row's last needed block: skipped steps issue no DMA."""
    lengths = jnp.asarray([0, 1, 32, 33, 128], jnp.int32)
    got = [[int(tpu.cache_block_index(lengths, row, step, 32)) for step in range(4)] for row in range(5)]
    assert got == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 2, 3]]


def test_gpu_loop_visits_only_blocks_below_length() -> None:
    """Per split, the GPU loop trip count stops at the row's length (split_len 64, block 16)."""
    trips = {
        (length, split): int(gpu.blocks_to_visit(jnp.int32(length), split, 64, 16))
        for length in (0, 1, 16, 17, 64, 100, 128)
        for split in (0, 1)
    }
    assert trips == {
        (0, 0): 0, (0, 1): 0, (1, 0): 1, (1, 1): 0, (16, 0): 1, (16, 1): 0, (17, 0): 2, (17, 1): 0,
        (64, 0): 4, (64, 1): 0, (100, 0): 4, (100, 1): 3, (128, 0): 4, (128, 1): 4,
    }  # fmt: skip


@pytest.mark.parametrize(("platform", "kernel"), [("tpu", tree_attention_tpu), ("cuda", tree_attention_gpu)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [24, PREFILL_CHUNK])  # a verify tree; a prefill chunk
def test_kernel_lowers_for_its_backend(platform: str, kernel, dtype: type, n: int) -> None:
    """Pallas -> Mosaic (TPU) / Triton IR (GPU) lowering succeeds at verify and prefill-chunk shapes
    (Llama-3-8B heads), no device needed."""
    b, hq, hkv, s = 2, 32, 8, 4096
    spec = functools.partial(jax.ShapeDtypeStruct, dtype=dtype)
    args = (
        spec((b, hq, n, 128)),
        spec((b, hkv, s, 128)),
        spec((b, hkv, s, 128)),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        spec((b, hkv, n, 128)),
        spec((b, hkv, n, 128)),
        jax.ShapeDtypeStruct((b, n, n), jnp.bool_),
    )
    target = compat.gpu_lowering_target() if platform == "cuda" else contextlib.nullcontext()
    with target:  # jax 0.11 lowers Triton off-GPU only for a named target GPU
        lowered = (
            jax.jit(functools.partial(kernel, scale=0.1)).trace(*args).lower(lowering_platforms=(platform,))
        )
    custom_call = "tpu_custom_call" if platform == "tpu" else "triton"
    assert custom_call in lowered.as_text()


def test_dispatch_auto_is_reference_on_cpu_and_pallas_runs_inside_jit_scan() -> None:
    assert jax.default_backend() == "cpu"
    assert dispatch.resolve_impl("auto", "cpu") == "reference"
    assert dispatch.resolve_impl("auto", "tpu") == "tpu"
    assert dispatch.resolve_impl("auto", "gpu") == "gpu"
    assert dispatch.resolve_impl("pallas", "cpu") == "tpu"
    case = CASES["g3_ragged_split_past_length"]
    layers = [make_inputs(case, seed=s) for s in range(2)]
    stacked = {
        k: jnp.stack([layer[k] for layer in layers]) for k in layers[0] if k not in ("lengths", "tree_mask")
    }
    lengths, tree_mask = layers[0]["lengths"], layers[0]["tree_mask"]

    def all_layers(impl: str) -> jax.Array:
        def layer(carry, x):
            out = tree_attention(**x, lengths=lengths, tree_mask=tree_mask, scale=SCALE, impl=impl)
            return carry, out

        return run_quickly_compiled(lambda xs: jax.lax.scan(layer, 0, xs)[1], stacked)

    auto_jaxpr = str(jax.make_jaxpr(lambda x: tree_attention(**x, scale=SCALE))(layers[0]))
    assert "pallas_call" not in auto_jaxpr
    np.testing.assert_allclose(all_layers("pallas"), all_layers("reference"), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(**layers[0], scale=SCALE, impl="triton")


def test_shape_errors_name_the_operand() -> None:
    inputs = make_inputs(CASES["single_node_empty_prefix_g1"])
    inputs["v_tree"] = inputs["v_tree"][:, :, :0]
    with pytest.raises(ValueError, match="v_tree"):
        tree_attention_tpu(**inputs, scale=SCALE, interpret=CHECKED_TPU_INTERPRET)
