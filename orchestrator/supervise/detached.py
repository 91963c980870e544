"""A detached distributed function's side in the driver: its supervisor started (or a
warm one adopted) and its calls sent. The cluster's detached jobs are found again by
`supervise.catalog`.

`distribute(..., detach=True)` gives the function a `Detached` in place of a `Runner`: each
call goes to the function's supervisor and comes back as a `FollowedJob`. Each supervisor
is recorded in the cluster's key-value store (`supervise.registry`) and publishes its jobs
there (`supervise.listing`), so `get_job` and `list_jobs` find a job from any process that
reaches the cluster; each warm pool is recorded too, so a later driver asking for the same
pool gets its ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import shipping
from orchestrator.connect import cluster, discovery, local, rankside
from orchestrator.errors import ConfigError, SupervisorEndedError
from orchestrator.job import Job, Submission
from orchestrator.options import Options
from orchestrator.show import messages
from orchestrator.supervise import direct, registry
from orchestrator.supervise.follow import PAGE_ENTRIES, READ_WAIT_S, FollowedJob, how_to_get_back
from orchestrator.supervise.journal import Page
from orchestrator.supervise.link import ASK_TIMEOUT_S
from orchestrator.supervise.supervisor import (
    CONCURRENCY,
    NAMESPACE,
    Outcome,
    RemoteShell,
    RemoteSupervisor,
)
from orchestrator_workers.protocol import Payload, unwire, wire

START_TIMEOUT_S = 120.0
"""How long a new supervisor may take to start."""
NO_LASTING_RAY = (
    "detach=True needs a Ray that outlives this process, and this process would start its "
    "own (embedded) Ray, which ends with it. Start the local runtime first "
    "(`orchestrator local start`), or give address= (or RAY_ADDRESS) of a cluster"
)


class Detached:
    """What a detached function has in place of a `Runner`: its supervisor in the cluster."""

    def __init__(self, name: str, options: Options) -> None:
        """No supervisor yet: it starts with the first call."""
        self.name = name
        self.options = options
        self._handle: Any = None
        self._supervisor_name: str | None = None
        self._session = 0
        """The Ray session `_handle` belongs to (see `cluster.rejoin`)."""
        self._lock = threading.Lock()
        self.last: FollowedJob[Any] | None = None
        self.current: FollowedJob[Any] | None = None
        self._holder = direct.Holder()

    def busy_with(self) -> FollowedJob[Any] | None:
        """The job of this function this process submitted last, while it runs or waits."""
        last = self.last
        return last if last is not None and not last.done() else None

    def submit(self, call: Submission) -> FollowedJob[Any]:
        """Send `call` to the supervisor; its FollowedJob, once accepted.

        Where the caller waits for the result (`call.waits`), the supervisor may wait for
        the job's first output or end before it answers (a short call then costs one Ray
        call, not a submit and a read); else it answers as soon as the job is queued.
        """
        payload, uses_torch, options = call.payload, call.uses_torch, call.options
        assert isinstance(payload, Payload), "a driver's call comes packed, not shipped"
        first_wait_s = READ_WAIT_S if call.waits else 0.0
        owner, in_cell = call.owner, call.in_cell
        loan = self._loan(payload, first_wait_s)
        if loan is not None:
            done = self._call_directly(
                payload, uses_torch, options, loan, first_wait_s, owner=owner, in_cell=in_cell
            )
            if done is not None:
                return done
        for anew in (False, True):
            record, handle, submitted = self._send(payload, uses_torch, options, first_wait_s)
            try:
                refused, page, outcome, loan = unwire(
                    ray.get(submitted, timeout=START_TIMEOUT_S + first_wait_s)
                )
            except KeyboardInterrupt:
                raise _interrupted(record.id) from None
            except RayActorError:  # it ended, or was stopped (with its ranks): anew, once
                if anew:
                    raise
                refused = SupervisorEndedError(f"{self._supervisor_name} is gone")
            if not isinstance(refused, SupervisorEndedError) or anew:
                break
            messages.say(f"its supervisor had ended ({refused}); starting a new one", job=self.name)
            with self._lock:
                self._handle = None
        if refused is not None:
            raise refused
        self._holder.keep(loan)
        return self._followed(record, handle, (page, outcome), owner, in_cell)

    def interrupt(self, job: Job[Any]) -> KeyboardInterrupt:
        """Ctrl-C while the caller waited for `job`: it is followed here no more, and runs on
        in the cluster; what to raise."""
        assert isinstance(job, FollowedJob)
        job.unfollow()
        return KeyboardInterrupt(
            f"stopped following job {job.id}; it runs on in the cluster: "
            f"orchestrator.get_job({job.id!r}) gets it back, job.cancel() stops it"
        )

    def _followed(
        self, record: registry.JobRecord, handle: Any, first: Any, owner: Any, in_cell: bool
    ) -> FollowedJob[Any]:
        messages.say(f"detached job {record.id}; {how_to_get_back(record.id)}", job=self.name)
        job: FollowedJob[Any] = FollowedJob(
            record, handle, in_cell=in_cell, owner=owner, first=first
        )
        self.last = self.current = job
        return job

    def _loan(self, payload: Payload, first_wait_s: float) -> direct.Loan | None:
        """The loan for this call to start on the ranks from here (see supervise.direct):
        where the caller waits for a small call's result, and nothing of this function's
        runs; None otherwise."""
        quiet = self.last is None or self.last.done()
        small = payload.size() <= shipping.INLINE_BYTES
        if not (first_wait_s > 0 and quiet and small) or cluster.through_ray_client():
            return None
        return self._holder.take()

    def _call_directly(
        self,
        payload: Payload,
        uses_torch: bool,
        options: Options,
        loan: direct.Loan,
        first_wait_s: float,
        *,
        owner: Any,
        in_cell: bool,
    ) -> FollowedJob[Any] | None:
        """The call, started on the ranks from here (see supervise.direct); None where its
        supervisor ended or is gone (with its ranks): the call goes to a new one."""
        handle = self._supervisor()
        record = registry.new_record(self.name, options, self._supervisor_name or "")
        shipped = shipping.ship(payload, uses_torch=uses_torch)
        told = (record, shipped, uses_torch, _in_cluster(options))
        wait_s = min(first_wait_s, direct.DIRECT_WAIT_S)
        try:
            values = self._holder.call(handle, told, shipped, options, loan=loan, wait_s=wait_s)
        except KeyboardInterrupt:
            raise _interrupted(record.id) from None
        except (SupervisorEndedError, RayActorError):
            with self._lock:
                self._handle = None
            return None
        first = None if values is None else (Page((), 0, closed=True), Outcome(value=values))
        return self._followed(record, handle, first, owner, in_cell)

    def _send(
        self, payload: Payload, uses_torch: bool, options: Options, first_wait_s: float
    ) -> tuple[registry.JobRecord, Any, ray.ObjectRef]:
        """The call sent to the supervisor (started now if need be): its job's record, the
        supervisor's handle, and the reference to its answer."""
        for again in (False, True):
            try:
                handle = self._supervisor()
                record = registry.new_record(self.name, options, self._supervisor_name or "")
                wants = first_wait_s > 0 and not cluster.through_ray_client()
                known = self._holder.known() if wants else None  # a loan for the next call
                packed = wire((record, payload, uses_torch, _in_cluster(options), known))
                return record, handle, handle.submit.remote(packed, PAGE_ENTRIES, first_wait_s)
            except ConnectionError as exc:  # Ray Client's session was lost: a new one, once
                if again or not cluster.lost_session(exc) or not cluster.rejoin(self._session):
                    raise
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        """Stop following this function's jobs here, and let its supervisor release its
        warm pool once no job runs (jobs that run go on)."""
        if self.last is not None:
            self.last.unfollow(say=True)
        with contextlib.suppress(RayError, GetTimeoutError, ConnectionError):
            handle = self._supervisor(start=False)
            if handle is not None:
                ray.get(handle.release_when_idle.remote(), timeout=ASK_TIMEOUT_S)

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty while it has none)."""
        handle = self._supervisor(start=False)
        if handle is None:
            return []
        return list(ray.get(handle.pids.remote(), timeout=ASK_TIMEOUT_S))

    def _supervisor(self, *, start: bool = True) -> Any:
        """The supervisor's handle: started with the first call (`start`: None until then);
        found again by name in a new Ray Client session (see `cluster.rejoin`), or started
        anew where it is gone."""
        with self._lock:
            if self._handle is not None and self._session != cluster.session():
                assert self._supervisor_name is not None
                self._handle = find_supervisor(self._supervisor_name)
                self._session = cluster.session()
            if self._handle is None and start:
                self._handle, self._supervisor_name = start_supervisor(self.name, self.options)
                self._session = cluster.session()
            return self._handle


def _interrupted(job_id: str) -> KeyboardInterrupt:
    return KeyboardInterrupt(
        f"stopped waiting for job {job_id}, which may run on in the cluster: "
        f"{how_to_get_back(job_id)}"
    )


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
    connect_lasting(options.address)
    paths = local.driver_paths()  # where its ranks run: this driver's, recorded now
    key = registry.pool_key(options, paths)
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
        wire(_in_cluster(options)),  # by value: a setup hook defined in the script
        key,
        actor_name,
        wire(paths),
    )
    try:
        ray.get(handle.ready.remote(), timeout=START_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(Exception):
            ray.kill(handle)
        raise
    registry.keep_supervisor(actor_name, name)
    registry.keep_pool(key, actor_name)
    return handle, actor_name


def _adopt(key: str) -> tuple[Any, str] | None:
    """The supervisor that keeps warm pool `key` for a later driver, if it takes this one."""
    name = registry.pool_supervisor(key)
    handle = find_supervisor(name) if name is not None else None
    if name is None or handle is None:
        return None
    with contextlib.suppress(RayError, GetTimeoutError):
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
    for node in cluster.nodes():
        if "node:__internal_head__" in node.resources:
            return node.node_id
    return ray.get_runtime_context().get_node_id()  # an old Ray: where this driver runs


def find_supervisor(name: str) -> Any | None:
    """The supervisor actor named `name`; None where it is gone."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
