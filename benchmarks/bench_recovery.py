"""Recovery from a lost rank, three ways side by side in one run: in-memory snapshots
(orchestrator.snapshot), the same loop with torch.save to local disk every K steps (the
page cache dropped before the reload), and torchrun --max-restarts=1 with that disk
checkpoint.

    python -m benchmarks.bench_recovery [--repeats 3] [--overhead-repeats 7] [--quick]
        [--modes memory,spare,dcp,disk,torchrun] [--sizes 4x1024,16x100,4x256]

Recovery: gloo on CPU, Adam on one flat parameter (params + moments = the state size),
a snapshot or checkpoint every K=5 steps; on attempt 0 one rank (on the second node)
SIGKILLs itself at step 12, so the newest snapshot is step 9's and 2 steps are redone.
distribute() runs on simulated nodes (ray.cluster_utils.Cluster); torchrun on this
machine alone (it has no nodes to lose). Reported: from the kill to every rank's first
completed step after recovery, median of --repeats, and where that time goes.

Each of ours runs on a warm pool (a first call of one step) that keeps no warm spare, but
"spare": (a) with one warm spare a node (orchestrator.standby), ready before the kill, so
the killed rank is replaced by a process that has imported torch; the others by a new one.

(a') is (a) through torch.distributed.checkpoint: dcp.save with snapshot.writer, dcp.load
with snapshot.reader (what an FSDP2 loop uses), on the same flat state.

Overhead: 4 ranks on 2 nodes, 100 steps, a snapshot (or a disk checkpoint) every 50, on
against off, alternating, --overhead-repeats each; steps/s of the slowest rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from benchmarks._recovery_job import train
from orchestrator import distribute, testing

ROOT = Path(__file__).resolve().parent.parent
EVERY, KILL_STEP = 5, 12
CONFIGS = {"4x1024": (4, 2, 1024), "16x100": (16, 4, 100), "4x256": (4, 2, 256)}
"""By name: (ranks, nodes, state MB per rank)."""
LABELS = {
    "memory": "(a) in-memory snapshot",
    "spare": "(a) + a warm spare a node",
    "dcp": "(a') the same, through dcp",
    "disk": "(b) distribute + disk checkpoint",
    "torchrun": "(c) torchrun + disk checkpoint",
}


@contextlib.contextmanager
def cluster(nodes: int, cpus: int) -> Iterator[None]:
    """`nodes` simulated nodes of `cpus` CPUs each, this process their driver."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=cpus)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        c.shutdown()


def ours(out: Path, ranks: int, nodes: int, mb: int, mode: str) -> dict[str, float]:
    """One kill and recovery through distribute(max_restarts=1), on a warm pool (mode
    "spare": one whose warm spares are ready; the others keep none)."""
    fn = distribute(
        train,
        num_replicas=ranks,
        replicas_per_node=ranks // nodes,
        gpus_per_replica=0,
        max_restarts=1,
        spares_per_node=1 if mode == "spare" else 0,
        log_dir=False,
        log_ranks=[],
        name=f"recover-{mode}",
    )
    kept = "memory" if mode == "spare" else mode
    with fn:
        warm = out / "warm"
        warm.mkdir()
        fn(str(warm), 1, 1, EVERY, "none", -1, -1)
        pool = testing.pool(fn)
        while pool is not None and len(pool.standby.pids()) < pool.standby.per_node * nodes:
            time.sleep(0.1)
        fn(str(out), mb, KILL_STEP + 3, EVERY, kept, KILL_STEP, ranks // nodes)
    return _timings(out)


def torchrun(out: Path, ranks: int, mb: int) -> dict[str, float]:
    """One kill and recovery under torchrun --max-restarts=1, from the disk checkpoint."""
    argv = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc_per_node={ranks}",
        "--max-restarts=1",
        "-m",
        "benchmarks._recovery_job",
        str(out),
        str(mb),
        str(KILL_STEP + 3),
        str(EVERY),
        "disk",
        str(KILL_STEP),
        str(ranks // 2),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return _timings(out)


def _timings(out: Path) -> dict[str, float]:
    killed = float((out / "killed").read_text())
    ranks = [json.loads(p.read_text()) for p in out.glob("resumed-*")]
    started = max(r["started"] for r in ranks)
    built = max(r["built"] for r in ranks)
    restored = max(r["restored"] for r in ranks)
    first = max(r["first_step"] for r in ranks)
    return {
        "total": first - killed,
        "restart": started - killed,
        "setup": built - started,
        "restore": restored - built,
        "first step": first - restored,
        "redone": KILL_STEP - min(r["first"] for r in ranks),
    }


def overhead(out: Path, mode: str, steps: int) -> float:
    """Steps/s of the slowest of 4 ranks on 2 nodes, 100 MB, a snapshot every 50 steps."""
    fn = distribute(
        train,
        num_replicas=4,
        replicas_per_node=2,
        gpus_per_replica=0,
        log_dir=False,
        log_ranks=[],
        name=f"overhead-{mode}",
    )
    with fn:
        rates = fn(str(out), 100, steps, 50, mode, -1, -1)
    return min(r["steps_per_s"] for r in rates)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    """Measure, then print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overhead-repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="100 MB and 4 ranks, 1 repeat")
    parser.add_argument("--modes", default=",".join(LABELS), help=f"a subset of {','.join(LABELS)}")
    parser.add_argument(
        "--sizes", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}"
    )
    args = parser.parse_args(argv)
    for given, known in ((args.modes, LABELS), (args.sizes, CONFIGS)):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            parser.error(f"{', '.join(sorted(unknown))}: not one of {', '.join(known)}")
    modes = [m for m in LABELS if m in args.modes.split(",")]
    ours_modes = [m for m in modes if m != "torchrun"]
    configs = [(4, 2, 100)] if args.quick else [CONFIGS[s] for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="rv", dir="/tmp"))  # short: Ray's sockets live here
    os.environ["RAY_TMPDIR"] = str(tmp)
    os.environ.pop("RAY_ADDRESS", None)
    rows: list[tuple[str, str, dict[str, float]]] = []
    try:
        for ranks, nodes, mb in configs:
            runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
            for i in range(repeats):
                with cluster(nodes, ranks // nodes):
                    for mode in ours_modes if i % 2 == 0 else ours_modes[::-1]:
                        out = tmp / f"{mode}-{ranks}-{i}"
                        out.mkdir()
                        runs[mode].append(ours(out, ranks, nodes, mb, mode))
                        shutil.rmtree(out)
                if "torchrun" in modes:
                    out = tmp / f"torchrun-{ranks}-{i}"
                    out.mkdir()
                    runs["torchrun"].append(torchrun(out, ranks, mb))
                    shutil.rmtree(out)
            for mode in modes:
                keys = runs[mode][0].keys()
                rows.append(
                    (
                        f"{ranks} ranks, {nodes} nodes, {mb} MB/rank",
                        LABELS[mode],
                        {k: _median([r[k] for r in runs[mode]]) for k in keys},
                    )
                )
        kept = ["none", *(m for m in ours_modes if m != "spare")]  # a spare costs no step
        rates: dict[str, list[float]] = {mode: [] for mode in kept}
        steps = 20 if args.quick else 100
        with cluster(2, 2):
            for i in range(1 if args.quick else args.overhead_repeats):
                for mode in kept if i % 2 == 0 else kept[::-1]:
                    out = tmp / f"overhead-{mode}-{i}"
                    out.mkdir()
                    rates[mode].append(overhead(out, mode, steps))
                    shutil.rmtree(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\nKill at step {KILL_STEP} -> every rank's first step after recovery "
        f"(snapshot or checkpoint every {EVERY} steps; median of {repeats})"
    )
    print(
        f"{'':<32}{'':<34}{'total':>8}{'restart':>9}{'setup':>9}{'restore':>9}"
        f"{'1st step':>9}{'redone':>8}"
    )
    for where, label, t in rows:
        print(
            f"{where:<32}{label:<34}{t['total']:>7.2f}s{t['restart']:>8.2f}s"
            f"{t['setup']:>8.2f}s{t['restore']:>8.2f}s{t['first step']:>8.2f}s"
            f"{t['redone']:>8.0f}"
        )
    base = _median(rates["none"])
    print(
        f"\nThroughput, 4 ranks on 2 nodes, 100 MB/rank, {steps} steps, every 50 "
        f"(median of {len(rates['none'])}; slowest rank's steps/s)"
    )
    for mode, runs_of in rates.items():
        value = _median(runs_of)
        print(
            f"  {mode:<8}{value:>8.2f} steps/s  cost {1 - value / base:>6.1%}  "
            f"runs {', '.join(f'{r:.2f}' for r in runs_of)}"
        )
    print(
        "goals: (a) under 5 s at 4 ranks with 1 GB and faster than (b) and (c); "
        f"redone <= {EVERY}; (a)'s cost <= 2%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
