"""Following a detached job from this process: `FollowedJob`, a `Job` its supervisor answers.

State, table, logs, stacks and outcome come from the supervisor; a thread shows the ranks'
output from its journal on this console, folded as a live call's, and what the supervisor
said to no one (what a pending job waits for, restarts, stalls). Exit, Ctrl-C and a
notebook's stop button stop following, not the job; `cancel()` stops it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Collection
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from orchestrator import job as jobs
from orchestrator.connect import cluster
from orchestrator.errors import SupervisorLostError
from orchestrator.job import Job
from orchestrator.jobstatus import JobStatus, RankStatus, restart_line
from orchestrator.observe.series import JobMetrics
from orchestrator.show import messages
from orchestrator.show.logs import Console
from orchestrator.show.notebook import Table
from orchestrator.supervise.link import ASK_TIMEOUT_S, SupervisorLink
from orchestrator.supervise.registry import JobRecord
from orchestrator.supervise.supervisor import Outcome, Snapshot
from orchestrator_workers.protocol import unwire
from orchestrator_workers.states import State

R = TypeVar("R")

READ_WAIT_S = 0.25
"""How long one read of the journal waits for output before the follower looks at the
job's state (and shows partial lines and folds that are due)."""
PAGE_ENTRIES = 5_000
"""Entries asked for per read."""


class FollowedJob(Job[R]):
    """A detached job, followed from this process: the `Job` API, answered by its supervisor.

    `id` names it in the cluster; `orchestrator.get_job(id)` gets it back from any process.
    """

    def __init__(
        self,
        record: JobRecord,
        handle: Any,
        *,
        backlog: int | None = None,
        in_cell: bool = False,
        show: bool = True,
        fold: bool | None = None,
        ranks: Collection[int] | None = None,
        owner: Any = None,
        first: tuple[Any, Outcome | None] | None = None,
    ) -> None:
        """Follow the job of `record`, supervised by actor `handle`.

        `first`: its first page, and its outcome where that page ends it (a submit's answer);
        `backlog`: show each rank's newest this many lines first (None: from the start);
        `show`: show the ranks' output here as it comes (else only keep its newest lines
        for a page, `console.shown`); `fold`, `ranks`: as `distribute`'s
        `fold_output` and `log_ranks` (None: as the job's driver asked).
        """
        self.id = record.id
        """The job's id in the cluster: its name and a short random part."""
        self.record = record
        self._link = SupervisorLink(record.id, record.name, record.supervisor, handle)
        self._snapshot: Snapshot | None = None
        self._unfollowed = threading.Event()
        self._following_lock = threading.Lock()
        self._reading = True
        """Whether a thread reads the journal now (set before it starts, cleared as it ends)."""
        self._show_output = show
        self._keep_output = not show
        """Its lines read into its console, not shown: kept for a page (the cluster's)."""
        # Last: in a notebook it draws the table at once, which asks the supervisor.
        super().__init__(record.name, record.ranks, _cancel_remote, in_cell=in_cell, owner=owner)
        jobs._live.discard(self)  # a detached job is not stopped at this process's exit
        options = record.console
        self._console = Console(
            record.name,
            record.ranks,
            prefix=options.log_prefix,
            show=options.log_ranks if ranks is None else ranks,
            sink=_unshown if not show else self._cell.write if self._cell is not None else None,
            fold=options.fold_output if fold is None else fold,
        )
        _following.add(self)
        after = 0
        if first is not None:
            page, outcome = first
            self._show_page(page)
            after = page.next
            if page.closed:  # it ended already: nothing to follow
                self._reading = False
                self._end(outcome)
                return
        self._read_in_thread("follow", backlog, after)

    # What a Job answers, asked of the supervisor.

    @property
    def console(self) -> Console:
        """The console this job's output is shown through (a page reads its newest lines)."""
        return self._console

    def status(self) -> JobStatus:
        """The job's state and each rank's, as its supervisor sees them now."""
        snapshot = self._look()
        if snapshot is None:  # unreachable before the first look
            ranks = tuple(RankStatus(r, self._phase) for r in range(self.num_ranks))
            return JobStatus(self.name, self._phase, ranks)
        return snapshot.status

    def table(self) -> Table:
        """The ranks as a table, as its supervisor sees them now."""
        snapshot = self._look()
        if snapshot is None:
            return Table(f"[{self.name}] {self._phase} (its supervisor does not answer)", ())
        return snapshot.table

    def logs(self, rank: int) -> str:
        """Everything rank `rank` wrote during this job (so far), from the supervisor's node."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank}: job {self.id} has ranks 0-{self.num_ranks - 1}")
        return str(self._link.ask("logs", rank))

    def metrics(self) -> JobMetrics:
        """The job's numbers over time since it started, as its supervisor keeps them."""
        found: JobMetrics = unwire(self._link.ask("metrics"))
        return found

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks while the job runs ({} otherwise)."""
        return dict(self._link.ask("stacks")) if not self.done() else {}

    def running(self) -> bool:
        """Whether the job's ranks are starting or running."""
        return not self.done() and self._phase in (State.STARTING, State.RUNNING)

    def release(self) -> None:
        """Let the supervisor forget this finished job (its journal and result); it is no
        longer followed here. InvalidStateError while it runs: cancel() stops it."""
        if self._link.ask("release") is False:  # None: a supervisor of an earlier version
            raise InvalidStateError(
                f"job {self.id} is still running: release() forgets a finished job's "
                "result and output; cancel() stops it, or release it once it is done"
            )
        self.unfollow()

    def unfollow(self, say: bool = False) -> None:
        """Stop following (and showing) the job here; it runs on. `say`: say how to get back."""
        if self._unfollowed.is_set():
            return
        self._unfollowed.set()
        _following.discard(self)
        if say and not self.done():
            messages.say(
                f"job {self.id} runs on in the cluster; {how_to_get_back(self.id)}", job=self.name
            )

    def result(self, timeout: float | None = None) -> list[R]:
        """Each rank's return value, by rank, or the job's error; waits for its end (after
        `unfollow()`, by watching it again, without showing its output)."""
        self._watch_quietly()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The job's error, or None once it succeeded; waits as `result` does."""
        self._watch_quietly()
        return super().exception(timeout)

    def _watch_quietly(self) -> None:
        with self._following_lock:
            if self.done() or not self._unfollowed.is_set():
                return
            self._show_output = self._keep_output = False  # its end only, nothing again
            self._unfollowed.clear()  # a follower still reading goes on, quietly
            if self._reading:
                return
            self._reading = True
            self._read_in_thread("watch", None, 0)

    def __repr__(self) -> str:
        """E.g. <Job train-3f9a1c running (detached)>."""
        state = State.CANCELLED if self.cancelled() else self._phase
        return f"<Job {self.id} {state} (detached)>"

    # Following.

    def _read_in_thread(self, what: str, backlog: int | None, after: int) -> None:
        name = f"{what} {self.id}"
        threading.Thread(target=self._follow, args=(backlog, after), name=name, daemon=True).start()

    def _follow(self, backlog: int | None, after: int) -> None:
        try:
            self._follow_from(backlog, after)
        except SystemExit:  # Ray shuts down in this process (its exit): stop following
            self.unfollow()
        except SupervisorLostError as exc:
            self._settle(None, exc)
        except Exception as exc:  # noqa: BLE001 - never leave result() waiting for ever
            self._settle(
                None,
                SupervisorLostError(
                    f"lost track of job {self.id} ({type(exc).__name__}: {exc}); it may run "
                    f"on: {how_to_get_back(self.id)}"
                ),
            )
        finally:
            with self._following_lock:
                self._reading = False

    def _follow_from(self, backlog: int | None, after: int) -> None:
        if not (self._show_output or self._keep_output):  # its end only: from where it is
            snapshot = self._look()
            after = snapshot.position if snapshot is not None else 0
        elif backlog is not None:
            with contextlib.suppress(RayError, KeyError):
                after = int(self._link.ask("newest", backlog))
        while True:
            with self._following_lock:
                if self._unfollowed.is_set():
                    self._reading = False  # now, under the lock: see _watch_quietly
                    return
            try:
                page, outcome = unwire(
                    ray.get(
                        self._link.handle.read.remote(self.id, after, PAGE_ENTRIES, READ_WAIT_S),
                        timeout=READ_WAIT_S + ASK_TIMEOUT_S,
                    )
                )
            except RayActorError as exc:
                self._settle_lost(exc)
                return
            except KeyError:  # raised by the supervisor (Ray's error is one too)
                self._settle(None, KeyError(f"job {self.id} was released by its supervisor"))
                return
            except Exception as exc:  # noqa: BLE001 - unreachable, or raised again there
                self._link.unreachable(exc)
                continue
            self._link.reached()
            self._show_page(page)
            after = page.next
            if page.closed:  # the job ended, and this is all it wrote
                self._end(outcome)
                return
            if not page.entries:
                self._look()  # its state moves on (for status, the table, a cell's title)

    def _show_page(self, page: Any) -> None:
        if not (self._show_output or self._keep_output) or self._unfollowed.is_set():
            return
        for rank, lines in sorted(page.dropped.items() if self._show_output else ()):
            messages.say(
                f"r{rank}: {lines} older lines were dropped (the journal is bounded)", job=self.name
            )
        for entry in page.entries:
            self._console.write(entry.rank, [entry.chunk])
        self._console.tick()

    def _look(self) -> Snapshot | None:
        """The supervisor's snapshot now (the last one when it does not answer)."""
        try:
            snapshot: Snapshot = unwire(
                ray.get(self._link.handle.snapshot.remote(self.id), timeout=ASK_TIMEOUT_S)
            )
        except Exception as exc:
            # Or a handle void in a new session: the next read finds the supervisor again.
            lost = self._link.void(exc) or cluster.lost_session(exc)
            if not (lost or isinstance(exc, (RayError, GetTimeoutError))):
                raise
        else:
            before, self._snapshot = self._snapshot, snapshot
            if self._show_output:
                self._say_news(before.status if before is not None else None, snapshot.status)
            if not self.done() and snapshot.status.state != self._phase:
                self._set_phase(snapshot.status.state, snapshot.status.waiting_for)
        return self._snapshot

    def _say_news(self, before: JobStatus | None, now: JobStatus) -> None:
        """Say what the supervisor said to no one: what the job waits for, a restart, a
        stall (each once, when it changes)."""
        if now.waiting_for and (before is None or before.waiting_for != now.waiting_for):
            messages.say(now.waiting_for, job=self.name)
        done = len(before.failed_attempts) if before is not None else 0
        for attempt, why in enumerate(now.failed_attempts[done:], start=done + 1):
            messages.warn(restart_line(attempt, why, self.num_ranks), job=self.name)
        if now.stall and (before is None or before.stall != now.stall):
            messages.warn(now.stall, job=self.name)

    def _end(self, outcome: Outcome | None) -> None:
        if outcome is None:
            self._settle(None, SupervisorLostError(f"job {self.id}: its outcome is gone"))
        elif not outcome.cancelled:
            self._settle(outcome.value, outcome.error)
        else:
            self._console.flush()
            _following.discard(self)
            # Unless cancelled from this process (cancel() settles it then).
            if not self._stop_requested.is_set() and _cancel_future(self):
                self._discard()
                self._show(State.CANCELLED)
                messages.say(
                    f"job {self.id} was stopped elsewhere (`orchestrator stop`, or "
                    "cancel() in another process)",
                    job=self.name,
                )

    def _settle(self, value: list[R] | None, error: BaseException | None) -> None:
        self._console.flush()
        _following.discard(self)
        self._finish(value, error)

    def _settle_lost(self, exc: BaseException) -> None:
        lost = SupervisorLostError(
            f"job {self.id}: its supervisor is gone ({type(exc).__name__}), so the job is "
            "lost: the node that supervised it (the head node) died or the actor was killed. "
            "Its ranks were stopped with it."
        )
        self._settle(None, lost)


def _cancel_future(job: Job[Any]) -> bool:
    """Mark `job` cancelled as a Future (its ranks were stopped elsewhere)."""
    with contextlib.suppress(InvalidStateError):
        if Future.cancel(job):
            job.set_running_or_notify_cancel()
            return True
    return False


def _cancel_remote(job: Job[Any]) -> None:
    """Job.cancel's stop: the supervisor stops the job's ranks."""
    assert isinstance(job, FollowedJob)
    job.unfollow()
    job._link.ask("cancel")


def how_to_get_back(job_id: str) -> str:
    """The words that say how to get job `job_id` back."""
    return f"get it back with orchestrator.get_job({job_id!r}), or `orchestrator logs {job_id} -f`"


_following: weakref.WeakSet[FollowedJob[Any]] = weakref.WeakSet()
"""The detached jobs this process follows now."""


def stop_following(say: bool = False) -> None:
    """Stop following every detached job (at exit: and say how to get each back)."""
    for job in list(_following):
        job.unfollow(say=say)


def _unshown(stream: str, text: str) -> None:
    """Where a job's lines go that are kept for a page but not shown here."""
