"""One call in flight: start every rank at once, watch them all, stream output, collect."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import channel, crash
from orchestrator.connect import cluster
from orchestrator.diagnose.stall import StallReport, Watch
from orchestrator.diagnose.straggle import Straggler
from orchestrator.errors import (
    CRASH,
    JobTimeoutError,
    StallError,
    StopRequested,
    describe_rank,
    distributed_error,
    is_secondary,
)
from orchestrator.options import Options
from orchestrator.pool import Pool
from orchestrator.shipping import Shipment
from orchestrator.show import messages
from orchestrator.show.logs import Console
from orchestrator.show.status import Notice, StatusLine
from orchestrator.states import State
from orchestrator_workers import sharing
from orchestrator_workers.protocol import (
    EXIT_STREAM,
    STATE_STREAM,
    CallSpec,
    RankFailure,
    RankResult,
)

_GATHER_S = 0.3
"""After the first failure, how long to keep listening for the others' (for the report)."""
_POLL_S = 0.1
"""While each rank runs in a Ray task of its own, how often the driver looks at their
runs and their output together (they end together: one look takes them all)."""
_IDLE_S = 0.5
"""Otherwise, while the ranks are quiet, the driver wakes when a run ends or a rank
prints; and at least this often, to see a stop (which also kills the ranks, and so ends
their runs)."""
_JUDGE_S = 1.0
"""While ranks are read, how often the driver works out who makes no progress."""
_FORGET_WAIT_S = 5.0
"""After a failure, how long to wait for stopped ranks to be gone before cleaning up."""


@dataclass(frozen=True)
class Awaited:
    """The ranks whose outcomes one Ray task in flight brings."""

    ranks: tuple[int, ...]
    leader: int | None = None
    """The rank whose actor handed the call to `ranks` (see handoff); None for a rank's
    own task."""


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
        options: Options,
        *,
        log_dir: Path | None = None,
        sink: Callable[[str, str], None] | None = None,
        stop: threading.Event | None = None,
        restart_count: int = 0,
        earlier: Sequence[BaseException] = (),
    ) -> None:
        """Start the shipped function (see `shipping.ship`) on every rank of `pool`.

        Its output is shown as `options` say, and filed in `log_dir` (the job's, one for
        all its attempts); `sink(stream, text)` takes it instead of the console (a
        notebook cell). `earlier`: the job's failed attempts, for this one's error.
        """
        self.pool = pool
        self.console = Console(
            pool.name,
            len(pool.actors),
            prefix=options.log_prefix,
            show=options.log_ranks,
            log_dir=log_dir,
            sink=sink,
            fold=options.fold_output,
        )
        if restart_count:
            self.console.mark_files(
                f"--- attempt {restart_count + 1} (restart {restart_count}) ---"
            )
        self.timeout = options.timeout
        self.stop = stop or threading.Event()
        self.earlier = tuple(earlier)
        self.share_key = uuid.uuid4().hex[:16]
        self.share_nodes = [node.node_id for node in pool.nodes]
        call = CallSpec(
            master_port=pool.store_port,
            restart_count=restart_count,
            max_restarts=options.max_restarts,
            share_key=self.share_key,
            uses_torch=shipped.uses_torch or pool.request.gpus_per_replica > 0,
            watched=options.stall_after is not None,
        )
        packed_call = pickle.dumps(call, pickle.HIGHEST_PROTOCOL)
        self.call_id = self.share_key.encode()
        self.runs = self._start(packed_call, shipped.data)
        """The Ray tasks in flight that bring ranks' outcomes, and whose."""
        self.draining: dict[ray.ObjectRef, int] = {}
        """Each live rank's output request in flight: ref -> rank."""
        self._undrained = set(range(len(pool.actors)))
        """Ranks whose output request is to be made (or found, if one is in flight)."""
        # How long each rank's output request gathers output once some comes; and when
        # output was last taken in (ranks that print are then read every `_POLL_S`).
        self.gather_s, self._shown_at = channel.gather_s(len(pool.actors)), 0.0
        self.dead: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        """Statuses ranks passed to os._exit, as they reported them just before."""
        self.waits_on: dict[int, str] = {}
        """Per rank, what it waits on beyond its work (a debugger), if anything."""
        self.next_port: int | None = None
        """The port rank 0 reserved for the next call's rendezvous store, once it returned."""
        self.store_open = False
        """Whether rank 0's store still serves (a rank connected to it)."""
        self.owed: dict[int, int] = {}  # rank -> output seq to show before it counts as done
        self.results: dict[int, Any] = {}
        self.failures: list[RankFailure] = []
        self.gather_until: float | None = None
        self.started = time.monotonic()
        self.time_limit = None if self.timeout is None else self.started + self.timeout
        self.on_stall = options.on_stall
        self.watch = (
            None if options.stall_after is None else Watch(pool, self.started, options.stall_after)
        )
        self.stall: StallReport | None = None
        """Ranks without progress for `stall_after`: who is where (None: all move)."""
        self.slow: list[Straggler] = []
        """Ranks slower than their peers, the slowest first (see orchestrator.straggle)."""
        self._judged = 0.0
        self._compared = 0
        """Node readings the slow ranks were last worked out from."""
        self.notice: Notice | None = None
        """What the status line must say now, as last worked out."""
        quiet = sink is not None  # a notebook cell shows the ranks' table instead
        self.status = None if quiet else StatusLine(
            pool.name,
            len(pool.actors),
            self.started,
            self._states,
            lambda: self.notice,
        )

    def _start(self, packed_call: bytes, data: bytes | ray.ObjectRef) -> dict[Any, Awaited]:
        """Start the call on every rank. A small payload is handed off (see handoff): one
        Ray task to each node's first rank, or on many nodes to rank 0, which calls the
        others. A large one goes in one Ray task per rank, each of which reads it from the
        object store in place."""
        pool = self.pool
        if pool.handoff and isinstance(data, bytes) and pool.others:  # rank 0 calls the nodes
            first = pool.nodes[0]
            root = pool.actors[first.ranks[0]]
            others = pool.others_for_call()
            ref = root.run_node.remote(self.call_id, packed_call, data, first.peers, others)
            return {ref: Awaited(tuple(range(len(pool.actors))), first.ranks[0])}
        if pool.handoff and isinstance(data, bytes):  # the driver calls each node's first rank
            runs = {}
            for node in pool.nodes:
                hand = pool.actors[node.ranks[0]]
                ref = hand.run_node.remote(self.call_id, packed_call, data, node.peers, ())
                runs[ref] = Awaited(node.ranks, node.ranks[0])
            return runs
        specs = zip(pool.actors, pool.packed_specs, strict=True)
        return {
            actor.run.remote(packed, packed_call, data): Awaited((rank,))
            for rank, (actor, packed) in enumerate(specs)
        }

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
        if self.failures:
            raise distributed_error(
                self.failures, log_dir=self.console.log_dir, earlier_attempts=self.earlier
            )
        self.pool.use_store(self.next_port, close=self.store_open)  # every rank is done
        return [self.results[rank] for rank in range(len(self.pool.actors))]

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, by rank."""
        return self.pool.stacks()

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
            looked = self._look(now)
            status = self.status.tick(now, console.last_output) if self.status else None
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
            for ref in shown:
                self._show(self.draining.pop(ref))
            if shown:
                self._shown_at = time.monotonic()

    def _look(self, now: float) -> float | None:
        """Read where the ranks are when due, and say who makes no progress; when next."""
        watch = self.watch
        if watch is None or not self.runs or self.failures:
            return None
        due = watch.tick(now)
        if watch.pending:  # readings on their way are taken in at the next pass
            due = min(due, now + _POLL_S)
        if (watch.where or watch.mute) and now >= self._judged + _JUDGE_S:
            self._judged = now
            self.stall = None
            returned = self._returned(watch)
            running = self.running() - returned
            if not any(self.waits_on.values()):  # a rank in a debugger holds the others
                self.stall = watch.report(
                    self.pool.name, now, running, self.console.last_times, returned=returned
                )
            if self.stall is not None:
                self.slow = []
            elif watch.readings != self._compared:  # new counts: compare the ranks again
                self._compared = watch.readings
                self.slow = watch.shares.stragglers(running, now)
            self.notice = self._notice()
            # Raise mode, the user's choice, ends the call once ranks have waited
            # `stall_after`, even for one that moves (rank 0 saving a checkpoint while its
            # peers wait at a barrier): the report says just that.
            if self.stall is not None and self.on_stall == "raise":
                self._stall_out(self.stall)
        return min(due, self._judged + _JUDGE_S) if watch.where else due

    def _returned(self, watch: Watch) -> set[int]:
        """Ranks whose function has returned: their outcome came, or their record says so
        (a handed-off call's outcomes come together, once all are done)."""
        found = set(self.results)
        for rank, (where, _) in watch.where.items():
            if where.call == self.share_key and not where.running:
                found.add(rank)
        return found

    def use(self, rank: int) -> str:
        """What `rank`'s process uses, as last read: '1.0 cores, 0.3 GB, GPU 3.1 GB 87% busy'."""
        found = self.watch.where.get(rank) if self.watch is not None else None
        if found is None or not found[0].running:
            return ""
        where = found[0]
        text = f"{where.process_cpu:.1f} cores, {where.rss_mb / 1024:.1f} GB"
        if where.gpu_mb is not None:
            text += f", GPU {where.gpu_mb / 1024:.1f} GB"
            text += f" {where.gpu_busy}% busy" if where.gpu_busy is not None else ""
        return text

    def _notice(self) -> Notice | None:
        """What the status line must say now: ranks without progress, or slow ones."""
        if self.stall is not None:  # said again at once when who waits where changes
            key = tuple((g.ranks, str(g.place)) for g in self.stall.groups if not g.moving)
            return Notice(key, self.stall.line(), str(self.stall))
        if self.slow:
            line = f"[{self.pool.name}] " + "; ".join(s.sentence() for s in self.slow)
            return Notice(tuple(s.rank for s in self.slow), line, line)
        return None

    def _wait_runs(
        self, wait_s: float | None
    ) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
        """Runs finished within `wait_s` (or the poll), and the output requests ready.

        Where the runs are few (a call handed off by node) and the ranks are quiet, one
        wait for the first of the runs and the output requests: a failure or a line is
        seen at once, and a call that prints nothing costs a pass or two. While they
        print (from `channel.GATHER_FROM_RANKS`), their output is taken every `_POLL_S`,
        not line by line. Where each rank has a run of its own, one wait for every run
        (a job's ranks end together: one wait takes them all) and a look at the output
        requests, every `_POLL_S`: a wait for the first would return once per rank, each
        time a pass over every rank.
        """
        runs, draining = list(self.runs), list(self.draining)
        per_rank = len(runs) > len(self.pool.nodes)
        printing = self.gather_s > 0 and time.monotonic() - self._shown_at < _POLL_S
        if not runs or not (per_rank or printing):
            timeout = _IDLE_S if wait_s is None else max(0.0, min(wait_s, _IDLE_S))
            ready = _ready(runs + draining, timeout)
            return [r for r in ready if r in self.runs], [r for r in ready if r in self.draining]
        poll = _POLL_S if per_rank else self._shown_at + _POLL_S - time.monotonic()
        timeout = max(0.0, poll if wait_s is None else min(wait_s, poll))
        if per_rank:
            finished, _ = ray.wait(runs, num_returns=len(runs), timeout=timeout)
        else:
            finished = _ready(runs, timeout)
        return finished, _ready(draining, 0) if draining else []

    def rank_state(self, rank: int, *, stopped: bool) -> str:
        """finished, failed, running (or what it waits on); `stopped` when the call ended."""
        if rank in self.results:
            return State.FINISHED
        if any(f.rank == rank for f in self.failures):
            return State.FAILED
        return State.STOPPED if stopped else self.waits_on.get(rank) or State.RUNNING

    def _states(self) -> list[tuple[int, str]]:
        """Each rank's state now, by rank (for the status line)."""
        ranks = range(len(self.pool.actors))
        return [(rank, self.rank_state(rank, stopped=False)) for rank in ranks]

    def repair(self, attempt: int, *, settle_s: float) -> bool:
        """After this call failed: replace its broken ranks in the pool for attempt number
        `attempt`; False where the whole pool must go instead.

        Healthy ranks (finished, or failed only because a peer did) keep their warm
        processes, so a restart costs one actor start, not a whole pool's. `settle_s`:
        how long ranks still running may take to return (a peer's death reaches gloo
        ranks in moments); 0 after a timeout, where they are all stuck.
        """
        until = time.monotonic() + settle_s
        while self.runs and (left := until - time.monotonic()) > 0:
            done = _ready(list(self.runs), left)  # a node's rest comes in a task of its own
            if not done:
                break
            self._take_all(done)
        broken = self.broken_ranks()
        return len(broken) < len(self.pool.actors) and self.pool.replace(broken, attempt)

    def broken_ranks(self) -> set[int]:
        """After a failure: ranks whose actor must be replaced before a restart.

        Dead ones, ones still running (perhaps stuck in a collective), and ones that
        raised an error of their own (their process may be in a bad state, e.g. CUDA's).
        A rank that finished, or failed only because a peer did, is healthy.
        """
        broken = self.running() | self.dead
        broken |= {f.rank for f in self.failures if f.exc_type == CRASH or not is_secondary(f)}
        return broken

    def running(self) -> set[int]:
        """Ranks whose outcomes have not come yet."""
        return {rank for awaited in self.runs.values() for rank in awaited.ranks}

    def _forget_buffers(self) -> None:
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
        channels, dead = self.pool.channels, self.dead
        return bool(self.runs) or any(
            channels[rank].shown < seq for rank, seq in self.owed.items() if rank not in dead
        )

    def _request_output(self) -> None:
        """Make the output requests still to be made (a rank's, once its last came back)."""
        for rank in self._undrained - self.dead:
            self.draining[self.pool.channels[rank].request(self.gather_s)] = rank
        self._undrained.clear()

    def _take_all(self, refs: list[ray.ObjectRef]) -> None:
        """Take the outcomes these finished tasks bring, fetched together where all are there."""
        if not refs:
            return
        try:
            values: list[bytes | None] = ray.get(refs)
        except RayActorError:  # one is gone: each on its own below
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
        done, pending, _ = pickle.loads(data)  # noqa: S301 - from our own rank actor
        for rank, outcome in done:
            if outcome is None:  # large, or its socket closed (then Ray says why it is gone)
                self._ask(rank)
            else:
                self._take(pickle.loads(outcome))  # noqa: S301 - from our own rank actor
        if pending:
            rest = self.pool.actors[leader].collect.remote(self.call_id)
            self.runs[rest] = Awaited(tuple(pending), leader)

    def _lost(self, awaited: Awaited, exc: RayActorError) -> None:
        """The actor that was to bring `awaited`'s outcomes is gone: its rank crashed; the
        other ranks (whose call it handed off) are asked for theirs directly."""
        gone = awaited.ranks[0] if awaited.leader is None else awaited.leader
        if gone in awaited.ranks:
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

    def _show(self, rank: int) -> None:
        try:
            chunks = self.pool.channels[rank].take()
        except RayActorError:
            self.dead.add(rank)
            return
        self._undrained.add(rank)
        for chunk in chunks:
            if chunk.stream == EXIT_STREAM:
                self.exit_codes[rank] = int(chunk.data)
            elif chunk.stream == STATE_STREAM:
                self.waits_on[rank] = chunk.data.decode()
        shown = [chunk for chunk in chunks if chunk.stream not in (EXIT_STREAM, STATE_STREAM)]
        self.console.write(rank, shown)

    def _crash(self, rank: int, exc: RayActorError) -> RankFailure:
        """`rank`'s failure: its actor is gone (`exc`, Ray's word on why)."""
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
            message=crash.reason(
                exc,
                self.exit_codes.get(rank),
                last_words,
                node_gone=cluster.node_lost(info.node_id),
            ),
            traceback="",
        )

    def _show_leftovers(self, rank: int) -> str:
        """Show what a dead rank wrote in its last instant (saved by its keeper); return it."""
        channel = self.pool.channels[rank]
        chunks = crash.last_words(self.pool.infos[rank], channel.shown)
        self.console.write(rank, chunks)
        channel.shown = max([channel.shown, *(chunk.seq for chunk in chunks)])
        return "".join(chunk.data.decode(errors="replace") for chunk in chunks)

    def _stall_out(self, report: StallReport) -> None:
        self.console.flush()
        where = {rank: _where(self.pool, rank) for rank in range(len(self.pool.actors))}
        raise StallError(
            self.watch.after_s if self.watch is not None else 0.0,
            str(report),
            self.pool.stacks(),
            where,
            log_dir=self.console.log_dir,
            earlier_attempts=self.earlier,
        )

    def _time_out(self) -> None:
        self.console.flush()
        where = {rank: _where(self.pool, rank) for rank in range(len(self.pool.actors))}
        raise JobTimeoutError(
            self.timeout or 0.0,
            self.pool.stacks(),
            where,
            log_dir=self.console.log_dir,
            earlier_attempts=self.earlier,
        )


def _ready(refs: list[ray.ObjectRef], wait_s: float | None) -> list[ray.ObjectRef]:
    """Wait up to `wait_s` for one of `refs`; then take every other one ready too."""
    done, rest = ray.wait(refs, num_returns=1, timeout=None if wait_s is None else max(0, wait_s))
    if done and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        done += more
    return done


def _where(pool: Pool, rank: int) -> str:
    info = pool.infos[rank]
    return describe_rank(rank, pool.specs[rank].local_rank, info.node_ip, info.hostname, info.pid)


_remote_remove = ray.remote(num_cpus=0)(sharing.remove)
