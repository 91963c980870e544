"""The cluster's detached jobs and warm pools, found from any process that reaches it:
`get_job`, `list_jobs`, and what `orchestrator jobs`, `logs` and `stop` need.

The cluster records each supervisor (`supervise.registry`), and each supervisor publishes
its jobs and its warm pool there (`supervise.listing`): finding or listing reads those
records as JSON and asks no supervisor anything (only Ray, whether its actor lives), so
nothing a supervisor sends is unpickled until a job found is followed. A job's name
reaches the caller's own jobs first (the user its driver claimed); a name only other
users' jobs have is refused, naming their ids.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator.connect import rankside
from orchestrator.errors import ConfigError, SupervisorLostError
from orchestrator.show import messages
from orchestrator.show.text import printable
from orchestrator.supervise import listing, registry
from orchestrator.supervise.detached import connect_lasting, find_supervisor
from orchestrator.supervise.follow import FollowedJob
from orchestrator.supervise.link import ASK_TIMEOUT_S
from orchestrator_workers.states import State

BACKLOG_LINES = 1_000
"""Getting a job back shows each rank's newest this many lines, then follows."""


def get_job(id_or_name: str, address: str | None = None, *, show: bool = True) -> FollowedJob[Any]:
    """The detached job `id_or_name` (a name: the caller's newest job of that name),
    followed from here.

    It shows the job's table and each rank's newest lines at once, then follows it.
    """
    connect_lasting(address)
    record, handle = find_job(id_or_name)
    if record.code != rankside.both_content():
        messages.warn(
            f"job {record.id} was started by another version of orchestrator (code "
            f"{printable(record.code)}, this one's is {rankside.both_content()}); what it "
            "reports may differ",
            job=record.name,
        )
    job: FollowedJob[Any] = FollowedJob(record, handle, backlog=BACKLOG_LINES, show=show)
    if show:
        with contextlib.suppress(Exception):
            print(job.table().text(), file=sys.stderr, flush=True)
    return job


def find_job(id_or_name: str) -> tuple[registry.JobRecord, Any]:
    """The record of job `id_or_name` and its supervisor's handle (a name: the caller's
    newest job of that name, see `_choose`).

    Read from what the supervisors published (`supervise.listing`): first the supervisors
    of the function that the id or name names, then the others; then from a job's own
    record where a version before 2026-12 started it. SupervisorLostError where the
    supervisor that keeps it is gone; else ConfigError.
    """
    found = _find(id_or_name)
    return found[0], found[1]


def _find(id_or_name: str) -> tuple[registry.JobRecord, Any, str | None]:
    """(record, handle, the state its supervisor last published) of `id_or_name`."""
    recorded = registry.supervisors()
    named = {id_or_name, registry.function_of(id_or_name)}
    first = {actor_name for actor_name, name, _ in recorded if name in named}
    listed: listing.Listed | None = None
    listing_of: dict[str, listing.Pooled] = {}
    groups = (first, {actor_name for actor_name, _, _ in recorded} - first)
    # A driver's own call in a loop is listed within WRITE_EVERY_S + SETTLE_S: where a
    # supervisor of that function lives, it is looked for that long.
    deadline = time.monotonic() + listing.WRITE_EVERY_S + 2 * listing.SETTLE_S
    while True:
        for group in groups:
            jobs, pools = listing.published(group.__contains__) if group else ([], {})
            listing_of.update(pools)
            exact = [each for each in jobs if each.record.id == id_or_name]
            by_name = [each for each in jobs if each.record.name == id_or_name]
            listed = _choose(id_or_name, exact or by_name)
            if listed is not None:
                break
        if listed is not None or not first or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if listed is not None:
        record = listed.record
        handle = find_supervisor(record.supervisor)
        if handle is None:
            raise SupervisorLostError(
                f"job {record.id}: its supervisor {record.supervisor} is gone, so the job is "
                "lost (the head node restarted, or it was stopped); `orchestrator stop "
                f"{record.supervisor}` forgets it"
            )
        return record, handle, listed.state
    earlier = registry.earlier_record(id_or_name)  # a job a version before 2026-12 started
    handle = find_supervisor(earlier.supervisor) if earlier is not None else None
    if earlier is not None and handle is not None:
        return earlier, handle, None
    for actor_name, name, _ in recorded:
        if name in named and find_supervisor(actor_name) is None:
            raise SupervisorLostError(
                f"job {id_or_name}: no live supervisor keeps it, and {actor_name}, the "
                f"supervisor of {name}, is gone, so the job is lost (the head node restarted, "
                f"or it was stopped); `orchestrator stop {actor_name}` forgets it"
            )
    names = sorted({name for _, name, _ in recorded})
    older = sorted(each for each in first - listing_of.keys() if find_supervisor(each))
    raise ConfigError(
        f"no detached job {id_or_name!r} in this cluster (functions with a supervisor there: "
        f"{', '.join(names) or 'none'}; `orchestrator jobs` lists their jobs). A finished job "
        "is kept until job.release() or for its retention (7 days unless distribute() says)"
        + "".join(
            f"; {each}, of an earlier version, lists its jobs to that version's orchestrator "
            "only (its answers would be unpickled here)"
            for each in older
        )
    )


def _choose(asked: str, found: list[listing.Listed]) -> listing.Listed | None:
    """The job that `asked` names among `found`, the jobs with that id or name: the one job
    of an id, or the caller's newest of a name (the user its driver claimed, as BY shows).
    Where only other users' jobs have the name, or an id is recorded twice and not once as
    the caller's, ConfigError names them: the caller gives the id, nothing is picked."""
    mine = [each for each in found if registry.caller_is(each.record.user)]
    by_id = bool(found) and found[0].record.id == asked
    if not found or (by_id and len(found) == 1):
        return found[0] if found else None
    if mine and not (by_id and len(mine) > 1):
        return max(mine, key=lambda each: each.record.started)
    which = ", ".join(
        f"{each.record.id} (by {printable(each.record.user)}, supervisor {each.record.supervisor})"
        for each in sorted(found, key=lambda each: each.record.started)
    )
    if by_id:
        raise ConfigError(
            f"job id {asked!r} is recorded by {len(found)} supervisors: {which}. Someone with "
            "the cluster's token recorded it again; `orchestrator jobs` shows who (BY)"
        )
    raise ConfigError(
        f"job name {asked!r} is not the name of any job of yours here (the user your drivers "
        f"claim: $USER), only of others': {which}. Give the job's id: `orchestrator logs ID`, "
        "`orchestrator stop ID`, get_job(ID)"
    )


def stop(id_or_name: str) -> str:
    """Stop job `id_or_name`'s ranks (found as `find_job` finds it); what was done, in words.
    Its supervisor's answer is waited for, not read (nothing it sends is unpickled)."""
    record, handle, state = _find(id_or_name)
    if state in (State.FINISHED, State.FAILED, State.CANCELLED):
        return f"job {record.id} had ended already ({state})"
    ray.wait([handle.cancel.remote(record.id)], timeout=ASK_TIMEOUT_S, fetch_local=False)
    return f"stopped job {record.id}"


def forget_lost(supervisor: str) -> bool:
    """Remove the record of `supervisor` if it is gone (its jobs were lost with it), and
    what it published; False if it lives or was never recorded."""
    recorded = any(actor_name == supervisor for actor_name, _, _ in registry.supervisors())
    if not recorded or find_supervisor(supervisor) is not None:
        return False
    listing.forget(supervisor)
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
    with it); EARLIER for one of an earlier version (its jobs are not listed)."""
    ranks: int
    nodes: tuple[str, ...]
    """The nodes its ranks run (or ran) on."""
    started: float
    """When it was submitted (time.time()); when a pool went idle."""
    user: str
    """user@host of the driver that submitted a job, as that driver claimed it ($USER;
    '' for a pool)."""
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
EARLIER = "earlier version"


def list_jobs(address: str | None = None) -> list[JobInfo]:
    """Every detached job in the cluster, oldest first, with its state as its supervisor
    last published it (a supervisor that is gone: once, as LOST, in place of its jobs);
    then every warm pool that waits for a next call, with what it holds."""
    connect_lasting(address)
    recorded = registry.supervisors()
    jobs, pools = listing.published()
    live = {actor_name for actor_name, _, _ in recorded if find_supervisor(actor_name)}
    found = []
    for actor_name, name, started in recorded:
        if actor_name not in live:  # its jobs went with it: listed once, as itself
            found.append(JobInfo(actor_name, name, LOST, 0, (), started, ""))
        elif actor_name not in pools:  # publishes nothing: it answers only through Ray
            found.append(JobInfo(actor_name, name, EARLIER, 0, (), started, ""))
    for each in jobs:
        record = each.record
        if record.supervisor in live:
            found.append(
                JobInfo(
                    record.id,
                    record.name,
                    each.state,
                    record.ranks,
                    each.nodes,
                    record.started,
                    record.user,
                )
            )
    found.sort(key=lambda info: info.started)
    now = time.time()
    for actor_name, pool in sorted(pools.items()):
        if actor_name in live and pool.ranks and not pool.busy:  # else its job is listed
            idle = max(0.0, now - pool.idle_since)
            held = {"CPU": pool.cpus, "GPU": pool.gpus}
            found.append(
                JobInfo(
                    actor_name,
                    pool.name,
                    WARM_POOL,
                    pool.ranks,
                    pool.nodes,
                    now - idle,
                    "",
                    held,
                    idle,
                    pool.idle_timeout,
                )
            )
    return found


def release_pool(supervisor: str, address: str | None = None) -> bool:
    """Release the warm pool of `supervisor` once no job of it runs; False if none is kept.
    Its answer is waited for, not read."""
    connect_lasting(address)
    handle = find_supervisor(supervisor)
    if handle is None:
        return False
    ray.wait([handle.release_when_idle.remote()], timeout=ASK_TIMEOUT_S, fetch_local=False)
    return True


def remove_unreadable(key: str) -> list[str]:
    """Remove the records that `key` names (as it is, or escaped as `registry.bad` names
    it) where none can be read; the keys removed. ConfigError where one can (a record
    that a job or pool still needs is never removed this way), or where there is none."""
    found = registry.named_by(key)
    if not found:
        raise ConfigError(
            f"no record {printable(key)} in the cluster's key-value store (give the key as the "
            "warning that named it wrote it)"
        )
    for each in found:
        read = listing.readable if each.startswith(listing.LISTING) else registry.readable
        if read(each):
            raise ConfigError(
                f"{printable(each)} in the cluster's key-value store can be read: `orchestrator "
                "stop KEY` removes only a record that cannot (give a job's id to stop it, or a "
                "supervisor's name to release its pool)"
            )
    for each in found:
        registry.remove(each)
    return found
