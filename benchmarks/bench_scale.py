"""Scale: distribute() at 16..128 ranks on a simulated cluster, beside Ray's own floor.

    python -m benchmarks.bench_scale                   # 16, 32, 64, 128 ranks (~25 min)
    python -m benchmarks.bench_scale --sizes 16,32 --quick

For each size a `ray.cluster_utils.Cluster` runs N/8 nodes of 8 CPUs (and a small object
store) on this machine. In it, fresh driver processes take turns, ours and the floor's:

- ours: `distribute(job, num_replicas=N, replicas_per_node=8, cpus_per_replica=1,
  gpus_per_replica=0, log_dir=False)`: one Ray task per node, whose first rank hands the
  call to the node's ranks (orchestrator_workers.handoff);
- ours without the hand-off (`ORCHESTRATOR_HANDOFF=0`, `--direct`): one Ray task per rank;
- the floor: N plain Ray actors in a placement group of the same shape, called with
  `ray.get` over all of them (the function pickled once per call); in gloo mode each gets
  the torchrun variables (rank 0 picks the port) and runs the same function.

Two jobs: rank-only (returns its rank; no torch), and gloo (init_process_group, one
all_reduce, destroy). Each driver measures: cold (pool or actors started, plus the first
call), warm calls (median, p90), its own CPU per warm call, its private memory (USS),
each rank's memory (PSS, with the processes it started), and its CPU while every rank
prints 100 lines a second. Then a least-squares line over the sizes projects each figure
to 1,024 ranks on 128 nodes. All the simulated nodes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PER_NODE = 8
PRINT_HZ = 100
IDLE_S = 3.0
"""How long each driver sits idle with its pool warm, to measure its idle CPU."""


# ----------------------------------------------------------------------------- the jobs


def rank_only(steps: int = 0) -> int:
    """The rank; with `steps`, a line per step at PRINT_HZ first (as a training loop)."""
    rank = int(os.environ["RANK"])
    for step in range(steps):
        print(f"Rank {rank}: Epoch 0, step {step}, Loss {0.5 / (step + 1):.4f}", flush=True)
        time.sleep(1 / PRINT_HZ)
    return rank


def gloo(steps: int = 0) -> int:
    """init_process_group, one all_reduce, destroy; the rank's sum (N*(N-1)/2)."""
    import torch
    import torch.distributed as dist

    rank_only(steps)
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return int(value.item())


JOBS: dict[str, Callable[[int], int]] = {"rank": rank_only, "gloo": gloo}


# ------------------------------------------------------------------- one driver process


def _pss_mb(pid: int, with_children: bool) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *(proc.children(recursive=True) if with_children else [])]
        return sum(p.memory_full_info().pss for p in procs) / 2**20
    except psutil.Error:
        return float("nan")


def _machine_busy_s() -> float:
    """CPU seconds every process on this machine has used (since boot), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _uss_mb() -> float:
    import psutil

    return psutil.Process().memory_full_info().uss / 2**20


class _Floor:
    """N plain Ray actors in a placement group shaped as ours: Ray's own floor."""

    def __init__(self, ranks: int, load_torch: bool, fan_out: bool = False) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=1)
        class Plain:
            def __init__(self, load_torch: bool) -> None:
                if load_torch:  # as our ranks do, for a job that uses torch
                    import torch.distributed  # noqa: F401

            def pid(self) -> int:
                return os.getpid()

            def node_ip(self) -> str:
                return ray.util.get_node_ip_address()

            def free_port(self) -> int:
                import socket

                with socket.socket() as sock:
                    sock.bind(("", 0))
                    return int(sock.getsockname()[1])

            def run(self, fn_bytes: bytes, env: dict[str, str], steps: int) -> Any:
                import cloudpickle

                os.environ.update(env)
                return cloudpickle.loads(fn_bytes)(steps)

        _Leader = _leader_class()
        self.pg = placement_group([{"CPU": PER_NODE}] * (ranks // PER_NODE), "STRICT_SPREAD")
        ray.get(self.pg.ready())
        self.actors = [
            Plain.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank // PER_NODE
                )
            ).remote(load_torch)
            for rank in range(ranks)
        ]
        self.gloo = load_torch
        self.master = ray.get(self.actors[0].node_ip.remote()) if load_torch else ""
        self.leaders: list[Any] = []
        if fan_out:  # one more actor per node, which calls that node's ranks
            self.leaders = [
                _Leader.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=node
                    )
                ).remote(self.actors[node * PER_NODE : (node + 1) * PER_NODE])
                for node in range(ranks // PER_NODE)
            ]

    def __call__(self, fn: Callable[[int], int], steps: int = 0) -> list[Any]:
        import cloudpickle
        import ray

        port = ray.get(self.actors[0].free_port.remote()) if self.gloo else 0
        size = len(self.actors)
        envs = [
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % PER_NODE),
                "WORLD_SIZE": str(size),
                "MASTER_ADDR": self.master,
                "MASTER_PORT": str(port),
            }
            for rank in range(size)
        ]
        data = cloudpickle.dumps(fn)
        if self.leaders:
            parts = [
                leader.run.remote(data, envs[node * PER_NODE : (node + 1) * PER_NODE], steps)
                for node, leader in enumerate(self.leaders)
            ]
            return [value for part in ray.get(parts) for value in part]
        refs = [a.run.remote(data, env, steps) for a, env in zip(self.actors, envs, strict=True)]
        return ray.get(refs)

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        for actor in [*self.actors, *self.leaders]:
            ray.kill(actor)


class _LeaderImpl:
    """Per-node fan-out: the driver calls one of these per node, it calls the node's ranks."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def run(self, data: bytes, envs: list[dict[str, str]], steps: int) -> list[Any]:
        import ray

        refs = [a.run.remote(data, env, steps) for a, env in zip(self.actors, envs, strict=True)]
        return ray.get(refs)


def _leader_class() -> Any:
    import ray

    return ray.remote(num_cpus=0)(_LeaderImpl)


@dataclass(frozen=True)
class Run:
    """What one driver process measures."""

    kind: str
    """"ours", "direct" (ours, one Ray task per rank), "floor" or "fanout" (the floor
    with a per-node fan-out)."""
    address: str
    ranks: int
    mode: str
    """"rank" or "gloo" (JOBS)."""
    calls: int
    print_s: float

    def argv(self) -> list[str]:
        """The command line of a driver process making this run."""
        return [
            sys.executable,
            "-m",
            "benchmarks.bench_scale",
            "--driver",
            self.kind,
            "--address",
            self.address,
            "--ranks",
            str(self.ranks),
            "--mode",
            self.mode,
            "--calls",
            str(self.calls),
            "--print-s",
            str(self.print_s),
            "--per-node",
            str(PER_NODE),
        ]


def drive(run: Run) -> dict:
    """One driver's measurements (run in a fresh process), as a dict."""
    kind, ranks, mode, calls = run.kind, run.ranks, run.mode, run.calls
    address, print_s = run.address, run.print_s
    import logging

    import ray

    job = JOBS[mode]
    ours = kind in ("ours", "direct")
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=not ours)
    started = time.perf_counter()
    if ours:
        from orchestrator import distribute
        from orchestrator_workers import handoff

        if kind == "direct":
            os.environ[handoff.SWITCH] = "0"

        fn = distribute(
            job,
            num_replicas=ranks,
            replicas_per_node=PER_NODE,
            cpus_per_replica=1,
            gpus_per_replica=0,
            log_dir=False,
        )
        call: Callable[[int], list[Any]] = fn
        first = call(0)
    else:
        floor = _Floor(ranks, load_torch=mode == "gloo", fan_out=kind == "fanout")
        first = floor(job)

        def call(steps: int) -> list[Any]:
            return floor(job, steps)

    cold = time.perf_counter() - started
    wanted = list(range(ranks)) if mode == "rank" else [ranks * (ranks - 1) // 2] * ranks
    assert first == wanted, (first[:4], wanted[:4])
    walls, cpus, machine = [], [], []
    for _ in range(calls):
        cpu, wall, busy = time.process_time(), time.perf_counter(), _machine_busy_s()
        call(0)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        machine.append(_machine_busy_s() - busy)
    cpu = time.process_time()
    time.sleep(IDLE_S)  # what Ray's own threads in this driver use with nothing to do
    idle_cpu_frac = (time.process_time() - cpu) / IDLE_S
    pids = fn.pids() if ours else floor.pids()
    rank_pss = [_pss_mb(pid, with_children=True) for pid in pids]
    steps = int(print_s * PRINT_HZ)
    cpu, wall = time.process_time(), time.perf_counter()
    call(steps)
    if not ours:
        time.sleep(1.0)  # Ray's log monitor forwards lines up to a moment later
    print_wall = time.perf_counter() - wall
    print_cpu = time.process_time() - cpu
    sys.stdout.flush()
    result = {
        "kind": kind,
        "cold_s": cold,
        "warm_s": walls,
        "cpu_s": cpus,
        "machine_cpu_s": machine,
        "idle_cpu_frac": idle_cpu_frac,
        "driver_uss_mb": _uss_mb(),
        "rank_pss_mb": statistics.median(rank_pss),
        "print_cpu_frac": print_cpu / print_wall,
        "print_lines_expected": steps * ranks,
    }
    if ours:
        fn.shutdown()
    else:
        floor.shutdown()
    return result


# ----------------------------------------------------------------------- the whole run


def _cluster(nodes: int, tmp: str) -> Any:
    os.environ["RAY_TMPDIR"] = tmp
    from ray.cluster_utils import Cluster

    args = {"num_cpus": PER_NODE, "object_store_memory": 96 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args=args)
    for _ in range(nodes - 1):
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    return cluster


def _run_driver(run: Run) -> dict:
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "ORCHESTRATOR_STATUS": "0"}
    proc = subprocess.run(
        run.argv(), env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    lines = proc.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{run.kind} driver failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = results[0]
    result["print_lines_seen"] = sum("Epoch 0, step" in line for line in lines)
    return result


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,32,64,128")
    parser.add_argument("--gloo-sizes", default="16,32,64")
    parser.add_argument("--calls", type=int, default=30, help="warm calls per driver")
    parser.add_argument("--quick", action="store_true", help="few calls, one driver each")
    parser.add_argument("--print-s", type=float, default=3.0, help="seconds of printing")
    parser.add_argument("--per-node", type=int, default=8, help="ranks per node")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="also ours with one Ray task per rank (ORCHESTRATOR_HANDOFF=0)",
    )
    parser.add_argument(
        "--no-fan-out",
        dest="fan_out",
        action="store_false",
        help="skip Ray's floor with a per-node fan-out",
    )
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PER_NODE  # noqa: PLW0603 - the drivers' processes get it on their command line
    PER_NODE = args.per_node
    if args.driver:
        run = Run(args.driver, args.address, args.ranks, args.mode, args.calls, args.print_s)
        measured = drive(run)
        print("RESULT " + json.dumps(measured), flush=True)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    gloo_sizes = {int(s) for s in args.gloo_sizes.split(",") if s}
    rows: list[dict] = []
    began = time.monotonic()
    for size in sizes:
        tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
        cluster = _cluster(size // PER_NODE, tmp)
        try:
            for mode in ("rank", "gloo"):
                if mode == "gloo" and size not in gloo_sizes:
                    continue
                repeats = 1 if args.quick else 2
                calls = args.calls if size < 128 else max(10, args.calls // 2)
                calls = 5 if args.quick else calls
                found: dict[str, list[dict]] = {"ours": [], "floor": []}
                for rep in range(repeats):
                    order = ("ours", "floor") if rep % 2 == 0 else ("floor", "ours")
                    for kind in order:
                        print(
                            f"[bench] {size} ranks, {mode}, {kind} (repeat {rep + 1})",
                            file=sys.stderr,
                            flush=True,
                        )
                        run = Run(kind, cluster.address, size, mode, calls, args.print_s)
                        found[kind].append(_run_driver(run))
                if mode == "rank" and args.direct:
                    print(f"[bench] {size} ranks, {mode}, direct", file=sys.stderr, flush=True)
                    run = Run("direct", cluster.address, size, mode, calls, args.print_s)
                    found["direct"] = [_run_driver(run)]
                if mode == "rank" and args.fan_out:
                    print(f"[bench] {size} ranks, {mode}, fanout", file=sys.stderr, flush=True)
                    run = Run("fanout", cluster.address, size, mode, calls, args.print_s)
                    found["fanout"] = [_run_driver(run)]
                rows.append({"size": size, "mode": mode, "calls": calls, **found})
        finally:
            cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
    _report(rows, time.monotonic() - began)


def _merge(results: list[dict]) -> dict[str, Any]:
    walls = [w for r in results for w in r["warm_s"]]
    cpus = [c for r in results for c in r["cpu_s"]]
    return {
        "cold": statistics.median(r["cold_s"] for r in results),
        "warm": statistics.median(walls),
        "p90": _p(walls, 0.9),
        "cpu": statistics.median(cpus),
        "machine": statistics.median(m for r in results for m in r["machine_cpu_s"]),
        "idle": statistics.median(r["idle_cpu_frac"] for r in results),
        "uss": statistics.median(r["driver_uss_mb"] for r in results),
        "pss": statistics.median(r["rank_pss_mb"] for r in results),
        "print": statistics.median(r["print_cpu_frac"] for r in results),
        "lines": f"{results[0]['print_lines_seen']}/{results[0]['print_lines_expected']}",
    }


def _report(rows: list[dict], took: float) -> None:
    print(
        f"\nbench_scale: {os.cpu_count()} cores; nodes of {PER_NODE} CPUs and a 96 MiB "
        "object store each, all on this machine; "
        f"{rows[0]['calls'] if rows else 0} warm calls per driver (fewer at 128)"
    )
    head = (
        "ranks",
        "nodes",
        "job",
        "cold ours",
        "cold floor",
        "x",
        "warm med ours",
        "warm med floor",
        "x",
        "p90 ours",
        "p90 floor",
        "drv CPU/call ours",
        "drv CPU/call floor",
        "drv USS ours/floor MB",
        "rank PSS ours/floor MB",
        "drv CPU printing ours/floor",
        "lines shown ours/floor",
    )
    print(" | ".join(head))
    merged = []
    for row in rows:
        ours, floor = _merge(row["ours"]), _merge(row["floor"])
        merged.append((row, ours, floor))
        print(
            " | ".join(
                [
                    str(row["size"]),
                    str(row["size"] // PER_NODE),
                    row["mode"],
                    f"{ours['cold']:.1f} s",
                    f"{floor['cold']:.1f} s",
                    f"{ours['cold'] / floor['cold']:.2f}",
                    f"{ours['warm'] * 1e3:.1f} ms",
                    f"{floor['warm'] * 1e3:.1f} ms",
                    f"{ours['warm'] / floor['warm']:.2f}",
                    f"{ours['p90'] * 1e3:.1f} ms",
                    f"{floor['p90'] * 1e3:.1f} ms",
                    f"{ours['cpu'] * 1e3:.1f} ms",
                    f"{floor['cpu'] * 1e3:.1f} ms",
                    f"{ours['uss']:.0f}/{floor['uss']:.0f}",
                    f"{ours['pss']:.0f}/{floor['pss']:.0f}",
                    f"{ours['print']:.0%}/{floor['print']:.0%}",
                    f"{ours['lines']} / {floor['lines']}",
                ]
            )
        )
    print(
        "\nWhere a warm call's time goes: every process's CPU per call (the machine's "
        f"{os.cpu_count()} cores), and the driver's CPU per call less what Ray's threads in "
        "it use idle (its idle rate x the call's wall time):"
    )
    print(
        "ranks | job | machine CPU/call ours / floor | drv idle CPU ours / floor | "
        "drv CPU/call less idle ours / floor"
    )
    for row, ours, floor in merged:
        own = [m["cpu"] - m["idle"] * m["warm"] for m in (ours, floor)]
        print(
            f"{row['size']} | {row['mode']} | {ours['machine'] * 1e3:.0f} / "
            f"{floor['machine'] * 1e3:.0f} ms | {ours['idle'] * 1e3:.1f} / "
            f"{floor['idle'] * 1e3:.1f} ms/s | {own[0] * 1e3:.1f} / {own[1] * 1e3:.1f} ms"
        )
    direct = [(row, _merge(row["direct"])) for row in rows if row.get("direct")]
    if direct:
        print("\nOurs with one Ray task per rank (ORCHESTRATOR_HANDOFF=0), rank-only job:")
        print(
            "ranks | nodes | warm med direct / hand-off / floor | drv CPU/call direct / "
            "hand-off / floor"
        )
        for row, alone in direct:
            ours, floor = _merge(row["ours"]), _merge(row["floor"])
            print(
                f"{row['size']} | {row['size'] // PER_NODE} | {alone['warm'] * 1e3:.1f} / "
                f"{ours['warm'] * 1e3:.1f} / {floor['warm'] * 1e3:.1f} ms | "
                f"{alone['cpu'] * 1e3:.1f} / {ours['cpu'] * 1e3:.1f} / "
                f"{floor['cpu'] * 1e3:.1f} ms"
            )
    fanned = [(row, _merge(row["fanout"])) for row in rows if row.get("fanout")]
    if fanned:
        print(
            "\nRay's floor with a per-node fan-out (the driver calls one actor per node, "
            f"which calls that node's {PER_NODE} ranks), rank-only job:"
        )
        print("ranks | nodes | warm med fan-out / direct floor | drv CPU/call fan-out / direct")
        for row, fan in fanned:
            direct = _merge(row["floor"])
            print(
                f"{row['size']} | {row['size'] // PER_NODE} | {fan['warm'] * 1e3:.1f} / "
                f"{direct['warm'] * 1e3:.1f} ms | {fan['cpu'] * 1e3:.1f} / "
                f"{direct['cpu'] * 1e3:.1f} ms"
            )
    _project([m for m in merged if m[0]["mode"] == "rank"])
    print(f"\n(run took {took / 60:.1f} min)")


def _project(merged: list[tuple[dict, dict, dict]]) -> None:
    """Least squares over the sizes (y = a + b*N), then N = 1,024 on 128 nodes."""
    if len(merged) < 2:
        return
    sizes = [row["size"] for row, _, _ in merged]
    print(f"\nProjection to 1,024 ranks on 128 nodes (rank-only job; a + b*N fitted over {sizes}):")
    for label, key, scale, unit in (
        ("cold", "cold", 1, "s"),
        ("warm median", "warm", 1e3, "ms"),
        ("driver CPU per warm call", "cpu", 1e3, "ms"),
    ):
        for who, index in (("ours", 1), ("floor", 2)):
            ys = [m[index][key] * scale for m in merged]
            b, a = _fit(sizes, ys)
            at = a + b * 1024
            print(f"  {label:26} {who:5}: {a:8.2f} + {b:8.4f}*N {unit} -> {at:9.1f} {unit}")


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return slope, mean_y - slope * mean_x


if __name__ == "__main__":
    main()
