"""Benchmark the Pallas tree-attention kernel against the jnp reference at verify-step shapes.

    python scripts/bench_kernels.py                       # on a TPU or GPU host
    python scripts/bench_kernels.py --peak-gbps 3350      # e.g. H100 instead of the H200 default
    python scripts/bench_kernels.py --interpret           # CPU: tiny sizes, TPU kernel interpreted

For each (batch, prefix, nodes) it times the kernel (`impl="pallas"`: the TPU kernel on TPU, the
Triton kernel on GPU) and the XLA-compiled reference, each inside one compiled loop over enough input
copies that K/V come from device memory rather than cache (`jaxspec.bench.kernels.loop_seconds`),
and reports the kernel's achieved fraction of peak memory bandwidth: bytes of K/V read (prefix
[0, length) plus the tree block) / time / peak. Every row of the cache is full (lengths = prefix), so
the reference reads the same bytes. The max |error| column compares the kernel with the reference
on the same inputs. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from jaxspec.bench.kernels import DEFAULT_PEAK_GBPS, input_copies, kv_bytes, loop_seconds, make_inputs
from pallas_kernels import tree_attention

INTERPRET_SIZES = dict(batches="1,2", prefixes="256,512", nodes="8", q_heads=4, kv_heads=2, head_dim=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes")
    p.add_argument("--prefixes", default="1024,8192,32768", help="comma-separated prefix lengths")
    p.add_argument("--nodes", default="8,64", help="comma-separated tree sizes N")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=20, help="timed calls per configuration")
    p.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="peak memory bandwidth in GB/s (default: 4800 on GPU = H200, 819 on TPU = v5e)",
    )
    p.add_argument("--interpret", action="store_true", help="CPU: run tiny sizes in interpret mode")
    args = p.parse_args(argv)
    if args.interpret:
        for name, value in INTERPRET_SIZES.items():
            setattr(args, name, value)
        args.dtype, args.iters = "float32", 2
    return args


def ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x]


def bench_one(batch: int, prefix: int, nodes: int, args: argparse.Namespace, peak_gbps: float | None) -> str:
    def make(seed: int) -> dict:
        return make_inputs(
            batch, prefix, nodes, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
            dtype=args.dtype, seed=seed,
        )  # fmt: skip

    inputs = make(0)
    copies = [inputs] if args.interpret else input_copies(inputs, make)
    scale = args.head_dim**-0.5
    kernel = functools.partial(tree_attention, scale=scale, impl="pallas")
    reference = functools.partial(tree_attention, scale=scale, impl="reference")
    t_kernel = loop_seconds(kernel, copies, args.iters)
    t_reference = loop_seconds(reference, copies, args.iters)
    kernel, reference = jax.jit(kernel), jax.jit(reference)
    error = float(jnp.max(jnp.abs(kernel(**inputs).astype(jnp.float32) - reference(**inputs))))
    gbps = kv_bytes(inputs) / t_kernel / 1e9
    fraction = f"{gbps / peak_gbps:.1%}" if peak_gbps else "n/a"
    return (
        f"| {batch} | {prefix} | {nodes} | {t_kernel * 1e6:.1f} | {t_reference * 1e6:.1f} | "
        f"{t_reference / t_kernel:.2f}x | {gbps:.1f} | {fraction} | {error:.2e} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend == "cpu" and not args.interpret:
        print(
            "bench_kernels: no TPU or GPU here (jax backend is 'cpu'); nothing to time. "
            "Run on an accelerator host, or pass --interpret for a tiny interpret-mode smoke run."
        )
        return 0
    peak_gbps = None if args.interpret else (args.peak_gbps or DEFAULT_PEAK_GBPS.get(backend))
    device = jax.devices()[0].device_kind
    mode = "interpret mode: times are meaningless" if args.interpret else f"peak {peak_gbps} GB/s"
    shape = f"Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}"
    print(f"# Tree attention: Pallas kernel vs jnp reference on {device} ({backend}, {mode})\n")
    print(f"{shape}; per call, {args.iters} calls timed inside one compiled loop (median of 3 loops)\n")
    columns = ["batch", "prefix", "nodes", "kernel us", "reference us", "speedup", "kernel GB/s", "of peak"]
    print("| " + " | ".join([*columns, "max abs err"]) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for batch in ints(args.batches):
        for prefix in ints(args.prefixes):
            for nodes in ints(args.nodes):
                print(bench_one(batch, prefix, nodes, args, peak_gbps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
