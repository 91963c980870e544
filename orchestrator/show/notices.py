"""Ray's own notices about our ranks, kept out of the user's output.

A crashed rank is reported, with its rank, by our own error: Ray's "(raylet) A worker
died ..." about it is noise, and so is its warning that many workers started at once
(pools start one per rank). ORCHESTRATOR_VERBOSE=1 keeps both.
"""

from __future__ import annotations

import os
import re
from typing import Any

from orchestrator import _ray_compat

_rank_pids: set[int] = set()
_WORKER_PID = re.compile(r"Worker PID: (\d+)")
_MANY_WORKERS = "PYTHON worker processes have been started on node"
"""Ray's warning when many actors start at once: a pool's ranks do, by design."""


def quiet_crash_notices(pids: list[int]) -> None:
    """Drop Ray's own "(raylet) A worker died ..." notice for these ranks' processes.

    The crash is reported, with its rank, by our own error. Ray's warning that many
    workers started at once goes too: pools start one per rank. ORCHESTRATOR_VERBOSE=1
    keeps both. Ray offers no switch, so its printer is wrapped (when present).
    """
    _rank_pids.update(pids)
    if not verbose():
        _ray_compat.wrap_log_printer(_without_our_notices)


def _without_our_notices(batch: dict[str, Any]) -> dict[str, Any] | None:
    """A batch of log lines without the raylet's notices about our ranks; None if empty."""
    if batch.get("pid") != "raylet":
        return batch
    lines = [line for line in batch.get("lines", []) if not _ours(line)]
    return {**batch, "lines": lines} if lines else None


def _ours(line: str) -> bool:
    if _MANY_WORKERS in line:
        return True
    match = _WORKER_PID.search(line)
    return match is not None and int(match.group(1)) in _rank_pids


def verbose() -> bool:
    """ORCHESTRATOR_VERBOSE=1: let Ray's own messages through."""
    return os.environ.get("ORCHESTRATOR_VERBOSE", "") not in ("", "0")
