"""The cluster's detached jobs and warm pools, found from any process that reaches it:
`get_job`, `list_jobs`, and what `orchestrator jobs`, `logs` and `stop` need.

The cluster records each supervisor (`supervise.registry`), and each supervisor keeps its
own jobs' records: a job is found by asking the supervisors of its function, then the
others, and a listing asks each supervisor once for its jobs (and one with a warm pool,
once more for what the pool holds), however many jobs each keeps.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from orchestrator.connect import rankside
from orchestrator.errors import ConfigError
from orchestrator.show import messages
from orchestrator.supervise import registry
from orchestrator.supervise.detached import connect_lasting, find_supervisor
from orchestrator.supervise.follow import FollowedJob
from orchestrator.supervise.link import ASK_TIMEOUT_S, SupervisorLostError
from orchestrator_workers.protocol import unwire

BACKLOG_LINES = 1_000
"""Getting a job back shows each rank's newest this many lines, then follows."""


def get_job(id_or_name: str, address: str | None = None, *, show: bool = True) -> FollowedJob[Any]:
    """The detached job `id_or_name` (a name: its newest job), followed from here.

    It shows the job's table and each rank's newest lines at once, then follows it.
    """
    connect_lasting(address)
    record, handle = find_job(id_or_name)
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


def find_job(id_or_name: str) -> tuple[registry.JobRecord, Any]:
    """The record of job `id_or_name` (a name: its newest job) and its supervisor's handle.

    Asked first of the supervisors of the function the id or name names, then of the
    others (a job id is its function's name and a random part), each group at once, so
    that another function's busy supervisor does not slow this. SupervisorLostError where
    no live one keeps it and the supervisor of a function of that name is gone; else
    ConfigError.
    """
    recorded = registry.supervisors()
    named = {id_or_name, registry.function_of(id_or_name)}
    lost: list[tuple[str, str]] = []
    first = [each for each in recorded if each[1] in named]
    for group in (first, [each for each in recorded if each not in first]):
        found = _ask_find(group, id_or_name, lost)
        if found:
            exact = [each for each in found if each[0].id == id_or_name]
            return (exact or sorted(found, key=lambda each: each[0].started))[-1]
    earlier = registry.earlier_record(id_or_name)  # a job an earlier version started
    handle = find_supervisor(earlier.supervisor) if earlier is not None else None
    if earlier is not None and handle is not None:
        return earlier, handle
    for actor_name, name in lost:
        if name in named:
            raise SupervisorLostError(
                f"job {id_or_name}: no live supervisor keeps it, and {actor_name}, the "
                f"supervisor of {name}, is gone, so the job is lost (the head node restarted, "
                f"or it was stopped); `orchestrator stop {actor_name}` forgets it"
            )
    names = sorted({name for _, name, _ in recorded})
    raise ConfigError(
        f"no detached job {id_or_name!r} in this cluster (functions with a supervisor there: "
        f"{', '.join(names) or 'none'}; `orchestrator jobs` lists their jobs). A finished job "
        "is kept until job.release() or for its retention (7 days unless distribute() says)"
    )


def _ask_find(
    supervisors: list[tuple[str, str, float]], id_or_name: str, lost: list[tuple[str, str]]
) -> list[tuple[registry.JobRecord, Any]]:
    """The records these supervisors keep for `id_or_name`, with their handles, asked at
    once; those gone are added to `lost`."""
    asked = {}
    for actor_name, name, _ in supervisors:
        handle = find_supervisor(actor_name)
        if handle is None:
            lost.append((actor_name, name))
        else:
            asked[handle.find.remote(id_or_name)] = handle
    found = []
    for ref in ray.wait(list(asked), num_returns=len(asked), timeout=ASK_TIMEOUT_S)[0]:
        with contextlib.suppress(RayError):  # one of another version, or ending: not it
            record = unwire(ray.get(ref))
            if record is not None:
                found.append((record, asked[ref]))
    return found


def forget_lost(supervisor: str) -> bool:
    """Remove the record of `supervisor` if it is gone (its jobs were lost with it); False
    if it lives or was never recorded."""
    recorded = any(actor_name == supervisor for actor_name, _, _ in registry.supervisors())
    if not recorded or find_supervisor(supervisor) is not None:
        return False
    registry.forget_supervisor(supervisor)
    return True


@dataclass(frozen=True)
class JobInfo:
    """One detached job, or a warm pool that waits for its next call, as `list_jobs` shows
    it."""

    id: str
    """A job's id; a warm pool's supervisor, or a lost one's (what `orchestrator stop`
    takes)."""
    name: str
    state: str
    """A job's State; WARM_POOL for a pool; LOST for a supervisor that is gone (its jobs
    with it)."""
    ranks: int
    nodes: tuple[str, ...]
    """The nodes its ranks run (or ran) on."""
    started: float
    """When it was submitted (time.time()); when a pool went idle."""
    user: str
    """user@host of the driver that submitted a job ('' for a pool)."""
    holds: dict[str, float] = field(default_factory=dict)
    """What a warm pool holds for its idle timeout: {"CPU": 4.0, "GPU": 0.0} ({} for a job)."""
    idle_s: float | None = None
    """How long a warm pool has been idle."""
    idle_timeout: float | None = None
    """After how long idle a warm pool is released."""

    @property
    def is_pool(self) -> bool:
        """Whether this is a warm pool, not a job."""
        return self.state == WARM_POOL


WARM_POOL = "warm pool"
LOST = "lost"


def list_jobs(address: str | None = None) -> list[JobInfo]:
    """Every detached job in the cluster, oldest first, with its state now (a supervisor
    that is gone: once, as LOST, in place of its jobs); then every warm pool that waits for
    a next call, with what it holds."""
    connect_lasting(address)
    found, asked = [], []
    for actor_name, name, started in registry.supervisors():
        handle = find_supervisor(actor_name)
        if handle is None:  # its jobs went with it: listed once, as itself
            found.append(JobInfo(actor_name, name, LOST, 0, (), started, ""))
        else:
            asked.append(handle.jobs.remote())
    for ref in ray.wait(asked, num_returns=len(asked), timeout=ASK_TIMEOUT_S)[0]:
        with contextlib.suppress(RayError):  # one of another version, or ending
            for record, state, nodes in unwire(ray.get(ref)):
                found.append(JobInfo(record.id, record.name, state, record.ranks, nodes,
                                     record.started, record.user))
    found.sort(key=lambda info: info.started)
    now = time.time()
    for pool in _pools():
        if pool["idle_s"] is None:
            continue  # its job is listed
        held = {"CPU": float(pool["cpus"]), "GPU": float(pool["gpus"])}
        found.append(
            JobInfo(pool["supervisor"], pool["name"], WARM_POOL, pool["ranks"],
                    tuple(pool["nodes"]), now - pool["idle_s"], "", held, pool["idle_s"],
                    pool["idle_timeout"])
        )
    return found


def _pools() -> list[dict[str, Any]]:
    """Every detached function's warm pool in the cluster: its supervisor, name, ranks,
    nodes, the CPUs and GPUs it holds, how long it has been idle (None: a job runs), its
    idle_timeout."""
    found = []
    for _key, name in registry.pools():
        handle = find_supervisor(name)
        with contextlib.suppress(RayError, GetTimeoutError):
            info = ray.get(handle.pool_info.remote(), timeout=ASK_TIMEOUT_S) if handle else None
            if info and info["ranks"]:
                found.append(info)
    return found


def release_pool(supervisor: str, address: str | None = None) -> bool:
    """Release the warm pool of `supervisor` once no job of it runs; False if none is kept."""
    connect_lasting(address)
    handle = find_supervisor(supervisor)
    if handle is None:
        return False
    ray.get(handle.release_when_idle.remote(), timeout=ASK_TIMEOUT_S)
    return True
