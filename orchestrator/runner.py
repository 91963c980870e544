"""The executor behind a distributed function: its queue of jobs, warm pool and restarts.

A `Runner` runs a function's jobs one after another in a thread of its own, on a warm
pool of rank actors it starts on first need and keeps between calls. A failed attempt
is followed by another (max_restarts) after the broken ranks, or the whole pool, were
replaced. When the runner is no longer referenced, a finalizer releases its pool.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator import call, logfiles, reserve, restart, shipping
from orchestrator.connect import cluster
from orchestrator.errors import BusyError, OrchestratorError, PlacementTimeoutError, StopRequested
from orchestrator.hook import Ended, RunFirst, RunnerHook, Started
from orchestrator.job import Job, JobControl, Submission
from orchestrator.options import Options
from orchestrator.pool import Pool
from orchestrator.reserve import Plan
from orchestrator.shipping import Shipment
from orchestrator.show import messages
from orchestrator.show.logs import Journaling
from orchestrator_workers.states import State


@dataclass
class _Entry:
    """A job queued and what it runs (`journal`: where its output is recorded too;
    `started`, `lend`: see `hook.Started`, `hook.Start`)."""

    control: JobControl
    shipped: Shipment
    options: Options
    plan: Plan | None
    journal: Journaling | None = None
    started: Started | None = None
    lend: bytes | None = field(default=None, repr=False)

    @property
    def job(self) -> Job[Any]:
        """The job queued."""
        return self.control.job


_LINGER_S = 2.0
"""How long the runner thread waits for the next call before it ends."""


class _PoolBox:
    """Holds a runner's warm pool apart from everything else, for the finalizer."""

    def __init__(self) -> None:
        self.pool: Pool | None = None

    def release(self) -> None:
        """Stop the pool's actors and give back its resources."""
        pool, self.pool = self.pool, None
        if pool is not None and ray.is_initialized():
            pool.shutdown()

    def drop(self) -> None:
        """Forget a pool whose actors ended with their Ray session (no spare starts)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.standby.close(kill=False)


class Runner:
    """Runs the jobs of the function named `name`, laid out as `options` say, in turn.

    Shared by a function and its `with_options` copies, which differ only in per-call
    options: each job brings its own.
    """

    def __init__(self, name: str, options: Options, hook: RunnerHook | None = None) -> None:
        """A runner with no pool and no thread yet: both start with the first job. `hook`:
        what its owner decides about the calls on its pool (default: nothing)."""
        self.name = name
        self.options = options
        self.hook = hook or RunnerHook()
        self._box = _PoolBox()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[_Entry] = deque()
        self._thread: threading.Thread | None = None
        self.current: Job[Any] | None = None
        """The job running now, if any."""
        self.last: Job[Any] | None = None
        """The job submitted last."""
        weakref.finalize(self, self._box.release)
        _runners.add(self)

    @property
    def pool(self) -> Pool | None:
        """The warm pool, if one is running."""
        return self._box.pool

    def busy_with(self) -> Job[Any] | None:
        """The job that runs or waits on this function now, if any."""
        waiting = [e.job for e in tuple(self._queue) if not e.job.done()]  # its thread moves them
        current = self.current if self.current is not None and not self.current.done() else None
        return current or (waiting[0] if waiting else None)

    def submit(
        self,
        call: Submission,
        *,
        journal: Journaling | None = None,
        started: Started | None = None,
        lend: bytes | None = None,
    ) -> Job[Any]:
        """Queue `call`; its Job, at once.

        In the caller's thread: BusyError (queue=False), shipping, connecting and an
        impossible request fail here, before anything is queued. `journal`: where the
        job's output is recorded too (a detached job's supervisor); `started`, `lend`:
        see `_Entry`.
        """
        options = call.options
        self._refuse_if_busy(options)
        plan = None if self.pool is not None else reserve.plan(options)
        # Now, before returning: the arguments' big tensors are pickled by reference, so a
        # caller changing them after submit() must not change what the ranks get.
        shipped = call.payload
        if not isinstance(shipped, Shipment):
            shipped = shipping.ship(shipped, uses_torch=call.uses_torch)
        folder = options.log_folder
        log_dir = logfiles.call_folder(folder, self.name) if folder is not None else None
        job: Job[Any] = Job(
            self.name,
            options.num_replicas,
            self.stop,
            log_dir=log_dir,
            in_cell=call.in_cell,
            owner=call.owner,
        )
        control = JobControl(job)
        with self._lock:
            try:
                self._refuse_if_busy(options)  # under the lock: another thread may have won
            except BusyError:
                control.discard()
                raise
            self._queue.append(_Entry(control, shipped, options, plan, journal, started, lend))
            self.last = job
            self._wakeup.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name=f"orchestrator-{job.name}", daemon=True
                )
                self._thread.start()
        return job

    def _refuse_if_busy(self, options: Options) -> None:
        busy = self.busy_with()
        if busy is not None and not options.queue:
            raise BusyError.still_running(self.name, busy)

    def stop(self, job: Job[Any]) -> None:
        """Withdraw a queued `job`, or kill its ranks if it runs (a waiting one sees its flag)."""
        with self._lock:
            for entry in [e for e in self._queue if e.job is job]:  # a copy: removed in place
                self._queue.remove(entry)
            pool = self.pool if job is self.current else None
            if pool is not None:
                self._box.pool = None  # never hand a killed pool to the next call
        if pool is not None:
            pool.shutdown()

    def release_if_idle(self, reason: str) -> bool:
        """Release the warm pool if no call runs or waits on it; True if released."""
        pool, idle = self.pool, self.current is None and not self._queue
        if pool is not None and idle and not self.hook.may_release(pool):
            return False
        with self._lock:
            pool = self.pool
            if pool is None or self.current is not None or self._queue:
                return False
            self._box.pool = None
        messages.say(f"released its idle ranks: {reason}", job=pool.name)
        pool.shutdown()
        return True

    def release(self) -> None:
        """Stop the warm pool's actors and give back its resources."""
        self._box.release()

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty while it has none)."""
        pool = self.pool
        return pool.pids() if pool is not None else []

    def interrupt(self, job: Job[Any]) -> KeyboardInterrupt:
        """Ctrl-C while the caller waited for `job`: its ranks are stopped; what to raise."""
        job.cancel()
        return KeyboardInterrupt(
            f"interrupted: all {self.options.num_replicas} ranks of {self.name} were "
            "stopped; the next call starts fresh ones"
        )

    def shutdown(self) -> None:
        """Cancel every queued and running job, then release the pool."""
        with self._lock:
            jobs = [entry.job for entry in self._queue]
            if self.current is not None:
                jobs.append(self.current)
        for job in jobs:
            job.cancel()
        self.release()

    def _idle(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for no job to run; whether none does."""
        with self._lock:
            return self._wakeup.wait_for(lambda: self.current is None, wait_s)

    def _work(self) -> None:
        while True:
            with self._lock:
                # Linger a moment: calls in a loop then cost no thread start each.
                self._wakeup.wait_for(lambda: bool(self._queue), timeout=_LINGER_S)
                if not self._queue:
                    self._thread = None
                    return
                entry = self._queue.popleft()
                self.current = entry.job
            try:
                entry = self._first(entry)
                entry.control.run(self._execute, entry)
            except BaseException as exc:  # noqa: BLE001 - a bug here must not strand jobs
                entry.control.finish(error=exc)
            finally:
                with self._lock:
                    self.current = None
                    self._wakeup.notify_all()  # for `settle`

    def _first(self, entry: _Entry) -> _Entry:
        """`entry`, or first the job the hook says holds the ranks now (`entry` then next)."""
        pool = self.pool
        if pool is None:
            return entry
        while (first := self.hook.run_first(pool, entry.started)) is not None:
            found = self._take_queued(first)
            if found is not None:
                with self._lock:
                    self._queue.appendleft(entry)
                    self.current = found.job
                return found
            self.hook.missed(pool, first.call_id)
        return entry

    def _take_queued(self, first: RunFirst) -> _Entry | None:
        """The entry of started call `first.call_id`, taken out of the queue once it comes;
        None where it did not come within `first.wait_s`."""

        def find() -> _Entry | None:
            calls = (e for e in self._queue if e.started and e.started.call_id == first.call_id)
            return next(calls, None)

        with self._lock:
            found = self._wakeup.wait_for(find, first.wait_s)
            if found is not None:
                self._queue.remove(found)
            return found

    def _execute(self, entry: _Entry) -> None:
        """Run the entry's job: start the pool if needed, call, restart as allowed, settle
        the job.

        A cancelled job is settled by cancel(); every other outcome here.
        """
        control, options, plan = entry.control, entry.options, entry.plan
        context = self._context(entry)
        earlier: list[BaseException] = []
        while not control.stop.is_set():
            try:
                value = self._attempt(entry, plan, earlier, context)
            except BaseException as exc:  # noqa: BLE001 - every outcome settles the job
                if cluster.lost_session(exc):  # its ranks ended with the session
                    self._box.drop()
                    control.finish(error=cluster.session_lost_error(exc))
                    return
                if isinstance(exc, StopRequested) or control.stop.is_set():
                    self.release()
                    return
                if restart.restartable(exc, options, len(earlier)):
                    earlier.append(exc)
                    control.restarted(exc)
                    try:
                        kept = restart.repair(control, self.pool, len(earlier), exc, options)
                    except PlacementTimeoutError as late:  # a lost node's ranks: no node
                        self.release()
                        late.earlier_attempts = tuple(earlier)
                        control.finish(error=late)
                        return
                    if not kept:
                        self.release()
                        plan = None  # a whole new pool, laid out on the nodes alive now
                    continue
                # Ranks may be stuck in a collective: replace the whole pool next time.
                self.release()
                if earlier and isinstance(exc, OrchestratorError) and not exc.earlier_attempts:
                    # Not from a call (which names them itself): the pool's start failed.
                    exc.earlier_attempts = tuple(earlier)
                control.finish(error=exc)
                return
            control.finish(value)
            if self.pool is not None and self.pool.shrunk:  # the next call: its full size
                self.release()
            return

    def _context(self, entry: _Entry) -> call.JobContext:
        """What every attempt of the entry's job shares. Its output shows in its notebook
        cell, or on the console, or nowhere where it is journaled (a detached job's
        supervisor has no one to show it to; its followers do)."""
        control = entry.control
        return call.JobContext(
            entry.shipped,
            entry.options,
            log_dir=control.job.log_dir,
            sink=control.sink or (_nowhere if entry.journal is not None else None),
            journal=entry.journal,
            stop=control.stop,
            # For all its attempts (its ranks' snapshots); a started call brings its own.
            secret=entry.started.secret if entry.started is not None else os.urandom(32),
            series=control.series,
        )

    def _attempt(
        self,
        entry: _Entry,
        plan: Plan | None,
        earlier: list[BaseException],
        context: call.JobContext,
    ) -> list[Any]:
        control, shipped, options = entry.control, entry.shipped, entry.options
        if self.pool is not None and self.pool.session != cluster.session():
            self._box.drop()  # its actors ended with an earlier Ray Client session
        if self.pool is None:
            plan = plan or reserve.plan(options)
            self._box.pool = self._start(control, plan, shipped.uses_torch)
        pool = self.pool
        assert pool is not None
        pool.keep_spares(options)
        first = not earlier  # a started call is so at its first attempt alone
        started = entry.started if first else None
        begin = self.hook.begin(pool, started, entry.lend if first else None, control.stop)
        if isinstance(begin, Ended):
            pool.use_store(begin.next_port, close=False)
            return begin.values
        attempt = call.Call(pool, context, earlier=earlier, begin=begin)
        control.running(attempt)
        return attempt.wait()

    def _start(self, control: JobControl, plan: Plan, uses_torch: bool) -> Pool:
        def progress(phase: State, detail: str | None) -> None:
            if phase == State.PENDING:
                _reclaim_idle(self.name)  # an idle warm pool of ours must not block a job
            control.phase(phase, detail)

        return Pool(
            self.name,
            plan,
            self.options,
            preload_torch=uses_torch,
            stop=control.stop,
            on_phase=progress,
        )


def _nowhere(stream: str, text: str) -> None:
    """Shows nothing."""


_runners: weakref.WeakSet[Runner] = weakref.WeakSet()
"""Every runner in this process, so a waiting job can reclaim idle pools."""


def settle(wait_s: float) -> list[str]:
    """Wait up to `wait_s` in all for every runner's current job to end (at exit, after
    they were cancelled: their threads leave Ray alone before it shuts down); the names of
    those whose job had not ended by then."""
    deadline = time.monotonic() + wait_s
    runners = list(_runners)
    return [r.name for r in runners if not r._idle(max(0.0, deadline - time.monotonic()))]


def _reclaim_idle(waiting: str) -> None:
    """Release this process's idle warm pools, so the waiting job `waiting` can be placed."""
    for runner in list(_runners):
        runner.release_if_idle(f"{waiting} is waiting for resources")
