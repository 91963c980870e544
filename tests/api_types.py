"""What a user's type checker sees of the public API: checked by mypy in .ci/run, never run.

Each `# type: ignore[...]` marks a call that must be an error: with warn_unused_ignores,
mypy fails if it stops being one.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from typing_extensions import assert_type

from orchestrator import DistributedError, Job, RankFailure, default_log_dir, distribute


def train(epochs: int, lr: float = 0.1) -> float:
    """A user's training function."""
    return lr * epochs


def check() -> None:
    """The public API's types, as a user's code meets them."""
    fn = distribute(train, num_replicas=2)
    assert_type(fn(3), list[float])
    assert_type(fn(3, lr=0.5), list[float])
    job = fn.submit(3)
    assert_type(job, Job[float])
    future: Future[list[float]] = job  # a Job is a Future of the ranks' results
    assert_type(future.result(), list[float])
    assert_type(fn.with_options(timeout=5.0, restart_on="crash")(3), list[float])
    fn.with_options(timeout="soon")  # type: ignore[arg-type]
    fn.with_options(restart_on="sometimes")  # type: ignore[arg-type]
    fn.with_options(num_replicas=4)  # type: ignore[call-arg]
    fn("3")  # type: ignore[arg-type]
    assert_type(default_log_dir(), Path)


def root_cause(error: DistributedError) -> RankFailure | None:
    """The failing rank's record is a public type."""
    return error.root_cause
