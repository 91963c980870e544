"""Section 6 of bench_core: 2..16 ranks over 1..8 simulated nodes, cold and warm."""

from __future__ import annotations

import os
import time

from benchmarks.core.common import (
    SectionResult,
    Settings,
    Table,
    fmt_s,
    progress,
    timed_calls,
    timing_row,
)


def run(s: Settings) -> SectionResult:
    """Cold and warm calls for 2..16 ranks over 1..8 simulated nodes (2 CPUs, 2 ranks each)."""
    import logging

    import ray
    from ray.cluster_utils import Cluster

    from benchmarks._jobs import trivial
    from orchestrator import distribute

    node_args = {"num_cpus": 2, "object_store_memory": 200 << 20}
    progress("growth: starting the head node")
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        nodes = 1
        add_s = time.perf_counter() - t0
        for ranks, want in s.growth_layouts:
            t0 = time.perf_counter()
            while nodes < want:
                cluster.add_node(**node_args)
                nodes += 1
            cluster.wait_for_nodes()
            _wait_cpus(2 * nodes)
            add_s += time.perf_counter() - t0
            progress(f"growth: {ranks} ranks on {nodes} node(s): cold call")
            t0 = time.perf_counter()
            job = distribute(
                trivial,
                num_replicas=ranks,
                replicas_per_node=ranks // nodes,
                cpus_per_replica=1,
                address=cluster.address,
                name=f"grow{ranks}",
            )
            first = job()
            cold = time.perf_counter() - t0
            assert [r["world"] for r in first] == [ranks] * ranks, first
            progress(f"growth: {ranks} ranks on {nodes} node(s): {s.growth_calls} warm calls")
            warm = timed_calls(job, s.growth_calls)
            job.shutdown()
            _wait_cpus(2 * nodes)
            row = timing_row(str(ranks), warm, cold)
            rows.append([row[0], str(nodes), row[-1], *row[2:6], fmt_s(add_s)])
            add_s = 0.0
    finally:
        ray.shutdown()
        cluster.shutdown()
    table = Table(
        "6. Growth: trivial gloo job, 2 ranks and 2 CPUs per simulated node "
        f"(ray.cluster_utils.Cluster; warm: median of {s.growth_calls})",
        [
            "ranks",
            "nodes",
            "cold (pool + 1st call)",
            "warm median",
            "warm mean",
            "warm min..max",
            "> 1 s",
            "adding nodes",
        ],
    )
    table.rows += rows
    table.notes.append(
        f"all nodes share this machine's {os.cpu_count()} cores: the cost of more ranks here "
        "is mostly CPU contention"
    )
    return SectionResult([table])


def _wait_cpus(total: float, timeout: float = 60) -> None:
    """Wait until the cluster has `total` CPUs and all of them are free."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            ray.cluster_resources().get("CPU", 0) >= total
            and ray.available_resources().get("CPU", 0) >= total
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"cluster CPUs not all free: {ray.available_resources()}")
