"""A warm call from a driver that is no Ray node, beside plain Ray actors, as the laptop test
has it (tests/hosts.py); and from a node, through the cluster's address. Paired: this tree
against an older checkout, in one run.

    sudo python -m benchmarks.bench_laptop [--baseline-tree PATH] [--tree PATH]
        [--rounds 3] [--calls 60] [--ranks-on head|worker|both]

The machines are tests/hosts.py's: a Ray head and a worker node (`ray start`, 4 CPUs each,
token authentication, Ray's worker niceness left as it is: 15) in two network namespaces,
each node's Ray run by a venv that lacks this package (the driver ships its rank side, as
on the laptop test's bare nodes), and a laptop in a third namespace on the bridge, with its
own /tmp, /dev/shm and HOME. Round after round, one driver process per tree and way in:

  laptop (ray://)          on the laptop, through Ray Client (ray://HEAD:10001)
  node (cluster address)   in the head's namespace, through HEAD:6379

Each driver makes a 4-rank pool of a no-op on one node (--ranks-on: the head, which runs
Ray Client's server and the node-side driver, or the worker node; `both`: 2 ranks on each),
and 4 plain Ray actors, each on its rank's node, at the same niceness: the floor (one
actor per rank, each called once, all awaited). Then both ways alternate call by call,
--calls each after 3 warm-ups. The trees' order alternates from round to round. Each
tree runs from a copy of its orchestrator/ and workers/ (and this tree's benchmarks/) in
the laptop's project folder, so the laptop sees it too; each driver reports the file of
`orchestrator` it imported.

The table, per way in and tree: `ours`, `plain`: the median over rounds of the round
medians (ms per call); `ours / plain`: the median of the rounds' paired ratios, and their
min..max (the spread); and the load averages seen. Goal: ours at most 1.5x plain, both
ways in. Root only (it makes namespaces); everything made is removed, and Ray's address
file in /tmp/ray where a `ray start` wrote it there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WAYS_IN = ("laptop (ray://)", "node (cluster address)")
RANKS = 4
WARMUPS = 3
DRIVER_TIMEOUT_S = 600
TRIES = 3
"""A Ray Client session whose server fails to start (seen on a loaded machine) is tried
again, at most this often in all."""


def _noop() -> None:
    return None


def _drive(calls: int, node_ip: str | None) -> dict[str, Any]:
    """In a driver process (RAY_ADDRESS set): ours and plain actors on the node at `node_ip`
    (None: 2 ranks on each node), alternated call by call; each call's seconds, by way."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import orchestrator
    from orchestrator import distribute, testing

    ray.init(log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Plain:
        def call(self) -> None:
            return None

        def niceness(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

        def node(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

    if node_ip is None:
        place: dict[str, Any] = {"replicas_per_node": RANKS // 2}
    else:
        place = {"resources_per_replica": {f"node:{node_ip}": 0.001}}
    ours = distribute(_noop, num_replicas=RANKS, log_dir=False, name="laptop", **place)
    ours()
    pool = testing.pool(ours)
    assert pool is not None
    nodes = [info.node_id for info in pool.infos]
    actors = [  # each beside its rank of ours
        Plain.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in nodes
    ]
    ways: dict[str, Callable[[], object]] = {
        "plain": lambda: ray.get([a.call.remote() for a in actors]),
        "ours": ours,
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for call in ways.values():
            for _ in range(WARMUPS):
                call()
        for _ in range(calls):
            for way, call in ways.items():
                started = time.perf_counter()
                call()
                times[way].append(time.perf_counter() - started)
        niceness = {
            "ours": sorted({info.niceness for info in pool.infos}),
            "plain": sorted(set(ray.get([a.niceness.remote() for a in actors]))),
        }
        beside = ray.get([a.node.remote() for a in actors]) == nodes
    finally:
        ours.shutdown()
    return {
        "times": times,
        "imported": orchestrator.__file__,
        "through_client": bool(ray.util.client.ray.is_connected()),
        "nodes": len(set(nodes)),
        "beside": beside,
        "niceness": niceness,
    }


def _copy_tree(tree: Path, into: Path) -> None:
    """`tree`'s two sides and this tree's benchmarks, copied into `into` (a PYTHONPATH)."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(tree / "orchestrator", into / "orchestrator", ignore=skip)
    shutil.copytree(tree / "workers", into / "orchestrator_workers", ignore=skip)
    shutil.copytree(ROOT / "benchmarks", into / "benchmarks", ignore=skip)


def _bare_venv(folder: Path) -> Path:
    """A venv without pip that reaches this one's site-packages through a `.pth` file, whose
    own `.pth` files (the editable install's among them) are not read: our packages do not
    import there. Its Python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    ours = sysconfig.get_paths()
    (folder / "lib" / version / "site-packages" / "bench.pth").write_text(
        "".join(f"{p}\n" for p in sorted({ours["purelib"], ours["platlib"]}))
    )
    return folder / "bin" / "python"


def _driver(
    hosts: Any, folder: Path, tree: str, way_in: str, *, calls: int, node_ip: str | None
) -> dict:
    """Run `_drive` with `tree` (copied into `folder`) from `way_in`; what it found."""
    code = (
        "import json; from benchmarks.bench_laptop import _drive; "
        f"print('RESULT', json.dumps(_drive({calls}, {node_ip!r})))"
    )
    if way_in.startswith("laptop"):  # `folder` is /mnt there
        argv = hosts.laptop_argv([sys.executable, "-c", code], folder)
        env = hosts.laptop_env(PYTHONPATH=f"/mnt/{tree}")
    else:
        argv = hosts.argv([sys.executable, "-c", code], 0)
        env = {**hosts.env, "RAY_ADDRESS": hosts.address, "PYTHONPATH": str(folder / tree)}
    for _ in range(TRIES):
        proc = subprocess.run(
            argv,
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=DRIVER_TIMEOUT_S,
            check=False,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                found = dict(json.loads(line.removeprefix("RESULT ")))
                if not found["imported"].startswith((f"/mnt/{tree}/", str(folder / tree))):
                    raise RuntimeError(f"{tree}'s driver imported {found['imported']}")
                if not found["beside"] or found["nodes"] != (2 if node_ip is None else 1):
                    raise RuntimeError(f"{tree}'s ranks not where asked: {found}")
                return found
        if "Starting Ray client server failed" not in proc.stderr:
            break
        print(f"  ({tree}, {way_in}: Ray Client's server did not start; again)", flush=True)
    raise RuntimeError(
        f"the {tree} driver ({way_in}) failed:\n{proc.stderr[-4000:]}\n{hosts.ray_logs()}"
    )


def _table(rounds: list[dict[str, Any]], trees: list[str]) -> list[str]:
    lines = [
        f"  {'way in':<24}{'tree':<6}{'ours':>8}{'plain':>8}{'ours / plain':>14}"
        f"{'per round':>14}  goal"
    ]
    for way_in in WAYS_IN:
        for tree in trees:
            runs = [r for r in rounds if r["way_in"] == way_in and r["tree"] == tree]
            if not runs:
                continue
            ours = [statistics.median(r["times"]["ours"]) * 1000 for r in runs]
            plain = [statistics.median(r["times"]["plain"]) * 1000 for r in runs]
            ratios = [o / p for o, p in zip(ours, plain, strict=True)]
            lines.append(
                f"  {way_in:<24}{tree:<6}{statistics.median(ours):>8.2f}"
                f"{statistics.median(plain):>8.2f}{statistics.median(ratios):>13.2f}x"
                f"{min(ratios):>8.2f}..{max(ratios):.2f}  ours <= 1.5x"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Boot the hosts, alternate the drivers round by round, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the tree measured (new)")
    parser.add_argument("--baseline-tree", type=Path, help="a checkout to pair it with (old)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--ranks-on", choices=("head", "worker", "both"), default="head")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests import hosts as machines  # needs pytest: tests/hosts.py fails and skips with it

    trees = {"new": args.tree.resolve()}
    if args.baseline_tree is not None:
        trees["old"] = args.baseline_tree.resolve()
    work = Path(tempfile.mkdtemp(prefix="blp", dir="/tmp"))
    address_file_was = machines.RAY_ADDRESS_FILE.exists()
    rounds: list[dict[str, Any]] = []
    loads = [os.getloadavg()]
    try:
        python = _bare_venv(work / "bare")
        with machines.boot([python, python], repo_on_path=False) as hosts:
            folder = hosts.tmp / "laptop"
            for name, tree in trees.items():
                _copy_tree(tree, folder / name)
            node_ip = {"head": hosts.ips[0], "worker": hosts.ips[1]}.get(args.ranks_on)
            order = list(trees)
            for number in range(args.rounds):
                for name in order if number % 2 == 0 else order[::-1]:
                    for way_in in WAYS_IN:
                        found = _driver(
                            hosts, folder, name, way_in, calls=args.calls, node_ip=node_ip
                        )
                        rounds.append({**found, "tree": name, "way_in": way_in})
                        loads.append(os.getloadavg())
                        ratio = statistics.median(found["times"]["ours"]) / statistics.median(
                            found["times"]["plain"]
                        )
                        print(
                            f"  round {number + 1} {name} {way_in}: {ratio:.2f}x "
                            f"(niceness {found['niceness']}, load {loads[-1][0]:.2f})",
                            flush=True,
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not address_file_was and machines.RAY_ADDRESS_FILE.exists():
            machines.RAY_ADDRESS_FILE.unlink()
    print(
        f"\nA warm {RANKS}-rank no-op call against plain actors beside the ranks "
        f"({args.ranks_on}), medians of {args.calls} alternated calls, {args.rounds} rounds (ms)"
    )
    print("\n".join(_table(rounds, list(trees))))
    ones = [f"{load[0]:.2f}" for load in loads]
    print(f"  load average (1 min) before and after each driver: {' '.join(ones)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
