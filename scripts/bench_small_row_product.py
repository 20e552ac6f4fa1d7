"""The target forward with its products as weight-left dots (`project`) vs x @ weight.T, paired.

    python scripts/bench_small_row_product.py --shapes 1x1,1x4,1x17,1x33,16x1,64x1,1x128 --rounds 7

Each shape is BxN: B rows of N new tokens each (1x4: a verify over 4 chain nodes at batch 1; 64x1: a
decode step of 64 slots), over a cache holding `--fill` tokens per row (padded to `--max-len`), with the
live attention the CPU loops decode with. "project" is `jaxspec.model.llama.project` as it is (one
dot_general with the weight as the left operand); "x @ weight.T" traces the same forward with 2-D
weights' products as `einsum("oi,...i->...o")`, which lowers to a dot with x on the left (the
formulation before). Each is compiled once, then the compiled loops are timed in turn for `--rounds`
rounds (a drifting machine load hits both alike). Prints, per shape, the median ms per forward of each
and the median of the paired ratios; `--json` writes them. XLA:CPU's choice of kernel depends on the
processor, so rerun it on a new machine before trusting the docstring's figures there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import jax
import jax.numpy as jnp

import jaxspec
from jaxspec.bench.step_costs import paired_loop_step_times, step_loop
from jaxspec.model import llama
from jaxspec.model.forward import causal_mask, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import live_attention

PROJECT = llama.project


def x_times_weight_t(weight: jax.Array, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """The formulation before `project`: 2-D weights as einsum("oi,...i->...o") (x @ weight.T)."""
    if weight.ndim != 2:
        return PROJECT(weight, x, out_dtype)
    return jnp.einsum("oi,...i->...o", weight, x.astype(weight.dtype), preferred_element_type=out_dtype)


VARIANTS = {"project": PROJECT, "x_at_weight_t": x_times_weight_t}


def paired_times(
    model: jaxspec.Model, batch: int, n: int, max_len: int, fill: int, iters: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per forward of `batch` rows x `n` tokens for each formulation, `rounds` paired rounds."""
    graphdef, config = model.graphdef, model.config
    tokens = (jnp.arange(batch * n, dtype=jnp.int32) % 1000 + 100).reshape(batch, n)
    mask = causal_mask(batch, n)
    zero = jnp.zeros((), jnp.int32)

    def carry() -> tuple[KVCache, jax.Array]:
        cache = KVCache.zeros(config, batch, max_len, model.dtype)
        return dataclasses.replace(cache, lengths=jnp.full((batch,), fill, jnp.int32)), jnp.zeros(
            (batch, 1), model.dtype
        )

    def forward(carry, params, tokens):
        cache, acc = carry
        positions = cache.lengths[:, None] + jnp.arange(n)[None, :]
        hidden, _, cache = model_forward(
            graphdef, params, tokens, positions, cache, mask, attend=live_attention
        )  # the cache's lengths stay: every iteration rewrites the same window
        return cache, acc + hidden[:, -1, :1]

    loops, carries = {}, {}
    try:
        for name, product in VARIANTS.items():
            llama.project = product  # read by Projection and lm_logits when the step is traced
            loops[name] = step_loop(forward, iters)
            carries[name] = jax.block_until_ready(loops[name](carry(), (model.params, tokens), zero))
    finally:
        llama.project = PROJECT
    return paired_loop_step_times(loops, carries, (model.params, tokens), iters=iters, rounds=rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shapes", default="1x1,1x4,1x17,1x33,16x1,64x1,1x128", help="BxN, comma-separated")
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--fill", type=int, default=128)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model = jaxspec.load(args.model)
    print(f"load average {os.getloadavg()[0]:.1f}, {model.dtype}, max_len {args.max_len}, fill {args.fill}")
    results = []
    for shape in args.shapes.split(","):
        batch, n = (int(v) for v in shape.split("x"))
        t = paired_times(model, batch, n, args.max_len, args.fill, args.iters, args.rounds)
        ratio = statistics.median(b / a for a, b in zip(t["project"], t["x_at_weight_t"], strict=True))
        row = {
            "shape": shape, "rows": batch * n,
            **{f"{name}_ms": statistics.median(t[name]) * 1e3 for name in VARIANTS},
            "project_speedup": ratio,
        }  # fmt: skip
        results.append(row)
        print(
            f"{shape} ({batch * n} rows): project {row['project_ms']:.1f} ms, x @ weight.T "
            f"{row['x_at_weight_t_ms']:.1f} ms: project {ratio:.2f}x as fast "
            f"(median of {args.rounds} paired rounds)",
            flush=True,
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
