"""Offline batch generation: JSONL requests in, JSONL results out, resumable, batch-aware speculation.

    jaxspec generate --input requests.jsonl --output results.jsonl [--batch-size 16] [--spec ngram]
    python scripts/generate.py --input requests.jsonl --output results.jsonl

Input: one request per line, see `jaxspec.batch.requests` (id; prompt | messages | prompt_ids;
optional max_new_tokens, temperature, top_k, top_p, seed, metadata). Every line is checked before
anything is generated; a bad line stops the job with `file:line: what is wrong` (exit code 2), or,
with --skip-invalid, goes to the errors JSONL and the rest runs.

Batching: --batching continuous (default) decodes through --batch-size slots refilled inside one
compiled loop (`jaxspec.decoding.continuous`): a finished request frees its slot for the next one, and every
--steps-per-call loop iterations the requests finished so far are appended. A continuous job speculates
in the same loop, with one draft shape for the whole job: the policy's pick at --batch-size rows (the
slot count), or --spec as given with --policy fixed, whatever the method (n-gram, draft model, heads).
A prompt that recurs in the input is prefilled once and copied into each slot that serves it (the prompt
cache, counted in the memory check; --no-prompt-cache prefills every request's prompt at its admit).
--batching static runs one `jaxspec.generate` call per planned batch, appended when the batch finishes,
the policy picking the draft shape per batch.

Memory: before anything is written, the job checks that the weights and the KV cache of --batch-size
rows (at the cache length its requests need) fit in 90% of --memory-budget-gib, or by default of the
device's free memory (`jaxspec.batch.memory`). A --batch-size that does not fit is lowered to the
largest that does, with a note on stderr; when not even 1 row fits, the job stops (exit code 2) naming
the longest request. The summary (and --summary-json) reports the process's peak RSS.

Output: one line per finished request, in the order they finish (not input order):
    {"id", "text", "token_ids", "finish_reason", "stats": {"prompt_tokens", "new_tokens", "rounds",
     "mean_accepted_length", "time_s", "batch_size", "speculation"[, "accepted_by_depth"]}[, "metadata"]}
time_s is the wall time of the request's whole batch (static; compilation included for a batch with new
shapes), or from the start of the continuous run to the call that finished it (continuous).
"text" is null, with an "error", when the tokenizer cannot decode the generated ids (they are kept).
Each write is fsync'ed; rerunning the same command resumes: ids already
in the output are skipped (a partial last line left by a kill is cut off and recomputed). The job
writes only to an output it created (sidecar OUTPUT.jaxspec-state, see `jaxspec.batch.output_file`),
holds a lock on it while it runs, and refuses an --output / --errors that is the input. The output is
keyed by id alone: a rerun does not redo an id whose parameters changed in the input. Each request's
randomness comes from (seed, id); a continuous job's draft shape depends only on --batch-size, and static
batches are planned over the whole input (finished requests included), so a resumed request keeps its
planned batch size and with it the draft shape --policy auto picks: resumed and uninterrupted runs give
the same tokens (same command, same --batch-size).

Prompts: `prompt` text is rendered as one user message with the model's chat template (as
`jaxspec generate --prompt` does) unless --no-chat; `messages` always use the template; `prompt_ids`
(pre-tokenized) are used as is, which also serves models without a tokenizer.

Speculation: --policy auto (default) drafts with --spec's method (n-gram when none is given) and lets
the batch-aware policy (`jaxspec.drafters.policy`) pick the draft shape from the compiled row count
(continuous: the slot count; static: the batch padded to a power of two) or turn speculation off;
--policy fixed uses --spec exactly as given; --policy off never speculates. With the default exact
acceptance, speculation changes the speed, not the distribution of the outputs (greedy outputs are
token-identical).

Set JAX_COMPILATION_CACHE_DIR to reuse compiled programs across runs (e.g. when resuming).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxspec.batch.memory import MemoryBudget, fit_batch_size, memory_budget
from jaxspec.batch.output_file import check_distinct_files, preflight_output
from jaxspec.batch.requests import (
    InputIssue,
    RequestDefaults,
    TokenizedRequest,
    check_defaults,
    read_requests,
    tokenize_requests,
)
from jaxspec.batch.results import check_errors_file, open_results, write_issues
from jaxspec.batch.schedule import plan_pending
from jaxspec.batch.summary import RunStats, format_summary, peak_rss_kib, plot_summary, write_summary_json
from jaxspec.errors import InputError, JaxspecError
from jaxspec.model.buckets import batch_bucket

MAX_ISSUES_SHOWN = 20


class InvalidInput(InputError):
    """Invalid input lines (and no --skip-invalid): the job stops before generating anything."""

    def __init__(self, issues: Sequence[InputIssue]):
        super().__init__(f"{len(issues)} invalid input lines")
        self.issues = list(issues)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxspec generate",
        description="Batch offline generation from a JSONL file of requests (resumable).",
    )
    p.add_argument("--input", required=True, help="JSONL requests (see jaxspec/batch/requests.py)")
    p.add_argument("--output", required=True, help="JSONL results; rerun with the same file to resume")
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    defaults = p.add_argument_group("defaults for requests that leave a parameter out")
    defaults.add_argument("--max-new-tokens", type=int, default=128)
    defaults.add_argument("--temperature", type=float, default=0.0)
    defaults.add_argument("--top-k", type=int, default=0)
    defaults.add_argument("--top-p", type=float, default=1.0)
    defaults.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="send 'prompt' text as is (no chat template)")
    spec = p.add_argument_group("speculation")
    spec.add_argument("--spec", default=None, help="method (ngram, draft_model, eagle3, ...) or a JSON dict")
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft length (--policy fixed; --spec defaults to ngram)",
    )
    spec.add_argument("--topk", type=int, default=None, help="branches per node (--policy fixed)")
    add_job_options(p)
    return p


def add_job_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The options only a batch job has (`jaxspec generate --help` lists them too)."""
    p.add_argument(
        "--batch-size", type=int, default=16,
        help="rows decoded together: continuous-batching slots, or requests per static batch",
    )  # fmt: skip
    p.add_argument(
        "--batching", choices=("continuous", "static"), default="continuous",
        help="continuous: finished slots refilled inside the compiled loop, results streamed as they "
        "finish (default); static: one generate call per batch",
    )  # fmt: skip
    p.add_argument(
        "--steps-per-call", type=int, default=64,
        help="continuous: loop iterations between writes of the requests finished so far",
    )  # fmt: skip
    p.add_argument(
        "--no-prompt-cache", action="store_true",
        help="continuous: prefill every request's prompt at its admit (default: a prompt that recurs in the "
        "input is prefilled once and copied into each slot that serves it; the same tokens either way)",
    )  # fmt: skip
    p.add_argument(
        "--policy", choices=("auto", "off", "fixed"), default="auto",
        help="auto: batch-aware draft shape / off switch (default); fixed: --spec as given; off: none",
    )  # fmt: skip
    p.add_argument("--policy-json", default=None, help="policy table (JSON string or file) for auto")
    p.add_argument(
        "--memory-budget-gib", type=float, default=None,
        help="memory the weights and KV cache may share (90%% of it); default: the device's free memory. "
        "A --batch-size that does not fit is lowered to the largest that does",
    )  # fmt: skip
    p.add_argument("--skip-invalid", action="store_true", help="write bad lines to --errors, run the rest")
    p.add_argument(
        "--errors", default=None, help="errors JSONL for --skip-invalid (default OUTPUT.errors.jsonl)"
    )
    p.add_argument("--summary-json", default=None, help="also write the run summary as JSON here")
    p.add_argument("--plot", default=None, help="also plot acceptance by depth and tokens/s to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def base_spec(args: argparse.Namespace):
    """SpecConfig from --spec / --num-speculative-tokens / --topk (None when --spec is not given)."""
    from jaxspec.config import SpecConfig

    shape = {"num_speculative_tokens": args.num_speculative_tokens, "topk": args.topk}
    shape = {key: value for key, value in shape.items() if value is not None}
    explicit = set(shape)
    try:
        if args.spec is None:
            spec = SpecConfig(method="ngram", **shape) if shape else None
        elif args.spec.strip().startswith("{"):
            fields = json.loads(args.spec)
            if not isinstance(fields, dict):
                raise ValueError("--spec JSON must be an object")
            explicit |= {
                key for key in fields if key in ("num_speculative_tokens", "topk", "num_draft_tokens")
            }
            spec = SpecConfig.from_dict({**fields, **shape})
        else:
            spec = SpecConfig(method=args.spec, **shape)
    except (ValueError, TypeError) as exc:
        raise InputError(f"--spec: {exc}") from None
    if explicit and args.policy == "auto":
        print(
            f"jaxspec: note: --policy auto picks the draft shape per batch size; {sorted(explicit)} "
            "ignored (use --policy fixed to keep them)",
            file=sys.stderr,
        )
    if args.policy == "fixed" and spec is None:
        raise InputError("--policy fixed needs --spec")
    return spec


def result_record(item: TokenizedRequest, completion: Any, seconds: float, size: int, label: str) -> dict:
    """The output line of one finished request."""
    stats = {
        "prompt_tokens": len(item.prompt_ids),
        "new_tokens": len(completion.token_ids),
        "rounds": int(completion.stats["rounds"]),
        "mean_accepted_length": round(float(completion.stats["mean_accepted_length"]), 4),
        "time_s": round(seconds, 3),
        "batch_size": size,
        "speculation": label,
    }
    if "accepted_by_depth" in completion.stats:
        stats["accepted_by_depth"] = list(completion.stats["accepted_by_depth"])
    record = {
        "id": item.request.id,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stats": stats,
    }
    if completion.error is not None:  # token ids kept; the text could not be decoded
        record.update(text=None, error=completion.error)
        print(f"jaxspec: request {json.dumps(item.request.id)}: {completion.error}", file=sys.stderr)
    if item.request.metadata is not None:
        record["metadata"] = item.request.metadata
    return record


def _request_arguments(items: Sequence[TokenizedRequest]) -> dict[str, list]:
    """The per-request arguments of `jaxspec.generate` / `generate_continuous` for these requests."""
    from jaxspec.decoding.generate import request_id_from_string

    return {
        "prompts": [list(item.prompt_ids) for item in items],
        "max_new_tokens": [item.request.max_new_tokens for item in items],
        "sampling": [item.request.sampling for item in items],
        "seed": [item.request.seed for item in items],
        "request_ids": [request_id_from_string(item.request.key) for item in items],
    }


def _generate_batch(model: Any, batch: list[TokenizedRequest], spec: Any) -> list[Any]:
    import jaxspec

    return jaxspec.generate(model, spec=spec, **_request_arguments(batch))


def errors_file(args: argparse.Namespace) -> str:
    """Where --skip-invalid writes the invalid requests."""
    return args.errors or f"{args.output}.errors.jsonl"


def validated_requests(args: argparse.Namespace) -> tuple[Any, list[TokenizedRequest], list[InputIssue]]:
    """Check every input line (before loading the model), load the model, tokenize and check against
    it. Raises InvalidInput (all bad lines) unless --skip-invalid. Returns (model, ready, issues)."""
    defaults = RequestDefaults(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    check_defaults(defaults)
    requests, issues = read_requests(args.input, defaults)
    if issues and not args.skip_invalid:
        raise InvalidInput(issues)
    import jaxspec

    model = jaxspec.load(args.model)
    ready, token_issues = tokenize_requests(requests, model, args.input, chat=not args.no_chat)
    issues = sorted(issues + token_issues, key=lambda issue: issue.line)
    if issues and not args.skip_invalid:
        raise InvalidInput(issues)
    if args.skip_invalid:
        errors_path = errors_file(args)
        write_issues(errors_path, issues)
        if issues:
            print(f"jaxspec: {len(issues)} invalid requests written to {errors_path}", file=sys.stderr)
    return model, ready, issues


def generate_batches(
    model: Any,
    batches: list[tuple[list[TokenizedRequest], int]],
    writer: Any,
    pick_spec: Callable[[int], Any],
    stats: RunStats,
    show_progress: bool = True,
) -> None:
    """Generate each (batch, planned rows) with the speculation `pick_spec(planned rows)` returns
    (SpecConfig or None; `plan_pending`: a resumed batch keeps its planned shape), append its results
    (one write + fsync per batch), update the stats and the progress bar."""
    from tqdm import tqdm

    from jaxspec.drafters.policy import describe_spec

    total = sum(len(b) for b, _ in batches)
    with tqdm(total=total, unit="req", desc="generate", disable=not show_progress, file=sys.stderr) as bar:
        for batch, planned_rows in batches:
            # The policy sees the compiled batch's rows: padding rows cost as much as real ones.
            spec = pick_spec(batch_bucket(planned_rows))
            label = describe_spec(spec)
            start = time.perf_counter()
            completions = _generate_batch(model, batch, spec)
            seconds = time.perf_counter() - start
            pairs = zip(batch, completions, strict=True)
            writer.append([result_record(i, c, seconds, len(batch), label) for i, c in pairs])
            stats.add_batch(completions, seconds, label, spec.num_speculative_tokens if spec else 0)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", accepted=f"{stats.mean_accepted_length:.2f}")


def generate_continuously(
    model: Any,
    items: list[TokenizedRequest],
    writer: Any,
    stats: RunStats,
    slots: int,
    steps_per_call: int,
    spec: Any = None,
    show_progress: bool = True,
    prompt_cache: bool = True,
) -> None:
    """Generation of every item through `slots` continuously refilled slots, autoregressive or
    speculating with `spec` (`jaxspec.decoding.continuous.generate_continuous`, its prompt cache on or
    off). Every `steps_per_call` loop iterations, the requests finished since the last call are appended
    (one write + fsync) in the order they finished; time_s is the time from the start of the run to the
    call that finished the request."""
    from tqdm import tqdm

    from jaxspec.decoding.continuous import generate_continuous
    from jaxspec.drafters.policy import describe_spec

    if not items:
        return
    label, depth = describe_spec(spec), spec.num_speculative_tokens if spec is not None else 0
    last = [time.perf_counter()]
    progress = tqdm(total=len(items), unit="req", desc="generate", disable=not show_progress, file=sys.stderr)
    with progress as bar:

        def write(finished: list[tuple[int, Any]]) -> None:
            now = time.perf_counter()
            writer.append(
                [result_record(items[i], c, c.stats["batch_time_s"], slots, label) for i, c in finished]
            )
            stats.add_batch([c for _, c in finished], now - last[0], label, depth)
            last[0] = now
            bar.update(len(finished))
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", accepted=f"{stats.mean_accepted_length:.2f}")

        generate_continuous(
            model, slots=slots, steps_per_call=steps_per_call, on_finished=write, spec=spec,
            prompt_cache=prompt_cache, **_request_arguments(items),
        )  # fmt: skip


def choose_batching(
    args: argparse.Namespace,
    model: Any,
    ready: list[TokenizedRequest],
    pick_spec: Callable[[int], Any],
    budget: MemoryBudget | None,
) -> tuple[bool, int]:
    """(continuous?, batch size): --batching, at the largest batch size up to --batch-size that fits the
    memory budget (`jaxspec.batch.memory`)."""
    continuous = args.batching == "continuous"
    return continuous, fit_batch_size(
        model, ready, args.batch_size, continuous, pick_spec, budget, args.input, not args.no_prompt_cache
    )


def run_job(args: argparse.Namespace) -> int:
    """The job itself (arguments already parsed); returns the exit code."""
    from jaxspec.drafters.policy import choose_spec, load_policy

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.steps_per_call < 1:
        raise InputError(f"--steps-per-call must be >= 1, got {args.steps_per_call}")
    if args.memory_budget_gib is not None and not 0 < args.memory_budget_gib < math.inf:
        raise InputError(f"--memory-budget-gib must be a number > 0, got {args.memory_budget_gib}")
    check_distinct_files(args.input, args.output, errors_file(args) if args.skip_invalid else None)
    preflight_output(args.output)  # before loading the model; claimed (locked) by open_results
    if args.skip_invalid:
        check_errors_file(errors_file(args))
    pick_spec = functools.partial(
        choose_spec, args.policy, base_spec(args), policy=load_policy(args.policy_json)
    )
    model, ready, issues = validated_requests(args)
    budget = memory_budget(args.memory_budget_gib, model)
    # Before any output is written: the batch size that fits the budget, from every valid request
    # (finished ones included, so a resumed run with the same budget decides the same).
    continuous, batch_size = choose_batching(args, model, ready, pick_spec, budget)
    writer, done, repaired = open_results(args.output)
    if repaired:
        print(f"jaxspec: removed a partial last line ({repaired} bytes) from {args.output}", file=sys.stderr)
    pending = [item for item in ready if item.request.key not in done]
    stats = RunStats(invalid=len(issues), skipped_done=len(ready) - len(pending))
    # A continuous job runs one draft shape, the policy's pick for its slot count (decided for the whole
    # job, so a resumed run decides the same).
    job_spec = pick_spec(batch_size)
    try:
        with writer:
            if continuous:
                generate_continuously(
                    model, pending, writer, stats, batch_size, args.steps_per_call, job_spec,
                    show_progress=not args.no_progress, prompt_cache=not args.no_prompt_cache,
                )  # fmt: skip
            else:
                batches = plan_pending(ready, batch_size, done)
                generate_batches(model, batches, writer, pick_spec, stats, show_progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\njaxspec: interrupted; rerun the same command to resume ({args.output})", file=sys.stderr)
        return 130
    stats.peak_rss_kib = peak_rss_kib()
    print(format_summary(stats))
    if args.summary_json:
        write_summary_json(stats, args.summary_json)
    if args.plot:
        plot_summary(stats, args.plot)
    return 0


def main(argv: list[str]) -> int:
    """`jaxspec generate --input IN --output OUT ...`; argv is everything after `generate`."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage / help
        return int(exc.code or 0)
    try:
        return run_job(args)
    except InvalidInput as exc:
        for issue in exc.issues[:MAX_ISSUES_SHOWN]:
            print(issue, file=sys.stderr)
        if len(exc.issues) > MAX_ISSUES_SHOWN:
            print(f"... and {len(exc.issues) - MAX_ISSUES_SHOWN} more invalid lines", file=sys.stderr)
        return 2
    except JaxspecError as exc:
        print(f"jaxspec: error: {exc}", file=sys.stderr)
        return 2
