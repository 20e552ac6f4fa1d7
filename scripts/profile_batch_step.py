"""Where a greedy autoregressive decode step spends its time at large batch, by component.

    python scripts/profile_batch_step.py --rows 16,64 [--max-len 256] [--fill 128] [--iters 8]

Each component is timed as its own step inside one compiled `lax.fori_loop`
(`jaxspec.bench.step_costs.median_loop_step_time`), as the generate loop runs it:

* full step: forward over one token + LM head + `sampling.sample_logits` (greedy rows: the first
  argmax of the logits) + output append, with the reference attention and with live-block attention
  (`jaxspec.model.live_attention`, what `jaxspec.decoding.continuous` decodes with on CPU);
* forward at S = max_len (reference and live-block attention) and at S = 16: the 30 layers (their
  matmuls + attention over the padded cache);
* LM head (tied embedding, [B, d] x [V, d]) + argmax;
* process_logits + sample_from_probs over the [B, V] logits (greedy rows), the path a batch with a
  sampled row takes, and `sample_logits`, the path of an all-greedy batch;
* output bookkeeping (`append_tokens`).

Rows hold `--fill` committed tokens each (the cache is padded to `--max-len`).

    python scripts/profile_batch_step.py --rows 64,16 --max-len 384 --fill 128 --iters 4 --attention-ab 7

times only the forward with the reference, live attention and live attention with a branch for every
128-block (the policy before `live_widths`), compiled once each and timed in
turn for 7 rounds (paired: a drifting machine load hits every variant alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics

import jax
import jax.numpy as jnp

import jaxspec
from jaxspec import sampling
from jaxspec.bench.step_costs import median_loop_step_time, paired_loop_step_times, step_loop
from jaxspec.config import SamplingParams
from jaxspec.decoding.output_buffer import OutputBuffer, append_tokens
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import live_attention


def profile(model: jaxspec.Model, rows: int, max_len: int, fill: int, iters: int) -> dict[str, float]:
    graphdef, params, config = model.graphdef, model.params, model.config
    samp = sampling.SamplingArrays.from_params(SamplingParams(), rows)
    seeds = jnp.zeros((rows,), jnp.int32)
    one = jnp.ones((rows, 1, 1), bool)
    eos = jnp.asarray([-1], jnp.int32)
    budget = jnp.full((rows,), 1 << 20, jnp.int32)

    def cache_of(size: int) -> KVCache:
        cache = KVCache.zeros(config, rows, size, model.dtype)
        return dataclasses.replace(cache, lengths=jnp.full((rows,), min(fill, size - 2), jnp.int32))

    def full(carry, params, token, attend=None):
        cache, out = carry
        hidden, _, cache = model_forward(
            graphdef, params, token[:, None], cache.lengths[:, None], cache, one, attend=attend
        )
        keys = sampling.derive_key(seeds, seeds, 1, sampling.PURPOSE_BONUS)
        new = sampling.sample_logits(lm_logits(graphdef, params, hidden[:, 0]), samp, keys)
        out, _ = append_tokens(out, new[:, None], jnp.ones((rows,), jnp.int32), budget, eos)
        out = dataclasses.replace(out, count=out.count % 64)  # never fills up
        return cache, out

    def forward(carry, params, token, attend=None):
        cache, acc = carry
        hidden, _, cache = model_forward(
            graphdef, params, token[:, None], cache.lengths[:, None], cache, one, attend=attend
        )
        return cache, acc + hidden[:, 0, :1]

    def head(carry, params, hidden):
        return carry + sampling.first_argmax(lm_logits(graphdef, params, hidden + carry[:, None] * 0))

    def process(carry, logits):
        probs = sampling.process_logits(logits + carry[:, None].astype(jnp.float32) * 0, samp)
        keys = sampling.derive_key(seeds, seeds, 1, sampling.PURPOSE_BONUS)
        return carry + sampling.sample_from_probs(probs, keys)

    def greedy(carry, logits):
        keys = sampling.derive_key(seeds, seeds, 1, sampling.PURPOSE_BONUS)
        return carry + sampling.sample_logits(logits + carry[:, None].astype(jnp.float32) * 0, samp, keys)

    def book(carry, token):
        out, _ = append_tokens(carry, token[:, None], jnp.ones((rows,), jnp.int32), budget, eos)
        return dataclasses.replace(out, count=out.count % 64)

    token = jnp.arange(rows, dtype=jnp.int32) + 100
    hidden = jax.random.normal(jax.random.key(0), (rows, config.hidden_size), model.dtype)
    logits = jax.random.normal(jax.random.key(1), (rows, config.vocab_size), jnp.float32)
    t = {}
    t["full step"] = median_loop_step_time(
        full, (cache_of(max_len), OutputBuffer.empty(rows, 128)), (params, token), iters=iters
    )
    t["full step, live attention"] = median_loop_step_time(
        functools.partial(full, attend=live_attention),
        (cache_of(max_len), OutputBuffer.empty(rows, 128)), (params, token), iters=iters,
    )  # fmt: skip
    t[f"forward S={max_len}"] = median_loop_step_time(
        forward, (cache_of(max_len), jnp.zeros((rows, 1), model.dtype)), (params, token), iters=iters
    )
    t[f"forward S={max_len}, live attention"] = median_loop_step_time(
        functools.partial(forward, attend=live_attention),
        (cache_of(max_len), jnp.zeros((rows, 1), model.dtype)), (params, token), iters=iters,
    )  # fmt: skip
    t["forward S=16"] = median_loop_step_time(
        forward, (cache_of(16), jnp.zeros((rows, 1), model.dtype)), (params, token), iters=iters
    )
    t["LM head + argmax"] = median_loop_step_time(
        head, jnp.zeros((rows,), jnp.int32), (params, hidden), iters=iters
    )
    t["process_logits + sample"] = median_loop_step_time(
        process, jnp.zeros((rows,), jnp.int32), (logits,), iters=iters
    )
    t["sample_logits (all rows greedy)"] = median_loop_step_time(
        greedy, jnp.zeros((rows,), jnp.int32), (logits,), iters=iters
    )
    t["append_tokens"] = median_loop_step_time(book, OutputBuffer.empty(rows, 128), (token,), iters=iters)
    return t


def attention_ab(
    model: jaxspec.Model, rows: int, max_len: int, fill: int, iters: int, rounds: int, variants: dict
) -> dict[str, list[float]]:
    """Seconds per forward step (cache padded to max_len, `fill` tokens per row) for each attention
    variant (name -> `attend`, None = the reference), each compiled once, then timed in turn for
    `rounds` rounds: a drifting machine load hits every variant alike."""
    graphdef, params, config = model.graphdef, model.params, model.config
    one = jnp.ones((rows, 1, 1), bool)
    token = jnp.arange(rows, dtype=jnp.int32) + 100
    zero = jnp.zeros((), jnp.int32)

    def carry() -> tuple[KVCache, jax.Array]:
        cache = KVCache.zeros(config, rows, max_len, model.dtype)
        cache = dataclasses.replace(cache, lengths=jnp.full((rows,), fill, jnp.int32))
        return cache, jnp.zeros((rows, 1), model.dtype)

    def forward(carry, params, token, attend):
        cache, acc = carry
        hidden, _, cache = model_forward(
            graphdef, params, token[:, None], cache.lengths[:, None], cache, one, attend=attend
        )
        return cache, acc + hidden[:, 0, :1]

    loops = {name: step_loop(functools.partial(forward, attend=a), iters) for name, a in variants.items()}
    carries = {
        name: jax.block_until_ready(loop(carry(), (params, token), zero)) for name, loop in loops.items()
    }
    return paired_loop_step_times(loops, carries, (params, token), iters=iters, rounds=rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default="16,64")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--fill", type=int, default=128)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument(
        "--attention-ab", type=int, default=0, metavar="ROUNDS",
        help="only the forward with reference vs live attention (its widths, and a branch for every "
        "128-block), interleaved for ROUNDS rounds",
    )  # fmt: skip
    args = p.parse_args()
    model = jaxspec.load(args.model)
    if args.attention_ab:
        every_block = tuple(sorted({min(w, args.max_len) for w in range(128, args.max_len + 128, 128)}))
        variants = {
            "reference": None,
            "live (live_widths)": live_attention,
            # the policy before: a branch for every multiple of 128, however close to the whole cache
            "live (every block)": functools.partial(live_attention, widths=every_block),
        }
        print(f"load average {os.getloadavg()[0]:.1f}, max_len {args.max_len}, fill {args.fill}", flush=True)
        for rows in args.rows.split(","):
            t = attention_ab(
                model, int(rows), args.max_len, args.fill, args.iters, args.attention_ab, variants
            )
            base = t["reference"]
            for name, times in t.items():
                ratio = statistics.median(b / x for b, x in zip(base, times, strict=True))
                print(
                    f"{rows} rows, forward with {name}: median {statistics.median(times) * 1e3:.1f} ms, "
                    f"{ratio:.2f}x the reference's speed (median of {len(times)} paired rounds)",
                    flush=True,
                )
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        return
    print(f"load average {os.getloadavg()[0]:.1f}, {model.dtype}, max_len {args.max_len}, fill {args.fill}")
    print("| component | " + " | ".join(f"{r} rows (ms)" for r in args.rows.split(",")) + " |")
    results = [profile(model, int(r), args.max_len, args.fill, args.iters) for r in args.rows.split(",")]
    print("|---|" + "---|" * len(results))
    for name in results[0]:
        print(f"| {name} | " + " | ".join(f"{r[name] * 1e3:.1f}" for r in results) + " |")
    for r, rows in zip(results, args.rows.split(","), strict=True):
        print(f"{rows} rows: {int(rows) / r['full step']:.0f} tok/s at the full step")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
