"""What each supervisor publishes of its jobs and its warm pool, for `list_jobs` and
`get_job`: JSON in the cluster's key-value store, written by the supervisor as they change
and read by any driver as data, so that listing or finding a job unpickles nothing that a
supervisor (or whoever registered an actor as one) sends.

One record per supervisor, `listing/<actor name>`: its warm pool (what it holds, whether a
job runs on it, since when it is idle) and every job it keeps (its record, state and
nodes), so that a listing reads one record per supervisor however many jobs each keeps.
A supervisor writes it before it answers its first call, so a live supervisor without one
is of an earlier version, which answered through Ray (unpickled): it is not asked.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator import _ray_compat
from orchestrator.errors import BadRecord
from orchestrator.supervise import registry
from orchestrator.supervise.registry import JobRecord

if TYPE_CHECKING:
    from orchestrator.job import Job
    from orchestrator.runner import Runner

LISTING = registry.LISTING
LARGEST = 1 << 28
"""A listing longer than this (bytes) is not read: 1,000 jobs kept take about 300 KB."""
POLL_S = 0.5
"""How often the supervisor looks whether a job's state or nodes, or its pool, changed."""
SETTLE_S = 0.05
"""How long it waits, told of a change, before it writes: a quick call's start and end
are written once, and a loop of quick calls a few times a second."""
WRITE_EVERY_S = 1.0
"""How often, at most, its thread writes (a loop of quick calls it lists, a job's state):
each write is the whole listing, and one every SETTLE_S cost a loop of 5 ms direct calls
on a 2-core node about 2 ms a call (a write as a job comes or ends is not held back)."""
REFRESH_S = 60.0
"""How often it writes its listing unchanged (a record removed or overwritten by someone
else is written again)."""


@dataclass(frozen=True)
class Listed:
    """A job, as its supervisor last published it."""

    record: JobRecord
    state: str
    nodes: tuple[str, ...]
    """The nodes its ranks run (or ran) on."""


@dataclass(frozen=True)
class Pooled:
    """A supervisor's warm pool, as it last published it."""

    supervisor: str
    name: str
    ranks: int
    nodes: tuple[str, ...]
    cpus: float
    gpus: float
    busy: bool
    """Whether a job runs on it (or waits for it)."""
    idle_since: float
    """When it went idle (time.time() on the supervisor's node)."""
    idle_timeout: float


def published(
    supervisors: Callable[[str], bool] | None = None,
) -> tuple[list[Listed], dict[str, Pooled]]:
    """Every job the supervisors published, and every warm pool by its supervisor's name
    (`supervisors`: of those whose actor name it takes). A record or a job in it that
    cannot be read is skipped, and named once."""
    jobs: list[Listed] = []
    pools: dict[str, Pooled] = {}
    for key in _ray_compat.kv_keys(LISTING):
        if supervisors is None or supervisors(key[len(LISTING) :]):
            found = registry.read(key, _decode)
            if found is not None:
                pools[found[0].supervisor] = found[0]
                jobs.extend(found[1])
    return jobs, pools


def readable(key: str) -> bool:
    """Whether the record under `key` (listing/) can be read whole, or is gone."""
    value = _ray_compat.kv_get(key)
    try:
        return value is None or not _decode(key, value, whole=True)[2]
    except BadRecord:
        return False


def _decode(key: str, value: bytes, *, whole: bool = False) -> tuple[Pooled, list[Listed], int]:
    """A listing's pool, its jobs that can be read, and how many cannot (each named once;
    `whole`: not named)."""
    actor_name = key[len(LISTING) :]
    if not registry.SUPERVISOR.fullmatch(actor_name):
        raise BadRecord("not under a supervisor's name")
    fields = registry.parse(value, LARGEST)
    pool, entries = fields.get("pool"), fields.get("jobs")
    if not isinstance(pool, dict) or not isinstance(entries, list):
        raise BadRecord("not a supervisor's listing")
    jobs, bad = [], 0
    for entry in entries:
        try:
            jobs.append(_listed(entry, actor_name))
        except BadRecord as exc:
            bad += 1
            if not whole:
                registry.bad(key, f"a job in it: {exc}")
    return _pooled(pool, actor_name), jobs, bad


def _listed(fields: Any, actor_name: str) -> Listed:
    if not isinstance(fields, dict):
        raise BadRecord("not an object")
    record = registry.job_record(fields)
    if record.supervisor != actor_name:
        raise BadRecord("another supervisor's job")
    return Listed(record, registry.text(fields, "state"), _nodes(fields))


def _pooled(fields: dict[str, Any], actor_name: str) -> Pooled:
    busy = fields.get("busy")
    if not isinstance(busy, bool):
        raise BadRecord("pool.busy: not true or false")
    return Pooled(
        supervisor=actor_name,
        name=registry.text(fields, "name", registry.NAME),
        ranks=int(registry.number(fields, "ranks", 0, 1 << 20)),
        nodes=_nodes(fields),
        cpus=registry.number(fields, "cpus", 0, 1e9),
        gpus=registry.number(fields, "gpus", 0, 1e9),
        busy=busy,
        idle_since=registry.number(fields, "idle_since", 0, 1e11),
        idle_timeout=registry.number(fields, "idle_timeout", 0, float("inf")),
    )


def _nodes(fields: dict[str, Any]) -> tuple[str, ...]:
    nodes = fields.get("nodes")
    if not isinstance(nodes, list) or not all(
        isinstance(node, str) and len(node) <= 256 for node in nodes
    ):
        raise BadRecord("nodes: not a list of strings of at most 256 characters")
    return tuple(nodes)


def forget(actor_name: str) -> None:
    """Remove what supervisor `actor_name` published (it is gone)."""
    _ray_compat.kv_delete(LISTING + actor_name)


class Publisher:
    """The supervisor's side: its listing, in one record, written as its jobs and pool
    change: a job as it comes and as it ends (see `came`, `ended`), the rest by a thread of
    its own that looks every POLL_S (a job's state and nodes, the pool)."""

    def __init__(
        self,
        actor_name: str,
        kept: Callable[[], list[tuple[JobRecord, Job[Any]]]],
        pool: Callable[[], dict[str, Any]],
    ) -> None:
        """Publish what `kept` (the jobs kept now) and `pool` (the pool's fields, see
        `pool_fields`) say, for supervisor `actor_name`: at once, then as they change."""
        self._key = LISTING + actor_name
        self._kept = kept
        self._pool = pool
        self._jobs: dict[str, str] = {}
        """Each job's entry as written (JSON), by id."""
        self._ended: set[str] = set()
        """The jobs whose end is written: not looked at again."""
        self._written = b""
        self._at = 0.0
        self._burst = -SETTLE_S
        """When a driver's own call was last written as it came (see `came`)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._publish()
        threading.Thread(target=self._run, name="publisher", daemon=True).start()

    def changed(self) -> None:
        """Something changed (a job came, ended, went; the pool was adopted): write soon."""
        self._wake.set()

    def publish(self, job_id: str) -> None:
        """Write job `job_id` as it is now, now (as it comes, before its driver hears of
        it; as it ends, before its followers do; as it goes), and the rest soon (what the
        supervisor does next, as the pool going idle). Where the store cannot be reached,
        the thread tries again."""
        with contextlib.suppress(Exception):  # the store unreachable a while: next time
            self._publish(job_id)
        self._wake.set()

    def came(self, job_id: str, *, driver_call: bool) -> None:
        """Job `job_id` was submitted: written now, as `publish` does; a driver's own call
        (`driver_call`) too, unless another was written less than SETTLE_S ago: in a loop
        of quick calls one write takes them all (each call's own write cost its driver
        about 1 ms on a 2-core node), so each is listed within WRITE_EVERY_S + SETTLE_S."""
        now = time.monotonic()
        if driver_call and now - self._burst < SETTLE_S:
            self.changed()
            return
        if driver_call:
            self._burst = now
        self.publish(job_id)

    def ended(self, job_id: str, *, driver_call: bool) -> None:
        """Job `job_id` ended: its end written now, before its followers hear of it; a
        driver's own call's with what changes next (its driver has its results already)."""
        if driver_call:
            self.changed()
        else:
            self.publish(job_id)

    def close(self) -> None:
        """Remove this supervisor's listing (it ends)."""
        with self._lock:
            self._closed = True
            _ray_compat.kv_delete(self._key)

    def _publish(self, job_id: str | None = None) -> None:
        """Write the listing if it changed: each job looked at again (`job_id`: that one
        alone, and those never written), until its end is written."""
        with self._lock:
            if self._closed:
                return
            kept = self._kept()
            entries = {}
            for record, job in kept:
                entry = self._jobs.get(record.id)
                fresh = job_id in (None, record.id) and record.id not in self._ended
                if entry is None or fresh:
                    ended = job.done()
                    status = job.status()
                    nodes = sorted({rank.node_ip for rank in status.ranks if rank.node_ip})
                    fields = {**record.as_json(), "state": str(status.state), "nodes": nodes}
                    entry = json.dumps(fields)
                    if ended:
                        self._ended.add(record.id)
                entries[record.id] = entry
            self._ended.intersection_update(entries)
            self._jobs = entries
            pool = json.dumps(self._pool())
            value = f'{{"pool": {pool}, "jobs": [{", ".join(entries.values())}]}}'.encode()
            if value != self._written or time.monotonic() - self._at >= REFRESH_S:
                _ray_compat.kv_put(self._key, value)
                self._written, self._at = value, time.monotonic()

    def _run(self) -> None:
        while not self._closed:
            if self._wake.wait(POLL_S):
                time.sleep(max(SETTLE_S, WRITE_EVERY_S - (time.monotonic() - self._at)))
            self._wake.clear()
            with contextlib.suppress(Exception):  # the store unreachable a while: next time
                self._publish()


def pool_fields(
    name: str, runner: Runner, idle_since: float, idle_timeout: float
) -> dict[str, Any]:
    """What a supervisor of function `name` publishes of its pool (`runner`'s, idle since
    `idle_since`, time.monotonic()): the fields `published` reads as a `Pooled`."""
    pool = runner.pool
    busy = runner.busy_with() is not None
    ranks = len(pool.actors) if pool is not None else 0
    asked = pool.request if pool is not None else None
    since = 0 if busy else round(time.time() - (time.monotonic() - idle_since))
    return {
        "name": name,
        "ranks": ranks,
        "nodes": sorted({info.node_ip for info in pool.infos}) if pool is not None else [],
        "cpus": ranks * asked.cpus_per_replica if asked is not None else 0,
        "gpus": ranks * asked.gpus_per_replica if asked is not None else 0,
        "busy": busy,
        "idle_since": since,
        "idle_timeout": idle_timeout,
    }
