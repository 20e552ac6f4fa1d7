"""The distilled data set kept in the repository: the target's own responses as compact token shards.

A data set is one directory:
  manifest.json    {"format": 1, "model", "vocab_size", "runs": [run, ...]}; a run is
                   {"shard", "records", "prompt_tokens", "response_tokens", "prompt_source", "seed",
                    "commit", "max_new_tokens", "sampling", "started", "generator"}
  NNNNN.jsd        one shard per run, an append-only sequence of records
Record framing (little endian): magic b"JD" | uint32 payload bytes | uint32 CRC-32 of the payload |
payload = zlib(JSON header line + token bytes). Header: {"id", "category", "prompt", "finish_reason",
"prompt_len", "response_len", "dtype"}; tokens = prompt ids then response ids, uint16 when the
vocabulary fits (else int32).

Appending writes and fsyncs the records, then replaces the manifest atomically (the commit point). A
writer killed mid-record leaves a torn tail past the committed count: the next append cuts it off (those
bytes were never committed) and a reader ignores it; complete records past the count (killed between
the fsync and the manifest) are kept and committed. A corrupt or missing committed record is a
DatasetError naming the shard and the record. Each run appends its own shard, so the files of earlier
runs never change and the set grows in git one shard at a time.

Several writers (processes distilling different runs into one data set) may run at once: every change
of the manifest (a new run, an append, a finished run) takes an exclusive lock on `.write.lock` in the
directory, re-reads the manifest from disk and changes only its own run, so no writer's records or runs
are lost to another's stale copy (POSIX `flock`; elsewhere no lock, one writer at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
import subprocess
import zlib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.errors import DatasetError

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one writer at a time)
    fcntl = None

FORMAT = 1
MANIFEST = "manifest.json"
LOCK = ".write.lock"
MAGIC = b"JD"
_FRAME = struct.Struct("<2sII")  # magic, payload bytes, crc32


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def encode_record(row: dict[str, Any], dtype: np.dtype) -> bytes:
    """A distilled row {"id", "prompt_ids", "response_ids", "category"?, "prompt"?, "finish_reason"?} ->
    one framed record."""
    prompt_ids, response_ids = list(row["prompt_ids"]), list(row["response_ids"])
    header = {
        "id": str(row["id"]), "category": row.get("category", ""), "prompt": row.get("prompt", ""),
        "finish_reason": row.get("finish_reason", ""), "prompt_len": len(prompt_ids),
        "response_len": len(response_ids), "dtype": dtype.name,
    }  # fmt: skip
    tokens = np.asarray(prompt_ids + response_ids, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DatasetError(f"record {header['id']!r}: token id outside the {dtype.name} range")
    payload = zlib.compress(
        json.dumps(header, ensure_ascii=False).encode() + b"\n" + tokens.astype(dtype).tobytes(), 9
    )
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    raw = zlib.decompress(payload)
    line, _, data = raw.partition(b"\n")
    header = json.loads(line)
    tokens = np.frombuffer(data, np.dtype(header["dtype"])).astype(np.int64)
    n = header["prompt_len"]
    if tokens.size != n + header["response_len"]:
        raise ValueError(f"{tokens.size} tokens, header says {n} + {header['response_len']}")
    return {
        "id": header["id"], "category": header["category"], "prompt": header["prompt"],
        "prompt_ids": tokens[:n].tolist(), "response_ids": tokens[n:].tolist(),
        "finish_reason": header["finish_reason"],
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ShardScan:
    """What a shard holds: `rows` decoded in order, `good_bytes` the end of the last complete record,
    `torn` whether bytes after it form an incomplete record (a writer killed mid-write)."""

    rows: list[dict[str, Any]]
    good_bytes: int
    torn: bool


def scan_shard(path: Path) -> ShardScan:
    """Decode every record of a shard. A complete record that fails its checks is a DatasetError naming
    the shard, the record number (0-based) and its byte offset; an incomplete tail is reported as torn."""
    data = path.read_bytes() if path.exists() else b""
    rows, pos = [], 0
    while pos < len(data):
        where = f"{path}: record {len(rows)} (byte {pos})"
        if len(data) - pos < _FRAME.size:
            return ShardScan(rows, pos, torn=True)
        magic, size, crc = _FRAME.unpack_from(data, pos)
        if magic != MAGIC:
            raise DatasetError(f"{where}: not a record (bad magic {magic!r}); the shard is corrupt")
        if pos + _FRAME.size + size > len(data):
            return ShardScan(rows, pos, torn=True)
        payload = data[pos + _FRAME.size : pos + _FRAME.size + size]
        if zlib.crc32(payload) != crc:
            raise DatasetError(f"{where}: checksum mismatch; the shard is corrupt")
        try:
            rows.append(decode_payload(payload))
        except (zlib.error, ValueError, KeyError, TypeError) as error:
            raise DatasetError(f"{where}: undecodable record ({error})") from None
        pos += _FRAME.size + size
    return ShardScan(rows, pos, torn=False)


def _write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the data set's exclusive write lock (blocking; released on exit, also when killed)."""
    if fcntl is None:
        yield
        return
    with open(directory / LOCK, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def current_commit(ignore: Path | None = None, checkout: Path | None = None) -> str:
    """The commit of `checkout` (default: jaxspec's own), with "+dirty" when it has changes outside
    `ignore` (a data set being written lives in the checkout, and its own new shards are no code change);
    "" outside a git checkout."""
    here = Path(checkout or Path(__file__).resolve().parent)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)

    try:
        head, top, status = (
            git("rev-parse", "HEAD"),
            git("rev-parse", "--show-toplevel"),
            git("status", "--porcelain", "--untracked-files=all"),
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    if head.returncode != 0:
        return ""
    changed = [line[3:].split(" -> ")[-1].strip('"') for line in status.stdout.splitlines() if line.strip()]
    if ignore is not None and top.returncode == 0:
        try:
            skip = Path(ignore).resolve().relative_to(Path(top.stdout.strip()).resolve()).as_posix()
        except ValueError:  # the data set is outside the checkout: nothing of it shows in the status
            skip = None
        if skip is not None:
            changed = [c for c in changed if not (c.rstrip("/") == skip or c.startswith(skip + "/"))]
    return head.stdout.strip() + ("+dirty" if changed else "")


class DistilledDataset:
    """An open data set directory (see the module docstring)."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest

    @classmethod
    def open(cls, path: str | Path) -> DistilledDataset:
        path = Path(path)
        return cls(path, cls._read_manifest(path))

    def reload(self) -> None:
        """Re-read the manifest from disk (another writer may have changed it)."""
        self.manifest = self._read_manifest(self.path)

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any]:
        file = path / MANIFEST
        if not file.exists():
            raise DatasetError(f"{path}: not a distilled data set (no {MANIFEST})")
        try:
            manifest = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DatasetError(f"{file}: malformed manifest ({error})") from None
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("runs"), list)
        ):
            raise DatasetError(f"{file}: unsupported manifest (want format {FORMAT} with a runs list)")
        return manifest

    @classmethod
    def open_or_create(cls, path: str | Path, *, model: str, vocab_size: int) -> DistilledDataset:
        path = Path(path)
        if (path / MANIFEST).exists():
            dataset = cls.open(path)
            if dataset.manifest["vocab_size"] != vocab_size:
                raise DatasetError(
                    f"{path}: data set of a {dataset.manifest['vocab_size']}-token vocabulary, "
                    f"model has {vocab_size}"
                )
            return dataset
        path.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "model": model, "vocab_size": vocab_size, "runs": []}
        _write_json_atomic(path / MANIFEST, manifest)
        return cls(path, manifest)

    @property
    def dtype(self) -> np.dtype:
        return _token_dtype(int(self.manifest["vocab_size"]))

    def _committed(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        shard = self.path / run["shard"]
        scan = scan_shard(shard)
        if len(scan.rows) < run["records"]:
            raise DatasetError(
                f"{shard}: record {len(scan.rows)} (byte {scan.good_bytes}) is "
                f"{'truncated' if scan.torn else 'missing'}; the manifest commits {run['records']} records"
            )
        return scan.rows[: run["records"]]

    def rows(self, runs: Collection[int] | None = None) -> Iterator[dict[str, Any]]:
        """Every committed row, shard by shard in run order; only those of run indices `runs` when given
        (`select_runs`)."""
        for index, run in enumerate(self.manifest["runs"]):
            if runs is None or index in runs:
                yield from self._committed(run)

    def select_runs(self, spec: str) -> tuple[int, ...]:
        """Run indices (= shard numbers: run 9 is 00009.jsd) named by `spec`, a comma-separated list of
        indices and inclusive ranges such as "9-14" or "0,3,11-14"; a DatasetError names a malformed
        part or a run the manifest does not have."""
        count = len(self.manifest["runs"])
        chosen: set[int] = set()
        for part in (p.strip() for p in spec.split(",")):
            low, _, high = part.partition("-")
            try:
                first, last = int(low), int(high if high else low)
            except ValueError:
                raise DatasetError(
                    f"{self.path}: runs {spec!r}: {part!r} is not a run index or a range like 9-14"
                ) from None
            if not 0 <= first <= last < count:
                raise DatasetError(
                    f"{self.path}: runs {spec!r}: {part!r} is outside runs 0-{count - 1} of its manifest"
                )
            chosen.update(range(first, last + 1))
        return tuple(sorted(chosen))

    def num_records(self) -> int:
        return sum(run["records"] for run in self.manifest["runs"])

    def ids(self, runs: Collection[int] | None = None) -> set[str]:
        """Ids of every committed row; only those of run indices `runs` when given (as `rows`)."""
        return {row["id"] for row in self.rows(runs)}

    def begin_run(self, **info: Any) -> DatasetWriter:
        """Start appending a new run (its own shard) described by `info` (prompt_source, seed, ...)."""
        commit = current_commit(ignore=self.path)
        with _locked(self.path):
            self.reload()
            return self._begin_run(commit, info)

    def resume_run(self, index: int = -1) -> DatasetWriter:
        """Continue appending to run `index` (default the last), after repairing a killed writer's tail."""
        with _locked(self.path):
            self.reload()
            return self._resume_run(index)

    def writer(self, **info: Any) -> DatasetWriter:
        """The writer for a generation run described by `info`: the last run when it has the same `info`
        (a rerun, e.g. after a kill: its shard goes on), else a new run with its own shard. The choice
        and the new run's manifest entry are made under one hold of the lock."""
        commit = current_commit(ignore=self.path)
        with _locked(self.path):
            self.reload()
            runs = self.manifest["runs"]
            if runs and all(runs[-1].get(k) == v for k, v in info.items()):
                return self._resume_run(-1)
            return self._begin_run(commit, info)

    def _begin_run(self, commit: str, info: dict[str, Any]) -> DatasetWriter:
        """begin_run with the lock held and the manifest fresh."""
        name = f"{len(self.manifest['runs']):05d}.jsd"
        run = {"shard": name, "records": 0, "prompt_tokens": 0, "response_tokens": 0,
               "commit": commit, "complete": False, **info}  # fmt: skip
        self.manifest["runs"].append(run)
        _write_json_atomic(self.path / MANIFEST, self.manifest)
        return DatasetWriter(self, len(self.manifest["runs"]) - 1)

    def _resume_run(self, index: int) -> DatasetWriter:
        """resume_run with the lock held and the manifest fresh."""
        writer = DatasetWriter(self, index % len(self.manifest["runs"]))
        writer.repair()
        return writer


@dataclasses.dataclass
class DatasetWriter:
    """Appends records to one run's shard; every `append` is committed when it returns."""

    dataset: DistilledDataset
    index: int

    @property
    def run(self) -> dict[str, Any]:
        return self.dataset.manifest["runs"][self.index]

    @property
    def shard(self) -> Path:
        return self.dataset.path / self.run["shard"]

    def repair(self) -> None:
        """Cut a torn tail (never committed) and commit complete records past the manifest's count.
        Call with the lock held (`DistilledDataset.resume_run`)."""
        scan = scan_shard(self.shard)
        if len(scan.rows) < self.run["records"]:
            self.dataset._committed(self.run)  # raises, naming the missing record
        if scan.torn:
            with open(self.shard, "r+b") as f:
                f.truncate(scan.good_bytes)
                os.fsync(f.fileno())
        extra = scan.rows[self.run["records"] :]
        if extra:
            self._commit(extra)

    def ids_of_other_runs(self) -> set[str]:
        """Ids that the data set's runs other than this one hold (as committed when this is called)."""
        others = [i for i in range(len(self.dataset.manifest["runs"])) if i != self.index]
        return self.dataset.ids(others)

    def append(self, rows: Sequence[dict[str, Any]]) -> None:
        payload = b"".join(encode_record(row, self.dataset.dtype) for row in rows)
        with _locked(self.dataset.path):
            with open(self.shard, "ab") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            self.dataset.reload()
            self._commit(rows)

    def finish(self) -> None:
        """Mark the run complete (all its prompts distilled)."""
        with _locked(self.dataset.path):
            self.dataset.reload()
            self.run["complete"] = True
            _write_json_atomic(self.dataset.path / MANIFEST, self.dataset.manifest)

    def _commit(self, rows: Sequence[dict[str, Any]]) -> None:
        """Count `rows` into this run and write the manifest (the commit point); lock held."""
        run = self.run
        run["records"] += len(rows)
        run["prompt_tokens"] += sum(len(r["prompt_ids"]) for r in rows)
        run["response_tokens"] += sum(len(r["response_ids"]) for r in rows)
        _write_json_atomic(self.dataset.path / MANIFEST, self.dataset.manifest)
