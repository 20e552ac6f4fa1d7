"""Self-distillation data: the target model answers the training prompts through continuous batching.

Output is JSONL, one row per prompt, appended (and fsync'ed) as each answer finishes; a rerun skips the
ids already written, so a kill loses only the answers in flight. A torn last line (killed mid-write) is
cut off on resume.

Row: {"id", "category", "prompt", "prompt_ids": [int], "response_ids": [int], "finish_reason"}.
The output may instead be a run of the repository's distilled data set (`jaxspec.loading.dataset`): same
rows, compact token shards, the same skip-what-is-done resume.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from jaxspec.config import SamplingParams
from jaxspec.loading.dataset import DatasetWriter


def read_jsonl_rows(path: str | Path, repair: bool = True) -> list[dict]:
    """Rows of a JSONL file written by `append_jsonl_rows`; a torn final line is dropped (and cut from
    the file when `repair`). A malformed line elsewhere raises ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, good_end, pos = [], 0, 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
        is_last = number == len(lines)
        end = pos + len(line) + (0 if is_last else 1)
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if not is_last:
                    raise ValueError(f"{path}:{number}: malformed JSON line ({exc})") from exc
                break
            if is_last:  # complete JSON but no newline yet: keep it, add the newline below
                good_end = -1
                break
        good_end, pos = end, end
    if repair:
        if good_end == -1:
            with open(path, "ab") as f:
                f.write(b"\n")
        elif good_end < len(data):
            with open(path, "r+b") as f:
                f.truncate(good_end)
    return rows


def append_jsonl_rows(path: str | Path, rows: Sequence[dict]) -> None:
    """Append rows as one write, flushed and fsync'ed (a kill after this returns loses nothing)."""
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    with open(path, "ab") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def chat_prompt_ids(model, prompt: str) -> list[int]:
    """The prompt rendered with the model's chat template (plain encoding without one)."""
    if model.tokenizer is None:
        raise ValueError("distill: model has no tokenizer")
    if getattr(model.tokenizer, "chat_template", None):
        return model.chat_prompt([{"role": "user", "content": prompt}])
    return list(model.tokenizer.encode(prompt))


def distill(
    model,
    prompts: Sequence[dict],
    output: str | Path | DatasetWriter,
    *,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    progress: bool = True,
    steps_per_call: int = 64,
) -> list[dict]:
    """Generate the target's own responses for `prompts` ([{"id", "prompt", ...}]) into `output`.

    A prompt row may carry its own "prompt_ids" (already tokenized); otherwise "prompt" is rendered with
    the chat template. Resumable: ids already in `output` are skipped. Returns all rows of `output`
    afterwards, in the order they were written.
    The prompts run through continuous batching (`decoding.continuous.generate_continuous`, autoregressive,
    `batch_size` slots refilled as requests finish, one compiled program): each answer is appended to
    `output` (and fsync'ed) as soon as the compiled call that finished it returns, so rows land in
    finishing order and a kill loses only the answers still in flight. Greedy by default, which matches
    how the heads are benchmarked; a request's tokens do not depend on its slot or neighbours. `output`
    is a JSONL path or a data set run (`DistilledDataset.writer`), whose whole data set's ids count as
    done. steps_per_call: loop iterations (decode steps or admits) between two collections of finished
    answers.
    """
    if isinstance(output, DatasetWriter):
        done = output.dataset.ids()
        append, read_all = output.append, lambda: list(output.dataset.rows())
    else:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        done = {row["id"] for row in read_jsonl_rows(output)}
        append, read_all = (lambda rows: append_jsonl_rows(output, rows)), (lambda: read_jsonl_rows(output))
    todo = [p for p in prompts if p["id"] not in done]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="distill", disable=not progress)
    if todo:
        from jaxspec.decoding import continuous
        from jaxspec.decoding.generate import request_id_from_string

        ids = [
            list(p["prompt_ids"]) if "prompt_ids" in p else chat_prompt_ids(model, p["prompt"]) for p in todo
        ]
        start, written = time.perf_counter(), 0

        def on_finished(finished: list) -> None:
            nonlocal written
            rows = [
                {
                    "id": todo[i]["id"],
                    "category": todo[i].get("category", ""),
                    "prompt": todo[i].get("prompt", ""),
                    "prompt_ids": ids[i],
                    "response_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                }  # fmt: skip
                for i, c in finished
            ]
            append(rows)
            written += sum(len(r["response_ids"]) for r in rows)
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{written / (time.perf_counter() - start):.0f}")

        continuous.generate_continuous(
            model, ids, max_new_tokens=max_new_tokens, sampling=sampling or SamplingParams(), seed=seed,
            request_ids=[request_id_from_string(p["id"]) for p in todo], slots=batch_size,
            steps_per_call=steps_per_call, on_finished=on_finished,
        )  # fmt: skip
    bar.close()
    return read_all()
