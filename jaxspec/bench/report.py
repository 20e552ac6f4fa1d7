"""Benchmark output: Markdown tables, JSON, PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.bench import predictor


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(value: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _rates(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "–"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def main_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per (variant, batch size)."""
    header = [
        "method", "batch", "tokens/s", "ms/token", "speedup", "τ", "α (fit)", "c", "v = verify/decode",
        "predicted", "predicted ÷ v", "α by depth",
    ]  # fmt: skip
    body = []
    for r in rows:
        predicted = [_num(r["predicted"], ".2f", "×"), _num(r["predicted_v"], ".2f", "×")]
        measured = [
            _num(r["tokens_per_s"], ".1f"),
            _num(r["time_per_token_ms"], ".1f"),
            _num(r["speedup"], ".2f", "×"),
        ]
        fitted = [_num(r["tau"]), _num(r["alpha"]), _num(r["c"], ".3f"), _num(r["verify_over_decode"])]
        body.append(
            [
                r["label"],
                str(r["batch_size"]),
                *measured,
                *fitted,
                *predicted,
                _rates(r["acceptance_by_depth"]),
            ]
        )
    return _table(header, body)


def category_table(by_category: Sequence[dict[str, Any]]) -> list[str]:
    """Batch size 1, one column per prompt category: tokens/s (speedup, τ)."""
    categories = sorted({r["category"] for r in by_category})
    labels = list(dict.fromkeys(r["label"] for r in by_category))
    cell = {(r["label"], r["category"]): r for r in by_category}
    body = []
    for label in labels:
        line = [label]
        for cat in categories:
            r = cell.get((label, cat))
            line.append(
                "–"
                if r is None
                else f"{r['tokens_per_s']:.1f} ({_num(r['speedup'], '.2f', '×')}, τ {r['tau']:.2f})"
            )
        body.append(line)
    return _table(["method", *categories], body)


def cost_table(variants: Sequence[dict[str, Any]]) -> list[str]:
    """Separately jitted steps (median ms, batch 1) and warm-up (compile + one call) seconds."""
    body = []
    for v in variants:
        costs = v.get("step_costs") or {}
        ms = {
            k: (1e3 * costs[k] if k in costs else None)
            for k in ("prefill_s", "decode_s", "verify_s", "draft_s")
        }
        steps = [_num(ms["prefill_s"], ".1f"), _num(ms["decode_s"], ".1f"), _num(ms["verify_s"], ".1f")]
        draft = [str(costs.get("num_nodes", "–")), _num(ms["draft_s"], ".2f")]
        body.append([v["label"], *steps, *draft, _num(v.get("compile_s"), ".0f")])
    header = ["method", "prefill ms", "decode ms", "verify ms", "nodes", "draft round ms", "warm-up s"]
    return _table(header, body)


def markdown(raw: dict[str, Any], summary: dict[str, Any], command: str | None = None) -> str:
    """The whole report as Markdown."""
    s = raw["settings"]
    lines = ["# jaxspec benchmark", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"{s['num_prompts']} prompts, max_new_tokens {s['max_new_tokens']}, {s['repeats']} repeats "
        f"(medians), batch sizes {s['batch_sizes']}, sampling {s['sampling']}.",
        "",
        raw.get("environment", ""),
        "",
        "speedup: tokens/s over the same engine's autoregressive tokens/s in the same repeat (median of "
        "repeats). τ: tokens per verify round. α (fit): per-token acceptance that gives this τ at this draft "
        "length. c: draft round time / (γ × verify step time). predicted: (1 − α^(γ+1)) / ((1 − α)(γc + 1)); "
        "predicted ÷ v also charges the verify forward's cost over one decode step.",
        "",
    ]  # fmt: skip
    lines += main_table(summary["rows"]) + [""]
    if summary["by_category"]:
        lines += ["## By prompt category (batch size 1): tokens/s (speedup, τ)", ""]
        lines += category_table(summary["by_category"]) + [""]
    lines += ["## Step costs (each step timed alone inside a compiled loop, batch 1)", ""]
    lines += cost_table(raw["variants"]) + [""]
    headline = summary.get("headline", {})
    if "jaxspec_ar_over_transformers_ar" in headline:
        ratio = headline["jaxspec_ar_over_transformers_ar"]
        lines += [f"jaxspec autoregressive / transformers greedy (batch 1 tokens/s): {ratio:.2f}×", ""]
    if summary["parity"]:
        parity = ", ".join(f"{k} {v['same']}/{v['total']}" for k, v in summary["parity"].items())
        lines += [f"Greedy outputs identical to jaxspec autoregressive (prompts × repeats): {parity}", ""]
    for item in raw.get("skipped", []):
        lines.append(f"- skipped {item['label']}: {item['reason']}")
    return "\n".join(lines).rstrip() + "\n"


def plot_acceptance(summary: dict[str, Any], path: Path) -> None:
    """α_d against depth, one line per speculative variant (batch size 1)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary["rows"]:
        if r["batch_size"] == 1 and r["acceptance_by_depth"]:
            depths = range(1, len(r["acceptance_by_depth"]) + 1)
            ax.plot(depths, r["acceptance_by_depth"], marker="o", label=r["label"])
    ax.set(xlabel="draft depth d", ylabel="α_d = P(accept d | accepted d − 1)", ylim=(0, 1.05))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Acceptance rate by depth")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_speedup_vs_draft_length(summary: dict[str, Any], path: Path) -> None:
    """Measured and predicted speedup against γ, per method (chains, batch size 1)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    methods = dict.fromkeys(
        r["method"]
        for r in summary["rows"]
        if r["draft_length"] and not r["tree_size"] and r["batch_size"] == 1
    )
    for i, method in enumerate(methods):
        pts = sorted(  # plain chains (variants of a γ: lookup-first, a token map, are table rows)
            (
                (r["draft_length"], r)
                for r in summary["rows"]
                if r["method"] == method
                and r["batch_size"] == 1
                and not r["tree_size"]
                and r["draft_length"]
                and not r.get("lookup_min_match")
                and not r.get("token_map")
            ),
            key=lambda pt: pt[0],
        )
        gammas = [g for g, _ in pts]
        color = f"C{i}"
        ax.plot(gammas, [r["speedup"] or 0 for _, r in pts], "o-", color=color, label=f"{method} measured")
        if any(r["predicted"] is not None for _, r in pts):
            ax.plot(gammas, [r["predicted"] or 0 for _, r in pts], "s--", color=color, alpha=0.7,
                    label=f"{method} predicted")  # fmt: skip
            ax.plot(gammas, [r["predicted_v"] or 0 for _, r in pts], "^:", color=color, alpha=0.7,
                    label=f"{method} predicted ÷ v")  # fmt: skip
        fits = [(r["alpha"], r["c"]) for _, r in pts if r["alpha"] is not None and r["c"] is not None]
        if fits:
            alpha, c = (float(np.median(v)) for v in zip(*fits, strict=True))
            curve = np.arange(1, max(gammas) + 3)
            ax.plot(curve, [predictor.predicted_speedup(alpha, int(g), c) for g in curve], "-", color=color,
                    lw=0.6, alpha=0.5, label=f"{method} model, median α {alpha:.2f}, c {c:.3f}")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="draft length γ", ylabel="speedup vs autoregressive (same engine)")
    ax.set_title("Speedup vs draft length")
    if ax.lines[:-1]:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_speedup_vs_batch(summary: dict[str, Any], path: Path) -> None:
    """Speedup against batch size per speculative variant (the throughput view)."""

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["label"] for r in summary["rows"] if r["engine"] == "jaxspec"):
        pts = sorted((r["batch_size"], r["speedup"]) for r in summary["rows"] if r["label"] == label)
        if len(pts) > 1 and all(s is not None for _, s in pts):
            ax.plot([b for b, _ in pts], [s for _, s in pts], "o-", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup vs autoregressive (same batch size)")
    ax.set_title("Speculation vs batch size")
    if len(ax.lines) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_report(
    raw: dict[str, Any], summary: dict[str, Any], out_dir: str | Path, command: str | None = None
) -> dict[str, Path]:
    """Write bench.md, bench.json (raw + summary) and the PNGs into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / "bench.md",
        "json": out / "bench.json",
        "acceptance": out / "acceptance_by_depth.png",
        "speedup": out / "speedup_vs_draft_length.png",
    }
    paths["markdown"].write_text(markdown(raw, summary, command), encoding="utf-8")
    paths["json"].write_text(
        json.dumps({"command": command, "raw": raw, "summary": summary}, indent=1, default=str),
        encoding="utf-8",
    )
    plot_acceptance(summary, paths["acceptance"])
    plot_speedup_vs_draft_length(summary, paths["speedup"])
    if len({r["batch_size"] for r in summary["rows"]}) > 1:
        paths["batch"] = out / "speedup_vs_batch_size.png"
        plot_speedup_vs_batch(summary, paths["batch"])
    return paths
