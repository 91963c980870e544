"""One call in flight: start every rank at once, watch them all, stream output, collect."""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import cluster, messages
from orchestrator.errors import (
    CRASH,
    describe_rank,
    distributed_error,
    is_secondary,
    timeout_error,
)
from orchestrator.logs import Console
from orchestrator.pool import Pool, StopRequested
from orchestrator.status import StatusLine
from orchestrator_workers import sharing
from orchestrator_workers.capture import EXIT_STREAM, STATE_STREAM
from orchestrator_workers.protocol import OutputChunk, Payload, RankFailure, RankResult
from orchestrator_workers.tail import read_tail

Shipment: TypeAlias = bytes | ray.ObjectRef
"""A call's payload as the ranks get it: pickled inline, or one object in Ray's store."""

_GATHER_S = 0.3
"""After the first failure, how long to keep listening for the others' (for the report)."""
_DRAIN_POLL_S = 30.0
"""How long one output request waits on an idle rank before returning empty."""


_INLINE_BYTES = 64 * 1024
"""Payloads up to this size are sent with each rank's task instead of through ray.put."""
_LEFTOVER_WAIT_S = 0.5
"""How long to wait for a dead rank's keeper process to save its unread output."""
_STACKS_WAIT_S = 3.0
"""How long to wait for the ranks' stacks before reporting without them."""
_FORGET_WAIT_S = 5.0
"""After a failure, how long to wait for stopped ranks to be gone before cleaning up."""


def ship(payload: Payload) -> Shipment:
    """Make `payload` ready to send to any number of ranks, now (a snapshot of its buffers).

    Large payloads go into the object store once, whatever the number of ranks, and each
    rank reads the bytes in place; small ones travel inside each task (bytes: Ray passes
    them as they are, where it would pickle a dataclass per rank).
    """
    if payload.size() <= _INLINE_BYTES:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return ray.put(replace(payload, call=pickle.PickleBuffer(payload.call)))


@dataclass(frozen=True)
class Leftover:
    """What a call leaves the next call on the same pool."""

    drains: dict[int, ray.ObjectRef] = field(default_factory=dict)
    """Per rank, its output request still in flight: it brings what the rank prints next."""
    shown: dict[int, int] = field(default_factory=dict)
    """Per rank, the seq of its last chunk taken in: the next call owes only newer ones."""


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
        shipped: Shipment,
        console: Console,
        *,
        timeout: float | None = None,
        stop: threading.Event | None = None,
        restart_count: int = 0,
        max_restarts: int = 0,
        before: Leftover | None = None,
    ) -> None:
        """Start the shipped function (see `ship`) on every rank of `pool`.

        `console` shows and files this call's output. `before`: what the pool's previous
        call left (output requests in flight, and how far each rank's output was shown).
        """
        self.pool = pool
        self.console = console
        self.timeout = timeout
        self.stop = stop or threading.Event()
        self.share_key = uuid.uuid4().hex[:16]
        self.share_nodes = {info.node_id for info in pool.infos}
        specs = [
            replace(
                spec,
                master_port=pool.store_port,
                restart_count=restart_count,
                max_restarts=max_restarts,
                share_key=f"{self.share_key}-{info.node_id[:16]}",  # this call's copy per node
            )
            for spec, info in zip(pool.specs, pool.infos, strict=True)
        ]
        self.runs = {
            actor.run.remote(pickle.dumps(spec), shipped): spec.rank
            for actor, spec in zip(pool.actors, specs, strict=True)
        }
        before = before or Leftover()
        self.drains: dict[int, ray.ObjectRef] = dict(before.drains)
        """Per rank, the output request in flight (handed on to the next call)."""
        for rank, seq in before.shown.items():  # a rank's chunks are numbered across calls
            console.printed[rank] = seq
        self.dead: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        """Statuses ranks passed to os._exit, as they reported them just before."""
        self.waits_on: dict[int, str] = {}
        """Per rank, what it waits on beyond its work (a debugger), if anything."""
        self.next_port: int | None = None
        """The rendezvous store rank 0 opened for the next call, once it returned."""
        self.owed: dict[int, int] = {}  # rank -> output seq to show before it counts as done
        self.results: dict[int, Any] = {}
        self.failures: list[RankFailure] = []
        self.gather_until: float | None = None
        self.started = time.monotonic()
        self.time_limit = None if timeout is None else self.started + timeout
        quiet = console.sink is not None  # a notebook cell shows the ranks' table instead
        self.status = None if quiet else StatusLine(pool.name, len(pool.actors), self.started)

    def wait(self) -> list[Any]:
        """Watch every rank until all are done or one failed; results by rank."""
        try:
            self._watch()
        finally:
            messages.clear_in_place()  # a status line, if one is drawn
        self.console.flush()
        if self.failures:
            raise distributed_error(self.failures, self.console.log_dir)
        return [self.results[rank] for rank in range(len(self.pool.actors))]

    def _watch(self) -> None:
        console = self.console
        while self._busy():
            if self.stop.is_set():
                raise StopRequested
            now = time.monotonic()
            if self.gather_until is not None and now >= self.gather_until:
                break
            if self.time_limit is not None and now >= self.time_limit and self.runs:
                self._time_out()
            self._request_output()
            draining = {ref: rank for rank, ref in self.drains.items()}
            status = self.status.tick(now, console.last_output) if self.status else None
            wake = [t for t in (self.gather_until, self.time_limit, console.tick(now), status) if t]
            for ready in _ready([*self.runs, *draining], min(wake) - now if wake else None):
                if self.stop.is_set():
                    raise StopRequested
                if ready in self.runs:
                    self._take(self._outcome(self.runs.pop(ready), ready))
                else:
                    self._show(draining[ready], ready)

    def leftover(self, replaced: Collection[int] = ()) -> Leftover:
        """What this call leaves the pool's next call, but for ranks `replaced` meanwhile."""
        return Leftover(
            {rank: ref for rank, ref in self.drains.items() if rank not in replaced},
            {rank: seq for rank, seq in enumerate(self.console.printed) if rank not in replaced},
        )

    def rank_state(self, rank: int, *, stopped: bool) -> str:
        """finished, failed, running (or what it waits on); `stopped` when the call ended."""
        if rank in self.results:
            return "finished"
        if any(f.rank == rank for f in self.failures):
            return "failed"
        return "stopped" if stopped else self.waits_on.get(rank) or "running"

    def settle(self, timeout: float) -> None:
        """After a failure: wait up to `timeout` s for ranks still running to return."""
        if not self.runs:
            return
        done, _ = ray.wait(list(self.runs), num_returns=len(self.runs), timeout=timeout)
        for ref in done:
            self._take(self._outcome(self.runs.pop(ref), ref))

    def broken_ranks(self) -> set[int]:
        """After a failure: ranks whose actor must be replaced before a restart.

        Dead ones, ones still running (perhaps stuck in a collective), and ones that
        raised an error of their own (their process may be in a bad state, e.g. CUDA's).
        A rank that finished, or failed only because a peer did, is healthy.
        """
        broken = set(self.runs.values()) | self.dead
        broken |= {f.rank for f in self.failures if f.exc_type == CRASH or not is_secondary(f)}
        return broken

    def forget_buffers(self) -> None:
        """After a failed call's ranks were told to stop: remove what they left in /dev/shm.

        A rank stopped before it mapped its node's copy of the large buffers never counts
        itself, so the copy's name would stay. In the background: first the ranks still
        running are given a moment to be gone (a rank killed is not gone at once).
        """
        pending = list(self.runs)

        def forget() -> None:
            with contextlib.suppress(Exception):  # Ray shut down meanwhile: the sweep remains
                if pending:
                    ray.wait(pending, num_returns=len(pending), timeout=_FORGET_WAIT_S)
                here = ray.get_runtime_context().get_node_id()
                for node in self.share_nodes:
                    if node == here:
                        sharing.remove(self.share_key)
                    else:
                        affinity = NodeAffinitySchedulingStrategy(node, soft=False)
                        remote = _remote_remove.options(scheduling_strategy=affinity)
                        remote.remote(self.share_key)

        threading.Thread(target=forget, name="forget buffers", daemon=True).start()

    def _busy(self) -> bool:
        printed, dead = self.console.printed, self.dead
        return bool(self.runs) or any(
            printed[rank] < seq for rank, seq in self.owed.items() if rank not in dead
        )

    def _request_output(self) -> None:
        for rank, actor in enumerate(self.pool.actors):
            if rank not in self.drains and rank not in self.dead:
                self.drains[rank] = actor.drain.remote(_DRAIN_POLL_S)

    def _take(self, outcome: RankResult | RankFailure) -> None:
        self.owed[outcome.rank] = outcome.output_seq
        if isinstance(outcome, RankFailure):
            self.failures.append(outcome)
            self.gather_until = self.gather_until or time.monotonic() + _GATHER_S
            return
        self.results[outcome.rank] = outcome.value
        if outcome.next_master_port is not None:
            self.next_port = outcome.next_master_port

    def _show(self, rank: int, ref: ray.ObjectRef) -> None:
        del self.drains[rank]
        try:
            chunks = ray.get(ref)
        except RayActorError:
            self.dead.add(rank)
            return
        for chunk in chunks:
            if chunk.stream == EXIT_STREAM:
                self.exit_codes[rank] = int(chunk.data)
            elif chunk.stream == STATE_STREAM:
                self.waits_on[rank] = chunk.data.decode()
        shown = [chunk for chunk in chunks if chunk.stream not in (EXIT_STREAM, STATE_STREAM)]
        self.console.write(rank, shown)
        if chunks:  # the pseudo-streams' chunks count as taken in too
            self.console.printed[rank] = max(self.console.printed[rank], chunks[-1].seq)

    def _outcome(self, rank: int, ref: ray.ObjectRef) -> RankResult | RankFailure:
        try:
            return pickle.loads(ray.get(ref))  # noqa: S301 - from our own rank actor
        except RayActorError as exc:
            self.dead.add(rank)
            info = self.pool.infos[rank]
            last_words = self._show_leftovers(rank)
            return RankFailure(
                rank=rank,
                local_rank=self.pool.specs[rank].local_rank,
                node_ip=info.node_ip,
                hostname=info.hostname,
                pid=info.pid,
                time=time.time(),
                exc_type=CRASH,
                message=_crash_reason(
                    exc,
                    self.exit_codes.get(rank),
                    last_words,
                    node_gone=cluster.node_lost(info.node_id),
                ),
                traceback="",
            )

    def _show_leftovers(self, rank: int) -> str:
        """Show what a dead rank wrote in its last instant (saved by its keeper); return it."""
        info = self.pool.infos[rank]
        if not info.tail_path:
            return ""
        if info.node_id == ray.get_runtime_context().get_node_id():
            leftovers = read_tail(info.tail_path, _LEFTOVER_WAIT_S)
        else:  # read on the rank's own node
            affinity = NodeAffinitySchedulingStrategy(info.node_id, soft=False)
            ref = _remote_read_tail.options(scheduling_strategy=affinity).remote(
                info.tail_path, _LEFTOVER_WAIT_S
            )
            done, _ = ray.wait([ref], timeout=_LEFTOVER_WAIT_S + 2)
            leftovers = ray.get(done[0]) if done else None
        shown = self.console.printed[rank]
        unseen = [(s, stream, text) for s, stream, text in leftovers or [] if s == 0 or s > shown]
        last = max([shown, *(seq for seq, _, _ in unseen)])
        chunks = [
            OutputChunk(seq or last + 1, stream, text.encode()) for seq, stream, text in unseen
        ]
        self.console.write(rank, chunks)
        return "".join(text for _, _, text in unseen)

    def _time_out(self) -> None:
        self.console.flush()
        ranks = range(len(self.pool.actors))
        where = {rank: _where(self.pool, rank) for rank in ranks}
        log_dir = self.console.log_dir
        raise timeout_error(self.timeout or 0.0, stacks(self.pool), where, log_dir)


def _ready(refs: list[ray.ObjectRef], wait_s: float | None) -> list[ray.ObjectRef]:
    """Wait up to `wait_s` for one of `refs`; then take every other one ready too."""
    done, rest = ray.wait(refs, num_returns=1, timeout=None if wait_s is None else max(0, wait_s))
    if done and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        done += more
    return done


def stacks(pool: Pool) -> dict[int, str]:
    """Each rank's current stacks, asked of all ranks at once; never blocks for long."""
    return rank_stacks(dict(enumerate(pool.actors)))


def rank_stacks(actors: Mapping[int, Any], wait_s: float = _STACKS_WAIT_S) -> dict[int, str]:
    """The current stacks of each rank's actor, by rank, asked of all at once; within
    `wait_s`. A rank that cannot answer says why instead."""
    refs = {actor.stacks.remote(): rank for rank, actor in actors.items()}
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    found = {rank: f"(no answer within {wait_s:g} s)" for rank in refs.values()}
    for ref in done:
        try:
            found[refs[ref]] = ray.get(ref)
        except RayActorError:
            found[refs[ref]] = "(its process is gone)"
        except ray.exceptions.RayError as exc:
            found[refs[ref]] = f"(no answer: {type(exc).__name__})"
    return dict(sorted(found.items()))


def _where(pool: Pool, rank: int) -> str:
    info = pool.infos[rank]
    return describe_rank(rank, pool.specs[rank].local_rank, info.node_ip, info.hostname, info.pid)


_remote_read_tail = ray.remote(num_cpus=0)(read_tail)
_remote_remove = ray.remote(num_cpus=0)(sharing.remove)


def _crash_reason(
    exc: RayActorError, exit_code: int | None, last_words: str, *, node_gone: bool = False
) -> str:
    if exit_code is not None:
        return f"its process called os._exit({exit_code})"
    fatal = re.search(r"Fatal Python error: ([^\n]+)", last_words)
    if fatal:
        return f"its process died: {fatal.group(1).strip()} (its stack is in its last lines above)"
    detail = re.search(r"Worker exit detail: ([^.]*)", str(exc))
    ray_says = f"; Ray says: {detail.group(1)}" if detail else ""
    if node_gone:
        return (
            "its node left the Ray cluster (Ray stopped there, or the machine was lost), "
            f"taking the rank with it{ray_says}"
        )
    return (
        "its process died without a word: killed by a signal (such as SIGKILL), "
        f"the out-of-memory killer, or its node was lost{ray_says}"
    )
