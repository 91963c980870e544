"""Hooks for this project's tests and benchmarks: what a distributed function's pool and a
job's running call hold. Not part of the public API: names here may change at any time."""

from __future__ import annotations

from typing import Any

from orchestrator.distribute import DistributedFunction
from orchestrator.job import Job
from orchestrator.pool import Pool
from orchestrator.view import CallView


def pool(fn: DistributedFunction[..., Any]) -> Pool | None:
    """`fn`'s warm pool of rank actors, if one runs."""
    return fn._runner.pool


def view(job: Job[Any]) -> CallView | None:
    """`job`'s running (or last) attempt as it is now, once its ranks started."""
    call = job._call
    return None if call is None else call.view(stopped=not job.running())


def readings(job: Job[Any]) -> int:
    """How many node readings of where the ranks are came back for the running call."""
    call = job._call
    return call.monitor.watch.readings if call is not None and call.monitor is not None else 0
