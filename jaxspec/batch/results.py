"""Batch job output: one JSON line per finished request, appended batch by batch, resumable.

Crash safety rests on one rule: a result counts as written once its line *and its newline* are on
disk. Each batch's lines go out in one write, then flush + fsync, so a process killed at any moment
leaves complete lines plus at most one partial last line. `open_results` repairs such a file by
cutting the partial line off (it is recomputed), then reports the ids already done so the rerun skips
them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError


def _done_key(line: bytes, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
        request_id = record["id"]
    except (ValueError, TypeError, KeyError):
        raise JaxspecError(
            f"{path}:{number}: not a result line of a batch job (only a partial last line is repaired "
            "automatically): fix the file or write to a new --output"
        ) from None
    return str(request_id)


def open_results(path: str | Path) -> tuple[ResultWriter, set[str], int]:
    """Open (or create) the output for appending after repairing it.

    Returns (writer, ids already written as text, number of bytes cut from a partial last line).
    A complete line that is not a result record is an error naming its file:line.
    """
    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    complete_end = data.rfind(b"\n") + 1  # everything after the last newline is a partial line
    done: set[str] = set()
    for number, line in enumerate(data[:complete_end].split(b"\n")[:-1], start=1):
        if line.strip():
            done.add(_done_key(line, path, number))
    removed = len(data) - complete_end
    if removed:
        with open(path, "r+b") as f:
            f.truncate(complete_end)
            f.flush()
            os.fsync(f.fileno())
    return ResultWriter(path), done, removed


class ResultWriter:
    """Appends batches of result records to a JSONL file; each batch is one write + flush + fsync."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._file = open(self.path, "ab")
        if created:  # make the new directory entry durable too
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        payload = b"".join(
            json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n" for r in records
        )
        self._file.write(payload)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_issues(path: str | Path, issues: Sequence[Any]) -> None:
    """Rewrite the errors JSONL (one line per invalid input line; derived from the input alone, so
    each run writes it whole)."""
    with open(path, "w", encoding="utf-8") as f:
        for issue in issues:
            f.write(json.dumps(issue.to_json(), ensure_ascii=False) + "\n")
