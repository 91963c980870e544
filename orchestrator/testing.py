"""Hooks for this project's tests and benchmarks: what a distributed function's pool and a
job's running call hold. Not part of the public API: names here may change at any time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from orchestrator.connect import rankside
from orchestrator.diagnose import straggle
from orchestrator.function import DistributedFunction
from orchestrator.job import Job
from orchestrator.pool import Pool
from orchestrator.supervise.detached import Detached
from orchestrator.view import CallView


def pool(fn: DistributedFunction[..., Any]) -> Pool | None:
    """`fn`'s warm pool of rank actors, if one runs."""
    return fn._runner.pool


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
