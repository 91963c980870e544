"""torchrun's error file on the rank side: TORCHELASTIC_ERROR_FILE, and what `record` wrote.

A rank's entry point decorated with `torch.distributed.elastic.multiprocessing.errors.record`
writes its uncaught exception there as JSON (message, timestamp, traceback); torchrun
builds its root-cause summary from that file, and so does this product's report.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, replace

from orchestrator_workers import private
from orchestrator_workers.protocol import RankFailure

VAR = "TORCHELASTIC_ERROR_FILE"


_pinned: dict[int, int] = {}
"""This process's private folder, opened once it was checked (by pid: a fork's differs)."""


def error_file() -> str:
    """This rank process's error file, in this user's own folder ("" where it has none).

    The path goes through the folder's descriptor (/proc/self/fd/N/...), which torch
    opens by name: if the folder is removed (a /tmp cleaner) and another user makes one
    of the same name, torch still writes into this user's folder, never theirs. A removed
    folder is made, checked and opened anew.
    """
    pid = os.getpid()
    fd = _pinned.get(pid)
    if fd is None or os.fstat(fd).st_nlink == 0:
        try:
            fd = private.pin(private.folder())
        except OSError:  # a folder another user made: torchrun's "" (no file) then
            return ""
        old = _pinned.pop(pid, None)
        if old is not None:
            os.close(old)
        _pinned[pid] = fd
    return f"/proc/self/fd/{fd}/torchelastic-error-{pid}.json"


_made: dict[int, tuple[int, int, int]] = {}
"""The error file `prepare` last made, by pid: (the pinned folder's fd, st_dev, st_ino)."""


def prepare(path: str) -> None:
    """Before a call: this call's error file, made empty, 0600 and new (O_EXCL) in the
    pinned folder, so that torch's `record` writes into the product's own file (torch
    would make it 0644, and follow a link planted there).

    The file the last call found made is kept when it is still that same file (same
    inode, one link, a regular file of this user's, 0600) and empty: it is then what a
    new one would be, for one stat instead of an unlink, an open and a close (a warm
    call's cost on every rank). Anything else is removed and made anew.
    """
    pid = os.getpid()
    fd = _pinned.get(pid)
    if not path or fd is None or not path.startswith(f"/proc/self/fd/{fd}/"):
        return
    name = os.path.basename(path)
    if _unchanged(fd, name, _made.get(pid)):
        return
    _made.pop(pid, None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        made = os.open(name, flags, 0o600, dir_fd=fd)
        try:
            found = os.fstat(made)
        finally:
            os.close(made)
        _made[pid] = (fd, found.st_dev, found.st_ino)


def _unchanged(folder: int, name: str, made: tuple[int, int, int] | None) -> bool:
    """Whether `name` in `folder` is still the empty 0600 file `made` says was made there."""
    if made is None or made[0] != folder:
        return False
    try:
        found = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return False
    return (
        (found.st_dev, found.st_ino) == made[1:]
        and stat.S_ISREG(found.st_mode)
        and stat.S_IMODE(found.st_mode) == 0o600
        and found.st_uid == os.getuid()
        and found.st_nlink == 1
        and found.st_size == 0
    )


@dataclass(frozen=True)
class ErrorReport:
    """What `record` wrote: the error, when, and its traceback."""

    message: str
    timestamp: float
    traceback: str
    path: str
    raw: bytes = b""
    """The file as torch wrote it (at most `KEPT_BYTES`): the driver keeps it beside the
    rank's log, where it outlives the rank, as torchrun's does."""


KEPT_BYTES = 1 << 20
"""The most of an error file a rank sends the driver."""


def read(path: str, since: float) -> ErrorReport | None:
    """The report in the error file at `path`, if it was written at `since` or later."""
    if not path:
        return None
    try:
        if os.stat(path).st_mtime < since - 1:  # whole seconds: torch writes int timestamps
            return None
        with open(path, "rb") as written:
            raw = written.read(KEPT_BYTES + 1)
        data = json.loads(raw.decode("utf-8", errors="replace"))
        kept = raw if len(raw) <= KEPT_BYTES else b""  # cut short, it is no JSON
        message = data["message"]
        if isinstance(message, str):  # an older torch's flat layout
            return ErrorReport(message, float(data.get("timestamp", 0)), "", path, kept)
        extra = message.get("extraInfo", {})
        return ErrorReport(
            str(message.get("message", "")),
            float(extra.get("timestamp", 0)),
            str(extra.get("py_callstack", "")),
            path,
            kept,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def reported(failure: RankFailure, path: str, since: float, exc_name: str) -> RankFailure:
    """`failure` as torch's `record` reported it in the error file at `path`, where it
    wrote one at `since` or later (as torchrun's root-cause summary reads it)."""
    report = read(path, since)
    if report is None:
        return failure
    # The time stays ours: `record` keeps whole seconds, too coarse to tell which rank
    # failed first.
    return replace(
        failure,
        message=report.message.removeprefix(f"{exc_name}: ") or failure.message,
        traceback=report.traceback or failure.traceback,
        error_file=report.path,
        error_json=report.raw,
    )
