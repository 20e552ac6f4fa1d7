"""Batch throughput: autoregressive vs the batch-aware speculation policy, on the dev prompts.

    python scripts/bench_batch.py --prompts ../shared/prompts_dev.jsonl --max-new-tokens 128
    python scripts/bench_batch.py --prompts ../shared/prompts_dev.jsonl --max-new-tokens 128 --calibrate

For each batch size the dev prompts (chat template applied, repeated to fill the batch) give a few
batches (`--batches`, one count per batch size), their starts spread over the file so that batch 1
and 4 see every kind of prompt. Each batch is generated greedily, autoregressive and with the
policy's choice (`jaxspec.drafters.policy`, n-gram drafting: training-free). Every compiled shape is
warmed up first (compilation excluded); then the configurations run back to back on each batch, so a
drifting machine load hits them alike. tokens/s is the median over the batches, the speedup the
median of the per-batch ratios. Greedy speculation is lossless, so both columns generate the same
tokens (checked: the "same" column). A policy that turns speculation off at a batch size runs exactly
the autoregressive program: its column repeats the autoregressive number.

--calibrate also times n-gram drafting at each of --depths (and --topks) per batch size and prints the
fastest shape per batch size as a policy table (off where nothing beats autoregressive by --margin):
the measurements behind `jaxspec.drafters.policy.default_policy("cpu")`. Prints Markdown tables.

--continuous: offline throughput on a mixed workload, side by side in one run. --requests requests cycle
through the dev prompts with max_new_tokens drawn from --mixed-budgets (fixed seed); greedy,
autoregressive. For each --slots count: jaxspec static batches (`jaxspec.generate` on batches of that
size, sorted by length bucket as the batch job plans them), jaxspec continuous batching
(`jaxspec.decoding.continuous.generate_continuous`, its defaults: the prompts that recur in the workload,
here every dev prompt, prefilled once and copied at admits), the same with the prompt cache off
(`prompt_cache=False`: every request's prompt prefilled at its admit), with --shared-prefix also the
prompts' shared prefix, the chat template's system turn, prefilled once (`share_prefix=True`, no prompt
cache) and, with --peer, Hugging Face transformers batched `generate` (left padding, same batch size,
float32, each batch run to its largest budget, tokens past a request's own budget or EOS not counted).
Reports total tokens/s, total time, time to the first finished request and peak RSS; compilation is
excluded (every program is compiled first). Last, the workload's compute bound
(`jaxspec.bench.compute_bound`): its matrix-product FLOPs (real prompt tokens, no padding, attention
free; every request's prompt counted, so an engine that prefills a recurring prompt once can pass it) at
the rate one large dense product reaches on this machine, and each engine's share of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import statistics
import time

import jax

import jaxspec
from jaxspec.batch.summary import peak_rss_kib
from jaxspec.bench.compute_bound import dense_product_rate, token_flops, workload_flops
from jaxspec.compile_cache import enable_compile_cache
from jaxspec.config import SpecConfig
from jaxspec.drafters.policy import PolicyRule, SpeculationPolicy, choose_spec, describe_spec, load_policy
from jaxspec.model.buckets import length_bucket


@dataclasses.dataclass
class Measurement:
    """One configuration over all batches of one batch size."""

    label: str
    tokens_per_s: list[float]  # per batch
    token_ids: list[list[int]]  # every row of every batch, for the equality check
    decode_tokens: int = 0
    rounds: int = 0

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward after prefill, over all rows (token-weighted)."""
        return self.decode_tokens / self.rounds if self.rounds else 0.0

    def speedup_over(self, base: Measurement) -> float:
        """Median over batches of the paired ratio (both timed back to back on the same batch)."""
        return statistics.median(a / b for a, b in zip(self.tokens_per_s, base.tokens_per_s, strict=True))


def load_prompts(path: str, model: jaxspec.Model, chat: bool) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if chat:
        return [model.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    return [model.tokenizer.encode(t) for t in texts]


def make_batches(prompts: list[list[int]], batch_size: int, count: int) -> list[list[list[int]]]:
    """`count` batches of `batch_size` consecutive prompts (cycling through the list), their starts
    spread evenly over the list so small batches sample every kind of prompt in the file."""
    stride = max(len(prompts) // count, batch_size) if count > 1 else 0
    return [[prompts[(b * stride + i) % len(prompts)] for i in range(batch_size)] for b in range(count)]


def warmup_budget(max_new_tokens: int) -> int:
    """The smallest budget with the same new-token bucket (same compiled program, shorter run)."""
    bucket = length_bucket(max_new_tokens)
    return 1 if bucket <= 16 else bucket // 2 + 1


def measure(
    model: jaxspec.Model, batches: list[list[list[int]]], max_new_tokens: int, specs: list[SpecConfig | None]
) -> list[Measurement]:
    """Time every spec (None = autoregressive) on every batch. All programs are compiled first; then
    the specs run back to back on each batch, so a drifting machine load hits them alike."""
    for spec in specs:
        warmed = set()
        for batch in batches:
            bucket = length_bucket(max(len(p) for p in batch))
            if bucket not in warmed:
                jaxspec.generate(model, batch, max_new_tokens=warmup_budget(max_new_tokens), spec=spec)
                warmed.add(bucket)
    results = [Measurement(describe_spec(spec), [], []) for spec in specs]
    for batch in batches:
        for spec, result in zip(specs, results, strict=True):
            start = time.perf_counter()
            completions = jaxspec.generate(model, batch, max_new_tokens=max_new_tokens, spec=spec)
            seconds = time.perf_counter() - start
            result.tokens_per_s.append(sum(len(c.token_ids) for c in completions) / seconds)
            result.token_ids += [c.token_ids for c in completions]
            result.decode_tokens += sum(max(len(c.token_ids) - 1, 0) for c in completions)
            result.rounds += sum(c.stats["rounds"] for c in completions)
    return results


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def compare(args, model, prompts) -> list[dict]:
    policy = load_policy(args.policy_json)
    rows, results = [], []
    for batch_size in args.batch_sizes:
        batches = make_batches(prompts, batch_size, args.batches[batch_size])
        spec = choose_spec("auto", SpecConfig(method="ngram"), batch_size, policy)
        measured = measure(model, batches, args.max_new_tokens, [None] if spec is None else [None, spec])
        base, chosen = measured[0], measured[-1]
        speedup = chosen.speedup_over(base)
        same = "yes" if chosen.token_ids == base.token_ids else "NO"
        rows.append(
            [str(batch_size), chosen.label, f"{base.median_tokens_per_s:.1f}",
             f"{chosen.median_tokens_per_s:.1f}", f"{speedup:.2f}x", f"{chosen.mean_accepted_length:.2f}",
             same]
        )  # fmt: skip
        results.append(
            {"batch_size": batch_size, "policy": chosen.label,
             "autoregressive_tokens_per_s": base.tokens_per_s, "policy_tokens_per_s": chosen.tokens_per_s,
             "speedup": speedup, "mean_accepted_length": chosen.mean_accepted_length,
             "same_tokens": same == "yes"}
        )  # fmt: skip
        print(f"batch {batch_size}: {rows[-1]}", flush=True)
    header = ["batch", "policy", "autoregressive tok/s", "policy tok/s", "speedup", "mean accepted", "same"]
    print(markdown(header, rows))
    return results


def calibrate(args, model, prompts) -> list[dict]:
    rows, results, rules = [], [], []
    shapes = [(d, k) for k in args.topks for d in args.depths]
    for batch_size in args.batch_sizes:
        batches = make_batches(prompts, batch_size, args.batches[batch_size])
        specs = [SpecConfig(method="ngram", num_speculative_tokens=d, topk=k) for d, k in shapes]
        base, *measured = measure(model, batches, args.max_new_tokens, [None, *specs])
        row = [str(batch_size), f"{base.median_tokens_per_s:.1f}"]
        best = (1.0 + args.margin, None)
        for (depth, topk), m in zip(shapes, measured, strict=True):
            speedup = m.speedup_over(base)
            row.append(f"{speedup:.2f}x ({m.mean_accepted_length:.2f})")
            results.append(
                {"batch_size": batch_size, "depth": depth, "topk": topk, "speedup": speedup,
                 "tokens_per_s": m.tokens_per_s, "autoregressive_tokens_per_s": base.tokens_per_s,
                 "mean_accepted_length": m.mean_accepted_length, "same_tokens": m.token_ids == base.token_ids}
            )  # fmt: skip
            if speedup > best[0]:
                best = (speedup, (depth, topk))
        depth, topk = best[1] or (0, 1)
        rules.append(PolicyRule(max_batch=batch_size, num_speculative_tokens=depth, topk=topk))
        rows.append(row + [f"k={depth} topk={topk}" if depth else "off"])
        print(f"batch {batch_size}: {rows[-1]}", flush=True)
    header = ["batch", "autoregressive tok/s"] + [f"k={d} topk={k}" for d, k in shapes] + ["best"]
    print("speedup over autoregressive (mean accepted length):")
    print(markdown(header, rows))
    last_on = max((i for i, r in enumerate(rules) if r.num_speculative_tokens > 0), default=-1)
    print("suggested policy (--policy-json):")
    print(json.dumps(SpeculationPolicy(tuple(rules[: last_on + 1])).to_dict()))
    return results


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (`jaxspec.batch.summary.peak_rss_kib`)."""
    return peak_rss_kib() / 2**20


def kept_length(ids: list[int], budget: int, eos: tuple[int, ...]) -> int:
    """Tokens a request keeps: up to and including its first EOS, at most its budget."""
    for j, t in enumerate(ids[:budget]):
        if t in eos:
            return j + 1
    return min(len(ids), budget)


def run_static(model, prompts, budgets, batch_size):
    """jaxspec.generate over batches of `batch_size` (sorted by (prompt bucket, budget bucket)):
    (tokens, seconds, seconds to the first finished batch)."""
    order = sorted(
        range(len(prompts)), key=lambda i: (length_bucket(len(prompts[i])), length_bucket(budgets[i]), i)
    )
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    warmed = set()
    for b in batches:  # compile every shape first (same buckets, shortest budget)
        key = (
            len(b),
            length_bucket(max(len(prompts[i]) for i in b)),
            length_bucket(max(budgets[i] for i in b)),
        )
        if key not in warmed:
            warmed.add(key)
            jaxspec.generate(model, [prompts[i] for i in b], max_new_tokens=warmup_budget(key[2]))
    start, first, tokens = time.perf_counter(), None, 0
    for b in batches:
        out = jaxspec.generate(model, [prompts[i] for i in b], max_new_tokens=[budgets[i] for i in b])
        tokens += sum(len(c.token_ids) for c in out)
        first = first or time.perf_counter() - start
    return tokens, time.perf_counter() - start, first, {}


def run_continuous_batching(model, prompts, budgets, slots, share_prefix=False, prompt_cache=True):
    from jaxspec.decoding.continuous import compile_continuous, generate_continuous

    options = dict(share_prefix=share_prefix, prompt_cache=prompt_cache)
    compile_continuous(model, prompts, budgets, slots=slots, **options)
    first = []
    start = time.perf_counter()
    out = generate_continuous(
        model, prompts, max_new_tokens=budgets, slots=slots, **options,
        on_finished=lambda batch: first.append(time.perf_counter() - start) if not first else None,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    counted = {  # the whole run's, as the last call reported them
        key: max(c.stats[f"batch_{key}"] for c in out) for key in ("decode_steps", "prefill_positions")
    }
    return sum(len(c.token_ids) for c in out), seconds, first[0], counted


def run_hf(peer, prompts, budgets, batch_size):
    """transformers batched greedy generate, left padded, in the static batches' order."""
    import torch

    eos = peer.eos_token_ids
    pad = (*eos, 0)[0]
    order = sorted(
        range(len(prompts)), key=lambda i: (length_bucket(len(prompts[i])), length_bucket(budgets[i]), i)
    )
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def one(b):
        width = max(len(prompts[i]) for i in b)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in b])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in b])
        with torch.inference_mode():
            out = peer.model.generate(
                ids, attention_mask=mask, max_new_tokens=max(budgets[i] for i in b), do_sample=False,
                eos_token_id=list(eos), pad_token_id=pad,
            )  # fmt: skip
        return sum(kept_length(out[r, width:].tolist(), budgets[i], eos) for r, i in enumerate(b))

    one(batches[0][:2])  # warm-up
    start, first, tokens = time.perf_counter(), None, 0
    for b in batches:
        tokens += one(b)
        first = first or time.perf_counter() - start
    return tokens, time.perf_counter() - start, first, {}


def continuous(args, model, prompts) -> list[dict]:
    rng = random.Random(0)
    reqs = [prompts[i % len(prompts)] for i in range(args.requests)]
    budgets = [rng.choice(args.mixed_budgets) for _ in reqs]
    peer = None
    if args.peer:
        from jaxspec.bench.peer import load_peer

        peer = load_peer(model.source, model.eos_token_ids)
    print(
        f"{len(reqs)} requests, budgets {args.mixed_budgets} (mean {statistics.mean(budgets):.1f})",
        flush=True,
    )
    rows, results = [], []
    for slots in args.slots:
        uncached = functools.partial(run_continuous_batching, prompt_cache=False)
        engines = [
            ("jaxspec static batches", run_static),
            ("jaxspec continuous", run_continuous_batching),
            ("jaxspec continuous, no prompt cache", uncached),
        ]
        if args.shared_prefix:
            shared = functools.partial(run_continuous_batching, share_prefix=True, prompt_cache=False)
            engines.append(("jaxspec continuous, shared prefix, no prompt cache", shared))
        measured = {}
        if peer is not None:
            engines.append(("transformers batched", lambda _model, *rest: run_hf(peer, *rest)))
        for label, fn in engines:
            tokens, seconds, first, counted = fn(model, reqs, budgets, slots)
            measured[label] = (tokens, seconds, first, counted)
            print(
                f"slots {slots}: {label}: {tokens / seconds:.1f} tok/s, {seconds:.1f} s, first result "
                f"{first:.1f} s, load {os.getloadavg()[0]:.1f}, peak RSS {peak_rss_gib():.2f} GiB"
                + "".join(f", {key.replace('_', ' ')} {value}" for key, value in counted.items()),
                flush=True,
            )
        static_rate = measured["jaxspec static batches"][0] / measured["jaxspec static batches"][1]
        peer_rate = (
            measured["transformers batched"][0] / measured["transformers batched"][1] if peer else None
        )
        for label, (tokens, seconds, first, counted) in measured.items():
            rate = tokens / seconds
            vs_peer = [f"{rate / peer_rate:.2f}x"] if peer_rate else []
            rows.append([str(slots), label, f"{rate:.1f}", f"{rate / static_rate:.2f}x", *vs_peer,
                         f"{seconds:.1f}", f"{first:.1f}", str(tokens)])  # fmt: skip
            results.append({"slots": slots, "engine": label, "tokens": tokens, "seconds": seconds, **counted,
                            "first_result_s": first, "tokens_per_s": rate})  # fmt: skip
    header = ["slots / batch", "engine", "tok/s", "vs static", *(["vs transformers"] if peer else []),
              "total s", "first result s", "tokens"]  # fmt: skip
    print(markdown(header, rows))
    print(f"peak RSS {peak_rss_gib():.2f} GiB")
    tokens, prompt_tokens = results[0]["tokens"], sum(len(r) for r in reqs)
    rate = dense_product_rate()
    flops = workload_flops(token_flops(model), prompt_tokens, tokens, len(reqs))
    bound = tokens / (flops / rate)
    print(
        f"compute bound: {flops / 1e12:.2f} TFLOP of matrix products ({prompt_tokens} prompt "
        f"tokens, {tokens} new) at {rate / 1e9:.0f} GFLOP/s (one dense [2048, 576] x [576, 1536] product) "
        f"= {bound:.1f} tok/s; "
        + ", ".join(f"{r['engine']} (slots {r['slots']}) {r['tokens_per_s'] / bound:.0%}" for r in results)
    )
    for r in results:
        r.update(
            compute_bound_tokens_per_s=bound, dense_product_gflops=rate / 1e9, workload_tflop=flops / 1e12
        )
    return results


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--batches", type=int_list, default=[4, 2, 1, 1],
        help="timed batches per batch size (median over them): one count, or one per --batch-sizes entry",
    )  # fmt: skip
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--policy-json", default=None, help="policy table to compare (default: the built-in one)")
    p.add_argument("--calibrate", action="store_true", help="sweep draft shapes, print a policy table")
    p.add_argument("--depths", type=int_list, default=[1, 2, 3, 4])
    p.add_argument("--topks", type=int_list, default=[1])
    p.add_argument("--margin", type=float, default=0.05, help="calibrate: required speedup over 1.0")
    p.add_argument("--continuous", action="store_true", help="static vs continuous vs transformers")
    p.add_argument("--requests", type=int, default=256, help="--continuous: number of requests")
    p.add_argument(
        "--shared-prefix",
        action="store_true",
        help="--continuous: also continuous batching with the system turn prefilled once, no prompt cache",
    )
    p.add_argument("--mixed-budgets", type=int_list, default=[16, 32, 64, 128])
    p.add_argument("--slots", type=int_list, default=[16, 64], help="--continuous: slots = batch sizes")
    p.add_argument("--peer", action="store_true", help="--continuous: also transformers batched generate")
    p.add_argument(
        "--compilation-cache",
        default=None,
        help="JAX persistent compilation cache directory (`jaxspec.compile_cache`)",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if len(args.batches) == 1:
        args.batches = args.batches * len(args.batch_sizes)
    if len(args.batches) != len(args.batch_sizes):
        p.error("--batches: give one count, or one per --batch-sizes entry")
    args.batches = dict(zip(args.batch_sizes, args.batches, strict=True))
    if args.compilation_cache:
        enable_compile_cache(args.compilation_cache)
    model = jaxspec.load(args.model)
    prompts = load_prompts(args.prompts, model, chat=not args.no_chat)
    load_before = os.getloadavg()[0]
    print(
        f"{jax.default_backend()} x{jax.device_count()}, {os.cpu_count()} cpus, model {args.model} "
        f"({model.dtype}), {len(prompts)} prompts, greedy, max_new_tokens {args.max_new_tokens}, "
        f"batches per size {args.batches}, load average {load_before:.1f}",
        flush=True,
    )
    if args.continuous:
        results = continuous(args, model, prompts)
    elif args.calibrate:
        results = calibrate(args, model, prompts)
    else:
        results = compare(args, model, prompts)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
