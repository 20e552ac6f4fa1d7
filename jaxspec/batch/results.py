"""Batch job output: one JSON line per finished request, appended batch by batch, resumable.

Crash safety rests on one rule: a result counts as written once its line *and its newline* are on
disk. Each batch's lines go out in one write, then fsync, so a process killed at any moment leaves
complete lines plus at most one partial last line. `open_results` claims the file
(`jaxspec.batch.output_file`: lock, ownership check, a partial last line of this job's own cut off),
then reports the ids already done so the rerun skips them. Only a complete result record counts as
done; any other line in the job's own output is an error naming its file:line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.batch.output_file import OutputFileError, OwnedOutput, claim_output, describe_os_error
from jaxspec.errors import JaxspecError

FINISH_REASONS = ("stop", "length")


def is_result_record(record: Any) -> bool:
    """A complete result line: id, text (or null with an "error"), token_ids, finish_reason, stats."""
    if not isinstance(record, dict):
        return False
    request_id = record.get("id")
    token_ids = record.get("token_ids")
    text_ok = isinstance(record.get("text"), str) or (
        record.get("text") is None and isinstance(record.get("error"), str)
    )
    return (
        isinstance(request_id, (str, int))
        and not isinstance(request_id, bool)
        and text_ok
        and isinstance(token_ids, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)
        and record.get("finish_reason") in FINISH_REASONS
        and isinstance(record.get("stats"), dict)
    )


def _done_key(line: bytes, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        record = None
    if not is_result_record(record):
        raise JaxspecError(
            f"{path}:{number}: not a complete result record of a batch job (only a partial last line "
            "is repaired automatically): fix the file or write to a new --output"
        )
    return str(record["id"])


def open_results(path: str | Path) -> tuple[ResultWriter, set[str], int]:
    """Claim (or create) the output for appending, after repairing it.

    Returns (writer, ids already written as text, number of bytes cut from a partial last line).
    Raises OutputFileError (nothing changed) for a file that is not the job's own results or that
    another job holds, JaxspecError naming file:line for a line that is not a complete result.
    """
    owned = claim_output(path)
    try:
        done: set[str] = set()
        for number, line in enumerate(owned.data.split(b"\n")[:-1], start=1):
            if line.strip():
                done.add(_done_key(line, owned.path, number))
    except BaseException:
        owned.close()
        raise
    return ResultWriter(owned), done, owned.repaired


class ResultWriter:
    """Appends batches of result records to the claimed output; each batch is one write + fsync,
    announced in the state file before and recorded after (see `jaxspec.batch.output_file`)."""

    def __init__(self, owned: OwnedOutput):
        self.owned = owned
        self.path = owned.path

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        payload = b"".join(
            json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n" for r in records
        )
        self.owned.begin_append(len(payload))
        self.write_raw(payload)
        self.owned.end_append(len(payload))

    def write_raw(self, payload: bytes) -> None:
        """Write already announced bytes and fsync (all of them: os.write may write only part)."""
        view = memoryview(payload)
        try:
            while view:
                view = view[os.write(self.owned.fd, view) :]
            os.fsync(self.owned.fd)
        except OSError as error:
            raise describe_os_error(self.path, error, "append results") from None

    def close(self) -> None:
        self.owned.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ISSUE_KEYS = {"file", "line", "id", "error"}


def check_errors_file(path: str | Path) -> None:
    """The errors file is rewritten whole by each run: refuse (OutputFileError) an existing file
    that is not an errors file a batch job wrote (every line an issue record), so a mistyped
    --errors cannot overwrite someone's file."""
    path = Path(path)
    if path.is_dir():
        raise OutputFileError(f"{path}: cannot write the errors file: is a folder, not a file")
    if not path.exists():
        return
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as error:
        raise describe_os_error(path, error, "read the errors file") from None
    for line in lines:
        try:
            record = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            record = False
        if record is not None and not (isinstance(record, dict) and set(record) == ISSUE_KEYS):
            raise OutputFileError(
                f"{path}: is not an errors file of a jaxspec batch job and would be overwritten; "
                "choose another --errors"
            )


def write_issues(path: str | Path, issues: Sequence[Any]) -> None:
    """Rewrite the errors JSONL (one line per invalid input line; derived from the input alone, so
    each run writes it whole). Only over an errors file a batch job wrote (`check_errors_file`)."""
    check_errors_file(path)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for issue in issues:
                f.write(json.dumps(issue.to_json(), ensure_ascii=False) + "\n")
    except OSError as error:
        raise describe_os_error(path, error, "write the errors file") from None
