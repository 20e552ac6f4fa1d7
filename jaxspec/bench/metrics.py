"""Benchmark arithmetic: pure functions on lists of `Completion.stats` dicts.

A *run* is a list of batches; a batch is the list of the stats dicts of the completions that one
`jaxspec.generate` call returned (they share `batch_time_s`). Keys read: new_tokens, rounds,
batch_time_s and, for speculative methods, accepted_by_depth (list, entry d counts the rounds in which
the draft at depth d + 1 was accepted).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

Stats = dict[str, Any]
Batch = Sequence[Stats]


def mean_accepted_length(stats: Sequence[Stats]) -> float:
    """τ: tokens emitted per verify round, pooled over requests.

    The prefill's first token is not produced by a round, so τ = Σ(new_tokens − 1) / Σ rounds
    (1.0 for autoregressive decoding; 0.0 when there was no round at all).
    """
    rounds = sum(int(s["rounds"]) for s in stats)
    emitted = sum(max(int(s["new_tokens"]) - 1, 0) for s in stats)
    return emitted / rounds if rounds > 0 else 0.0


def accepted_counts_by_depth(stats: Sequence[Stats]) -> list[int]:
    """Σ over requests of accepted_by_depth, padded to the longest list ([] without speculation)."""
    depth = max((len(s.get("accepted_by_depth") or ()) for s in stats), default=0)
    totals = [0] * depth
    for s in stats:
        for d, count in enumerate(s.get("accepted_by_depth") or ()):
            totals[d] += int(count)
    return totals


def reach_rate_by_depth(stats: Sequence[Stats]) -> list[float]:
    """Entry d: fraction of rounds whose draft at depth d + 1 was accepted (so at least d + 1 drafts)."""
    rounds = sum(int(s["rounds"]) for s in stats)
    return [c / rounds if rounds else 0.0 for c in accepted_counts_by_depth(stats)]


def acceptance_rate_by_depth(stats: Sequence[Stats]) -> list[float]:
    """α_d: P(draft at depth d + 1 accepted | every shallower draft accepted), entry d.

    = accepted[d] / accepted[d − 1], with accepted[−1] = rounds; 0.0 where the parent depth was never
    reached (the rate is undefined there).
    """
    rounds = sum(int(s["rounds"]) for s in stats)
    rates = []
    reached = rounds
    for count in accepted_counts_by_depth(stats):
        rates.append(count / reached if reached else 0.0)
        reached = count
    return rates


def total_new_tokens(batches: Sequence[Batch]) -> int:
    return sum(int(s["new_tokens"]) for batch in batches for s in batch)


def total_time_s(batches: Sequence[Batch]) -> float:
    """Wall time of the run: each batch counted once (its completions share batch_time_s)."""
    return sum(float(batch[0]["batch_time_s"]) for batch in batches if batch)


def tokens_per_second(batches: Sequence[Batch]) -> float:
    """Throughput: all new tokens over all batch time."""
    elapsed = total_time_s(batches)
    return total_new_tokens(batches) / elapsed if elapsed > 0 else 0.0


def time_per_output_token(batches: Sequence[Batch]) -> float:
    """Latency a request sees per token: Σ batch time / Σ (most new tokens in the batch), seconds.

    Equals 1 / tokens_per_second at batch size 1.
    """
    steps = sum(max(int(s["new_tokens"]) for s in batch) for batch in batches if batch)
    return total_time_s(batches) / steps if steps else 0.0


def speedup(baseline_tokens_per_s: float, tokens_per_s: float) -> float:
    """How many times faster than the baseline (0.0 when the baseline is 0)."""
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s > 0 else 0.0


def median(values: Sequence[float]) -> float:
    """Median (0.0 for no values): benchmarks on shared machines report medians of repeats."""
    return float(statistics.median(values)) if values else 0.0


def median_speedup(baseline_runs: Sequence[Sequence[Batch]], runs: Sequence[Sequence[Batch]]) -> float:
    """Median over repeats of the per-repeat speedup (repeat r of `runs` vs repeat r of the baseline,
    which ran interleaved with it)."""
    if len(baseline_runs) != len(runs):
        raise ValueError(f"median_speedup: {len(baseline_runs)} baseline repeats vs {len(runs)} repeats")
    pairs = zip(baseline_runs, runs, strict=True)
    return median([speedup(tokens_per_second(b), tokens_per_second(r)) for b, r in pairs])
