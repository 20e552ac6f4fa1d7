"""Benchmark arithmetic, the speedup model, the advisor and the report writer (no model needed)."""

import json

import pytest

from jaxspec.bench import metrics, predictor
from jaxspec.bench.advise import advise, speculation_cutoff
from jaxspec.bench.report import markdown, write_report
from jaxspec.bench.summary import summarize


def _stats(new_tokens, rounds, time_s, by_depth=None):
    s = {"new_tokens": new_tokens, "rounds": rounds, "batch_time_s": time_s}
    if by_depth is not None:
        s["accepted_by_depth"] = by_depth
    return s


# ---------------------------------------------------------------------------------------------- metrics


def test_mean_accepted_length_pools_requests_and_excludes_prefill_token():
    stats = [_stats(11, 4, 1.0), _stats(21, 5, 1.0)]  # (10 + 20) tokens from rounds over 9 rounds
    assert metrics.mean_accepted_length(stats) == pytest.approx(30 / 9)
    assert metrics.mean_accepted_length([_stats(1, 0, 0.1)]) == 0.0
    assert metrics.mean_accepted_length([_stats(9, 8, 1.0)]) == 1.0  # autoregressive


def test_acceptance_rates_by_depth_are_conditional_on_the_parent_depth():
    # 10 rounds: 8 accepted depth 1, 4 of those accepted depth 2, 1 of those depth 3.
    stats = [_stats(20, 6, 1.0, [5, 3, 1]), _stats(10, 4, 1.0, [3, 1, 0])]
    assert metrics.accepted_counts_by_depth(stats) == [8, 4, 1]
    assert metrics.reach_rate_by_depth(stats) == pytest.approx([0.8, 0.4, 0.1])
    assert metrics.acceptance_rate_by_depth(stats) == pytest.approx([0.8, 0.5, 0.25])
    # a depth never reached has rate 0, not a division error
    assert metrics.acceptance_rate_by_depth([_stats(3, 2, 1.0, [0, 0])]) == [0.0, 0.0]
    assert metrics.acceptance_rate_by_depth([_stats(9, 8, 1.0)]) == []


def test_throughput_latency_and_speedup():
    batch_a = [_stats(100, 99, 2.0), _stats(50, 49, 2.0)]  # one batch of 2: time counted once
    batch_b = [_stats(30, 29, 1.0)]
    run = [batch_a, batch_b]
    assert metrics.total_new_tokens(run) == 180
    assert metrics.total_time_s(run) == pytest.approx(3.0)
    assert metrics.tokens_per_second(run) == pytest.approx(60.0)
    # latency per token: 3 s over 100 + 30 steps
    assert metrics.time_per_output_token(run) == pytest.approx(3.0 / 130)
    assert metrics.time_per_output_token([batch_b]) == pytest.approx(1 / metrics.tokens_per_second([batch_b]))
    assert metrics.speedup(40.0, 60.0) == pytest.approx(1.5)
    assert metrics.speedup(0.0, 60.0) == 0.0


def test_median_speedup_pairs_repeats():
    base = [[[_stats(10, 9, 1.0)]], [[_stats(10, 9, 2.0)]], [[_stats(10, 9, 1.0)]]]
    fast = [[[_stats(10, 3, 0.5)]], [[_stats(10, 3, 0.5)]], [[_stats(10, 3, 0.8)]]]
    # per repeat: 2.0, 4.0, 1.25 -> median 2.0 (not the ratio of medians, 12.5 / 10)
    assert metrics.median_speedup(base, fast) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        metrics.median_speedup(base[:2], fast)


# -------------------------------------------------------------------------------------------- predictor


@pytest.mark.parametrize(
    "alpha, c, gamma, value",
    [(0.6, 0.05, 4, 1.92), (0.8, 0.05, 8, 3.09), (0.8, 0.2, 4, 1.87)],
)
def test_best_draft_length_matches_hand_worked_values(alpha, c, gamma, value):
    best_gamma, best = predictor.best_draft_length(alpha, c)
    assert best_gamma == gamma
    assert round(best, 2) == value


def test_predicted_speedup_formula_by_hand():
    # α=0.6, γ=4, c=0.05: (1 − 0.6^5) / (0.4 · 1.2) = 0.92224 / 0.48
    assert predictor.predicted_speedup(0.6, 4, 0.05) == pytest.approx(0.92224 / 0.48)
    # neighbours of the optimum are lower
    assert predictor.predicted_speedup(0.6, 3, 0.05) < predictor.predicted_speedup(0.6, 4, 0.05)
    assert predictor.predicted_speedup(0.6, 5, 0.05) < predictor.predicted_speedup(0.6, 4, 0.05)
    # α = 1: every draft accepted; c = 0: E[τ]
    assert predictor.predicted_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
    assert predictor.predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        predictor.predicted_speedup(1.2, 2, 0.1)
    with pytest.raises(ValueError):
        predictor.predicted_speedup(0.5, 0, 0.1)


def test_alpha_from_tau_inverts_expected_length():
    for alpha in (0.1, 0.5, 0.83):
        tau = predictor.expected_accepted_length(alpha, 5)
        assert predictor.alpha_from_tau(tau, 5) == pytest.approx(alpha, abs=1e-8)
    assert predictor.alpha_from_tau(1.0, 4) == 0.0
    assert predictor.alpha_from_tau(5.0, 4) == 1.0


# ---------------------------------------------------------------------------------------------- summary


def _raw(ar_times, spec_times, batch_sizes=(1,), spec_rounds=4):
    """Two prompts ('summ_1', 'chat_1'), 2 repeats; ngram γ=4 emits 17 tokens in spec_rounds rounds."""
    runs = []
    for b in batch_sizes:
        for repeat, (t_ar, t_spec) in enumerate(zip(ar_times[b], spec_times[b], strict=True)):
            for pid in ("summ_1", "chat_1"):
                cat = pid.split("_")[0]
                ar = {**_stats(17, 16, t_ar), "token_ids": [1] * 17}
                ng = {**_stats(17, spec_rounds, t_spec, [4, 3, 3, 2]), "token_ids": [1] * 17}
                for label, s in (("ar", ar), ("ngram γ=4", ng)):
                    runs.append({"label": label, "batch_size": b, "repeat": repeat, "prompt_ids": [pid],
                                 "categories": [cat], "stats": [s]})  # fmt: skip
    costs = {"prefill_s": 0.1, "decode_s": 0.05, "verify_s": 0.06, "draft_s": 0.002, "num_nodes": 5,
             "gamma": 4, "c": 0.002 / (4 * 0.06), "verify_over_decode": 1.2}  # fmt: skip
    variants = [
        {"label": "ar", "method": "ar", "engine": "jaxspec", "draft_length": None, "tree_size": None,
         "step_costs": None, "compile_s": 3.0},
        {"label": "ngram γ=4", "method": "ngram", "engine": "jaxspec", "draft_length": 4, "tree_size": None,
         "step_costs": costs, "compile_s": 4.0},
    ]  # fmt: skip
    settings = {"batch_sizes": list(batch_sizes), "max_new_tokens": 17, "repeats": 2, "sampling": {},
                "num_prompts": 2}  # fmt: skip
    return {"baseline": "ar", "variants": variants, "runs": runs, "settings": settings,
            "skipped": [{"label": "eagle γ=4", "reason": "no head"}]}  # fmt: skip


def test_summary_rows_speedup_tau_prediction_and_parity():
    raw = _raw({1: [1.0, 2.0]}, {1: [0.5, 0.5]})
    summary = summarize(raw)
    row = next(r for r in summary["rows"] if r["label"] == "ngram γ=4")
    assert row["speedup"] == pytest.approx(3.0)  # repeats: 2.0 and 4.0
    assert row["tau"] == pytest.approx(16 / 4)
    assert row["acceptance_by_depth"] == pytest.approx([1.0, 0.75, 1.0, 2 / 3])
    alpha = predictor.alpha_from_tau(4.0, 4)
    assert row["alpha"] == pytest.approx(alpha)
    expected = predictor.predicted_speedup(alpha, 4, 0.002 / 0.24)
    assert row["predicted"] == pytest.approx(expected)
    assert row["predicted_v"] == pytest.approx(expected / 1.2)
    ar_row = next(r for r in summary["rows"] if r["label"] == "ar")
    assert ar_row["speedup"] == pytest.approx(1.0) and ar_row["predicted"] is None
    assert {r["category"] for r in summary["by_category"]} == {"chat", "summ"}
    assert summary["parity"]["ngram γ=4"] == {"same": 4, "total": 4}


# ----------------------------------------------------------------------------------------------- advise


def test_advise_picks_fastest_and_finds_batch_cutoff():
    raw = _raw({1: [1.0, 1.0], 4: [1.0, 1.0], 16: [1.0, 1.0]}, {1: [0.5, 0.5], 4: [0.8, 0.8], 16: [1.5, 1.5]},
               batch_sizes=(1, 4, 16))  # fmt: skip
    advice = advise(summarize(raw))
    assert advice.method == "ngram" and advice.draft_length == 4
    assert advice.speedup == pytest.approx(2.0)
    assert advice.speculation_off_above == 4  # 2.0× at 1, 1.25× at 4, 0.67× at 16
    assert "above batch size 4" in advice.text()
    assert advice.predicted_best_draft_length is not None


def test_advise_falls_back_to_autoregressive_when_nothing_gains():
    raw = _raw({1: [1.0, 1.0]}, {1: [1.02, 0.99]})
    advice = advise(summarize(raw), min_gain=1.05)
    assert advice.method == "ar"
    assert "autoregressive" in advice.text()


def test_speculation_cutoff():
    rows = [{"batch_size": b, "speedup": s} for b, s in ((1, 1.8), (2, 1.4), (8, 0.9), (4, 1.1))]
    assert speculation_cutoff(rows) == 4
    assert speculation_cutoff([{"batch_size": 1, "speedup": 1.2}, {"batch_size": 8, "speedup": 1.1}]) is None
    assert speculation_cutoff([{"batch_size": 1, "speedup": 0.8}]) == 0


# ----------------------------------------------------------------------------------------------- report


def test_report_writes_table_json_and_pngs(tmp_path):
    raw = _raw({1: [1.0, 2.0], 4: [1.0, 1.0]}, {1: [0.5, 0.5], 4: [0.9, 0.9]}, batch_sizes=(1, 4))
    summary = summarize(raw)
    paths = write_report(raw, summary, tmp_path / "out", command="jaxspec bench --prompts p.jsonl")
    text = paths["markdown"].read_text()
    assert "jaxspec bench --prompts p.jsonl" in text
    assert "| ngram γ=4 | 1 |" in text and "3.00×" in text
    assert "skipped eagle γ=4: no head" in text
    data = json.loads(paths["json"].read_text())
    assert [(r["label"], r["batch_size"]) for r in data["summary"]["rows"]] == [
        ("ar", 1), ("ar", 4), ("ngram γ=4", 1), ("ngram γ=4", 4)
    ]  # fmt: skip
    assert len(data["raw"]["runs"]) == 16
    for key in ("acceptance", "speedup", "batch"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert markdown(raw, summary) == text.replace("```\njaxspec bench --prompts p.jsonl\n```\n\n", "")
