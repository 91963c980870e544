"""Warm spare rank processes of the local runtime: torch already imported, each used once.

`orchestrator local start` runs a Ray head that outlives scripts, with one Broker
actor. The broker keeps `count` Spare actors ready; a driver claims some for a
CPU-only pool instead of starting processes that must import torch first. A
claimed spare serves one pool and dies with it, or within a second of its
driver's job ending (a SIGKILLed driver included); one a detached function's
supervisor claimed, within a second of that supervisor ending, whatever becomes
of the driver. Both are detached actors: owned by the runtime, not by a script.
The runtime stops itself after `idle_timeout` with no driver and no supervisor.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator_workers import _compat
from orchestrator_workers.actor import CONCURRENCY_GROUPS, RankActor
from orchestrator_workers.protocol import SUPERVISOR_PREFIX

BROKER_NAME = "local-runtime"
NAMESPACE = "orchestrator"
_WATCH_S = 1.0
"""How often a claimed spare checks that its owner (a driver's job, or a supervisor) lives."""
_START_TIMEOUT_S = 300.0
"""A spare not ready (torch imported) within this long is killed and tried again."""
_REFILL_QUIET_S = 3.0
"""After a claim, the broker waits this long before starting replacements (CPU for the job)."""


@functools.cache
def code_id() -> str:
    """Identifies the rank-side code and interpreter: a spare is used only where they match."""
    digest = hashlib.sha256(os.path.realpath(sys.executable).encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as source:
                digest.update(name.encode() + source.read())
    return digest.hexdigest()[:16]


class Spare(RankActor):
    """A rank's actor started ahead of need; `claim` makes it one rank of one pool."""

    def __init__(self) -> None:
        """Import what every rank imports, so a claimed spare starts at once."""
        super().__init__("spare", -1)
        import torch.distributed  # noqa: F401 - the reason spares exist

    def ready(self) -> int:
        """This process's pid, once torch is imported."""
        return os.getpid()

    def claim(
        self, job_name: str, rank: int, owner_job: str, paths: list[str], owner_actor: str = ""
    ) -> None:
        """Serve `rank` of `job_name` for the Ray job `owner_job`; exit when that job ends,
        or, given `owner_actor` (an actor's name in NAMESPACE: a detached function's
        supervisor, which outlives its driver's job), when that actor is gone.

        `paths` go first on sys.path: what Ray gives the workers of the owner's job
        (its script's folder and working directory; for a supervisor, those of the driver
        that submitted, recorded there), so its sibling modules import.
        """
        self.serve_as(job_name, rank)
        sys.path[:0] = [path for path in paths if path not in sys.path]
        if owner_actor:
            owner_lives = functools.partial(_actor_lives, owner_actor)
        else:
            owner_lives = functools.partial(_job_runs, owner_job)
        threading.Thread(target=self._watch, args=(owner_lives,), daemon=True).start()

    def _watch(self, owner_lives: Callable[[], bool | None]) -> None:
        while True:
            time.sleep(_WATCH_S)
            if owner_lives() is False:
                os._exit(0)


def _job_runs(job_id: str) -> bool | None:
    """Whether Ray job `job_id` (hex) still runs; None when Ray cannot tell."""
    jobs = _compat.job_states()
    return None if jobs is None else jobs.get(job_id, False)


def _actor_lives(name: str) -> bool | None:
    """Whether the actor named `name` in NAMESPACE lives; None when Ray cannot tell."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # no actor of that name: it ended, or was killed
        return False
    except Exception:  # noqa: BLE001 - the GCS did not answer this time
        return None
    return True


_RemoteSpare = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(Spare)  # type: ignore[call-overload]  # Ray's stubs omit this documented option


@dataclass(frozen=True)
class ClaimRequest:
    """A driver's request for spares, for the ranks of one pool."""

    owner_job: str
    """Hex id of the driver's Ray job: the spares exit when it ends."""
    job_name: str
    pool_id: str
    ranks_by_node: dict[str, list[int]]
    code: str
    """The driver's code_id(): spares serve only the same code and Python."""
    paths: list[str]
    """Put first on each spare's sys.path (the driver's script folder and working dir:
    `local.driver_paths()`), never the claiming supervisor's own."""
    owner_actor: str = ""
    """The claiming actor's name in NAMESPACE, for a detached function's supervisor: the
    spares exit when it is gone, not with its driver's job."""


@dataclass(frozen=True)
class Claim:
    """A spare serving one rank of a job, for `orchestrator stacks` and `local status`."""

    actor_name: str
    job_name: str
    pool_id: str
    rank: int
    owner_job: str
    pid: int


@dataclass(frozen=True)
class RuntimeInfo:
    """What the local runtime's broker reports."""

    code: str
    node_id: str
    count: int
    ready: list[int] = field(default_factory=list)
    """Pids of the spares ready now."""
    starting: int = 0
    claims: list[Claim] = field(default_factory=list)
    idle_timeout: float | None = None
    runtime_pid: int = 0
    error: str = ""
    """Why the last spare failed to start, if it did."""


class Broker:
    """Keeps `count` spares ready on its node and hands them out, each once."""

    def __init__(
        self, count: int, idle_timeout: float | None, runtime_pid: int, names: list[str]
    ) -> None:
        """Start filling; `runtime_pid` (the `ray start --block` process) ends the runtime.

        `names`: the files naming this runtime (its record, Ray's address file), removed
        when it stops itself: a name left behind would let another user squat its port.
        """
        self._count = count
        self._idle_timeout = idle_timeout
        self._runtime_pid = runtime_pid
        self._names = names
        self._node_id = ray.get_runtime_context().get_node_id()
        self._error = ""
        self._lock = threading.Lock()
        self._ready: list[tuple[Any, str, int]] = []
        self._starting = 0
        self._claims: list[Claim] = []
        self._last_claim = 0.0
        self._idle_since = time.monotonic()
        threading.Thread(target=self._loop, daemon=True).start()

    def info(self) -> RuntimeInfo:
        """The runtime's state."""
        alive = {
            entry["name"]
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == NAMESPACE
        }
        with self._lock:
            self._claims = [claim for claim in self._claims if claim.actor_name in alive]
            return RuntimeInfo(
                code=code_id(),
                node_id=self._node_id,
                count=self._count,
                ready=[pid for _, _, pid in self._ready],
                starting=self._starting,
                claims=list(self._claims),
                idle_timeout=self._idle_timeout,
                runtime_pid=self._runtime_pid,
                error=self._error,
            )

    def claim(self, request: ClaimRequest) -> tuple[str, dict[int, tuple[Any, int]]]:
        """(this code's id, {rank: (spare, pid)}) for ranks on this node, as many as ready.

        None are given where the request's code differs from the spares' own. Each
        spare given has its `claim` done (its watchdog runs) before this returns, so a
        driver dying at any moment after takes its spares with it.
        """
        ours = code_id()
        ranks = request.ranks_by_node.get(self._node_id, [])
        if request.code != ours or not ranks:
            return ours, {}
        with self._lock:
            taken, self._ready = self._ready[: len(ranks)], self._ready[len(ranks) :]
            self._last_claim = time.monotonic()
        given = {}
        for (handle, name, pid), rank in zip(taken, ranks, strict=False):
            try:
                done = handle.claim.remote(
                    request.job_name, rank, request.owner_job, request.paths, request.owner_actor
                )
                ray.get(done, timeout=30)
            except Exception:  # noqa: BLE001 - a broken spare: that rank gets a new actor
                ray.kill(handle, no_restart=True)
                continue
            given[rank] = (handle, pid)
            with self._lock:
                self._claims.append(
                    Claim(name, request.job_name, request.pool_id, rank, request.owner_job, pid)
                )
        return ours, given

    def _loop(self) -> None:
        while True:
            time.sleep(0.5)
            if self._idle_too_long():
                for name in self._names:
                    with contextlib.suppress(OSError):
                        os.unlink(name)
                os.kill(self._runtime_pid, signal.SIGTERM)  # `ray start --block` stops the rest
                return
            with self._lock:
                short = len(self._ready) < self._count
                quiet = time.monotonic() - self._last_claim >= _REFILL_QUIET_S
            if short and quiet:
                self._start_one()  # one at a time: torch imports compete for cores
                # Idle time counts from now: a spare's start (seconds of torch import) is
                # not idleness, and the driver that waited for it may end at once. Else a
                # runtime whose spares start slower than its idle timeout stops itself
                # right after `orchestrator local start` returns.
                self._idle_since = time.monotonic()

    def _start_one(self) -> None:
        name = f"spare-{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._starting = 1
        handle = None
        try:
            handle = _RemoteSpare.options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=0,  # idle spares hold nothing; a claiming pool's bundles hold the CPUs
                scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=False),
            ).remote()
            pid = ray.get(handle.ready.remote(), timeout=_START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - said by info(); tried again on the next round
            if handle is not None:
                ray.kill(handle, no_restart=True)
            self._error = f"{type(exc).__name__}: {str(exc)[:500]}"
            time.sleep(2)
            return
        finally:
            with self._lock:
                self._starting = 0
        with self._lock:
            self._ready.append((handle, name, pid))
            self._error = ""

    def _idle_too_long(self) -> bool:
        """True once no driver has run, and no detached function's supervisor lived, for
        `idle_timeout` seconds (a supervisor's jobs outlive their drivers, and it keeps
        their results until released)."""
        if self._idle_timeout is None:
            return False
        jobs = _compat.job_states()
        # Any live driver counts, `orchestrator local start` itself included (it waits for
        # the spares); so does not knowing.
        if jobs is None or any(jobs.values()) or _supervisors_live():
            self._idle_since = time.monotonic()
            return False
        return time.monotonic() - self._idle_since >= self._idle_timeout


def _supervisors_live() -> bool:
    """Whether a detached function's supervisor lives in the cluster (or Ray cannot tell)."""
    try:
        named = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # noqa: BLE001 - the GCS did not answer this time
        return True
    return any(
        entry["namespace"] == NAMESPACE and entry["name"].startswith(SUPERVISOR_PREFIX)
        for entry in named
    )


RemoteBroker = ray.remote(num_cpus=0)(Broker)
