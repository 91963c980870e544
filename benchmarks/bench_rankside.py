"""What bringing the rank side to nodes costs, beside nodes that have the package installed.

    python -m benchmarks.bench_rankside [--nodes 2,4] [--repeats 5] [--fresh 3]

A `ray.cluster_utils.Cluster` of N nodes on this machine (2 CPUs each), one rank per node,
gloo. "shipped": `testing.ship_rank_side()`, so every actor and task carries the driver's
copy of `orchestrator_workers` (connect/bootstrap.py), exactly as on a node without the
package; "installed": the nodes' own copy (this venv's). The two alternate; medians:

- first call, fresh cluster: new nodes, so the archive is put, fetched and unpacked
  on each (`--fresh` clusters per mode);
- cold start: a new pool's first call on a cluster that has the package cached;
- restart: a call whose rank 1 dies once, with max_restarts=1 (a new actor replaces it);
- warm call: a no-op call on a warm pool (`--warm-calls` per round);
- second driver: the first call of a fresh process that joins the cluster.

Goals (issue 35): the fresh cluster's extra under 1 s; cold start and restart at most 10%
slower; warm call and second driver no slower beyond noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import ray
from ray.cluster_utils import Cluster

from orchestrator import distribute, testing

MODES = ("installed", "shipped")

_SECOND_DRIVER = """
import contextlib, json, sys, time
from orchestrator import distribute, testing
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
with testing.ship_rank_side() if sys.argv[2] == "shipped" else contextlib.nullcontext():
    began = time.perf_counter()
    distribute(lambda: 1, num_replicas=int(sys.argv[3]), replicas_per_node=1, log_dir=False)()
print(json.dumps(time.perf_counter() - began))
"""


def _noop() -> int:
    return 1


def _gloo() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _dies_once(folder: str) -> int:
    import pathlib
    import signal

    mark = pathlib.Path(folder) / "died"
    if os.environ["RANK"] == "1" and not mark.exists():
        mark.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    return _gloo()


def _mode(mode: str) -> AbstractContextManager[None]:
    return testing.ship_rank_side() if mode == "shipped" else nullcontext()


def _cluster(nodes: int) -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def _close(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


def _timed(call: Callable[[], object]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def fresh(nodes: int, runs: int) -> dict[str, list[float]]:
    """First call on a cluster whose nodes never had the package shipped."""
    found: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(runs):
        for mode in MODES:
            cluster = _cluster(nodes)
            try:
                with _mode(mode):
                    fn = distribute(_gloo, num_replicas=nodes, replicas_per_node=1, log_dir=False)
                    found[mode].append(_timed(fn))
                    fn.shutdown()
            finally:
                _close(cluster)
    return found


def warm_cluster(nodes: int, repeats: int, warm_calls: int, folder: str) -> dict[str, dict]:
    """Cold start, restart, warm call and second driver, on one cluster with the package cached."""
    found: dict[str, dict[str, list[float]]] = {
        m: {"cold": [], "restart": [], "warm": [], "second": []} for m in MODES
    }
    cluster = _cluster(nodes)
    try:
        for mode in MODES:  # each mode's first pool: the package reaches every node
            with _mode(mode):
                distribute(_noop, num_replicas=nodes, replicas_per_node=1, log_dir=False)()
        for _ in range(repeats):
            for mode in MODES:
                with _mode(mode):
                    fn = distribute(_gloo, num_replicas=nodes, replicas_per_node=1, log_dir=False)
                    found[mode]["cold"].append(_timed(fn))
                    calls = [_timed(fn) for _ in range(warm_calls)]
                    found[mode]["warm"].append(statistics.median(calls))
                    fn.shutdown()
                    for name in os.listdir(folder):
                        os.remove(os.path.join(folder, name))
                    restart = distribute(
                        _dies_once,
                        num_replicas=nodes,
                        replicas_per_node=1,
                        log_dir=False,
                        max_restarts=1,
                    )
                    restart(folder)  # the pool, warm
                    os.remove(os.path.join(folder, "died"))
                    found[mode]["restart"].append(_timed(lambda: restart(folder)))  # noqa: B023
                    restart.shutdown()
                found[mode]["second"].append(_second_driver(cluster.address, mode, nodes))
    finally:
        _close(cluster)
    return found


def _second_driver(address: str, mode: str, nodes: int) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_DRIVER, address, mode, str(nodes)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _row(what: str, values: dict[str, list[float]], unit: float = 1.0, fmt: str = ".2f") -> str:
    a, b = (statistics.median(values[m]) * unit for m in MODES)
    n = len(values[MODES[0]])
    return f"| {what} | {a:{fmt}} | {b:{fmt}} | {b - a:+{fmt}} | {b / a:.2f}x | {n} |"


def main() -> None:
    """Measure each size, then print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,4", help="cluster sizes (default: 2,4)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds on a warm cluster")
    parser.add_argument("--fresh", type=int, default=3, help="fresh clusters per mode and size")
    parser.add_argument("--warm-calls", type=int, default=30, help="warm calls per round")
    args = parser.parse_args()
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-rankside-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    rows = ["| nodes: what | installed | shipped | extra | ratio | runs |", "|---" * 6 + "|"]
    for nodes in (int(n) for n in args.nodes.split(",")):
        first = fresh(nodes, args.fresh)
        rows.append(_row(f"{nodes}: first call, fresh cluster (s)", first))
        warm = warm_cluster(nodes, args.repeats, args.warm_calls, folder)
        for key, what, unit, fmt in (
            ("cold", "cold start (s)", 1.0, ".2f"),
            ("restart", "call with one restart (s)", 1.0, ".2f"),
            ("warm", "warm gloo call (ms)", 1000.0, ".1f"),
            ("second", "second driver's first call (s)", 1.0, ".2f"),
        ):
            rows.append(_row(f"{nodes}: {what}", {m: warm[m][key] for m in MODES}, unit, fmt))
        print("\n".join(rows), flush=True)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
