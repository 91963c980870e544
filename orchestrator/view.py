"""What the driver knows of a call, as one snapshot of plain data: each rank's state, its
last output, whether it is slow or silent, and who holds the call back (what its monitor
found, `Findings`, made in diagnose/monitor.py, with the `Notice` for the status line).

`Job.status()`, `Job.table()`, the notebook and the status line read a call through this
alone, so it may as well come from another process (it pickles).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.diagnose.stall import StallReport
from orchestrator.diagnose.stopped import Stopped
from orchestrator.diagnose.straggle import Straggler
from orchestrator_workers.figures import Figures
from orchestrator_workers.states import State

if TYPE_CHECKING:
    from orchestrator.pool import Pool
    from orchestrator.show.logs import Console


@dataclass(frozen=True)
class Notice:
    """What a running call must tell the user now, in place of its usual line."""

    key: object
    """What it is about: said again at once only when this changes."""
    line: str
    full: str
    """With the details (stacks), for a log that keeps every line."""


@dataclass(frozen=True)
class Findings:
    """What the monitor of a call worked out last (see `diagnose.monitor`)."""

    stall: StallReport | None
    """Ranks without progress for `stall_after`, grouped by where they are; None: all move."""
    slow: tuple[Straggler, ...]
    """Ranks slower than their peers, the slowest first."""
    notice: Notice | None
    """What the status line must say now (a stall, slow ranks), if anything."""
    stopped: Stopped | None
    """A rank that stopped while its peers wait in a collective (see diagnose.stopped)."""
    figures: Mapping[int, Figures]
    """Each rank's figures as last read while it runs (a rank not read: none)."""


@dataclass(frozen=True)
class RankSnapshot:
    """One rank of a call, as last known."""

    rank: int
    state: State
    """finished, failed, running (or what it waits on: a debugger), or stopped."""
    node_ip: str | None
    node_id: str | None
    hostname: str | None
    pid: int | None
    last_line: str
    """The last line it printed ('' for none)."""
    silent_s: float | None
    """While it runs: seconds since it last printed (or since the call began)."""
    slow: bool
    """Named slower than its peers."""
    figures: Figures | None = None
    """Its step, CPU, memory and GPU figures, as last read while it runs (None: not read)."""

    @property
    def use(self) -> str:
        """What its process uses, in words ('' when not read)."""
        return self.figures.use() if self.figures is not None else ""


@dataclass(frozen=True)
class CallView:
    """One call, as the driver knows it at one moment."""

    name: str
    key: str
    """The call's id (the names of its /dev/shm buffers carry it)."""
    started: float
    """When it started (time.time())."""
    ranks: tuple[RankSnapshot, ...]
    stall: StallReport | None
    """Ranks without progress for `stall_after`, grouped by where they are; None: all move."""
    slow: tuple[Straggler, ...]
    """Ranks slower than their peers, the slowest first."""
    notice: Notice | None
    """What the status line must say now (a stall, slow ranks), if anything."""
    stopped: Stopped | None
    """A rank that stopped while its peers wait in a collective."""
    log_dir: Path | None


def snapshot(
    key: str,
    started: float,
    pool: Pool,
    *,
    states: Sequence[State],
    console: Console,
    findings: Findings | None,
) -> CallView:
    """The view of call `key` of `pool`, started at `started` (time.time()), its ranks in
    `states`, its output on `console`; its monitor's `findings` while it is watched."""
    now, infos = time.monotonic(), pool.infos
    slow = {s.rank for s in findings.slow} if findings is not None else set()
    ranks = []
    for rank, state in enumerate(states):
        info = infos[rank] if infos else None
        ranks.append(
            RankSnapshot(
                rank=rank,
                state=state,
                node_ip=info.node_ip if info else None,
                node_id=info.node_id if info else None,
                hostname=info.hostname if info else None,
                pid=info.pid if info else None,
                last_line=console.last_lines[rank],
                silent_s=now - console.last_times[rank] if state == State.RUNNING else None,
                slow=rank in slow,
                figures=findings.figures.get(rank) if findings is not None else None,
            )
        )
    return CallView(
        name=pool.name,
        key=key,
        started=started,
        ranks=tuple(ranks),
        stall=findings.stall if findings is not None else None,
        slow=findings.slow if findings is not None else (),
        notice=findings.notice if findings is not None else None,
        stopped=findings.stopped if findings is not None else None,
        log_dir=console.log_dir,
    )
