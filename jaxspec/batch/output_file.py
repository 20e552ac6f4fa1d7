"""Ownership of the batch job's output file: it never touches a byte it did not write.

The job appends results to OUTPUT and keeps a sidecar state file, ``OUTPUT.jaxspec-state``
(JSON: ``{"format", "version", "committed", "appending"}``):

* ``committed``: the output's length after the last batch whose lines and newlines are on disk;
* ``appending``: the length the output will have once the batch being written is on disk (equal to
  ``committed`` when no write is in flight). It is made durable *before* the batch is written.

So on reopening, with ``size`` the output's length: ``committed <= size <= appending`` means the bytes
past ``committed`` are this job's own interrupted write (complete lines are kept, a partial last line
is cut off); anything else (a non-empty output without a state file, a file shorter than recorded or
longer than announced) was changed by someone else and the job stops without touching it.
While a job runs it holds an exclusive `fcntl.flock` on the output; a second job on the same output
stops with a clear message.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
from pathlib import Path

from jaxspec.errors import JaxspecError

STATE_SUFFIX = ".jaxspec-state"
STATE_FORMAT = "jaxspec batch results"
STATE_VERSION = 1


class OutputFileError(JaxspecError):
    """The output (or errors) file cannot be used safely; nothing was changed."""


def state_path(output: str | Path) -> Path:
    """Where the sidecar state of `output` lives."""
    return Path(f"{output}{STATE_SUFFIX}")


def check_distinct_files(input_path: str | Path, output: str | Path, errors: str | Path | None) -> None:
    """Refuse an output or errors file that is the input (or each other), by path or by inode (a hard
    link or symlink to the same file)."""
    named = [("--input", Path(input_path)), ("--output", Path(output))]
    if errors is not None:
        named.append(("--errors", Path(errors)))
    for i, (flag_a, path_a) in enumerate(named):
        for flag_b, path_b in named[i + 1 :]:
            if _same_file(path_a, path_b):
                raise OutputFileError(f"{flag_b} must not be the {flag_a} file ({path_b} is {path_a})")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def describe_os_error(path: str | Path, error: OSError, purpose: str) -> OutputFileError:
    """A clear message for an output-side OSError (folder, permissions, missing folder, disk full)."""
    reasons = {
        errno.EISDIR: "is a folder, not a file",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EROFS: "the file system is read-only",
        errno.ENOENT: "its folder does not exist",
        errno.ENOTDIR: "a parent of it is not a folder",
        errno.ENOSPC: "no space left on the device",
    }
    reason = reasons.get(error.errno or 0, error.strerror or str(error))
    return OutputFileError(f"{path}: cannot {purpose}: {reason}")


@dataclasses.dataclass
class OwnedOutput:
    """An output file opened for appending, locked, with the byte range this job may rely on.

    fd: O_WRONLY | O_APPEND descriptor holding the lock. `data` is the output's content up to the
    last complete line (everything the job wrote and may read back as results).
    """

    path: Path
    fd: int
    committed: int
    data: bytes
    repaired: int  # bytes of a partial last line (this job's own) cut off on opening

    def begin_append(self, size: int) -> None:
        """Announce (durably) that `size` bytes are about to be appended."""
        _write_state(self.path, self.committed, self.committed + size)

    def end_append(self, size: int) -> None:
        """Record that the announced `size` bytes are on disk."""
        self.committed += size
        _write_state(self.path, self.committed, self.committed)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def preflight_output(path: str | Path) -> None:
    """Before any work: raise OutputFileError if `path` could not be claimed (a folder, an unwritable
    or non-folder parent, a file that is not the job's own, another job's lock). Changes nothing."""
    path = Path(path)
    if path.is_dir():
        raise OutputFileError(f"{path}: cannot open the output for writing: is a folder, not a file")
    if not path.exists():
        parent = next(p for p in path.absolute().parents if p.exists())
        if not parent.is_dir():
            raise OutputFileError(f"{path}: cannot create the output: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputFileError(f"{path}: cannot create the output: permission denied in {parent}")
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise describe_os_error(path, error, "open the output") from None
    try:
        if not os.access(path, os.W_OK):
            raise OutputFileError(f"{path}: cannot open the output for writing: permission denied")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(path) from None
        _check_state(path, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _locked(path: Path) -> OutputFileError:
    return OutputFileError(
        f"{path}: another jaxspec job is writing this output (it holds the file's lock); "
        "wait for it to finish or choose another --output"
    )


def claim_output(path: str | Path) -> OwnedOutput:
    """Create or reopen `path`, take its lock, check that its content is this job's own results and
    cut off a partial last line this job left. Raises OutputFileError without changing anything
    when the file is not the job's own or another job holds it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise describe_os_error(path, error, "open the output for writing") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(path) from None
        if not existed and state_path(path).exists():  # the output was deleted to start over
            _write_state(path, 0, 0)
        return _check_ownership(path, fd)
    except BaseException:
        os.close(fd)
        raise


def _check_ownership(path: Path, fd: int) -> OwnedOutput:
    size = os.fstat(fd).st_size
    state = _check_state(path, size)
    if state is None:
        _write_state(path, 0, 0)
        return OwnedOutput(path, fd, 0, b"", 0)
    committed, appending = state
    data = path.read_bytes()[:size]
    complete = data.rfind(b"\n", committed) + 1 or committed  # own lines finished before a kill
    repaired = size - complete
    if repaired:
        os.ftruncate(fd, complete)
        os.fsync(fd)
    if (complete, complete) != (committed, appending):
        _write_state(path, complete, complete)
    return OwnedOutput(path, fd, complete, data[:complete], repaired)


def _check_state(path: Path, size: int) -> tuple[int, int] | None:
    """(committed, appending) of an output of `size` bytes that is this job's own; None for an empty
    output without state. Raises OutputFileError for anything else."""
    state = _read_state(path)
    if state is None:
        if size:
            raise OutputFileError(
                f"{path}: already holds {size} bytes that a jaxspec batch job did not write (no "
                f"{state_path(path).name} next to it); choose a new --output, or delete the file to "
                "start over"
            )
        return None
    committed, appending = state
    if size < committed:
        raise OutputFileError(
            f"{path}: is {size} bytes long but this job had written {committed}: it was changed outside "
            "jaxspec; choose a new --output"
        )
    if size > appending:
        raise OutputFileError(
            f"{path}: has {size - appending} bytes after the results this job wrote: it was changed "
            "outside jaxspec; choose a new --output"
        )
    return state


def _read_state(path: Path) -> tuple[int, int] | None:
    file = state_path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise OutputFileError(f"{file}: unreadable state file ({error}); choose a new --output") from None
    ok = isinstance(raw, dict) and raw.get("format") == STATE_FORMAT and raw.get("version") == STATE_VERSION
    committed, appending = (raw.get("committed"), raw.get("appending")) if ok else (None, None)
    numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (committed, appending))
    if not (numbers and 0 <= committed <= appending):
        raise OutputFileError(f"{file}: not a jaxspec state file; choose a new --output")
    return committed, appending


def _write_state(path: Path, committed: int, appending: int) -> None:
    """Replace the state file atomically and durably (temporary file, fsync, rename, fsync folder)."""
    file = state_path(path)
    temporary = file.with_name(file.name + ".tmp")
    payload = {"format": STATE_FORMAT, "version": STATE_VERSION}
    payload.update(committed=committed, appending=appending)
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(json.dumps(payload) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, file)
        directory = os.open(file.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as error:
        raise describe_os_error(file, error, "write the output's state file") from None
