"""`tree_attention`: the one entry point the model calls; picks reference, TPU or GPU implementation.

impl="auto":      TPU kernel on a TPU backend, GPU (Triton) kernel on a GPU backend, jnp reference on CPU.
impl="pallas":    the kernel for the backend; on CPU (no kernel can compile) the TPU kernel in TPU
                  interpret mode, which simulates its DMAs, raises on out-of-bounds reads and runs
                  the race detector (prints "RACE DETECTED"; about 25% slower than without).
impl="reference": the jnp oracle everywhere.
The choice is made at trace time from static arguments, so the call nests in jit / lax.scan layer
loops like any jnp function.
"""

from __future__ import annotations

import jax

from pallas_kernels import compat
from pallas_kernels.gpu import tree_attention_gpu
from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tpu import tree_attention_tpu

IMPLS = ("auto", "reference", "pallas")


def resolve_impl(impl: str, backend: str) -> str:
    """Which implementation (impl, backend) runs: "reference", "tpu" or "gpu"."""
    if impl not in IMPLS:
        raise ValueError(f"tree attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and backend == "cpu"):
        return "reference"
    return "gpu" if backend in ("gpu", "cuda", "rocm") else "tpu"


def tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of N tree queries over each row's cache prefix [0, lengths[b]) plus the tree itself.

    Args:
      q: [B, Hq, N, D]; k_cache, v_cache: [B, Hkv, S, D]; lengths: [B] int32;
      k_tree, v_tree: [B, Hkv, N, D]; tree_mask: [B, N, N] bool (node i sees node j).
      scale: softmax scale.
      impl: "auto" | "reference" | "pallas" (see module docstring).
      interpret: run the Pallas kernel in interpret mode; None means "only where nothing can compile"
        (CPU). Ignored by the reference.
    Returns:
      [B, Hq, N, D] in q's dtype.
    """
    backend = jax.default_backend()
    chosen = resolve_impl(impl, backend)
    if chosen == "reference":
        return tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, scale=scale)
    if interpret is None:
        interpret = backend == "cpu"
    if chosen == "gpu":
        return tree_attention_gpu(
            q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, scale=scale, interpret=interpret
        )
    if backend == "cpu" and not interpret:
        raise ValueError("tree attention impl='pallas' on CPU runs only in interpret mode (interpret=True)")
    return tree_attention_tpu(
        q,
        k_cache,
        v_cache,
        lengths,
        k_tree,
        v_tree,
        tree_mask,
        scale=scale,
        interpret=compat.tpu_interpret_params(detect_races=True) if interpret else None,
    )
