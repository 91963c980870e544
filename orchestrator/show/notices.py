"""Notices about our ranks: Ray's own, kept out of the user's output, and ours, said once.

A crashed rank is reported, with its rank, by our own error: Ray's "(raylet) A worker
died ..." about it is noise, and so is its warning that many workers started at once
(pools start one per rank). ORCHESTRATOR_VERBOSE=1 keeps both. Ours: ranks that run
niced below the driver, and how to change it.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from orchestrator import _ray_compat
from orchestrator.show import messages
from orchestrator_workers.protocol import NodeInfo

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


_niced_noted = threading.Event()


def note_niceness(name: str, infos: list[NodeInfo]) -> None:
    """Say once per process when ranks run niced below the driver, and how to change it."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    niced = sorted({info.niceness for info in infos if info.niceness > mine})
    if not niced or _niced_noted.is_set():
        return
    _niced_noted.set()
    levels = "/".join(map(str, niced))
    messages.warn(
        f"the ranks run at niceness {levels} (this driver at {mine}), set by Ray's "
        "worker_niceness on their nodes: they and their data loader workers yield the CPU "
        "to every other process there. To run them at normal priority, start Ray on each "
        "node with RAY_worker_niceness=0 in the environment of `ray start`.",
        job=name,
    )
