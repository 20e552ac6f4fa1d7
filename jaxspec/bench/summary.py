"""Raw benchmark records -> summary rows (pure; no timing, no model).

A raw result is a dict:
  variants: [{label, method, engine, draft_length, tree_size, step_costs (StepCosts.to_dict() or None),
              compile_s, own_baseline}]
  runs:     [{label, batch_size, repeat, prompt_ids: [str], categories: [str], stats: [stats dict]}],
            one record per generate call (one batch), stats shaped like Completion.stats.
  baseline: the label of jaxspec autoregressive; a variant's "own_baseline" (default: baseline) is the
            autoregressive run of its own engine, its "speedup" column is measured against it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from jaxspec.bench import metrics, predictor

Run = dict[str, Any]


def runs_by_repeat(runs: Sequence[Run], keep: Callable[[Run], bool]) -> dict[int, list[list[dict]]]:
    """repeat -> list of batches (each a list of stats dicts) of the runs that `keep` selects."""
    out: dict[int, list[list[dict]]] = defaultdict(list)
    for run in runs:
        if keep(run):
            out[int(run["repeat"])].append(list(run["stats"]))
    return dict(out)


def summarize_selection(
    runs: Sequence[Run], variant: dict[str, Any], baseline: str, keep: Callable[[Run], bool]
) -> dict[str, Any]:
    """Metrics of one variant over the runs `keep` selects (same selection for the baseline)."""
    label = variant["label"]
    mine = runs_by_repeat(runs, lambda r: r["label"] == label and keep(r))
    repeats = sorted(mine)
    all_stats = [s for r in repeats for batch in mine[r] for s in batch]
    tps = [metrics.tokens_per_second(mine[r]) for r in repeats]
    tpot = [metrics.time_per_output_token(mine[r]) for r in repeats]

    def speedup_vs(reference: str) -> float | None:
        base = runs_by_repeat(runs, lambda r: r["label"] == reference and keep(r))
        paired = [r for r in repeats if r in base]
        if not paired:
            return None
        return metrics.median_speedup([base[r] for r in paired], [mine[r] for r in paired])

    row: dict[str, Any] = {
        "label": label,
        "method": variant["method"],
        "engine": variant.get("engine", "jaxspec"),
        "draft_length": variant.get("draft_length"),
        "tree_size": variant.get("tree_size"),
        "lookup_min_match": (variant.get("spec") or {}).get("lookup_min_match", 0),
        "token_map": (variant.get("spec") or {}).get("token_map"),
        "datastore": (variant.get("spec") or {}).get("datastore"),
        "branch_tokens": (variant.get("spec") or {}).get("branch_tokens"),
        "repeats": len(repeats),
        "new_tokens": metrics.total_new_tokens(mine[repeats[0]]) if repeats else 0,
        "tokens_per_s": metrics.median(tps),
        "tokens_per_s_all": tps,
        "time_per_token_ms": 1e3 * metrics.median(tpot),
        # vs the autoregressive run of the same engine (transformers rows: vs transformers greedy)
        "speedup": speedup_vs(variant.get("own_baseline") or baseline),
        "speedup_vs_jaxspec_ar": speedup_vs(baseline),
        "tau": metrics.mean_accepted_length(all_stats),
        "acceptance_by_depth": metrics.acceptance_rate_by_depth(all_stats),
        "reach_by_depth": metrics.reach_rate_by_depth(all_stats),
    }
    row.update(predicted_columns(row["tau"], variant))
    return row


def predicted_columns(tau: float, variant: dict[str, Any]) -> dict[str, Any]:
    """α fitted to τ, measured c and v, and the predicted speedups (None without speculation)."""
    costs = variant.get("step_costs")
    gamma = variant.get("draft_length") or (costs or {}).get("gamma")
    if variant["method"] in ("ar", "transformers") or not gamma or tau <= 0:
        return {"alpha": None, "c": None, "verify_over_decode": None, "predicted": None, "predicted_v": None}
    alpha = predictor.alpha_from_tau(tau, gamma)
    if costs is None:
        return {"alpha": alpha, "c": None, "verify_over_decode": None, "predicted": None, "predicted_v": None}
    c, v = costs["c"], costs["verify_over_decode"]
    formula = predictor.predicted_speedup(alpha, gamma, c)
    return {
        "alpha": alpha,
        "c": c,
        "verify_over_decode": v,
        "predicted": formula,
        # The formula assumes a verify forward costs one decode step; dividing by v removes that.
        "predicted_v": formula / v if v else None,
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Summary rows per (variant, batch size), per (variant, prompt category) at batch size 1, the
    greedy-parity check against the baseline and the headline ratios."""
    runs, baseline = raw["runs"], raw["baseline"]
    batch_sizes = sorted({int(r["batch_size"]) for r in runs})
    categories = sorted({c for r in runs for c in r["categories"]})
    rows, by_category = [], []
    for variant in raw["variants"]:
        for b in batch_sizes:
            if any(r["label"] == variant["label"] and r["batch_size"] == b for r in runs):
                row = summarize_selection(runs, variant, baseline, lambda r, b=b: r["batch_size"] == b)
                rows.append({**row, "batch_size": b})
        for cat in categories:

            def keep(r: Run, cat: str = cat) -> bool:
                return r["batch_size"] == 1 and all(c == cat for c in r["categories"])

            if any(r["label"] == variant["label"] and keep(r) for r in runs):
                by_category.append({**summarize_selection(runs, variant, baseline, keep), "category": cat})
    return {
        "rows": rows,
        "by_category": by_category,
        "parity": greedy_parity(runs, baseline),
        "headline": headline(rows, by_category, baseline),
    }


def greedy_parity(runs: Sequence[Run], baseline: str) -> dict[str, dict[str, int]]:
    """label -> {"same": n, "total": n}: prompts (per repeat, batch size 1) whose tokens equal the
    baseline's in the same repeat. With greedy decoding every lossless method must match."""
    reference = {
        (r["repeat"], pid): s.get("token_ids")
        for r in runs
        if r["label"] == baseline and r["batch_size"] == 1
        for pid, s in zip(r["prompt_ids"], r["stats"], strict=True)
    }
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"same": 0, "total": 0})
    for r in runs:
        if r["label"] == baseline or r["batch_size"] != 1:
            continue
        for pid, s in zip(r["prompt_ids"], r["stats"], strict=True):
            ref = reference.get((r["repeat"], pid))
            if ref is None or s.get("token_ids") is None:
                continue
            out[r["label"]]["total"] += 1
            out[r["label"]]["same"] += int(list(ref) == list(s["token_ids"]))
    return dict(out)


def headline(rows: Sequence[dict], by_category: Sequence[dict], baseline: str) -> dict[str, Any]:
    """jaxspec autoregressive vs transformers, and the best speculative variant per category."""
    at1 = {r["label"]: r for r in rows if r["batch_size"] == 1}
    out: dict[str, Any] = {}
    peer = next((r for r in at1.values() if r["method"] == "transformers"), None)
    if baseline in at1 and peer is not None and peer["tokens_per_s"] > 0:
        out["jaxspec_ar_over_transformers_ar"] = at1[baseline]["tokens_per_s"] / peer["tokens_per_s"]
    best: dict[str, tuple[str, float]] = {}
    for r in by_category:
        if r["engine"] == "jaxspec" and r["label"] != baseline and r["speedup"] is not None:
            if r["category"] not in best or r["speedup"] > best[r["category"]][1]:
                best[r["category"]] = (r["label"], r["speedup"])
    out["best_speedup_by_category"] = {c: {"label": lab, "speedup": s} for c, (lab, s) in best.items()}
    return out
