"""The one home of version-sensitive Pallas APIs (jax 0.10.2 pinned here, 0.11.x on accelerator images).

Kernels import the names below instead of reaching into `jax.experimental.pallas.*` themselves, so a
rename between jax releases is handled here once. Each name falls back to its older spelling; when
neither exists the error says which jax is installed and which API is missing.

  squeezed                 BlockSpec entry for a dimension of size 1 dropped in the kernel
                           (`pl.squeezed`; older releases spelled it `None`).
  tpu_interpret_params     TPU interpret mode (simulated DMAs, race detection) for CPU runs.
  tpu_compiler_params      Mosaic compiler params (`pltpu.CompilerParams`, before: TPUCompilerParams).
  triton_compiler_params   Triton compiler params (`pltriton.CompilerParams`, before: TritonCompilerParams).
  PrefetchScalarGridSpec, VMEM   TPU grid spec with scalar prefetch, VMEM scratch shapes.
  kernel_launches          the pallas_calls of a traced program with their per-program blocks
                           (reads jaxpr internals: the grid mapping of each call).
  gpu_lowering_target      lowering a Triton kernel with no GPU present: jax 0.11 asks for the
                           target GPU as an abstract device (older releases lower without one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def _first(module: Any, *names: str) -> Any:
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(
        f"jax {jax.__version__}: {module.__name__} has none of {names}; "
        "update pallas_kernels/compat.py for this jax release"
    )


squeezed: Any = getattr(pl, "squeezed", None)
PrefetchScalarGridSpec = _first(pltpu, "PrefetchScalarGridSpec")
VMEM = _first(pltpu, "VMEM")


def tpu_interpret_params(**kwargs: Any) -> Any:
    """TPU interpret-mode parameters, e.g. tpu_interpret_params(detect_races=True)."""
    return _first(pltpu, "InterpretParams", "TPUInterpretParams")(**kwargs)


def tpu_compiler_params(**kwargs: Any) -> Any:
    """Mosaic (TPU) compiler parameters, e.g. dimension_semantics=("parallel", "arbitrary")."""
    return _first(pltpu, "CompilerParams", "TPUCompilerParams")(**kwargs)


def triton_compiler_params(**kwargs: Any) -> Any:
    """Triton (GPU) compiler parameters (num_warps, num_stages). Selecting them also selects the
    Triton lowering: plain `pl.pallas_call` defaults to Mosaic GPU on CUDA in recent releases."""
    from jax.experimental.pallas import triton as pltriton

    return _first(pltriton, "CompilerParams", "TritonCompilerParams")(**kwargs)


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One `pallas_call` found in a traced program: kernel name, the per-program block of every
    input/output operand (shape, dtype; squeezed dimensions as 1) and the scratch buffers."""

    name: str
    blocks: tuple[tuple[tuple[int, ...], jnp.dtype], ...]
    scratch: tuple[tuple[tuple[int, ...], jnp.dtype], ...]


def _block_dim(dim: Any) -> int:
    if dim is None:  # older releases: None for a squeezed dimension
        return 1
    if isinstance(dim, int):
        return dim
    size = getattr(dim, "block_size", None)
    return 1 if size is None else int(size)  # Squeezed() has no size


def kernel_launches(closed_jaxpr: Any) -> list[KernelLaunch]:
    """Every `pallas_call` in a traced program (`jax.make_jaxpr(f)(...)`), sub-jaxprs (jit, scan,
    cond, while) included, read from the call's grid mapping: the BlockSpecs the code actually used."""
    launches: list[KernelLaunch] = []

    def visit(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                mapping = eqn.params["grid_mapping"]
                blocks = tuple(
                    (
                        tuple(_block_dim(d) for d in bm.block_shape),
                        jnp.dtype(getattr(bm, "array_aval", getattr(bm, "array_shape_dtype", None)).dtype),
                    )
                    for bm in mapping.block_mappings
                )
                scratch = tuple(
                    (tuple(getattr(a, "inner_aval", a).shape), jnp.dtype(getattr(a, "inner_aval", a).dtype))
                    for a in mapping.scratch_avals
                )
                launches.append(KernelLaunch(str(eqn.params.get("name", "")), blocks, scratch))
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(closed_jaxpr.jaxpr)
    return launches


@contextlib.contextmanager
def gpu_lowering_target(device_kind: str = "NVIDIA H200") -> Iterator[None]:
    """Within this block, `.lower(lowering_platforms=("cuda",))` of a Triton kernel works on a
    machine without a GPU: the target is named as an abstract device (jax >= 0.11 reads the compute
    capability from it). Where jax has no abstract devices, nothing is needed and nothing is done."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    use_abstract_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
    if abstract_device is None or use_abstract_mesh is None:
        yield
        return
    device = abstract_device(device_kind=device_kind, num_cores=None, platform="cuda")
    with use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        yield
