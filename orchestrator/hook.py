"""The runner's hook: what the owner of a runner decides about the calls on its pool.

A live function's runner starts every call on its pool itself, and its hook decides
nothing. A runner whose pool other processes start calls on too (a detached function's
supervisor, whose drivers start small calls themselves) is given a hook that answers, in
typed decisions, which call must run first, how each attempt begins, and whether an idle
pool may be released. The runner alone calls it, from its own thread, and keeps its queue
and its lock to itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.pool import Pool


@dataclass(frozen=True)
class Started:
    """A call another process starts on a pool's ranks, under its own id: its job is queued
    as any other, and where the hook says it runs, the runner collects its outcomes from
    rank 0 instead of starting it."""

    call_id: bytes
    """Its id at rank 0's hand, and its share key (encoded)."""
    secret: bytes = field(repr=False)
    """The job's secret it was started with (its ranks' snapshots); never shown."""
    port: int
    """The port of the rendezvous store it uses."""


@dataclass(frozen=True)
class RunFirst:
    """Before a queued job starts: the job of started call `call_id` holds the ranks now
    and runs first, once it is queued (the runner waits up to `wait_s` for it)."""

    call_id: bytes
    wait_s: float


@dataclass(frozen=True)
class Start:
    """The attempt starts the call on the ranks, and its start lends `lend`: the token
    rank 0 holds from then on, which another process's start must carry (None: rank 0
    takes no other process's start)."""

    lend: bytes | None = field(default=None, repr=False)


START = Start()
"""A start that lends nothing: every start of a live function's calls."""


@dataclass(frozen=True)
class Collect:
    """The call runs on the ranks already (`started`): the attempt collects its outcomes."""

    started: Started


@dataclass(frozen=True)
class Ended:
    """The call ended on the ranks already, with these results (by rank): no attempt runs.
    Rank 0 reserved `next_port` for the next call's store (its starter closed the last)."""

    values: list[Any]
    next_port: int | None = None


Begin = Start | Collect | Ended
"""How a job's attempt begins, as the hook decides."""


class RunnerHook:
    """What a runner asks its owner before it runs a call on its pool. This one, a live
    function's, decides nothing: each method says what the runner then does."""

    def run_first(self, pool: Pool, started: Started | None) -> RunFirst | None:
        """Before the runner starts a queued job on `pool` (`started`: the call that job is,
        where another process starts it): the call whose job must run first, if any."""
        return None

    def missed(self, pool: Pool, call_id: bytes) -> None:
        """The job of `call_id`, which `run_first` named, was not queued in time: its call
        ends on `pool`'s ranks with no job to show it (the runner waits here for that)."""

    def begin(
        self, pool: Pool, started: Started | None, lend: bytes | None, stop: threading.Event
    ) -> Begin:
        """How a job's attempt on `pool` begins (`started`, `lend`: the job's, at its first
        attempt; see `Started` and `Start`). `stop` is set once the job is stopped."""
        return START

    def may_release(self, pool: Pool) -> bool:
        """Whether `pool`, idle, may be released now (False: a call another process started
        holds its ranks, and its job comes)."""
        return True
