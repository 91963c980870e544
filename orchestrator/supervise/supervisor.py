"""The supervisor of a detached distributed function: a Ray actor that outlives its driver.

It runs where the driver's runner would (`orchestrator.runner`): it starts the rank actors
itself, so that they belong to it and not to the driver, runs each call, restarts, watches
for stalls and timeouts, and keeps each job's output (a `Journal`), its log files, status
and outcome until they are released, with each job's record: it publishes them, with
their state, and its warm pool, as JSON in the cluster's key-value store for any process
that lists or finds them (`supervise.listing`). Drivers only follow: they read pages of
the journal and snapshots of the state (`supervise.follow`).

It runs on the head node: losing the head loses the cluster's control store anyway, so the
supervisor adds no node whose loss would end jobs that could otherwise go on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, replace
from typing import Any

import ray

from orchestrator.connect import bootstrap, local
from orchestrator.errors import SupervisorEndedError
from orchestrator.job import Job, Submission
from orchestrator.jobstatus import JobStatus
from orchestrator.options import Options
from orchestrator.runner import Runner
from orchestrator.shipping import Shipment
from orchestrator.show.logs import Bulk
from orchestrator.show.notebook import Table
from orchestrator.supervise import direct, listing, registry
from orchestrator.supervise.journal import Journal
from orchestrator.supervise.lending import Lending, pool_id
from orchestrator_workers.protocol import Payload, unwire, wire

NAMESPACE = "orchestrator"
"""The Ray namespace of every supervisor, whatever the namespace of the driver that made it."""
JANITOR_S = 5.0
"""How often the supervisor looks for an idle pool and expired jobs (more often where
`idle_timeout` or a job's retention is shorter: see `_janitor_wait`)."""
FIRST_SETTLE_S = 0.01
"""How long a submit's answer waits, once the job has output, for the job to end (a short
call that prints then comes back in one Ray call; its first lines are shown that late)."""
CONCURRENCY = 64
"""Calls the supervisor serves at once: followers' long reads must not queue behind each
other, nor behind a call that submits."""


@dataclass(frozen=True)
class Snapshot:
    """A job as its supervisor sees it now: what a follower shows."""

    status: JobStatus
    table: Table
    position: int
    """The journal's newest position when this was taken (a follower that only waits for
    the end reads on from there)."""


@dataclass(frozen=True)
class Outcome:
    """How a job ended: its results by rank, or its error, or that it was cancelled."""

    value: list[Any] | None = None
    error: BaseException | None = None
    cancelled: bool = False


@dataclass
class _Kept:
    record: registry.JobRecord
    job: Job[Any]
    journal: Journal
    retention: float
    """Seconds its output and result are kept once it ended (its call's `retention`)."""
    ended: float | None = None

    def done_at(self, now: float) -> float:
        """When the job was first seen done (time.monotonic())."""
        if self.ended is None:
            self.ended = now
        return self.ended


class Supervisor:
    """Runs one detached function's calls and keeps each job's output and outcome."""

    def __init__(
        self, name: str, options: bytes, pool_key: str, actor_name: str, paths: bytes
    ) -> None:
        """A supervisor of the function named `name`, laid out as `options` (wired: they
        are read once our code is on the path) say; its warm pool is recorded under
        `pool_key` for later drivers, with this actor's name `actor_name`; its ranks run
        where its driver ran (`paths`: a `local.DriverPaths`, wired)."""
        self.name = name
        self.options: Options = unwire(options)
        local.act_for(unwire(paths))
        self._pool_key = pool_key
        self._actor_name = actor_name
        self._ending = False
        self._lending = Lending()
        self._runner = Runner(name, self.options, self._lending)
        self._jobs: dict[str, _Kept] = {}
        self._lock = threading.Lock()
        self._idle_since = time.monotonic()
        self._release_now = False
        self._started = time.monotonic()
        self._submitted = False
        self._submitting = 0
        """Calls being queued now (the janitor does not end this actor under them)."""
        self._publisher = listing.Publisher(actor_name, self._listed, self._pool_fields)
        threading.Thread(target=self._janitor, name="janitor", daemon=True).start()

    def ready(self) -> bool:
        """True once the actor is up (the driver waits for it before its first call)."""
        return True

    def adopt(self) -> bool:
        """A later driver asks for this warm pool: True if it may use it (its idle time
        starts again), False if this supervisor is ending."""
        with self._lock:
            if self._ending:
                return False
            self._idle_since = time.monotonic()
        self._publisher.changed()
        return True

    def _listed(self) -> list[tuple[registry.JobRecord, Job[Any]]]:
        """The jobs it keeps now, for its `listing.Publisher`."""
        with self._lock:
            return [(kept.record, kept.job) for kept in self._jobs.values()]

    def _pool_fields(self) -> dict[str, Any]:
        """Its warm pool now, for its `listing.Publisher`."""
        idle_timeout = self.options.idle_timeout
        return listing.pool_fields(self.name, self._runner, self._idle_since, idle_timeout)

    def submit(self, packed: bytes, limit: int, wait_s: float) -> bytes:
        """Queue one call, packed by the driver: (record, payload, uses_torch, options,
        known), wired (see `protocol.wire`); `known`: None, or the pool the driver knows
        ("" for none) where it wants a `direct.Loan` to make its next call itself. Its job
        is kept, with `record`, until released. Then the job's first `read` (after
        position 0, up to `limit` entries, waiting up to `wait_s`), so that a call that ends
        within `wait_s` costs its driver one Ray call: (None, Page, Outcome or None, Loan or
        None), or (the error that refused it, None, None, None), wired."""
        record, payload, uses_torch, options, known = unwire(packed)
        lend = direct.new_token() if known is not None else None
        try:
            job_id = self._submit(record, payload, uses_torch, options, lend=lend)
        except Exception as exc:  # noqa: BLE001 - raised in the driver
            return wire((exc, None, None, None))
        page, outcome = self._read(job_id, 0, limit, wait_s, FIRST_SETTLE_S)
        loan = self._loan(lend, known) if outcome is not None else None
        return wire((None, page, outcome, loan))

    def notice(self, packed: bytes) -> bytes:
        """A call its driver starts on the ranks itself (see supervise.direct): (record,
        Shipment, uses_torch, options, DirectCall), wired; kept as any job. None, or the
        error that refused it, wired."""
        record, shipped, uses_torch, options, call = unwire(packed)
        options = replace(options, queue=True)  # it runs already: never refused as busy
        try:
            self._submit(record, shipped, uses_torch, options, call=call)
        except Exception as exc:  # noqa: BLE001 - raised in the driver
            return wire(exc)
        return wire(None)

    def settle(self, call_id: bytes, packed: bytes) -> None:
        """Its driver's word on a call it made itself: a `direct.Settled`, wired."""
        self._lending.say(call_id, unwire(packed))

    def _loan(self, lend: bytes | None, known: str) -> direct.Loan | None:
        """The loan for its driver's next call, where the token `lend` is still lent."""
        pool = self._runner.pool
        if lend is None or pool is None or self._lending.outstanding != lend:
            return None
        full = known != pool_id(pool)  # else the driver has rank 0 and its peers
        return direct.Loan(
            pool=pool_id(pool),
            token=lend,
            port=pool.store_port,
            gpus=pool.request.gpus_per_replica > 0,
            rank0=pool.actors[0] if full else None,
            peers=pool.routes.first.peers if full else b"",
        )

    def _submit(
        self,
        record: registry.JobRecord,
        payload: Payload | Shipment,
        uses_torch: bool,
        options: Options,
        *,
        lend: bytes | None = None,
        call: direct.DirectCall | None = None,
    ) -> str:
        job_id = record.id
        with self._lock:
            if self._ending:
                raise SupervisorEndedError(
                    f"{self._actor_name} ended: no call for idle_timeout="
                    f"{self.options.idle_timeout:g} s, and no job kept"
                )
            self._submitting += 1
        try:
            journal = Journal(options.num_replicas)
            submission = Submission(payload, uses_torch, options)
            job = self._runner.submit(submission, journal=journal, started=call, lend=lend)
            mine = call is not None
            job.add_done_callback(lambda _: self._publisher.ended(job_id, driver_call=mine))
            job.add_done_callback(lambda _: journal.close())  # after its last output is in
        except BaseException:
            with self._lock:
                self._submitting -= 1
            raise
        with self._lock:  # counted or kept whenever the janitor looks
            self._submitting -= 1
            self._jobs[job_id] = _Kept(record, job, journal, options.retention)
            self._submitted = True
        self._publisher.came(job_id, driver_call=call is not None)
        return job_id

    def read(self, job_id: str, after: int, limit: int, wait_s: float) -> bytes:
        """Journal entries of `job_id` after position `after` (see `Journal.read`), and
        when the page reaches the end of a job that ended, how it ended: (Page, Outcome or
        None), wired."""
        return wire(self._read(job_id, after, limit, wait_s))

    def _read(
        self, job_id: str, after: int, limit: int, wait_s: float, settle_s: float = 0.0
    ) -> tuple[Any, Any]:
        page = self._kept(job_id).journal.read(after, limit, wait_s, settle_s)
        return page, self._outcome(job_id, 0.0) if page.closed else None

    def text(self, job_id: str, prefix: str) -> tuple[str, str]:
        """Everything the journal keeps of `job_id`, as whole lines prefixed as `prefix`
        says (a line not ended yet last): (stdout's, stderr's). In one piece, for
        `orchestrator logs` into a pipe."""
        bulk = Bulk(self.name, prefix)
        out: list[str] = []
        err: list[str] = []
        for entry in self._kept(job_id).journal.read(0, limit=1 << 62).entries:
            (err if entry.chunk.stream == "stderr" else out).extend(
                bulk.lines(entry.rank, entry.chunk)
            )
        for stream, line in bulk.rest():
            (err if stream == "stderr" else out).append(line)
        return "".join(out), "".join(err)

    def newest(self, job_id: str, lines: int) -> int:
        """The position to read after to get the newest `lines` lines of each rank."""
        return self._kept(job_id).journal.newest(lines)

    def snapshot(self, job_id: str) -> bytes:
        """The job's status and table now, and the journal's position: a Snapshot, wired."""
        kept = self._kept(job_id)
        return wire(Snapshot(kept.job.status(), kept.job.table(), kept.journal.position))

    def metrics(self, job_id: str) -> bytes:
        """The job's numbers over time since it started (a JobMetrics), wired."""
        return wire(self._kept(job_id).job.metrics())

    def _outcome(self, job_id: str, wait_s: float) -> Outcome | None:
        """How the job ended, waiting up to `wait_s` for it; None while it runs."""
        job = self._kept(job_id).job
        with contextlib.suppress(TimeoutError, CancelledError):
            job.exception(timeout=wait_s)
        if not job.done():
            return None
        if job.cancelled():
            return Outcome(cancelled=True)
        try:
            return Outcome(value=job.result(timeout=0))
        except BaseException as exc:  # noqa: BLE001 - the job's error, for the follower
            return Outcome(error=exc)

    def cancel(self, job_id: str) -> bool:
        """Stop the job's ranks (or withdraw it); False if it was done."""
        return self._kept(job_id).job.cancel()

    def stacks(self, job_id: str) -> dict[int, str]:
        """Each rank's stacks while the job runs ({} otherwise)."""
        return self._kept(job_id).job.stacks()

    def logs(self, job_id: str, rank: int) -> str:
        """Everything rank `rank` wrote during the job, from its log file on this node."""
        job = self._kept(job_id).job
        return job.logs(rank) if job.log_dir is not None else self._from_journal(job_id, rank)

    def pids(self) -> list[int]:
        """The warm pool's ranks' process ids, by rank (empty when none is running)."""
        pool = self._runner.pool
        return pool.pids() if pool is not None else []

    def release(self, job_id: str) -> bool:
        """Forget a finished job: its journal and outcome (its log files stay); False,
        forgetting nothing, while it runs."""
        with self._lock:
            kept = self._jobs.get(job_id)
            if kept is not None and not kept.job.done():
                return False
            self._jobs.pop(job_id, None)
        self._publisher.publish(job_id)  # gone from the listing before its driver hears so
        return True

    def release_when_idle(self) -> None:
        """Release the warm pool as soon as no job runs or waits (now, if none does)."""
        self._release_now = True
        self._runner.release_if_idle("its driver let it go")

    def shutdown(self) -> None:
        """Cancel every job and release the pool (the caller then kills this actor)."""
        self._runner.shutdown()

    def _janitor(self) -> None:
        """Release the pool after `idle_timeout` without a call, and each job once it has
        been done for its `retention`; with nothing left to keep, end this actor."""
        while True:
            time.sleep(self._janitor_wait())
            now = time.monotonic()
            busy = self._runner.busy_with() is not None
            if busy:
                self._idle_since = now
                continue
            idle_timeout = self.options.idle_timeout
            if self._runner.pool is not None and (
                self._release_now or now - self._idle_since >= idle_timeout
            ):
                self._runner.release_if_idle(f"no call for {now - self._idle_since:.0f} s")
            if self._runner.pool is None and self._submitted:  # no pool for a later driver
                registry.forget_pool(self._pool_key, self._actor_name)
            with self._lock:
                for job_id, kept in list(self._jobs.items()):
                    if kept.job.done() and now - kept.done_at(now) >= kept.retention:
                        del self._jobs[job_id]
                        self._publisher.changed()
                empty = not self._jobs and not self._submitting
                unused = self._submitted or now - self._started >= idle_timeout
                self._ending = empty and unused and self._runner.pool is None
            if self._ending:
                with contextlib.suppress(Exception):  # else it stays, listed as lost
                    self._publisher.close()
                    registry.forget_supervisor(self._actor_name)
                ray.kill(ray.get_runtime_context().current_actor)
                return

    def _janitor_wait(self) -> float:
        """JANITOR_S, or a quarter of the shortest time kept to (`idle_timeout`, a kept
        job's retention) where that is shorter: a timeout of 1 s is not kept as 6."""
        with self._lock:
            shortest = min([self.options.idle_timeout, *(k.retention for k in self._jobs.values())])
        return max(0.1, min(JANITOR_S, shortest / 4))

    def _kept(self, job_id: str) -> _Kept:
        with self._lock:
            kept = self._jobs.get(job_id)
        if kept is None:
            raise KeyError(
                f"{self.name} keeps no job {job_id!r}: it was released (job.release(), "
                "or its retention ran out)"
            )
        return kept

    def _from_journal(self, job_id: str, rank: int) -> str:
        page = self._kept(job_id).journal.read(0, limit=1 << 30)
        chunks = [e.chunk.data for e in page.entries if e.rank == rank]
        return b"".join(chunks).decode(errors="replace")


RemoteSupervisor = ray.remote(Supervisor)
"""The actor class where the node has our code at the driver's content."""
RemoteShell: Any = ray.remote(bootstrap.shell(Supervisor))
"""The actor class elsewhere: it brings both sides first (see `connect.bootstrap`)."""
