"""Run statistics of a batch job: totals, per-batch throughput, acceptance by draft depth; printed as
a summary, optionally saved as JSON and plotted to a PNG."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class BatchRecord:
    """One generate call: rows, new tokens, wall seconds (compilation included on a first shape), and
    the speculation it ran with ("off" or e.g. "ngram k=4 topk=1")."""

    size: int
    tokens: int
    seconds: float
    speculation: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class RunStats:
    """Accumulated over the requests this run generated (skipped, resumed ids are not counted).

    mean accepted length = (new tokens - first tokens) / verify rounds: tokens per target forward after
    prefill (1.0 without speculation). accepted_by_depth[d] counts rounds whose draft at depth d + 1 was
    accepted; drafted_by_depth[d] counts rounds that drafted to that depth (their ratio is the
    acceptance rate at that depth).
    """

    requests: int = 0
    tokens: int = 0
    decode_tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0
    skipped_done: int = 0
    invalid: int = 0
    accepted_by_depth: list[int] = dataclasses.field(default_factory=list)
    drafted_by_depth: list[int] = dataclasses.field(default_factory=list)
    batches: list[BatchRecord] = dataclasses.field(default_factory=list)
    peak_rss_kib: int = 0  # the process's peak resident memory, KiB (`peak_rss_kib()`, set at the end)

    def add_batch(self, completions: Sequence[Any], seconds: float, speculation: str, depth: int) -> None:
        """Fold in one finished batch (`jaxspec.Completion`s) run with draft depth `depth` (0 = off)."""
        tokens = sum(len(c.token_ids) for c in completions)
        self.requests += len(completions)
        self.tokens += tokens
        self.seconds += seconds
        self.batches.append(BatchRecord(len(completions), tokens, seconds, speculation))
        for c in completions:
            self.decode_tokens += max(len(c.token_ids) - 1, 0)
            self.rounds += int(c.stats["rounds"])
        if depth == 0:
            return
        grow = depth - len(self.accepted_by_depth)
        if grow > 0:
            self.accepted_by_depth += [0] * grow
            self.drafted_by_depth += [0] * grow
        for c in completions:
            for d, count in enumerate(c.stats.get("accepted_by_depth", [])):
                self.accepted_by_depth[d] += int(count)
            for d in range(depth):
                self.drafted_by_depth[d] += int(c.stats["rounds"])

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.decode_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [
            a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.drafted_by_depth, strict=True)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth],
            "skipped_already_done": self.skipped_done,
            "invalid": self.invalid,
            "peak_rss_kib": self.peak_rss_kib,
            "batches": [
                {
                    **dataclasses.asdict(b),
                    "seconds": round(b.seconds, 3),
                    "tokens_per_s": round(b.tokens_per_s, 2),
                }
                for b in self.batches
            ],
        }


def peak_rss_kib() -> int:
    """The peak resident memory of this process so far, in KiB (`getrusage` ru_maxrss: KiB on Linux,
    bytes on macOS). Host memory only: an accelerator's memory is not in it."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def format_summary(stats: RunStats) -> str:
    """Human-readable summary, one fact per line."""
    lines = [
        f"requests: {stats.requests} generated, {stats.skipped_done} already done, {stats.invalid} invalid",
        f"tokens: {stats.tokens} in {stats.seconds:.1f} s = {stats.tokens_per_s:.1f} tokens/s "
        f"(compilation included)",
        f"mean accepted length: {stats.mean_accepted_length:.2f} tokens per target forward",
        f"peak RSS: {stats.peak_rss_kib / 1024:.1f} MiB (host memory of this process)",
    ]
    if stats.accepted_by_depth:
        rates = ", ".join(f"d{d + 1} {a:.0%}" for d, a in enumerate(stats.acceptance_by_depth))
        lines.append(f"acceptance by depth: {rates}")
    speculation = sorted({b.speculation for b in stats.batches})
    if speculation:
        lines.append(f"speculation: {'; '.join(speculation)}")
    return "\n".join(lines)


def write_summary_json(stats: RunStats, path: str | Path) -> None:
    Path(path).write_text(json.dumps(stats.to_dict(), indent=2) + "\n", encoding="utf-8")


def plot_summary(stats: RunStats, path: str | Path) -> None:
    """PNG with two panels: acceptance rate by draft depth, and tokens/s per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rates = stats.acceptance_by_depth
    if rates:
        left.bar([str(d + 1) for d in range(len(rates))], rates, color="tab:blue")
        left.set_ylim(0, 1)
    else:
        left.text(0.5, 0.5, "no speculation", ha="center", va="center", transform=left.transAxes)
    left.set_xlabel("draft depth")
    left.set_ylabel("acceptance rate")
    left.set_title(f"mean accepted length {stats.mean_accepted_length:.2f}")
    right.plot(range(1, len(stats.batches) + 1), [b.tokens_per_s for b in stats.batches], marker="o")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("batch")
    right.set_ylabel("tokens/s")
    right.set_title(f"{stats.tokens} tokens, {stats.tokens_per_s:.1f} tokens/s overall")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
