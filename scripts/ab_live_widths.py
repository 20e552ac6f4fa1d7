"""The continuous-batching workload of `scripts/bench_batch.py --continuous` with live attention's branch
widths as they are (`jaxspec.model.live_attention.live_widths`: 128-blocks up to half the cache, then the
whole cache) and as they were before (a branch for every 128-block), in turn for `--rounds` rounds.

    python scripts/ab_live_widths.py --prompts ../shared/prompts_dev.jsonl --rounds 2

The policy is a trace-time choice deep inside the compiled loop, so each variant is traced afresh (the
module's `live_widths` swapped, JAX's caches cleared, the persistent compilation cache off) and compiled
before it is timed; compilation is excluded. Prints tokens/s per round and variant, and the paired ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

os.environ["JAXSPEC_COMPILE_CACHE"] = "off"  # before jaxspec reads it: both variants really compile
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts.bench_batch from the checkout

import jax  # noqa: E402

import jaxspec  # noqa: E402
import jaxspec.model.live_attention as live  # noqa: E402
from scripts.bench_batch import load_prompts, run_continuous_batching  # noqa: E402


def every_block(cache_len: int, block: int = live.LIVE_BLOCK) -> list[int]:
    """The widths before `live_widths`: every multiple of `block`, then the cache."""
    return sorted({min(w, cache_len) for w in range(block, cache_len + block, block)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = jaxspec.load(args.model)
    prompts = load_prompts(args.prompts, model, chat=True)
    rng = random.Random(0)  # the budgets bench_batch.py --continuous draws
    requests = [prompts[i % len(prompts)] for i in range(args.requests)]
    budgets = [rng.choice([16, 32, 64, 128]) for _ in requests]
    variants = {"every block (before)": every_block, "live_widths (now)": live.live_widths}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, widths in variants.items():
            live.live_widths = widths
            jax.clear_caches()
            tokens, seconds, _, _ = run_continuous_batching(model, requests, budgets, args.slots)
            rates[name].append(tokens / seconds)
            print(f"round {round_index}, {name}: {tokens / seconds:.1f} tok/s ({seconds:.1f} s)", flush=True)
    before, now = rates.values()
    ratios = [n / b for n, b in zip(now, before, strict=True)]
    paired = " ".join(f"{r:.2f}x" for r in ratios)
    print(f"live_widths / every block: {paired} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
