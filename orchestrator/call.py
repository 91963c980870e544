"""One attempt of a call: start it on every rank at once, wait for all, collect their
outcomes, time out. Its output goes through `channel.CallOutput`, its watching through
`diagnose.monitor.Monitor`; what it knows is read through `view()`."""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from orchestrator import crash, shipping, waits
from orchestrator.channel import POLL_S, CallOutput
from orchestrator.connect import cluster
from orchestrator.diagnose.monitor import Monitor
from orchestrator.dispatch import Awaited, call_spec
from orchestrator.errors import (
    JobTimeoutError,
    StallError,
    StopRequested,
    distributed_error,
    is_secondary,
)
from orchestrator.hook import START, Collect, Start
from orchestrator.observe.series import Series
from orchestrator.options import Options
from orchestrator.pool import Pool
from orchestrator.shipping import Shipment
from orchestrator.show import messages
from orchestrator.show.logs import Console, Journaling
from orchestrator.show.status import StatusLine
from orchestrator.view import CallView, snapshot
from orchestrator_workers.protocol import Collected, RankFailure, RankResult
from orchestrator_workers.states import State

_GATHER_S = 0.3
"""After the first failure, how long to keep listening for the others' (for the report)."""
_IDLE_S = 0.5
"""Otherwise, while the ranks are quiet, the driver wakes when a run ends or a rank
prints, and at least this often, to see a stop (which kills the ranks: their runs end)."""
_QUICK_S = 0.05
"""How long a call's first look waits for all its outcomes at once (a warm call's come)."""


@dataclass(frozen=True)
class JobContext:
    """What every attempt of one job shares: its function, its options, where its output
    goes, its stop and its secret."""

    shipped: Shipment
    """The function and its arguments, shipped (see `shipping.ship`)."""
    options: Options
    """The job's options: how its output is shown, its time limits."""
    log_dir: Path | None = None
    """Its per-rank log folder, one for all its attempts (None: no log files)."""
    sink: Callable[[str, str], None] | None = None
    """Takes the ranks' output instead of the console (a notebook cell): `sink(stream,
    text)`."""
    journal: Journaling | None = None
    """Records every chunk too (a detached job's, for its followers)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set once the job is stopped: its ranks are killed, and its call raises StopRequested."""
    secret: bytes = field(default=b"", repr=False)
    """The same for all its attempts: its ranks' snapshots prove it (see snapshot)."""
    series: Series = field(default_factory=Series)
    """Its numbers over time, from all its attempts (`Job.metrics`)."""


class Call:
    """One call on every rank of a pool: ranks still running, output still owed, outcomes.

    Ranks are watched as they complete, not in rank order. On the first failure the
    caller must tear the pool down (the other ranks may be blocked in a collective
    forever): `wait` raises a DistributedError after a short wait for the others'
    reports. When `stop` is set (and the ranks killed), `wait` raises StopRequested.
    """

    def __init__(
        self,
        pool: Pool,
        context: JobContext,
        *,
        earlier: Sequence[BaseException] = (),
        begin: Start | Collect = START,
    ) -> None:
        """Start the job's function on every rank of `pool`, as an attempt of the job whose
        `context` it takes.

        `earlier`: the job's failed attempts, for this one's error. `begin`: start the call
        (lending the token it names), or collect one another process started (see hook).
        """
        self.pool = pool
        self.console = Console(
            pool.name,
            len(pool.actors),
            prefix=context.options.log_prefix,
            show=context.options.log_ranks,
            log_dir=context.log_dir,
            sink=context.sink,
            fold=context.options.fold_output,
            journal=context.journal,
        )
        restart_count = len(earlier)
        if restart_count:
            attempt = f"attempt {restart_count + 1} (restart {restart_count})"
            self.console.mark_files(f"--- {attempt} ---")
        options, shipped = context.options, context.shipped
        self.timeout = options.timeout
        self.stop = context.stop
        self.earlier = tuple(earlier)
        if isinstance(begin, Collect):  # its outcomes are collected at rank 0
            self.share_key = begin.started.call_id.decode()
            self.call_id = begin.started.call_id
            pool.store_port = begin.started.port
            everyone = Awaited(tuple(range(len(pool.actors))), 0)
            self.runs = {pool.actors[0].collect.remote(self.call_id): everyone}
        else:
            self.share_key = uuid.uuid4().hex[:16]
            self.call_id = self.share_key.encode()
            spec = call_spec(
                options,
                shipped,
                gpus=pool.request.gpus_per_replica > 0,
                port=pool.store_port,
                share_key=self.share_key,
                job_secret=context.secret,
                restart_count=restart_count,
            )
            self.runs = pool.routes.start(self.call_id, spec, shipped.data, begin.lend)
        """The Ray tasks in flight that bring ranks' outcomes, and whose."""
        self.output = CallOutput(pool.channels, pool.infos, self.console)
        self.next_port: int | None = None
        """The port rank 0 reserved for the next call's rendezvous store, once it returned."""
        self.store_open = False
        """Whether rank 0's store still serves (a rank connected to it)."""
        self.owed: dict[int, int] = {}  # rank -> output seq to show before it counts as done
        self.results: dict[int, Any] = {}
        self.failures: list[RankFailure] = []
        self.gather_until: float | None = None
        self.started = started = time.monotonic()
        self._started_at = time.time()
        self.time_limit = None if self.timeout is None else started + self.timeout
        after, on_stall = options.stall_after, options.on_stall
        self.monitor = None
        if after is not None:
            self.monitor = Monitor(
                pool, started, after, on_stall, series=context.series, key=self.share_key
            )
        quiet = context.sink is not None  # a notebook cell shows the ranks' table instead
        self.status = None if quiet else StatusLine(pool.name, len(pool.actors), started, self.view)

    def wait(self) -> list[Any]:
        """Watch every rank until all are done or one failed; results by rank.

        The log files are closed when it returns or raises. A call that fails or is
        stopped removes what its ranks left in /dev/shm once they are gone.
        """
        try:
            try:
                self._watch()
            finally:
                messages.clear_in_place()  # a status line, if one is drawn
            self.console.flush()
        except BaseException:
            self._forget_buffers()
            raise
        finally:
            self.console.close_logs()
        if self.failures:
            self._forget_buffers()
            raise distributed_error(
                self.failures, log_dir=self.console.log_dir, earlier_attempts=self.earlier
            )
        self.pool.use_store(self.next_port, close=self.store_open)  # every rank is done
        if self.monitor is not None:
            self.monitor.watch.last_reading()  # the ranks' last steps, where it was read
        return [self.results[rank] for rank in range(len(self.pool.actors))]

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, by rank."""
        return self.pool.stacks()

    def _watch(self) -> None:
        console, output = self.console, self.output
        self._take_all(list(self.runs), quick=True)  # a warm call's: no wait, one get
        while self._busy():
            if self.stop.is_set():
                raise StopRequested
            if self.pool.session != cluster.session():  # another thread made a new one
                raise ConnectionError("the Ray Client session that owned the ranks ended")
            now = time.monotonic()
            if self.gather_until is not None and now >= self.gather_until:
                self._node_losses()
                break
            if self.time_limit is not None and now >= self.time_limit and self.runs:
                self._end(self.timeout or 0.0)
            output.request()
            looked = self._look(now)
            notice = self.monitor.notice if self.monitor is not None else None
            status = self.status.tick(now, console.last_output, notice) if self.status else None
            wake = [
                t
                for t in (self.gather_until, self.time_limit, console.tick(now), status, looked)
                if t
            ]
            wait_s = min(wake) - now if wake else None
            finished, shown = self._wait_runs(wait_s)
            if self.stop.is_set():
                raise StopRequested
            self._take_all(finished)
            output.take(shown)

    def _look(self, now: float) -> float | None:
        """Let the monitor read the ranks when due; end the call if it says so; when next."""
        monitor = self.monitor
        if monitor is None or not self.runs or self.failures:
            return None
        due = monitor.look(
            now,
            call_key=self.share_key,
            running=self.running(),
            results=self.results.keys(),
            waits_on=self.output.waits_on,
            last_output=self.console.last_times,
        )
        if (report := monitor.ends_call()) is not None:
            self._end(monitor.after_s, str(report))
        return due

    def _wait_runs(self, wait_s: float | None) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
        """Runs finished within `wait_s` (or the poll), and the output requests ready.

        A call handed off by node, with quiet ranks: one wait for the first of the runs
        and the output requests (a failure or a line is seen at once; a quiet call costs
        a pass or two). Ranks that print (from `channel.GATHER_FROM_RANKS`), or a run
        per rank (they end together): every `POLL_S`, all that is ready at once.
        """
        output = self.output
        runs, draining = list(self.runs), list(output.draining)
        readings = list(self.monitor.watch.pending) if self.monitor and runs else []
        per_rank = len(runs) > len(self.pool.routes.nodes)
        if not runs or not (per_rank or output.printing(time.monotonic())):
            timeout = _IDLE_S if wait_s is None else max(0.0, min(wait_s, _IDLE_S))
            ready = waits.ready(runs + draining + readings, timeout, more_of=runs + readings)
            return [r for r in ready if r in self.runs], [r for r in ready if r in draining]
        poll = POLL_S if per_rank else output.shown_at + POLL_S - time.monotonic()
        timeout = max(0.0, poll if wait_s is None else min(wait_s, poll))
        if per_rank:
            finished, _ = ray.wait(runs, num_returns=len(runs), timeout=waits.whole_ms(timeout))
        else:
            finished = waits.ready(runs, timeout)
        return finished, waits.ready(draining, 0) if draining else []

    def rank_state(self, rank: int, *, stopped: bool) -> State:
        """finished, failed, running (or what it waits on); `stopped` when the call ended."""
        if rank in self.results:
            return State.FINISHED
        if any(f.rank == rank for f in self.failures):
            return State.FAILED
        waits_on = self.output.waits_on.get(rank)
        return State.STOPPED if stopped else State(waits_on) if waits_on else State.RUNNING

    def view(self, *, stopped: bool = False) -> CallView:
        """What this call knows now, as one snapshot (`stopped`: the call has ended)."""
        states = [self.rank_state(r, stopped=stopped) for r in range(len(self.pool.actors))]
        monitor = None if stopped else self.monitor
        return snapshot(
            self.share_key,
            self._started_at,
            self.pool,
            states=states,
            console=self.console,
            findings=monitor.findings() if monitor is not None else None,
        )

    def let_return(self, wait_s: float) -> None:
        """Take the outcomes of ranks still running that come within `wait_s`."""
        until = time.monotonic() + wait_s
        while self.runs and (left := until - time.monotonic()) > 0:
            done = waits.ready(list(self.runs), left)
            if not done:
                break
            self._take_all(done)

    def running(self) -> set[int]:
        """Ranks whose outcomes have not come yet."""
        return {rank for awaited in self.runs.values() for rank in awaited.ranks}

    def _forget_buffers(self) -> None:
        """After a failed call's ranks were told to stop: remove what they left in /dev/shm."""
        nodes = list(self.pool.routes.nodes)
        shipping.forget_buffers(self.share_key, nodes, list(self.runs))

    def _busy(self) -> bool:
        return bool(self.runs) or self.output.owes(self.owed)

    def _take_all(self, refs: list[ray.ObjectRef], *, quick: bool = False) -> None:
        """Take the outcomes these finished tasks bring, fetched together where all are there;
        `quick`: all if within _QUICK_S, else none (through Ray Client: one request)."""
        if not refs:
            return
        try:
            values: list[bytes | None] = ray.get(refs, timeout=_QUICK_S if quick else None)
        except (GetTimeoutError, RayActorError):  # quick: none yet; else one is gone: each below
            if quick:
                return
            values = [None] * len(refs)
        for ref, value in zip(refs, values, strict=True):
            awaited = self.runs.pop(ref)
            try:
                data = ray.get(ref) if value is None else value
            except RayActorError as exc:
                self._lost(awaited, exc)
                continue
            if awaited.leader is None:
                self._take(pickle.loads(data))  # noqa: S301 - from our own rank actor
            else:
                self._take_node(awaited.leader, data)

    def _take_node(self, leader: int, data: bytes) -> None:
        """Take what `leader` collected from the ranks; ask again for the rest."""
        collected: Collected = pickle.loads(data)  # noqa: S301 - from our own rank actor
        for rank, outcome in collected.outcomes:
            if outcome is None:  # large, or its socket closed (then Ray says why it is gone)
                self._ask(rank)
            else:
                self._take(pickle.loads(outcome))  # noqa: S301 - from our own rank actor
        if collected.running:
            rest = self.pool.actors[leader].collect.remote(self.call_id)
            self.runs[rest] = Awaited(collected.running, leader)

    def _lost(self, awaited: Awaited, exc: RayActorError) -> None:
        """The actor that was to bring `awaited`'s outcomes is gone: its rank crashed; the
        other ranks (whose call it handed off) are asked for theirs directly."""
        gone = awaited.ranks[0] if awaited.leader is None else awaited.leader
        if gone in awaited.ranks and all(f.rank != gone for f in self.failures):
            self._take(self._crash(gone, exc))
        for rank in awaited.ranks:
            if rank != gone:
                self._ask(rank)

    def _ask(self, rank: int) -> None:
        """Ask `rank`'s actor itself for its outcome of this call (handed off to it)."""
        self.runs[self.pool.actors[rank].outcome.remote(self.call_id)] = Awaited((rank,))

    def _take(self, outcome: RankResult | RankFailure) -> None:
        self.owed[outcome.rank] = outcome.output_seq
        if isinstance(outcome, RankFailure):
            self.failures.append(outcome)
            self.gather_until = self.gather_until or time.monotonic() + _GATHER_S
            return
        self.results[outcome.rank] = outcome.value
        if outcome.next_master_port is not None:
            self.next_port = outcome.next_master_port
            self.store_open = outcome.store_open

    def _node_losses(self) -> None:
        """Where every failure so far is a peer's symptom (a closed connection), the ranks
        not heard from on a lost node are the cause: said as such now, not once Ray's
        health checks notice (seconds later, after the call ended)."""
        if all(is_secondary(f) for f in self.failures):
            for rank in crash.on_lost_nodes(self.running(), self.pool.infos):
                self._take(self._crash(rank, RayActorError()))

    def _crash(self, rank: int, exc: RayActorError) -> RankFailure:
        """`rank`'s failure: its actor is gone (`exc`, Ray's word on why)."""
        said, code = self.output.last_words(rank), self.output.exit_codes.get(rank)
        local, info = self.pool.specs[rank].local_rank, self.pool.infos[rank]
        return crash.failure(rank, local, info, exc, exit_code=code, last_words=said)

    def _end(self, after_s: float, stall: str | None = None) -> None:
        """Raise JobTimeoutError after `after_s` (or StallError, with its `stall` report),
        with every rank's stack and place."""
        self.console.flush()
        stacks, where, log_dir = self.pool.stacks(), self.pool.places(), self.console.log_dir
        earlier = self.earlier
        if stall is None:
            raise JobTimeoutError(after_s, stacks, where, log_dir=log_dir, earlier_attempts=earlier)
        raise StallError(after_s, stall, stacks, where, log_dir=log_dir, earlier_attempts=earlier)
