"""Shared fixtures: one real multi-node Ray cluster for the whole session; the two lanes.

A test that starts Ray, a cluster or any other process is marked `ray`, from its fixtures:
`cluster` (and what builds on it), the modules' own boots, or `processes` for a test that
starts processes of its own. `pytest -m "not ray"` runs the rest, the pure tests, alone; a
test outside the `ray` lane that starts Ray or a process fails, saying which fixture to ask
for.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import ray
import torch  # noqa: F401 - whole before any guard: its first import may run a subprocess
from ray.cluster_utils import Cluster

from orchestrator._ray_compat import same_niceness_env
from tests.helpers import CPUS_PER_NODE, GPUS_PER_NODE, NODES, starting_nothing

RAY_FIXTURES = frozenset(
    {
        "cluster",  # this file's session cluster, and fixtures built on it
        "processes",  # a test that starts processes of its own
        "two_hosts",  # test_bare_nodes: two hosts in network namespaces
        "runtime",  # test_local_runtime: `orchestrator local start`
        "private_env",
        "fresh_env",  # test_embedded, test_inheritance: a private Ray temp dir for a script
        "fresh_ray_dir",  # test_notebook
        "torchrun_results",  # test_clients
    }
)
"""Fixtures that start Ray or processes: a test that uses one is in the `ray` lane."""


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """2 nodes x 2 logical GPUs on this machine, the test process connected as driver."""
    # Ray's address file must not leak to other tests' subprocesses: keep it private.
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    node_args = {"num_cpus": CPUS_PER_NODE, "num_gpus": GPUS_PER_NODE}
    # The ranks at the driver's niceness, as the embedded local default runs them: at
    # Ray's worker_niceness=15 they yield to any busy process (beside two, the suite ran
    # 62 tests in 32 min). Only the raylets started here read it.
    niceness = same_niceness_env()
    os.environ.update(niceness)
    try:
        c = Cluster(initialize_head=True, head_node_args=node_args)
        for _ in range(NODES - 1):
            c.add_node(**node_args)
        c.wait_for_nodes()
    finally:
        for name in niceness:
            os.environ.pop(name, None)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    from orchestrator.job import stop_all

    stop_all()  # a failed test may leave jobs running: they must not outlive the cluster
    ray.shutdown()
    c.shutdown()
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def processes() -> None:
    """This test starts processes of its own (a subprocess, a fork, Ray): the `ray` lane."""


LONGEST_FIRST = (
    "test_bare_nodes",
    "test_snapshot",
    "test_restarts",
    "test_detach",
    "test_local_runtime",
    "test_stall",
    "test_clients",
    "test_failures",
    "test_cli",
    "test_metrics",
    "test_straggle",
    "test_shutdown",
    "test_shipping",
    "test_dashboard",
    "test_embedded",
    "test_user_names",
    "test_examples",
    "test_jobs",
    "test_soak",
    "test_output",
    "test_notebook",
    "test_raymetrics",
    "test_stacks",
)
"""The modules that take longest (their seconds in a full run's `--durations=0`, most
first; the others follow in their own order). The two test processes take a module each
in this order, so neither is left with a long one at the end while the other idles."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `ray` every test whose fixtures start Ray or processes; longest modules first."""
    for item in items:
        if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: in-module order


@pytest.fixture(autouse=True)
def _pure_tests_start_nothing(request: pytest.FixtureRequest) -> Iterator[None]:
    """Outside the `ray` lane, starting Ray or a process fails the test."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    lane = (
        "but is not in the `ray` lane: ask for the `processes` fixture (or one of "
        f"{', '.join(sorted(RAY_FIXTURES))})"
    )
    with starting_nothing(lane):
        yield
