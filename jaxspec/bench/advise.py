"""`jaxspec advise`: from a short calibration run (the benchmark on a few of the user's prompts),
recommend a method, its draft length / tree size, and the batch size above which to stop speculating.

`advise(summary)` is pure: it reads the rows `summary.summarize` produces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.bench import predictor


@dataclasses.dataclass(frozen=True)
class Advice:
    """label/method "ar" means: do not speculate. speedup: measured at batch size 1.
    speculation_off_above: the largest measured batch size up to which every measured batch size still
    gained (None: speculation helped at every measured batch size; 0: it did not help even at 1).
    predicted_best_draft_length / predicted_best_speedup: the speedup model's optimum for the chosen
    method's fitted α and measured c (chains only)."""

    label: str
    method: str
    draft_length: int | None
    tree_size: int | None
    speedup: float
    speculation_off_above: int | None
    largest_batch_measured: int
    predicted_best_draft_length: int | None = None
    predicted_best_speedup: float | None = None
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        if self.method == "ar":
            lines = [
                "Recommendation: autoregressive decoding "
                f"(no speculative method gained enough: best {self.speedup:.2f}×)."
            ]
        else:
            shape = (
                f"draft length {self.draft_length}"
                if self.tree_size is None
                else f"tree size {self.tree_size}"
            )
            lines = [
                f"Recommendation: {self.method}, {shape} ({self.label}): {self.speedup:.2f}× at batch size 1."
            ]
            if self.speculation_off_above is None:
                lines.append(
                    "Speculation still gained at the largest batch size measured "
                    f"({self.largest_batch_measured})."
                )
            else:
                lines.append(f"Turn speculation off above batch size {self.speculation_off_above}.")
        return "\n".join(lines + [f"- {n}" for n in self.notes])


def advise(summary: dict[str, Any], *, min_gain: float = 1.05, baseline: str = "ar") -> Advice:
    """Pick the fastest jaxspec variant at batch size 1 (when it beats autoregressive by min_gain),
    then find the batch size at which its gain over autoregressive ends."""
    rows = [r for r in summary["rows"] if r.get("engine", "jaxspec") == "jaxspec"]
    largest = max((r["batch_size"] for r in rows), default=1)
    candidates = [
        r for r in rows if r["batch_size"] == 1 and r["label"] != baseline and r["speedup"] is not None
    ]
    if not candidates:
        return Advice(
            baseline, "ar", None, None, 1.0, 0, largest, notes=("no speculative method was measured",)
        )
    best = max(candidates, key=lambda r: r["speedup"])
    if best["speedup"] < min_gain:
        note = f"fastest was {best['label']} at {best['speedup']:.2f}× (needs >= {min_gain:.2f}×)"
        return Advice(baseline, "ar", None, None, best["speedup"], 0, largest, notes=(note,))
    notes = []
    off_above = speculation_cutoff([r for r in rows if r["label"] == best["label"]])
    gamma_best = speedup_best = None
    if best.get("alpha") is not None and best.get("c") is not None and not best.get("tree_size"):
        gamma_best, speedup_best = predictor.best_draft_length(best["alpha"], best["c"])
        measured = sorted(
            r["draft_length"] for r in candidates if r["method"] == best["method"] and not r.get("tree_size")
        )
        if measured and not measured[0] <= gamma_best <= measured[-1]:
            notes.append(
                f"the speedup model (α {best['alpha']:.2f}, c {best['c']:.3f}) peaks at γ = {gamma_best} "
                f"({speedup_best:.2f}×), outside the measured {measured}: worth a run"
            )
        if best.get("verify_over_decode") and best["verify_over_decode"] > 1.2:
            notes.append(
                f"a verify forward costs {best['verify_over_decode']:.2f}× a decode step here; the model "
                "assumes 1×, so long drafts pay off less than it predicts"
            )
    return Advice(
        label=best["label"], method=best["method"], draft_length=best.get("draft_length"),
        tree_size=best.get("tree_size"), speedup=best["speedup"], speculation_off_above=off_above,
        largest_batch_measured=largest, predicted_best_draft_length=gamma_best,
        predicted_best_speedup=speedup_best, notes=tuple(notes),
    )  # fmt: skip


def speculation_cutoff(rows: list[dict[str, Any]], threshold: float = 1.0) -> int | None:
    """Rows of one variant at several batch sizes -> the largest batch size b such that the speedup is
    >= threshold at every measured batch size <= b; None when it holds at all of them, 0 when at none."""
    ordered = sorted((r["batch_size"], r["speedup"]) for r in rows if r["speedup"] is not None)
    last_good = 0
    for b, s in ordered:
        if s < threshold:
            return last_good
        last_good = b
    return None
