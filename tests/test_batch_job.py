"""Batch offline generation job: input validation, resumable output, per-request sampling, policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxspec.batch.job import main
from jaxspec.batch.requests import RequestDefaults, TokenizedRequest, parse_request, read_requests
from jaxspec.batch.results import open_results
from jaxspec.batch.schedule import plan_batches, plan_pending
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.drafters.policy import SpeculationPolicy, choose_spec, default_policy, load_policy
from jaxspec.errors import InputError, JaxspecError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import save_tiny

    directory = tmp_path_factory.mktemp("tiny_llama")
    save_tiny("llama", directory)
    return directory


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# Bad input: every case stops with `file:line: what is wrong`, exit code 2, nothing generated
# ---------------------------------------------------------------------------------------------------

BAD_LINES = [
    ('{"id": "ok", "prompt_ids": [1, 2]}', None),
    ('{"id": "x", "prompt_ids": [1, 2]', "malformed JSON: Expecting ',' delimiter (column 33)"),
    ('{"prompt_ids": [1]}', "missing 'id'"),
    ('{"id": "ok", "prompt_ids": [3]}', 'duplicate id "ok" (first on line 1)'),
    ('{"id": "n"}', "needs one of 'prompt', 'messages' or 'prompt_ids'"),
    (
        '{"id": "b", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
        "give only one of 'prompt', 'messages', 'prompt_ids' (got prompt, messages)",
    ),
    ('{"id": "t", "prompt_ids": [1], "temperature": -0.5}', "'temperature' must be a number >= 0, got -0.5"),
    ('{"id": "p", "prompt_ids": [1], "top_p": 0}', "'top_p' must be a number in (0, 1], got 0"),
    ('{"id": "m", "prompt_ids": [1], "max_new_tokens": 0}', "'max_new_tokens' must be >= 1, got 0"),
    ('{"id": "k", "prompt_ids": [1], "top_k": "5"}', "'top_k' must be an integer, got \"5\""),
    ('{"id": "s", "prompt_ids": [1], "seed": 1.5}', "'seed' must be an integer, got 1.5"),
    ("[1, 2]", "a request must be a JSON object, got list"),
    (
        '{"id": "u", "prompt_ids": [1], "temprature": 1}',
        "unknown field 'temprature' (known: id, prompt, messages, prompt_ids, max_new_tokens, "
        "temperature, top_k, top_p, seed, metadata)",
    ),
    ('{"id": true, "prompt_ids": [1]}', "'id' must be a string or an integer, got true"),
    (
        '{"id": "mm", "messages": [{"role": "user"}]}',
        '\'messages\'[0] must be {"role": string, "content": string}',
    ),
]


def test_each_bad_line_stops_the_job_with_file_line_message(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [text for text, _ in BAD_LINES])
    out = tmp_path / "out.jsonl"
    # The model path does not exist: line checks run (and stop the job) before any model is loaded.
    code = main(["--input", str(src), "--output", str(out), "--model", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2
    expected = [f"{src}:{n}: {message}" for n, (_, message) in enumerate(BAD_LINES, 1) if message]
    assert err.splitlines() == expected
    assert "Traceback" not in err
    assert not out.exists()


def test_model_dependent_checks_name_file_and_line(tmp_path, tiny_dir, capsys):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": 1, "prompt_ids": [1, 2, 3]},
            {"id": 2, "prompt_ids": [1] * 500, "max_new_tokens": 20},
            {"id": 3, "prompt": "hello"},
            {"id": 4, "prompt_ids": [5, 320]},
        ],
    )
    out = tmp_path / "out.jsonl"
    code = main(["--input", str(src), "--output", str(out), "--model", str(tiny_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        f"{src}:2: prompt of 500 tokens + max_new_tokens 20 = 520 exceeds the model's context of 512",
        f"{src}:3: 'prompt' needs a tokenizer but the model has none: give 'prompt_ids' instead",
        f"{src}:4: 'prompt_ids' has token id 320, outside the vocabulary [0, 320)",
    ]
    assert not out.exists()


def test_bad_flags_are_errors_without_traceback(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    base = ["--input", str(src), "--output", str(tmp_path / "o.jsonl")]
    assert main([*base, "--temperature", "-1"]) == 2
    assert "command-line default: 'temperature' must be a number >= 0, got -1.0" in capsys.readouterr().err
    assert main([*base, "--policy", "fixed"]) == 2
    assert "--policy fixed needs --spec" in capsys.readouterr().err
    assert main([*base, "--spec", "nope"]) == 2
    assert "--spec: SpecConfig.method must be None or one of" in capsys.readouterr().err
    assert main([*base, "--policy-json", '{"rules": [{"max_batch": 0, "num_speculative_tokens": 2}]}']) == 2
    assert "need max_batch >= 1" in capsys.readouterr().err
    assert main(["--input", str(src), "--output", str(src)]) == 2
    assert "--output must not be the --input file" in capsys.readouterr().err


def test_cli_routes_generate_input_to_the_job(tmp_path, capsys):
    from jaxspec.cli import main as cli_main

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1], "top_k": -1}])
    assert cli_main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err == f"{src}:1: 'top_k' must be >= 0, got -1\n"


def test_defaults_fill_missing_parameters():
    defaults = RequestDefaults(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11)
    request = parse_request('{"id": 5, "prompt": "x", "top_p": 0.5, "seed": 2}', 1, defaults)
    assert (request.max_new_tokens, request.seed) == (7, 2)
    assert (request.sampling.temperature, request.sampling.top_k, request.sampling.top_p) == (0.5, 3, 0.5)
    assert request.key == "5"


def test_int_and_string_ids_collide(tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}, "", {"id": "1", "prompt_ids": [2]}]
    )
    requests, issues = read_requests(src, RequestDefaults())
    assert [r.id for r in requests] == [1]
    assert [str(i) for i in issues] == [f'{src}:3: duplicate id "1" (first on line 1)']


# ---------------------------------------------------------------------------------------------------
# Output repair, batch planning, policy (no model)
# ---------------------------------------------------------------------------------------------------


def _record(request_id) -> dict:
    return {"id": request_id, "text": "", "token_ids": [], "finish_reason": "stop", "stats": {}}


def test_open_results_cuts_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    writer, _, _ = open_results(out)
    with writer:
        writer.append([_record("a"), _record(2)])
        torn = json.dumps(_record("c")).encode() + b"\n"
        writer.owned.begin_append(len(torn))  # a kill while writing: announced, half on disk
        writer.write_raw(torn[:15])
    writer, done, removed = open_results(out)
    with writer:
        writer.append([{**_record("c"), "text": "again"}])
    assert done == {"a", "2"} and removed == 15
    assert [r["id"] for r in read_jsonl(out)] == ["a", 2, "c"]


def test_open_results_refuses_a_corrupt_middle_line(tmp_path):
    out = tmp_path / "out.jsonl"
    writer, _, _ = open_results(out)
    with writer:
        writer.append([_record("a")])
        line = b'{"id": "b"}\n'  # an incomplete record (no text, token_ids, ...) does not count as done
        writer.owned.begin_append(len(line))
        writer.write_raw(line)
        writer.owned.end_append(len(line))
    with pytest.raises(JaxspecError, match=rf"{out}:2: not a complete result record"):
        open_results(out)


def test_plan_batches_groups_by_length_bucket_in_input_order():
    def item(line: int, prompt_len: int, max_new: int = 8) -> TokenizedRequest:
        request = parse_request(
            json.dumps({"id": line, "prompt_ids": [1], "max_new_tokens": max_new}), line, RequestDefaults()
        )
        return TokenizedRequest(request, tuple(range(prompt_len)))

    items = [item(1, 40), item(2, 5), item(3, 41), item(4, 6), item(5, 7, max_new=100)]
    batches = plan_batches(items, batch_size=2)
    assert [[i.request.line for i in b] for b in batches] == [[2, 4], [5, 1], [3]]


def test_policy_picks_shape_by_batch_size_and_turns_off():
    policy = SpeculationPolicy.from_dict(
        {
            "rules": [
                {"max_batch": 4, "num_speculative_tokens": 2},
                {"max_batch": 1, "num_speculative_tokens": 5, "topk": 2},
            ]
        }
    )
    base = SpecConfig(method="ngram", ngram_max=3)
    one = choose_spec("auto", base, 1, policy)
    assert (one.num_speculative_tokens, one.topk, one.ngram_max) == (5, 2, 3)
    assert choose_spec("auto", base, 3, policy).num_speculative_tokens == 2
    assert choose_spec("auto", base, 5, policy) is None
    assert choose_spec("auto", None, 1, policy).method == "ngram"
    assert choose_spec("fixed", base, 64, policy) is base
    assert choose_spec("off", base, 1, policy) is None
    assert load_policy(None) is default_policy()
    assert default_policy("cpu").spec_for(base, 1) is None  # measured on the dev CPU: never pays there
    assert default_policy("cpu").rule_for(4) is None
    assert default_policy("tpu").spec_for(base, 1).num_speculative_tokens == 4
    assert load_policy(json.dumps(policy.to_dict())) == policy
    with pytest.raises(InputError):
        SpeculationPolicy.from_dict({"rules": [{"max_batch": 2, "depth": 3}]})


# ---------------------------------------------------------------------------------------------------
# Generation: per-request parameters, batch independence, --skip-invalid
# ---------------------------------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 10, 11, 12, 10, 11], [20, 21, 22, 23]]


@pytest.mark.slow
def test_per_request_parameters_and_batch_independence(tmp_path, tiny_dir):
    import jaxspec

    requests = [
        {"id": "greedy0", "prompt_ids": PROMPTS[0], "temperature": 0},
        {"id": "greedy1", "prompt_ids": PROMPTS[1], "temperature": 0, "max_new_tokens": 5},
        {"id": "hot", "prompt_ids": PROMPTS[0], "seed": 7},
        {"id": "top1", "prompt_ids": PROMPTS[0], "top_k": 1, "seed": 8},
        {"id": "bad", "prompt_ids": PROMPTS[2], "top_p": 1.5},
        {"id": "hot2", "prompt_ids": PROMPTS[2], "seed": 7, "metadata": {"k": [1]}},
        {"id": "nucleus", "prompt_ids": PROMPTS[3], "top_p": 1e-6},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    common = [
        "--input", str(src), "--model", str(tiny_dir), "--max-new-tokens", "12", "--temperature", "5.0",
        "--spec", "ngram", "--num-speculative-tokens", "2", "--policy", "fixed", "--skip-invalid",
        "--no-progress",
    ]  # fmt: skip
    assert main([*common, "--output", str(tmp_path / "b4.jsonl"), "--batch-size", "4"]) == 0
    assert main([*common, "--output", str(tmp_path / "b1.jsonl"), "--batch-size", "1"]) == 0
    in_batch = {r["id"]: r for r in read_jsonl(tmp_path / "b4.jsonl")}
    alone = {r["id"]: r for r in read_jsonl(tmp_path / "b1.jsonl")}

    assert read_jsonl(tmp_path / "b4.jsonl.errors.jsonl") == [
        {"file": str(src), "line": 5, "id": "bad", "error": "'top_p' must be a number in (0, 1], got 1.5"}
    ]
    assert sorted(in_batch) == sorted(r["id"] for r in requests if r["id"] != "bad")
    # Same request, same tokens, alone or in a batch of 4 (greedy and sampled alike).
    assert {k: r["token_ids"] for k, r in in_batch.items()} == {k: r["token_ids"] for k, r in alone.items()}
    assert in_batch["hot2"]["metadata"] == {"k": [1]}
    assert {r["stats"]["batch_size"] for r in alone.values()} == {1}

    model = jaxspec.load(str(tiny_dir))
    greedy = jaxspec.generate(model, [PROMPTS[0], PROMPTS[1], PROMPTS[3]], max_new_tokens=[12, 5, 12])
    assert in_batch["greedy0"]["token_ids"] == greedy[0].token_ids
    assert in_batch["greedy1"]["token_ids"] == greedy[1].token_ids  # its own max_new_tokens = 5
    assert len(in_batch["greedy1"]["token_ids"]) == 5 and in_batch["greedy1"]["finish_reason"] == "length"
    assert in_batch["top1"]["token_ids"] == greedy[0].token_ids  # top_k = 1 at temperature 5 is greedy
    assert in_batch["nucleus"]["token_ids"] == greedy[2].token_ids  # so is a tiny nucleus
    assert in_batch["hot"]["token_ids"] != greedy[0].token_ids  # temperature 5 samples
    assert all(len(r["token_ids"]) == 12 for k, r in in_batch.items() if k != "greedy1")


# ---------------------------------------------------------------------------------------------------
# Resume after SIGKILL (subprocesses)
# ---------------------------------------------------------------------------------------------------

# Runs the job with one hook: after the `at`-th batch is written ("after"), halfway through writing it
# ("torn": the first record and half of the second reach the disk; the first write from the `at`-th on
# with 2+ records), or with the batch computed but not yet written ("inflight"), it prints PAUSED and
# sleeps until the test kills it with SIGKILL.
DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    import jaxspec.batch.job as job
    from jaxspec.batch.results import ResultWriter

    mode, at = os.environ["KILL_MODE"], int(os.environ.get("KILL_AT", "0"))
    calls = {"write": 0, "generate": 0}

    def pause():
        print("PAUSED", flush=True)
        time.sleep(600)

    original_append = ResultWriter.append

    def append(self, records):
        calls["write"] += 1
        if mode == "torn" and calls["write"] >= at and len(records) >= 2:  # the first 2+ record write
            lines = [json.dumps(r).encode() + b"\\n" for r in records]
            self.owned.begin_append(len(lines[0] + lines[1]))
            self.write_raw(lines[0] + lines[1][: len(lines[1]) // 2])
            pause()
        original_append(self, records)
        if mode == "after" and calls["write"] == at:
            pause()

    original_generate = job._generate_batch

    def generate(*args):
        calls["generate"] += 1
        result = original_generate(*args)
        if mode == "inflight" and calls["generate"] == at:
            pause()
        return result

    ResultWriter.append = append
    job._generate_batch = generate
    sys.exit(job.main(sys.argv[1:]))
    """
)


def run_driver(tmp_path: Path, args: list[str], mode: str, at: int = 0) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, KILL_MODE=mode, KILL_AT=str(at), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    proc = subprocess.Popen(
        [sys.executable, str(driver), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    if mode == "none":
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        return
    for line in proc.stdout:
        if line.strip() == "PAUSED":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    proc.stderr.close()
    proc.stdout.close()


def complete_ids(path: Path) -> list:
    data = path.read_bytes()
    return [json.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()]


@pytest.mark.slow
def test_resume_after_sigkill_at_several_points(tmp_path, tiny_dir):
    requests = [
        {"id": f"r{i}", "prompt_ids": [1 + i, 2 + i, 3 + i], "max_new_tokens": 6 + i} for i in range(8)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    # Policy: speculate (n-gram, k=2) only on single-row batches; greedy output must not change.
    policy = '{"rules": [{"max_batch": 1, "num_speculative_tokens": 2}]}'
    common = [
        "--input", str(src), "--model", str(tiny_dir), "--batch-size", "2", "--policy-json", policy,
        "--no-progress", "--batching", "static",
    ]  # fmt: skip
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    run_driver(tmp_path, [*common, "--output", str(reference)], "none")

    args = [*common, "--output", str(out)]
    run_driver(tmp_path, args, "after", at=1)  # killed right after the first batch was written
    assert complete_ids(out) == ["r0", "r1"] and out.read_bytes().endswith(b"\n")
    run_driver(tmp_path, args, "torn", at=1)  # killed while writing: one line and a half on disk
    assert complete_ids(out) == ["r0", "r1", "r2"] and not out.read_bytes().endswith(b"\n")
    run_driver(tmp_path, args, "inflight", at=2)  # killed with its second batch computed, unwritten
    assert complete_ids(out) == ["r0", "r1", "r2", "r3"]  # r3 (its planned batch's rest), not r4, r5
    run_driver(tmp_path, args, "none")  # finishes the job

    final = read_jsonl(out)
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == len(requests)
    by_id = {r["id"]: (r["token_ids"], r["finish_reason"]) for r in final}
    assert by_id == {r["id"]: (r["token_ids"], r["finish_reason"]) for r in read_jsonl(reference)}
    assert {r["stats"]["speculation"] for r in read_jsonl(reference)} == {"off"}
    # Each request ran with its planned batch's shape (2 rows: off), however the kills split the job.
    assert [r["stats"]["speculation"] for r in final] == ["off"] * len(requests)
    assert all(len(by_id[r["id"]][0]) == r["max_new_tokens"] for r in requests)
    run_driver(tmp_path, args, "none")  # a rerun of a finished job writes nothing
    assert read_jsonl(out) == final


@pytest.mark.slow
def test_continuous_job_killed_twice_resumes_to_the_uninterrupted_output(tmp_path, tiny_dir):
    """256 requests of very different lengths (greedy and sampled) through 16 continuously refilled
    slots, results streamed every 8 loop iterations; SIGKILL once halfway through a write and once just
    after one, at points drawn at random; the rerun finishes the job: every id exactly once, each with
    the tokens of the uninterrupted run."""
    import random

    rng = random.Random(17)
    requests = []
    for i in range(256):
        request = {
            "id": f"q{i}",
            "prompt_ids": [rng.randrange(1, 320) for _ in range(rng.randint(1, 20))],
            "max_new_tokens": rng.choice([1, 2, 5, 9, 17, 33, 40]),
        }
        if i % 3 == 0:
            request.update(temperature=1.0, top_k=rng.choice([0, 8]), seed=rng.randrange(1000))
        requests.append(request)
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    common = ["--input", str(src), "--model", str(tiny_dir), "--batch-size", "16", "--steps-per-call", "8"]
    common += ["--no-progress"]
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    run_driver(tmp_path, [*common, "--output", str(reference)], "none")
    expected = read_jsonl(reference)
    assert sorted(r["id"] for r in expected) == sorted(r["id"] for r in requests)
    assert [r["id"] for r in expected] != [r["id"] for r in requests]  # streamed as they finished
    assert {(r["stats"]["batch_size"], r["stats"]["speculation"]) for r in expected} == {(16, "off")}

    args = [*common, "--output", str(out)]
    run_driver(tmp_path, args, "torn", at=rng.randint(2, 6))  # killed halfway through a write
    first = complete_ids(out)
    assert 0 < len(first) < len(requests) and not out.read_bytes().endswith(b"\n")
    run_driver(tmp_path, args, "after", at=rng.randint(2, 6))  # killed right after a write
    second = complete_ids(out)
    assert len(first) < len(second) < len(requests) and second[: len(first)] == first
    run_driver(tmp_path, args, "none")

    final = read_jsonl(out)
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == len(requests)  # nothing lost, nothing twice
    assert {r["id"]: (r["token_ids"], r["finish_reason"]) for r in final} == {
        r["id"]: (r["token_ids"], r["finish_reason"]) for r in expected
    }


def test_plan_pending_keeps_each_requests_planned_batch_size():
    def item(i: int) -> TokenizedRequest:
        request = parse_request(json.dumps({"id": f"r{i}", "prompt_ids": [1]}), i + 1, RequestDefaults())
        return TokenizedRequest(request, (1,))

    items = [item(i) for i in range(5)]
    done = {items[0].request.key, items[1].request.key, items[2].request.key}
    plan = plan_pending(items, 2, done)
    assert [([i.request.id for i in batch], rows) for batch, rows in plan] == [(["r3"], 2), (["r4"], 1)]
    assert plan_pending(items, 2, {i.request.key for i in items}) == []


@pytest.mark.slow
def test_resume_with_policy_auto_and_sampling_gives_the_uninterrupted_tokens(tmp_path, tiny_dir):
    """Static batches: --policy auto picks the draft shape from each batch's row count (here k=3 alone,
    k=1 at 2 rows). A kill mid-write leaves r0..r2; the resumed r3 and r4 must keep their planned batches
    ([r2, r3]: 2 rows, [r4]: 1 row), not be re-planned as one 2-row batch: sampled tokens depend on the
    shape."""
    requests = [
        {
            "id": f"r{i}",
            "prompt_ids": [5, 6, 5, 6, 5, 6 + i],
            "max_new_tokens": 12,
            "temperature": 1.0,
            "seed": i,
        }
        for i in range(5)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    rules = [{"max_batch": 1, "num_speculative_tokens": 3}, {"max_batch": 2, "num_speculative_tokens": 1}]
    policy = json.dumps({"rules": rules})
    common = ["--input", str(src), "--model", str(tiny_dir), "--batch-size", "2", "--policy-json", policy]
    common += ["--no-progress", "--batching", "static"]
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    run_driver(tmp_path, [*common, "--output", str(reference)], "none")
    args = [*common, "--output", str(out)]
    run_driver(tmp_path, args, "torn", at=2)  # [r0, r1] written, then r2 and half of r3
    assert complete_ids(out) == ["r0", "r1", "r2"]
    run_driver(tmp_path, args, "none")
    expected = {r["id"]: (r["token_ids"], r["stats"]["speculation"]) for r in read_jsonl(reference)}
    assert {r["id"]: (r["token_ids"], r["stats"]["speculation"]) for r in read_jsonl(out)} == expected
    assert expected["r4"][1] == "ngram k=3 topk=1" and expected["r3"][1] == "ngram k=1 topk=1"


# ---------------------------------------------------------------------------------------------------
# Continuous batching with n-gram speculation
# ---------------------------------------------------------------------------------------------------

# Self-repeating prompts (prompt lookup finds drafts), budgets from 2 to 30, greedy and sampled.
NGRAM_JOB = [
    {"id": f"s{i}", "prompt_ids": (pattern * 6)[:length], "max_new_tokens": budget, **sampled}
    for i, (pattern, length, budget, sampled) in enumerate(
        [
            ([242, 287, 52], 9, 30, {}),
            ([314], 8, 2, {"temperature": 1.0, "seed": 3}),
            ([123, 73], 12, 20, {}),
            ([155], 8, 5, {}),
            ([24, 294], 14, 30, {"temperature": 0.7, "top_p": 0.9, "seed": 5}),
            ([77, 20], 5, 9, {}),
            ([47, 42, 164, 261], 11, 3, {"temperature": 1.0, "seed": 8}),
        ]
    )
]
SPECULATE_AT_4 = '{"rules": [{"max_batch": 4, "num_speculative_tokens": 2}]}'


def assert_each_result_matches_the_request_alone(out, model_dir, spec, label: str, batch_size: int) -> None:
    """Every result of the job's output has the tokens, rounds and acceptance `jaxspec.generate` gives
    its request alone with `spec`, seed and id, and the speculation label `label`."""
    import jaxspec
    from jaxspec.decoding.generate import request_id_from_string

    records = {r["id"]: r for r in read_jsonl(out)}
    assert list(records) != [r["id"] for r in NGRAM_JOB]  # streamed as they finished
    model = jaxspec.load(str(model_dir))
    for request in NGRAM_JOB:
        record = records[request["id"]]
        sampling = SamplingParams(request.get("temperature", 0.0), top_p=request.get("top_p", 1.0))
        (alone,) = jaxspec.generate(
            model, [request["prompt_ids"]], max_new_tokens=request["max_new_tokens"], sampling=sampling,
            seed=request.get("seed", 0), request_ids=[request_id_from_string(request["id"])], spec=spec,
        )  # fmt: skip
        assert record["token_ids"] == alone.token_ids, request["id"]
        stats = record["stats"]
        assert (stats["speculation"], stats["batch_size"]) == (label, batch_size)
        assert stats["rounds"] == alone.stats["rounds"]
        assert stats["accepted_by_depth"] == alone.stats["accepted_by_depth"]
        assert stats["mean_accepted_length"] == round(alone.stats["mean_accepted_length"], 4)


def test_continuous_job_speculates_with_ngram_and_matches_each_request_alone(tmp_path, tiny_dir):
    """--policy auto speculating at the slot count (4): every result says ngram k=2 with its own
    rounds and acceptance, and each request's tokens are those `jaxspec.generate` gives it alone with
    that spec, seed and id."""
    src = write_jsonl(tmp_path / "in.jsonl", NGRAM_JOB)
    out = tmp_path / "out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--model", str(tiny_dir), "--batch-size", "4"]
    assert main([*args, "--policy-json", SPECULATE_AT_4, "--steps-per-call", "3", "--no-progress"]) == 0
    spec = SpecConfig(method="ngram", num_speculative_tokens=2)
    assert_each_result_matches_the_request_alone(out, tiny_dir, spec, "ngram k=2 topk=1", 4)
    assert max(r["stats"]["mean_accepted_length"] for r in read_jsonl(out)) > 1.0


def test_continuous_job_drafts_with_a_head_inside_the_loop(tmp_path, tiny_dir, monkeypatch):
    """A continuous job drafting with an EAGLE-3 head (random, --policy fixed): the head runs in the
    continuous loop (results streamed as they finish), each request with the tokens, rounds and
    acceptance it gets alone."""
    import jaxspec.batch.job as job

    src = write_jsonl(tmp_path / "in.jsonl", NGRAM_JOB)
    out = tmp_path / "out.jsonl"
    fields = {
        "method": "eagle3",
        "head": "random",
        "num_speculative_tokens": 2,
        "extra": {"draft_vocab_size": 96},
    }
    args = ["--input", str(src), "--output", str(out), "--model", str(tiny_dir), "--batch-size", "3"]
    monkeypatch.setattr(job, "generate_batches", None)  # a static batch would fail here
    assert main([*args, "--policy", "fixed", "--spec", json.dumps(fields), "--steps-per-call", "3",
                 "--no-progress"]) == 0  # fmt: skip
    spec = SpecConfig.from_dict(fields)
    assert_each_result_matches_the_request_alone(out, tiny_dir, spec, "eagle3 k=2 topk=1", 3)


@pytest.mark.slow
def test_speculating_continuous_job_killed_twice_resumes_to_the_uninterrupted_output(tmp_path, tiny_dir):
    """The n-gram continuous job above, 4 slots, results every 3 iterations: killed halfway through a
    write and just after one, then rerun: every id once, each with the uninterrupted run's tokens and
    stats (the draft shape depends only on --batch-size)."""
    src = write_jsonl(tmp_path / "in.jsonl", NGRAM_JOB)
    common = ["--input", str(src), "--model", str(tiny_dir), "--batch-size", "4", "--steps-per-call", "3"]
    common += ["--policy-json", SPECULATE_AT_4, "--no-progress"]
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    run_driver(tmp_path, [*common, "--output", str(reference)], "none")
    expected = {
        r["id"]: (r["token_ids"], r["stats"]["rounds"], r["stats"]["speculation"])
        for r in read_jsonl(reference)
    }
    assert {speculation for _, _, speculation in expected.values()} == {"ngram k=2 topk=1"}
    args = [*common, "--output", str(out)]
    run_driver(tmp_path, args, "torn", at=2)
    first = complete_ids(out)
    assert 0 < len(first) < len(NGRAM_JOB)
    run_driver(tmp_path, args, "after", at=1)
    assert len(complete_ids(out)) > len(first)
    run_driver(tmp_path, args, "none")
    final = read_jsonl(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in NGRAM_JOB)  # nothing lost or twice
    assert {
        r["id"]: (r["token_ids"], r["stats"]["rounds"], r["stats"]["speculation"]) for r in final
    } == expected


# ---------------------------------------------------------------------------------------------------
# Memory: the batch size the job runs fits the budget; peak RSS in the summary
# ---------------------------------------------------------------------------------------------------


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays or of jax.ShapeDtypeStructs."""
    import math

    import jax

    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def test_memory_estimate_equals_the_caches_the_decoding_loops_allocate(tiny_dir, monkeypatch):
    """`decode_memory_bytes` at `cache_length` equals the weights plus the cache the continuous loop's
    state holds and the cache the static loops' prefill builds (autoregressive, and n-gram tree
    drafting with its window's extra positions); `kv_cache_bytes` also matches an MLA cache."""
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec.decoding import generate as generate_module
    from jaxspec.decoding import speculative
    from jaxspec.decoding.continuous import prepare_continuous
    from jaxspec.decoding.generate import cache_length, check_requests
    from jaxspec.decoding.prefill import prefill
    from jaxspec.model.deepseek_v3.config import DeepseekV3Config
    from jaxspec.model.kv_cache import KVCache, decode_memory_bytes, kv_cache_bytes

    model = jaxspec.load(str(tiny_dir))
    weights = tree_bytes(model.params)
    prompts, budgets = [[1] * 20, [2, 3]], [5, 40]  # length buckets 32 and 64

    class Stop(Exception):
        pass

    def prefilled_cache_bytes(*args, config, max_len, **kwargs):
        """Stands in for the static loops: the bytes of the cache their prefill builds, nothing run."""
        requests = args[-1]
        cache = jax.eval_shape(lambda: prefill(model.graphdef, model.params, config, requests, max_len).cache)
        raise Stop(requests.prompt_tokens.shape[0], max_len, tree_bytes(cache))

    monkeypatch.setattr(generate_module, "generate_autoregressive", prefilled_cache_bytes)
    monkeypatch.setattr(speculative, "speculative_loop", prefilled_cache_bytes)
    lengths = []
    for spec in (None, SpecConfig(method="ngram", num_speculative_tokens=3, topk=2)):
        positions = cache_length(model, spec, 20, 40)
        lengths.append(positions)
        checked = check_requests(model, prompts, budgets, None, 0, None)
        state, _ = prepare_continuous(model, checked, 3, None, spec)
        assert state.cache.max_len == positions
        assert kv_cache_bytes(model.config, 3, positions, model.dtype) == tree_bytes(state.cache)
        assert decode_memory_bytes(model.config, model.params, 3, positions) == weights + tree_bytes(
            state.cache
        )
        with pytest.raises(Stop) as static:
            jaxspec.generate(model, prompts, budgets, spec=spec)
        rows, max_len, allocated = static.value.args
        assert (rows, max_len) == (2, positions)
        assert decode_memory_bytes(model.config, model.params, 2, positions) == weights + allocated
    assert lengths[0] == 32 + 64 + 1 and lengths[1] > lengths[0]  # the tree window's room
    mla = DeepseekV3Config(96, 32, 48, 3, 4, 4, 12, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12)
    cache = KVCache.zeros(mla, 2, 7, jnp.bfloat16)
    assert kv_cache_bytes(mla, 2, 7, jnp.bfloat16) == tree_bytes(cache) == 3 * 2 * 7 * (16 + 8) * 2 + 2 * 4


def test_the_memory_check_counts_the_prompt_cache_and_no_prompt_cache_gives_the_same_tokens(
    tmp_path, tiny_dir, monkeypatch
):
    """A continuous job whose prompts recur (3 prompts x 3 requests, one unique): the memory need adds
    the prompt cache, its planned rows at the bank's prompt width, at least the bytes of the PromptCache
    the loop builds and at most the slots' own KV cache; with --no-prompt-cache it adds nothing, the loop
    builds no cache and the job writes the same tokens."""
    import jaxspec
    from jaxspec.batch.memory import job_need
    from jaxspec.decoding import continuous
    from jaxspec.model.kv_cache import kv_cache_bytes

    prompts = [[3 + i % 3, 4, 5, 6 + i % 3] for i in range(9)]  # three prompts, three requests each
    lines = [{"id": f"r{i}", "prompt_ids": p, "max_new_tokens": 33 + i} for i, p in enumerate(prompts)]
    lines.append({"id": "alone", "prompt_ids": [9, 9, 9], "max_new_tokens": 5})
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    model = jaxspec.load(str(tiny_dir))
    items = [
        TokenizedRequest(parse_request(json.dumps(line), i + 1, RequestDefaults()), tuple(line["prompt_ids"]))
        for i, line in enumerate(lines)
    ]
    slots = 3
    with_cache = job_need(model, items, slots, True, lambda rows: None)
    without = job_need(model, items, slots, True, lambda rows: None, prompt_cache=False)
    row_bytes = continuous.prompt_cache_row_bytes(model.config, 16, model.dtype)  # prompts pad to 16
    assert with_cache.prompt_cache == 3 * row_bytes and without.prompt_cache == 0
    assert with_cache.total == without.total + 3 * row_bytes
    assert "prompt cache" in with_cache.describe() and "prompt cache" not in without.describe()
    assert with_cache.prompt_cache <= kv_cache_bytes(model.config, slots, with_cache.positions, model.dtype)

    built = []
    original = continuous.build_prompt_cache

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(continuous, "build_prompt_cache", recording)
    common = ["--input", str(src), "--model", str(tiny_dir), "--batch-size", str(slots), "--no-progress"]
    assert main([*common, "--output", str(tmp_path / "cached.jsonl")]) == 0
    (cache,) = built
    assert cache.prefill.cache.keys[0].shape[0] == 3 and cache.prefill.cache.max_len == 16
    assert sorted(set(cache.index.tolist())) == [-1, 0, 1, 2]  # "alone" is prefilled at its admit
    assert 0 < tree_bytes(cache.prefill) <= with_cache.prompt_cache
    assert main([*common, "--output", str(tmp_path / "plain.jsonl"), "--no-prompt-cache"]) == 0
    assert built[1:] == []  # no cache built
    cached = {r["id"]: r["token_ids"] for r in read_jsonl(tmp_path / "cached.jsonl")}
    plain = {r["id"]: r["token_ids"] for r in read_jsonl(tmp_path / "plain.jsonl")}
    assert cached == plain and len(cached) == 10


def test_free_memory_comes_from_the_device_stats_else_meminfo(monkeypatch):
    import jax

    from jaxspec.model import kv_cache

    meminfo = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
    free = kv_cache.available_memory_bytes()  # this CPU: no device memory stats
    assert 0 < free <= meminfo["MemTotal"] * 1024

    class Accelerator:
        def memory_stats(self):
            return {"bytes_limit": 1000, "bytes_in_use": 300, "peak_bytes_in_use": 900}

    monkeypatch.setattr(jax, "local_devices", lambda: [Accelerator()])
    assert kv_cache.available_memory_bytes() == 700


# Two long-budget requests, admitted first (the bank runs longest budgets first) and finished first, and
# five short ones: a resumed run without the two has shorter caches, but must decide as the first run.
MEMORY_JOB = [{"id": f"long{i}", "prompt_ids": [3 + i, 4, 5], "max_new_tokens": 20} for i in range(2)] + [
    {"id": f"short{i}", "prompt_ids": [6 + i, 7, 8, 9], "max_new_tokens": 4} for i in range(5)
]


def job_memory(model, rows: int, positions: int) -> int:
    """Weights + a real cache of rows x positions, in bytes (counted apart from the job's estimate)."""
    from jaxspec.model.kv_cache import KVCache

    return tree_bytes(model.params) + tree_bytes(KVCache.zeros(model.config, rows, positions, model.dtype))


def test_a_budget_for_two_slots_runs_two_slots_with_the_same_tokens_also_resumed(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    """--batch-size 4 with a budget that fits 2 slots: the job says so and runs 2 slots (recorded in
    every result), with the tokens of an unconstrained 4-slot run; interrupted after its first write and
    rerun, it decides the same from every request (those left alone would fit 3 slots)."""
    import jaxspec
    from jaxspec.batch.results import ResultWriter

    src = write_jsonl(tmp_path / "in.jsonl", MEMORY_JOB)
    common = ["--input", str(src), "--model", str(tiny_dir), "--batch-size", "4", "--steps-per-call", "8"]
    common += ["--no-progress"]
    assert main([*common, "--output", str(tmp_path / "free.jsonl")]) == 0
    assert "does not fit" not in capsys.readouterr().err
    free = {r["id"]: r for r in read_jsonl(tmp_path / "free.jsonl")}
    assert {r["stats"]["batch_size"] for r in free.values()} == {4}

    # Prompts <= 16 tokens, budgets <= 32: 16 + 32 + 1 cache positions a row (short ones alone: 16 + 16 + 1).
    model = jaxspec.load(str(tiny_dir))
    need = {rows: job_memory(model, rows, 49) for rows in (2, 3, 4)}
    assert job_memory(model, 3, 33) < (need[2] + need[3]) / 2
    budget_gib = (need[2] + need[3]) / 2 / 0.9 / 2**30
    out = tmp_path / "out.jsonl"
    args = [*common, "--output", str(out), "--memory-budget-gib", repr(budget_gib)]
    original_append = ResultWriter.append

    def append_then_interrupt(self, records):
        original_append(self, records)
        raise KeyboardInterrupt

    monkeypatch.setattr(ResultWriter, "append", append_then_interrupt)
    assert main(args) == 130
    first_err = capsys.readouterr().err
    first = {r["id"] for r in read_jsonl(out)}
    assert first >= {"long0", "long1"} and len(first) < len(MEMORY_JOB)  # the long requests are done
    monkeypatch.setattr(ResultWriter, "append", original_append)
    assert main(args) == 0
    second_err = capsys.readouterr().err
    note = (
        f"jaxspec: note: --batch-size 4 does not fit in memory: it needs {need[4]:,} bytes (",
        "for 4 rows x 49 cache positions",
        f"running --batch-size 2 instead, which needs {need[2]:,} bytes (",
    )
    for err in (first_err, second_err):
        assert all(part in err for part in note), err
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(free)
    assert {r["stats"]["batch_size"] for r in records} == {2}
    assert {r["id"]: r["token_ids"] for r in records} == {k: r["token_ids"] for k, r in free.items()}


def test_a_budget_too_small_for_one_row_stops_before_writing_naming_the_longest_request(
    tmp_path, tiny_dir, capsys
):
    import jaxspec

    src = write_jsonl(tmp_path / "in.jsonl", [*MEMORY_JOB[2:4], {"id": "big", "prompt_ids": [1] * 40}])
    out = tmp_path / "out.jsonl"
    one_row = job_memory(
        jaxspec.load(str(tiny_dir)), 1, 64 + 16 + 1
    )  # the 40-token prompt's bucket + --max-new-tokens 16
    budget_gib = (one_row - 100) / 0.9 / 2**30
    args = ["--input", str(src), "--output", str(out), "--model", str(tiny_dir), "--max-new-tokens", "16"]
    assert main([*args, "--memory-budget-gib", repr(budget_gib), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"jaxspec: error: not enough memory for even --batch-size 1: it needs {one_row:,} bytes (" in err
    assert "for 1 row x 81 cache positions" in err
    assert f'the longest request is {src}:3 (id "big", 40 prompt tokens + max_new_tokens 16)' in err
    assert f"of the {int(budget_gib * 2**30):,} bytes (" in err
    assert not out.exists()
    assert main([*args, "--memory-budget-gib", "0"]) == 2
    assert "--memory-budget-gib must be a number > 0, got 0.0" in capsys.readouterr().err


def test_the_summary_reports_the_peak_rss(tmp_path, tiny_dir, capsys):
    import resource

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1, 2], "max_new_tokens": 2}])
    summary = tmp_path / "summary.json"
    args = ["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--model", str(tiny_dir)]
    assert main([*args, "--summary-json", str(summary), "--no-progress"]) == 0
    peak = json.loads(summary.read_text())["peak_rss_kib"]
    assert 0 < peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak > 50 * 1024  # jax and the model alone hold more than 50 MiB
    assert f"peak RSS: {peak / 1024:.1f} MiB" in capsys.readouterr().out
