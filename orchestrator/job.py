"""A submitted call: a Future that also knows its ranks' states, logs and stacks."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from orchestrator.errors import describe, summary
from orchestrator.jobstatus import Attempts, JobStatus, RankStatus, failures, restart_line
from orchestrator.logfiles import read_log
from orchestrator.observe.series import JobMetrics, Series
from orchestrator.show import messages
from orchestrator.show.notebook import CellOutput, Table, rank_table
from orchestrator.show.text import rank_label
from orchestrator_workers.states import State

if TYPE_CHECKING:
    from orchestrator.call import Call
    from orchestrator.options import Options
    from orchestrator.pool import Shrunk
    from orchestrator.shipping import Shipment
    from orchestrator.view import CallView
    from orchestrator_workers.protocol import Payload, RankFailure

R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True)
class Submission:
    """A call of a distributed function as its executor takes it, to make its `Job`."""

    payload: Payload | Shipment
    """The function and its arguments, packed (see `shipping.pack`); or shipped already,
    where another process started the call (see `hook.Started`)."""
    uses_torch: bool
    """Whether the function refers to torch (see `shipping.pack`)."""
    options: Options
    """The call's options."""
    owner: Any = None
    """Kept alive until the job is done (the distributed function, and so its pool)."""
    in_cell: bool = False
    """The job is shown in the submitting notebook cell."""
    waits: bool = False
    """The caller waits for its result at once (a detached call's first read then goes
    with its submit)."""


class Job(Future[list[R]]):
    """One call of a distributed function, running or waiting; a concurrent.futures.Future.

    `result()` returns the ranks' results by rank, or raises the DistributedError;
    `cancel()` stops a running job's ranks or withdraws a waiting one; `await job`
    works in asyncio (a notebook's loop too).
    """

    def __init__(
        self,
        name: str,
        num_ranks: int,
        stop: Callable[[Job[R]], None],
        *,
        log_dir: Path | None = None,
        in_cell: bool = False,
        owner: Any = None,
    ) -> None:
        """A job named `name` of `num_ranks` ranks; `stop` kills it if it runs.

        `log_dir`: its per-rank log folder, for every attempt; `in_cell`: shown in the
        submitting notebook cell; `owner` is kept alive until the job is done (the
        distributed function, and so its pool).
        """
        super().__init__()
        self.name = name
        self.num_ranks = num_ranks
        self.log_dir = log_dir
        """The job's per-rank log folder (rank-N.log); None for log_dir=False."""
        self._stop_requested = threading.Event()
        self._series = Series()
        """Its numbers over time, fed by its attempts' monitors."""
        self._context = contextvars.copy_context()
        """The submitter's context: a notebook routes output by it to the submitting cell."""
        self._call: Call | None = None
        """The running (or last) attempt's call, once its ranks started."""
        self._cell: CellOutput | None = None
        """In a notebook, the submitting cell's display that shows the ranks' output."""
        self._owner = owner
        self._stop = stop
        self._error: BaseException | None = None
        self._ran: list[float] = []
        """When its ranks started running, and when it ended (time.monotonic())."""
        self._phase = State.QUEUED
        self._waiting_for: str | None = None
        self._attempts = Attempts()
        if in_cell:  # last: it draws the table at once
            self._cell = CellOutput(f"[{name}] submitted", table=self.table)
        _live.add(self)

    def result(self, timeout: float | None = None) -> list[R]:
        """Each rank's return value, by rank; raises the job's error (or CancelledError)."""
        return super().result(timeout)

    def cancel(self) -> bool:
        """Stop the job's ranks (within a second) or withdraw its request; False if done.

        Done-callbacks of a cancelled job run in the thread that cancelled it.
        """
        if self.done():
            return False
        self._stop_requested.set()  # from now on, only this settles the job
        try:
            self._stop(self)  # ranks stopped before anyone is told
        finally:
            cancelled = super().cancel()
        if not cancelled:  # it finished just before: its result stands
            return False
        self.set_running_or_notify_cancel()  # concurrent.futures.wait() and as_completed
        self._attempts.ended(str(State.CANCELLED))
        self._discard()
        self._show(State.CANCELLED)
        return True

    def running(self) -> bool:
        """Whether the job's ranks are starting or running (not waiting, not done)."""
        return not self.done() and self._phase in (State.STARTING, State.RUNNING)

    def status(self) -> JobStatus:
        """The job's state, each rank's state, and while pending what it waits for."""
        return self._status(*self._now())

    def _now(self) -> tuple[State, CallView | None]:
        """The job's phase, and its running (or last) attempt's call as it is now, once
        its ranks started."""
        phase = State.CANCELLED if self.cancelled() else self._phase
        call = self._call
        return phase, call.view(stopped=phase != State.RUNNING) if call is not None else None

    def _status(self, phase: State, view: CallView | None) -> JobStatus:
        ranks = []
        ran = phase in (State.RUNNING, State.FINISHED, State.FAILED, State.CANCELLED)
        for rank in range(len(view.ranks) if view is not None else self.num_ranks):
            seen = view.ranks[rank] if view is not None else None
            state = seen.state if seen is not None and ran else phase
            node_ip, pid = (seen.node_ip, seen.pid) if seen is not None else (None, None)
            ranks.append(RankStatus(rank, state, node_ip, pid))
        waiting = self._waiting_for if phase == State.PENDING else None
        stopped = [r.rank for r in ranks if r.state == State.WAITING]
        if stopped and phase == State.RUNNING:
            which = f"ranks {rank_label(stopped)} wait"
            if len(stopped) == 1:
                which = f"rank {stopped[0]} waits"
            waiting = f"{which} for a debugger (the attach command is in the output)"
        events = self._attempts.events()
        attempts = failures(events)
        report = (
            (view.stall or view.stopped) if view is not None and phase == State.RUNNING else None
        )
        stall = str(report) if report is not None else None
        return JobStatus(
            self.name, phase, tuple(ranks), waiting, len(attempts), attempts, stall, events=events
        )

    def logs(self, rank: int) -> str:
        """Everything rank `rank` wrote during this job (so far, while it runs)."""
        if self.log_dir is None:
            raise FileNotFoundError(f"job {self.name} has kept no log files (not started yet?)")
        if self._call is not None and not self.done():
            with contextlib.suppress(ValueError):  # closed by the runner meanwhile
                self._call.console.flush_files()
        return read_log(self.log_dir, rank)

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, by rank, while the job runs ({} otherwise)."""
        call = self._call
        return call.stacks() if call is not None and self.running() else {}

    def table(self) -> Table:
        """The ranks as a table (rank, node, state, elapsed, restarts, last output); when
        the job failed, the root cause first."""
        phase, last = self._now()
        status = self._status(phase, last)
        ran = self._ran
        elapsed = (ran[1] if len(ran) > 1 else time.monotonic()) - ran[0] if ran else 0.0
        root = self._root_cause()
        return rank_table(
            self.name,
            status.state,
            [(r.rank, r.node_ip, r.state) for r in status.ranks],
            last,
            running=phase == State.RUNNING,
            elapsed=elapsed,
            restarts=status.restarts,
            root=(root.rank, describe(root, limit=200)) if root is not None else None,
        )

    def metrics(self) -> JobMetrics:
        """The job's numbers over time, per rank process (see `observe.series`): steps,
        step times, CPU, memory, GPU and what its function reported."""
        return self._series.metrics()

    def _repr_html_(self) -> str:
        """Jupyter: the ranks' table, as it is now."""
        return self.table().html()

    def _root_cause(self) -> RankFailure | None:
        return None if self.cancelled() else getattr(self._error, "root_cause", None)

    def __await__(self) -> Generator[Any, None, list[R]]:
        """`await job` in asyncio: the ranks' results; cancelling the await cancels the job."""
        return asyncio.wrap_future(self).__await__()

    def __repr__(self) -> str:
        """E.g. <Job train running>."""
        state = State.CANCELLED if self.cancelled() else self._phase
        return f"<Job {self.name} {state}>"

    # What the job's runner (through a JobControl) and a subclass tell it.

    def _set_phase(self, phase: State, waiting_for: str | None = None) -> None:
        """Record the job's progress: pending (with what it waits for), starting, running."""
        self._waiting_for = waiting_for
        if phase == State.RUNNING and not self._ran:
            self._ran.append(time.monotonic())
        changed, self._phase = phase != self._phase, phase
        if changed and self._cell is not None:
            detail = f": {waiting_for}" if waiting_for else ""
            self._cell.set_title(f"[{self.name}] {phase}{detail}")

    def _finish(self, value: list[R] | None = None, error: BaseException | None = None) -> None:
        """Settle the future with the ranks' results or the error (a cancelled job stays so).

        Done-callbacks run in the runner thread: a callback must not wait for another
        call of the same function (it would wait for itself).
        """
        if self._stop_requested.is_set():
            return  # cancel() settles a job it stopped, and tells everyone
        self._phase = State.FAILED if error is not None else State.FINISHED
        self._error = error  # the table shows its root cause from the next redraw on
        self._attempts.ended(str(self._phase), summary(error) if error is not None else "")
        why = f": {str(error).splitlines()[0]}" if error is not None else ""
        self._show(f"{self._phase}{why}")  # before the waiter wakes, so its cell sees it
        self._discard()
        with contextlib.suppress(InvalidStateError):  # else cancel() won and tells everyone
            if error is not None:
                self.set_exception(error)
            else:
                assert value is not None, "a job settles with its results or an error"
                self.set_result(value)

    def _discard(self) -> None:
        """Stop tracking a settled job, or one whose submit failed (for exit and GC)."""
        if len(self._ran) == 1:
            self._ran.append(time.monotonic())  # its elapsed time stops here
        _live.discard(self)
        self._owner = None

    def _show(self, ended: str) -> None:
        if self._cell is not None:
            with contextlib.suppress(Exception):  # the job settles whatever the display does
                self._cell.set_title(f"[{self.name}] {ended}")


class JobControl:
    """The runner's hold on a job it runs: everything it tells the job, and what the job's
    calls take from it. The runner reaches a `Job` through this alone."""

    def __init__(self, job: Job[Any]) -> None:
        """Drive `job`."""
        self.job = job
        self.stop = job._stop_requested
        """Set once the job is stopped (cancelled): its calls and its waits end."""
        self.series = job._series
        """The job's numbers over time, which its calls' monitors feed."""

    @property
    def sink(self) -> Callable[[str, str], None] | None:
        """Where the job's shown output goes instead of the console (its notebook cell)."""
        cell = self.job._cell
        return cell.write if cell is not None else None

    @property
    def call(self) -> Call | None:
        """The running (or last) attempt's call, once its ranks started."""
        return self.job._call

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in the submitter's context (a notebook routes the ranks'
        output by it to the submitting cell)."""
        return self.job._context.run(fn, *args, **kwargs)

    def phase(self, phase: State, waiting_for: str | None = None) -> None:
        """The job's progress: pending (with what it waits for), starting."""
        self.job._set_phase(phase, waiting_for)

    def running(self, call: Call) -> None:
        """An attempt's ranks run `call` now."""
        self.job._call = call
        self.job._attempts.running()
        self.job._set_phase(State.RUNNING)

    def restarted(self, error: BaseException) -> None:
        """A failed attempt is followed by a restart: say so."""
        job, why = self.job, summary(error)
        job._attempts.restarted(why)
        self._say(restart_line(len(job._attempts.failures()), why, job.num_ranks))
        job._set_phase(State.STARTING)

    def repaired(self, how: set[int] | Shrunk) -> None:
        """Say what the restart did: the ranks it replaced, or how the job shrank."""
        if isinstance(how, set):
            self._replaced(how)
        else:
            self._shrunk(how)

    def _replaced(self, ranks: set[int]) -> None:
        """Say which ranks the restart replaced, the others kept with their processes."""
        kept = sorted(set(range(self.job.num_ranks)) - ranks)
        self._say(
            f"restart {len(self.job._attempts.failures())}: rank(s) {rank_label(ranks)} in new "
            f"processes; rank(s) {rank_label(kept)} kept, with their memory",
            warn=False,
        )

    def _shrunk(self, shrunk: Shrunk) -> None:
        """Say that the restart goes on with fewer ranks, and which."""
        job = self.job
        job.num_ranks = shrunk.new_world
        line = (
            f"restart {len(job._attempts.failures())}: going on with {shrunk.new_world} of "
            f"{shrunk.old_world} ranks: rank(s) {rank_label(shrunk.lost)} lost with their "
            f"node(s), which no node could replace; rank(s) {_renumbered(shrunk)}"
        )
        job._attempts.shrunk(line)
        self._say(line)

    def finish(self, value: list[Any] | None = None, error: BaseException | None = None) -> None:
        """Settle the job with the ranks' results or the error (see `Job._finish`)."""
        self.job._finish(value, error)

    def discard(self) -> None:
        """Stop tracking a job whose submit failed."""
        self.job._discard()

    def _say(self, line: str, *, warn: bool = True) -> None:
        """Say `line` in the job's cell, or as the driver's message (`warn`: a warning)."""
        job = self.job
        if job._cell is not None:
            job._cell.write("stderr", f"[{job.name}] {line}\n")
        elif warn:
            messages.warn(line, job=job.name)
        else:
            messages.say(line, job=job.name)


_live: set[Job[Any]] = set()


def stop_all(say: bool = False) -> None:
    """Cancel every job of this process that is not done (at exit: and say so)."""
    for job in list(_live):
        if not job.done():
            if say:
                messages.say(f"stopping job {job.name} ({job.status().state}) at exit")
            job.cancel()


def _renumbered(shrunk: Shrunk) -> str:
    """The ranks kept by a shrink, as said: as they were, or old -> new."""
    moved = {old: new for old, new in shrunk.renumbered.items() if old != new}
    if not moved:
        return f"{rank_label(shrunk.renumbered)} kept as they were"
    return "kept, renumbered " + ", ".join(f"{old}->{new}" for old, new in sorted(moved.items()))
