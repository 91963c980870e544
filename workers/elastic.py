"""torchrun's error file on the rank side: TORCHELASTIC_ERROR_FILE, and what `record` wrote.

A rank's entry point decorated with `torch.distributed.elastic.multiprocessing.errors.record`
writes its uncaught exception there as JSON (message, timestamp, traceback); torchrun
builds its root-cause summary from that file, and so does this product's report.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator_workers import private

VAR = "TORCHELASTIC_ERROR_FILE"


_known: dict[int, str] = {}
"""This process's error file, once its folder was made or checked (by pid: a fork's differs)."""


def error_file() -> str:
    """This rank process's error file, in this user's own folder ("" where it has none)."""
    pid = os.getpid()
    known = _known.get(pid)
    # Checked once: no other user can remove this user's 0700 folder from a sticky
    # temp dir to plant their own; if it is gone (a cleaner), it is made and checked anew.
    if known and os.path.isdir(os.path.dirname(known)):
        return known
    try:
        path = str(private.folder() / f"torchelastic-error-{pid}.json")
    except OSError:  # a folder another user made: torchrun's "" (no file) then
        return ""
    _known[pid] = path
    return path


def forget(path: str) -> None:
    """Remove an earlier call's error file before the next call runs (ours only)."""
    if path and os.path.basename(path).startswith("torchelastic-error-"):
        with contextlib.suppress(OSError):
            os.unlink(path)


@dataclass(frozen=True)
class ErrorReport:
    """What `record` wrote: the error, when, and its traceback."""

    message: str
    timestamp: float
    traceback: str
    path: str


def read(path: str, since: float) -> ErrorReport | None:
    """The report in the error file at `path`, if it was written at `since` or later."""
    if not path:
        return None
    try:
        if os.stat(path).st_mtime < since - 1:  # whole seconds: torch writes int timestamps
            return None
        data = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
        message = data["message"]
        if isinstance(message, str):  # an older torch's flat layout
            return ErrorReport(message, float(data.get("timestamp", 0)), "", path)
        extra = message.get("extraInfo", {})
        return ErrorReport(
            str(message.get("message", "")),
            float(extra.get("timestamp", 0)),
            str(extra.get("py_callstack", "")),
            path,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
