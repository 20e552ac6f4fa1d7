"""Prompt forward on the reference attention path: the whole padded cache vs the prompt's own keys.

    python scripts/bench_prefill_attention.py                      # SmolLM2-135M, CPU shapes below
    python scripts/bench_prefill_attention.py --shapes 2x96x385 --iters 9

A prefill (and the training feature pass) runs the prompt through the target as one causal forward
into an empty KV cache of S slots. The jnp reference attention scores every query against all S cache
slots, masked out because the cache is empty, and then against the prompt itself;
`jaxspec.model.live_attention.prompt_attention_for` reads only the cache positions before the prompt
(none, or a shared prefix's). Both variants run the same jitted `model_forward` in one process,
alternating, with the cache built outside the jit; the table gives median seconds per forward and their ratio.

Default shapes (rows x prompt width x cache slots): a 16-slot continuous-batching admit (2 x 96 x 385),
a 64-slot one (8 x 96 x 385), a static batch of 16 prompts at the dev bucket (16 x 256 x 385), and a
feature batch of `jaxspec train` (8 x 320 x 320).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jaxspec
from jaxspec.model.forward import causal_mask, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import cache_prefix_attention

DEFAULT_SHAPES = "2x96x385,8x96x385,16x256x385,8x320x320"


def parse_shape(text: str) -> tuple[int, int, int]:
    rows, width, slots = (int(x) for x in text.split("x"))
    if width > slots:
        raise SystemExit(f"--shapes {text}: a prompt of {width} tokens does not fit {slots} cache slots")
    return rows, width, slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated ROWSxWIDTHxSLOTS")
    p.add_argument("--iters", type=int, default=7, help="timed forwards per variant and shape")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model = jaxspec.load(args.model)

    def forward(tokens, cache, attend):
        b, n = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        hidden, _, _ = model_forward(
            model.graphdef, model.params, tokens, positions, cache, causal_mask(b, n),
            attention="reference", attend=attend,
        )  # fmt: skip
        return hidden

    variants = {
        "whole cache": jax.jit(lambda t, c: forward(t, c, None)),
        "prompt only": jax.jit(lambda t, c: forward(t, c, cache_prefix_attention(0))),
    }
    results = []
    print("| rows x width x slots | whole cache s | prompt only s | ratio | max abs diff |")
    print("|---|---|---|---|---|")
    for text in args.shapes.split(","):
        rows, width, slots = parse_shape(text)
        tokens = jax.random.randint(jax.random.key(0), (rows, width), 1, model.config.vocab_size)
        cache = KVCache.zeros(model.config, rows, slots, model.dtype)
        outputs = {name: jax.block_until_ready(fn(tokens, cache)) for name, fn in variants.items()}
        times = {name: [] for name in variants}
        for _ in range(args.iters):
            for name, fn in variants.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(tokens, cache))
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        diff = float(jnp.max(jnp.abs(outputs["whole cache"] - outputs["prompt only"])))
        ratio = medians["whole cache"] / medians["prompt only"]
        results.append({"rows": rows, "width": width, "slots": slots, "seconds": medians, "ratio": ratio,
                        "max_abs_diff": diff})  # fmt: skip
        print(
            f"| {rows} x {width} x {slots} | {medians['whole cache']:.3f} | {medians['prompt only']:.3f} | "
            f"{ratio:.2f}x | {diff:.1e} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
