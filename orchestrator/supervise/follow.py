"""The driver's side of a detached job: start its supervisor, follow it, get it back.

A detached distributed function (`distribute(..., detach=True)`) sends each call to its
supervisor (`supervise.supervisor`) and returns a `FollowedJob`: a `Job` whose state, table,
logs, stacks and outcome come from the supervisor, and whose ranks' output a thread reads
from the supervisor's journal and shows on this process's console, folded as a live call's.
Exit, Ctrl-C and a notebook's stop button stop following, not the job; `cancel()` stops it.

Each job is recorded in the cluster's key-value store (`supervise.registry`), so that
`get_job` and `list_jobs` find it from any process that reaches the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from orchestrator import shipping
from orchestrator.connect import cluster, discovery, rankside
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.job import CANCELLED, FAILED, Job, JobStatus, RankStatus
from orchestrator.options import Options
from orchestrator.show import messages
from orchestrator.show.logs import Console
from orchestrator.show.notebook import Table
from orchestrator.supervise import registry
from orchestrator.supervise.registry import JobRecord
from orchestrator.supervise.supervisor import (
    CONCURRENCY,
    NAMESPACE,
    Outcome,
    RemoteShell,
    RemoteSupervisor,
    Snapshot,
)
from orchestrator_workers.states import State

R = TypeVar("R")

READ_WAIT_S = 0.25
"""How long one read of the journal waits for output before the follower looks at the
job's state (and shows partial lines and folds that are due)."""
PAGE_ENTRIES = 5_000
"""Entries asked for per read."""
BACKLOG_LINES = 1_000
"""Getting a job back shows each rank's newest this many lines, then follows."""
RETRY_S = 1.0
"""While the supervisor cannot be reached (the network is down), how often to try again."""
ASK_TIMEOUT_S = 30.0
"""How long one question to the supervisor may take before it counts as unreachable."""
START_TIMEOUT_S = 120.0
"""How long a new supervisor may take to start."""

NO_LASTING_RAY = (
    "detach=True needs a Ray that outlives this process, and this process would start its "
    "own (embedded) Ray, which ends with it. Start the local runtime first "
    "(`orchestrator local start`), or give address= (or RAY_ADDRESS) of a cluster"
)


class SupervisorLostError(OrchestratorError):
    """The supervisor of a detached job is gone (its node was lost, or it was killed)."""


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
    ) -> None:
        """Follow the job of `record`, supervised by actor `handle`.

        `backlog`: show each rank's newest this many lines first (None: from the start);
        `show`: show the ranks' output on this process's console as it comes; `fold`: as
        `distribute(fold_output=...)` (None: as the job's driver asked); `ranks`: the
        ranks shown (None: as the job's driver asked).
        """
        self.id = record.id
        """The job's id in the cluster: its name and a short random part."""
        self.record = record
        self._handle = handle
        self._snapshot: Snapshot | None = None
        self._unfollowed = threading.Event()
        self._following_lock = threading.Lock()
        self._reading = True
        """Whether a thread reads the journal now (set before it starts, cleared as it ends)."""
        self._show_output = show
        # Last: in a notebook it draws the table at once, which asks the supervisor.
        super().__init__(record.name, record.ranks, _cancel_remote, in_cell=in_cell, owner=owner)
        self._live_discard()
        options = record.console
        self._console = Console(
            record.name,
            record.ranks,
            prefix=options.log_prefix,
            show=options.log_ranks if ranks is None else ranks,
            sink=self._cell.write if self._cell is not None else None,
            fold=options.fold_output if fold is None else fold,
        )
        _following.add(self)
        self._thread = threading.Thread(
            target=self._follow, args=(backlog,), name=f"follow {self.id}", daemon=True
        )
        self._thread.start()

    # What a Job answers, asked of the supervisor.

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
        return str(self._ask(self._handle.logs, rank))

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks while the job runs ({} otherwise)."""
        return dict(self._ask(self._handle.stacks)) if not self.done() else {}

    def running(self) -> bool:
        """Whether the job's ranks are starting or running."""
        return not self.done() and self._phase in (State.STARTING, State.RUNNING)

    def release(self) -> None:
        """Let the supervisor forget this finished job (its journal and result)."""
        self._ask(self._handle.release)
        registry.forget(self.id)

    def unfollow(self, say: bool = False) -> None:
        """Stop following (and showing) the job here; it runs on. `say`: print how to get
        it back."""
        if self._unfollowed.is_set():
            return
        self._unfollowed.set()
        _following.discard(self)
        if say and not self.done():
            messages.say(f"job {self.id} runs on in the cluster; {_how_to_get_back(self.id)}",
                         job=self.name)

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
            self._show_output = False
            self._unfollowed.clear()  # a follower still reading goes on, quietly
            if self._reading:
                return
            self._reading = True
            self._thread = threading.Thread(
                target=self._follow, args=(None,), name=f"watch {self.id}", daemon=True
            )
            self._thread.start()

    def __repr__(self) -> str:
        """E.g. <Job train-3f9a1c running (detached)>."""
        state = CANCELLED if self.cancelled() else self._phase
        return f"<Job {self.id} {state} (detached)>"

    # Following.

    def _follow(self, backlog: int | None) -> None:
        try:
            self._follow_from(backlog)
        except SystemExit:  # Ray shuts down in this process (its exit): stop following
            self.unfollow()
        finally:
            with self._following_lock:
                self._reading = False

    def _follow_from(self, backlog: int | None) -> None:
        after = 0
        down_since: float | None = None
        if not self._show_output:  # watching for its end only: from where it is now
            snapshot = self._look()
            after = snapshot.position if snapshot is not None else 0
        elif backlog is not None:
            with contextlib.suppress(RayError, KeyError):
                after = int(self._ask(self._handle.newest, backlog))
        while True:
            with self._following_lock:
                if self._unfollowed.is_set():
                    self._reading = False  # now, under the lock: see _watch_quietly
                    return
            try:
                page, outcome = ray.get(
                    self._handle.read.remote(self.id, after, PAGE_ENTRIES, READ_WAIT_S),
                    timeout=READ_WAIT_S + ASK_TIMEOUT_S,
                )
                if down_since is not None:
                    messages.say(f"reached the supervisor of {self.id} again", job=self.name)
                down_since = None
            except RayActorError as exc:
                self._settle_lost(exc)
                return
            except (RayError, GetTimeoutError, KeyError) as exc:
                if isinstance(exc, KeyError):
                    self._settle(None, KeyError(f"job {self.id} was released by its supervisor"))
                    return
                if down_since is None:
                    down_since = time.monotonic()
                    messages.say(
                        f"cannot reach the supervisor of {self.id} ({type(exc).__name__}); "
                        f"trying again every {RETRY_S:g} s (the job runs on)",
                        job=self.name,
                    )
                time.sleep(RETRY_S)
                continue
            self._show_page(page)
            after = page.next
            if page.closed:  # the job ended, and this is all it wrote
                self._end(outcome)
                return
            if not page.entries:
                self._look()  # its state moves on (for status, the table, a cell's title)

    def _show_page(self, page: Any) -> None:
        if not self._show_output or self._unfollowed.is_set():
            return
        for rank, lines in sorted(page.dropped.items()):
            messages.say(f"r{rank}: {lines} older lines were dropped (the journal is bounded)",
                         job=self.name)
        for entry in page.entries:
            self._console.write(entry.rank, [entry.chunk])
        self._console.tick()

    def _look(self) -> Snapshot | None:
        """The supervisor's snapshot now (the last one when it does not answer)."""
        with contextlib.suppress(RayError, GetTimeoutError):
            snapshot: Snapshot = ray.get(
                self._handle.snapshot.remote(self.id), timeout=ASK_TIMEOUT_S
            )
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
            messages.warn(f"attempt {attempt} failed: {why}; restarting all "
                          f"{self.num_ranks} ranks (restart {attempt})", job=self.name)
        if now.stall and (before is None or before.stall != now.stall):
            messages.warn(now.stall, job=self.name)

    def _end(self, outcome: Outcome | None) -> None:
        self._console.flush()
        if outcome is None:
            self._settle(None, SupervisorLostError(f"job {self.id}: its outcome is gone"))
        elif outcome.cancelled:
            self._settle_cancelled()
        else:
            self._settle(outcome.value, outcome.error)

    def _settle(self, value: list[R] | None, error: BaseException | None) -> None:
        self._console.flush()
        _following.discard(self)
        self._finish(value, error)

    def _settle_cancelled(self) -> None:
        _following.discard(self)
        if self._stop_requested.is_set():
            return  # cancelled from this process: cancel() settles it
        if _cancel_future(self):
            self._discard()
            self._show(CANCELLED)

    def _settle_lost(self, exc: BaseException) -> None:
        self._phase = FAILED
        self._settle(
            None,
            SupervisorLostError(
                f"job {self.id}: its supervisor is gone ({type(exc).__name__}), so the job "
                "is lost: the node that supervised it (the head node) died or the actor was "
                "killed. Its ranks were stopped with it."
            ),
        )

    def _ask(self, method: Any, *args: Any) -> Any:
        try:
            return ray.get(method.remote(self.id, *args), timeout=ASK_TIMEOUT_S)
        except RayActorError as exc:
            raise SupervisorLostError(f"job {self.id}: its supervisor is gone") from exc

    def _live_discard(self) -> None:
        from orchestrator import job as jobs

        jobs._live.discard(self)  # a detached job is not stopped at this process's exit


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
    job._ask(job._handle.cancel)


def _how_to_get_back(job_id: str) -> str:
    return f"get it back with orchestrator.get_job({job_id!r}), or `orchestrator logs {job_id} -f`"


class Detached:
    """What a detached function has in place of a `Runner`: its supervisor in the cluster."""

    def __init__(self, name: str, options: Options) -> None:
        """No supervisor yet: it starts with the first call."""
        self.name = name
        self.options = options
        self._handle: Any = None
        self._supervisor_name: str | None = None
        self._lock = threading.Lock()
        self.last: FollowedJob[Any] | None = None
        self.current: FollowedJob[Any] | None = None
        self.pool = None
        """Always None: the warm pool lives in the supervisor."""

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: Options,
        *,
        owner: Any = None,
        in_cell: bool = False,
    ) -> FollowedJob[Any]:
        """Send `fn(*args, **kwargs)` to the supervisor; its FollowedJob, at once."""
        busy = self.last is not None and not self.last.done()
        if busy and not options.queue:
            from orchestrator.errors import BusyError

            raise BusyError(
                f"{self.name} is still running an earlier call ({self.last!r}); wait for it "
                "(job.result()), cancel it, or submit with queue=True to run after it"
            )
        payload, uses_torch = shipping.pack(fn, args, kwargs)
        handle = self._supervisor()
        record = registry.new_record(self.name, options, self._supervisor_name or "")
        submitted = handle.submit.remote(record, payload, uses_torch, _in_cluster(options))
        # Its first read goes with the submit (the supervisor waits for the job), not after.
        job: FollowedJob[Any] = FollowedJob(record, handle, in_cell=in_cell, owner=owner)
        try:
            ray.get(submitted, timeout=START_TIMEOUT_S)  # its errors, here
        except BaseException:
            job.unfollow()
            job._discard()
            raise
        messages.say(f"detached job {record.id}; {_how_to_get_back(record.id)}", job=self.name)
        self.last = self.current = job
        return job

    def shutdown(self) -> None:
        """Stop following this function's jobs here, and let its supervisor release its
        warm pool once no job runs (jobs that run go on)."""
        if self.last is not None:
            self.last.unfollow(say=True)
        if self._handle is not None:
            with contextlib.suppress(RayError, GetTimeoutError):
                ray.get(self._handle.release_when_idle.remote(), timeout=ASK_TIMEOUT_S)

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty while it has none)."""
        if self._handle is None:
            return []
        return list(ray.get(self._handle.pids.remote(), timeout=ASK_TIMEOUT_S))

    def _supervisor(self) -> Any:
        with self._lock:
            if self._handle is None:
                self._handle, self._supervisor_name = start_supervisor(self.name, self.options)
            return self._handle


def _in_cluster(options: Options) -> Options:
    """The options a supervisor runs a call with: it is connected, runs it itself, and
    shows no rank's lines (it journals them, and keeps the log files; its followers show
    them as this driver asked)."""
    return dataclasses.replace(options, detach=False, address=None, log_ranks=())


def connect_lasting(address: str | None) -> None:
    """Connect to a Ray that outlives this process; ConfigError (before starting one) if
    there is none."""
    if not ray.is_initialized():
        given = address or os.environ.get("RAY_ADDRESS")
        if not given and discovery.local_cluster()[0] is None:
            raise ConfigError(NO_LASTING_RAY)
        cluster.connect(address)
    if cluster.is_embedded():
        raise ConfigError(NO_LASTING_RAY)


def start_supervisor(name: str, options: Options) -> tuple[Any, str]:
    """The supervisor of detached function `name`: the one a driver left with a warm pool
    of the same kind (see `registry.pool_key`), else a new one on the head node; (handle,
    its name)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connect_lasting(options.address)
    key = registry.pool_key(options)
    left = _adopt(key)
    if left is not None:
        messages.say(f"using the warm ranks an earlier driver left ({left[1]})", job=name)
        return left
    head = _head_node()
    actor, carry = _supervisor_class(head, name)
    actor_name = registry.supervisor_name(name)
    handle = actor.options(
        name=actor_name,
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
    ).remote(
        *carry,
        name,
        pickle.dumps(_in_cluster(options), pickle.HIGHEST_PROTOCOL),
        key,
        actor_name,
    )
    try:
        ray.get(handle.ready.remote(), timeout=START_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(Exception):
            ray.kill(handle)
        raise
    registry.keep_pool(key, actor_name)
    return handle, actor_name


def _adopt(key: str) -> tuple[Any, str] | None:
    """The supervisor that keeps warm pool `key` for a later driver, if it takes this one."""
    name = registry.pool_supervisor(key)
    if name is None:
        return None
    with contextlib.suppress(ValueError, RayError, GetTimeoutError):
        handle = ray.get_actor(name, namespace=NAMESPACE)
        if ray.get(handle.adopt.remote(), timeout=ASK_TIMEOUT_S):
            return handle, name
    return None


def _supervisor_class(node_id: str, name: str) -> tuple[Any, tuple[Any, ...]]:
    """The supervisor's actor class on `node_id`, and what its arguments start with: our
    code, where the node lacks it at the driver's content."""
    if rankside.needs_nothing():
        return RemoteSupervisor, ()
    rankside.check_nodes([node_id], name)
    carry = rankside.carried_both(node_id)
    return (RemoteShell if carry else RemoteSupervisor), carry


def _head_node() -> str:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return ray.get_runtime_context().get_node_id()  # an old Ray: where this driver runs


def get_job(id_or_name: str, address: str | None = None, *, show: bool = True) -> FollowedJob[Any]:
    """The detached job `id_or_name` (a name: its newest job), followed from here.

    It shows the job's table and each rank's newest lines at once, then follows it.
    """
    connect_lasting(address)
    record = registry.find(id_or_name)
    try:
        handle = ray.get_actor(record.supervisor, namespace=NAMESPACE)
    except ValueError as exc:
        raise SupervisorLostError(
            f"job {record.id}: its supervisor {record.supervisor} is gone, so the job is lost "
            "(the head node restarted, or it was stopped)"
        ) from exc
    if record.code != rankside.both_content():
        messages.warn(
            f"job {record.id} was started by another version of orchestrator (code "
            f"{record.code}, this one's is {rankside.both_content()}); what it reports may "
            "differ",
            job=record.name,
        )
    job: FollowedJob[Any] = FollowedJob(record, handle, backlog=BACKLOG_LINES, show=show)
    if show:
        with contextlib.suppress(Exception):
            print(job.table().text(), file=sys.stderr, flush=True)
    return job


@dataclass(frozen=True)
class JobInfo:
    """One detached job, as `list_jobs` shows it."""

    id: str
    name: str
    state: str
    """Its State, or "lost" when its supervisor is gone."""
    ranks: int
    nodes: tuple[str, ...]
    """The nodes its ranks run (or ran) on."""
    started: float
    """When it was submitted (time.time())."""
    user: str


def list_jobs(address: str | None = None) -> list[JobInfo]:
    """Every detached job in the cluster, oldest first, with its state now."""
    connect_lasting(address)
    found = []
    for record in registry.records():
        state, nodes = "lost", ()
        with contextlib.suppress(ValueError, RayError, GetTimeoutError, KeyError):
            handle = ray.get_actor(record.supervisor, namespace=NAMESPACE)
            snapshot = ray.get(handle.snapshot.remote(record.id), timeout=ASK_TIMEOUT_S)
            state = str(snapshot.status.state)
            nodes = tuple(sorted({r.node_ip for r in snapshot.status.ranks if r.node_ip}))
        found.append(
            JobInfo(record.id, record.name, state, record.ranks, nodes, record.started,
                    record.user)
        )
    return found


def list_pools(address: str | None = None) -> list[dict[str, Any]]:
    """Every detached function's warm pool in the cluster: its supervisor, name, ranks, the
    CPUs and GPUs it holds, how long it has been idle (None: a job runs), its idle_timeout."""
    connect_lasting(address)
    found = []
    for _key, name in registry.pools():
        with contextlib.suppress(ValueError, RayError, GetTimeoutError):
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = ray.get(handle.pool_info.remote(), timeout=ASK_TIMEOUT_S)
            if info["ranks"]:
                found.append(info)
    return found


def release_pool(supervisor: str, address: str | None = None) -> bool:
    """Release the warm pool of `supervisor` once no job of it runs; False if none is kept."""
    connect_lasting(address)
    try:
        handle = ray.get_actor(supervisor, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.get(handle.release_when_idle.remote(), timeout=ASK_TIMEOUT_S)
    return True


_following: weakref.WeakSet[FollowedJob[Any]] = weakref.WeakSet()
"""The detached jobs this process follows now."""


def stop_following(say: bool = False) -> None:
    """Stop following every detached job (at exit: and say how to get each back)."""
    for job in list(_following):
        job.unfollow(say=say)


