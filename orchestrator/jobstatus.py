"""What a job is now (`JobStatus`, with each rank's `RankStatus`) and has been: its
events, when its ranks ran, when an attempt failed and why, when a restart had them
running again, and how it ended. The page draws the events on its timeline; a detached
job's come from its supervisor with its status."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from orchestrator.show.summary import SUMMARY_FROM_RANKS, states_line
from orchestrator_workers.states import State


@dataclass(frozen=True)
class JobEvent:
    """One moment of a job's life."""

    at: float
    """When (wall clock)."""
    kind: str
    """running (an attempt's ranks run: the first, or a restart's once recovered),
    restart (an attempt failed and is restarted), failed, finished or cancelled."""
    text: str
    """What happened: for a failure, which rank, where and why (its root cause)."""


@dataclass(frozen=True)
class RankStatus:
    """Where one rank is and what it is doing."""

    rank: int
    state: State
    """queued, pending (placement), starting, running, finished, failed, stopped, cancelled;
    while it stops at a breakpoint, "waiting for a debugger" and then "in a debugger" (a
    State: it compares equal to those words)."""
    node_ip: str | None = None
    pid: int | None = None


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of a job: its state, each rank's, and what it waits for."""

    name: str
    state: State
    """queued (behind the function's previous call), pending (waiting for resources),
    starting (actors starting), running, finished, failed, or cancelled (a State: it
    compares equal to those words)."""
    ranks: tuple[RankStatus, ...]
    waiting_for: str | None = None
    """While pending: what it needs and what the cluster has free now. While running:
    which ranks wait for a debugger to attach."""
    restarts: int = 0
    """How many times the job was restarted (max_restarts); the attempt is restarts + 1."""
    failed_attempts: tuple[str, ...] = ()
    """One line per failed attempt: which rank, where, and why."""
    stall: str | None = None
    """While running: the ranks without progress for `stall_after`, grouped by where they
    are, each group's first stack (see orchestrator.stall), or before that a rank that
    stopped while its peers wait for it (see diagnose.stopped); None while all move."""
    events: tuple[JobEvent, ...] = field(default=(), repr=False)
    """Its life so far, with when: attempts running, failed, restarted; how it ended."""

    def __str__(self) -> str:
        """E.g. 'train: running (r0 finished, r1 running)'; ranks in one state share a
        part ('r5 failed, r0-4,6-127 stopped'), the fewest first."""
        detail = f"; {self.waiting_for}" if self.waiting_for else ""
        restarts = f", restarted {self.restarts}x" if self.restarts else ""
        if len(self.ranks) < SUMMARY_FROM_RANKS:
            ranks = ", ".join(f"r{r.rank} {r.state}" for r in self.ranks)
        else:
            ranks = states_line((r.rank, r.state) for r in self.ranks)
        text = f"{self.name}: {self.state}{detail}{restarts} ({ranks})"
        return f"{text}\n{self.stall}" if self.stall else text


class Attempts:
    """The events of one job, in order; safe across the runner's and readers' threads."""

    def __init__(self) -> None:
        """No attempt yet."""
        self._events: list[JobEvent] = []
        self._lock = threading.Lock()

    def running(self) -> None:
        """An attempt's ranks run now."""
        restarts = len(self.failures())
        self._add("running", f"restart {restarts}: running again" if restarts else "running")

    def restarted(self, why: str) -> None:
        """An attempt failed (`why`) and a restart follows."""
        self._add("restart", why)

    def shrunk(self, text: str) -> None:
        """A restart goes on with fewer ranks (`text` says which)."""
        self._add("shrunk", text)

    def ended(self, kind: str, why: str = "") -> None:
        """The job ended: finished, failed (`why`) or cancelled."""
        self._add(kind, why)

    def failures(self) -> tuple[str, ...]:
        """Why each restarted attempt failed, oldest first."""
        return failures(self.events())

    def events(self) -> tuple[JobEvent, ...]:
        """Every event so far, oldest first."""
        with self._lock:
            return tuple(self._events)

    def _add(self, kind: str, text: str) -> None:
        with self._lock:
            self._events.append(JobEvent(time.time(), kind, text))


def failures(events: tuple[JobEvent, ...]) -> tuple[str, ...]:
    """Why each restarted attempt of `events` failed, oldest first."""
    return tuple(e.text for e in events if e.kind == "restart")


def restart_line(attempt: int, why: str, ranks: int) -> str:
    """What is said when failed attempt `attempt` (`why`) is followed by a restart."""
    return f"attempt {attempt} failed: {why}; restarting all {ranks} ranks (restart {attempt})"
