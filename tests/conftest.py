"""Shared fixtures: one real multi-node Ray cluster for the whole session."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

NODES = 2
GPUS_PER_NODE = 2
CPUS_PER_NODE = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """2 nodes x 2 logical GPUs on this machine, the test process connected as driver."""
    # Ray's address file must not leak to other tests' subprocesses: keep it private.
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    node_args = {"num_cpus": CPUS_PER_NODE, "num_gpus": GPUS_PER_NODE}
    c = Cluster(initialize_head=True, head_node_args=node_args)
    for _ in range(NODES - 1):
        c.add_node(**node_args)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    from orchestrator.job import stop_all

    stop_all()  # a failed test may leave jobs running: they must not outlive the cluster
    ray.shutdown()
    c.shutdown()
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(tmp, ignore_errors=True)


def wait_resources_back(timeout: float = 20.0) -> None:
    """Wait until every CPU and GPU of the cluster is available again, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        total = ray.cluster_resources()
        free = ray.available_resources()
        if all(free.get(k, 0) == total.get(k, 0) for k in ("CPU", "GPU")):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"resources not released: total {total}, available {free}")
        time.sleep(0.1)


def default_sigint(argv: list[str]) -> list[str]:
    """`argv`, run with SIGINT's (and SIGHUP's) default disposition, as from a terminal.

    Under nohup, or `cmd &` in a script, the suite starts with SIGINT (SIGHUP) ignored, and every
    child would inherit that: a test that interrupts one, or compares what a process
    inherits, runs it as a user's terminal would. (A disposition set to the default
    survives exec; preexec_fn would be unsafe beside Ray's threads.)
    """
    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "signal.signal(signal.SIGHUP, signal.SIG_DFL); "  # nohup ignores SIGHUP
    )
    return [sys.executable, "-c", reset + "os.execv(sys.argv[1], sys.argv[1:])", *argv]


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """In this process: SIGINT raises KeyboardInterrupt while inside, even if it was ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
