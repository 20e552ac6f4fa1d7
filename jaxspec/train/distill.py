"""Self-distillation data: the target model answers the training prompts with jaxspec's batched generate.

Output is JSONL, one row per prompt, appended (and fsync'ed) batch by batch; a rerun skips the ids
already written, so a kill loses at most the batch in flight. A torn last line (killed mid-write) is
cut off on resume.

Row: {"id", "category", "prompt", "prompt_ids": [int], "response_ids": [int], "finish_reason"}.
The output may instead be a run of the repository's distilled data set (`jaxspec.train.dataset`): same
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
from jaxspec.train.dataset import DatasetWriter


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
    spec=None,
    progress: bool = True,
) -> list[dict]:
    """Generate the target's own responses for `prompts` ([{"id", "prompt", ...}]) into `output`.

    A prompt row may carry its own "prompt_ids" (already tokenized); otherwise "prompt" is rendered with
    the chat template. Resumable: ids already in `output` are skipped. Returns all rows of `output`
    afterwards.
    Prompts are processed in the given order (batches of `batch_size`, one compiled program per
    bucket); greedy by default, which matches how the heads are benchmarked. `output` is a JSONL path or
    a data set run (`DistilledDataset.writer`), whose whole data set's ids count as done.
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
    from jaxspec.buckets import length_bucket
    from jaxspec.generation import generate, request_id_from_string

    # One compiled program per prompt-length bucket: run the prompts grouped by bucket (stable order),
    # and pad a short last batch with repeats of its first prompt (their outputs are dropped).
    all_ids = [
        list(p["prompt_ids"]) if "prompt_ids" in p else chat_prompt_ids(model, p["prompt"]) for p in todo
    ]
    order = sorted(range(len(todo)), key=lambda i: length_bucket(len(all_ids[i])))
    todo, all_ids = [todo[i] for i in order], [all_ids[i] for i in order]

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="distill", disable=not progress)
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        ids = all_ids[start : start + batch_size]
        pad = batch_size - len(batch)
        request_ids = [request_id_from_string(p["id"]) for p in batch + [batch[0]] * pad]
        t0 = time.perf_counter()
        completions = generate(
            model, ids + [ids[0]] * pad, max_new_tokens=max_new_tokens, sampling=sampling or SamplingParams(),
            seed=seed, spec=spec, request_ids=request_ids,
        )[: len(batch)]  # fmt: skip
        rows = [
            {
                "id": p["id"],
                "category": p.get("category", ""),
                "prompt": p.get("prompt", ""),
                "prompt_ids": pid,
                "response_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }  # fmt: skip
            for p, pid, c in zip(batch, ids, completions, strict=True)
        ]
        append(rows)
        bar.update(len(batch))
        bar.set_postfix(
            tok_s=f"{sum(len(c.token_ids) for c in completions) / (time.perf_counter() - t0):.0f}"
        )
    bar.close()
    return read_all()
