"""Hooks for this project's tests and benchmarks: what a distributed function's pool and a
job's running call hold. Not part of the public API: names here may change at any time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from orchestrator import call as calls
from orchestrator import job as jobs
from orchestrator.connect import rankside
from orchestrator.diagnose import straggle
from orchestrator.function import DistributedFunction
from orchestrator.job import Job
from orchestrator.pool import Pool
from orchestrator.runner import Runner
from orchestrator.supervise.detached import Detached
from orchestrator.supervise.follow import FollowedJob
from orchestrator.view import CallView


def pool(fn: DistributedFunction[..., Any]) -> Pool | None:
    """`fn`'s warm pool of rank actors, if one runs."""
    runner = fn._runner
    return runner.pool if isinstance(runner, Runner) else None


def lent(fn: DistributedFunction[..., Any]) -> bool:
    """Whether detached `fn`'s supervisor lent this driver its pool for the next call (see
    supervise.direct)."""
    runner = fn._runner
    return isinstance(runner, Detached) and runner._holder.holds()


def view(job: Job[Any]) -> CallView | None:
    """`job`'s running (or last) attempt as it is now, once its ranks started."""
    call = job._call
    return None if call is None else call.view(stopped=not job.running())


def readings(job: Job[Any]) -> int:
    """How many node readings of where the ranks are came back for the running call."""
    call = job._call
    return call.monitor.watch.readings if call is not None and call.monitor is not None else 0


def last_job(fn: DistributedFunction[..., Any]) -> Job[Any] | None:
    """`fn`'s job submitted last (a detached function's: its `FollowedJob`)."""
    return fn._runner.last


def supervisor(fn: DistributedFunction[..., Any]) -> str | None:
    """The actor name of detached `fn`'s supervisor (None: not detached, or no call yet)."""
    runner = fn._runner
    return runner._supervisor_name if isinstance(runner, Detached) else None


@contextlib.contextmanager
def sent_to_supervisor(fn: DistributedFunction[..., Any]) -> Iterator[list[str]]:
    """Within: the id of each job detached `fn` sends through its supervisor (not to its
    ranks directly), in the list given."""
    runner = fn._runner
    assert isinstance(runner, Detached), f"{fn} is not detached"
    send = runner._send
    sent: list[str] = []

    def noted(*args: Any) -> Any:
        got = send(*args)
        sent.append(got[0].id)
        return got

    runner._send = noted  # type: ignore[method-assign,assignment]
    try:
        yield sent
    finally:
        del runner._send


def following(job: Job[Any]) -> bool:
    """Whether this process still follows detached `job` (shows its output, and says at
    its exit that the job runs on)."""
    return isinstance(job, FollowedJob) and not job._unfollowed.is_set()


def store_open(job: Job[Any]) -> bool | None:
    """Whether rank 0 made (and holds) a rendezvous store for `job`'s last attempt; None
    before its ranks started."""
    call = job._call
    return None if call is None else call.store_open


def live_jobs() -> list[Job[Any]]:
    """The jobs this process stops at its exit: submitted, and not yet ended or forgotten."""
    return list(jobs._live)


@contextlib.contextmanager
def wait_passes() -> Iterator[list[float]]:
    """Within: when (`time.monotonic()`) each pass of a call's wait for its ranks began, in
    the list given: a pass each time a rank prints or a run ends, else every `idle_wait_s()`."""
    real = calls.Call._wait_runs
    passes: list[float] = []

    def noted(self: calls.Call, wait_s: float | None) -> Any:
        passes.append(time.monotonic())
        return real(self, wait_s)

    calls.Call._wait_runs = noted  # type: ignore[method-assign]
    try:
        yield passes
    finally:
        calls.Call._wait_runs = real  # type: ignore[method-assign]


def idle_wait_s() -> float:
    """How long a call's wait for its ranks lasts while nothing comes from them."""
    return calls._IDLE_S


@contextlib.contextmanager
def driver_torch_version(version: str) -> Iterator[None]:
    """Within: the driver compares each newly read node's torch with `version`, not with
    the torch installed here (to see the warning of a node with another torch)."""
    rankside.set_driver_torch(version)
    try:
        yield
    finally:
        rankside.set_driver_torch(None)


@contextlib.contextmanager
def straggler_thresholds(*, min_looks: int, confirm_s: float) -> Iterator[None]:
    """Within: a rank is compared with its peers after `min_looks` looks in the window, and
    named once found slow for `confirm_s` (shorter tests of the straggler watch)."""
    saved = straggle.MIN_LOOKS, straggle.CONFIRM_S
    straggle.MIN_LOOKS, straggle.CONFIRM_S = min_looks, confirm_s
    try:
        yield
    finally:
        straggle.MIN_LOOKS, straggle.CONFIRM_S = saved


@contextlib.contextmanager
def ship_rank_side() -> Iterator[None]:
    """Within: new actors and tasks carry the driver's rank side to every node, as on nodes
    without this package (what that costs, beside installed)."""
    rankside.set_always(True)
    try:
        yield
    finally:
        rankside.set_always(False)


def nodes_read() -> int:
    """How many nodes this process has asked, by a task, what they have (see rankside)."""
    return rankside.nodes_read()
