"""Paired A/B of the hot paths: this tree against an older checkout, in one run.

    python -m benchmarks.bench_hotpaths --baseline-tree /tmp/base-9738a12
    python -m benchmarks.bench_hotpaths --baseline-tree PATH [--rounds 4] [--calls 200]
        [--saves 20] [--no-16] [--quick]

What it measures, for each tree ("old": --baseline-tree, a checkout of an older commit;
"new": this working tree):

  warm no-op call    a live distributed no-op on 4 ranks (2 per node), then a detached one
                     (detach=True) on 4 ranks, then a live and a detached one on 16 ranks (8
                     per node; --no-16 leaves them out): a few warm-ups, then --calls calls
                     timed one by one from the driver. One child process per tree and round
                     starts a ray.cluster_utils.Cluster of 2 simulated nodes (its own
                     RAY_TMPDIR; the ranks at niceness 0, as on the embedded instance), makes
                     the four pools one after another, and stops it.
  snapshot.save      orchestrator_workers.snapshot.save through a real keeper: 2 ranks in 2
                     processes on 2 simulated nodes (gloo, each the other's buddy), states
                     of 1 KB and 16 MB; after 3 warm-up saves, --saves saves of each size,
                     each timed on rank 0 after a barrier. Two fresh processes per tree and
                     round.

Each round runs both trees, the order alternating (old new, new old, old new, ...), every
measurement in fresh processes, so the trees never share one. A tree's processes run in a
temporary folder whose links `orchestrator` and `orchestrator_workers` point at that tree's
orchestrator/ and workers/ (and `benchmarks` at this tree's), that folder the working
directory and first on PYTHONPATH (Ray puts the driver's working directory first on its
workers' path too); each child reports the file of orchestrator and orchestrator_workers it
imported, in the driver and in every rank of each pool (or the saving ranks), and the run
stops if one is not under its tree.

The table: one row per measurement; `old`, `new`: the median over rounds of each round's
median (ms per call or per save); `old min..max`, `new min..max`: the spread of those round
medians; `new/old`: the ratio of the two medians; `per round`: min..max of the ratio within
each round (the paired ratio). Below 1: the new tree is faster.

A default run (4 rounds) takes about 7 minutes on 2 quiet cores, about 10 on busy ones (a
calls child 40 to 65 s, a save pair about 10 s); --quick (2 rounds, 50 calls, 10 saves, no
16 ranks) about 2 minutes, 3 on busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_core import render
from benchmarks.core.common import (
    PYTHON,
    ROOT,
    Table,
    clean_env,
    fresh_ray_tmpdir,
    stop_leftovers,
    timed_calls,
)

SIZES = {"1 KB": 1 << 10, "16 MB": 16 << 20}
"""State sizes a save is timed at."""
WARMUPS = 3
"""Calls (and saves) made before timing starts."""


def _noop(report: bool = False) -> str | None:
    """Nothing; with `report`, the file of orchestrator_workers this rank imported."""
    if report:
        return os.path.realpath(sys.modules["orchestrator_workers"].__file__ or "")
    return None


def _imported() -> list[str]:
    """The files of orchestrator and orchestrator_workers this process imported."""
    import orchestrator
    import orchestrator_workers

    return [os.path.realpath(m.__file__ or "") for m in (orchestrator, orchestrator_workers)]


# --------------------------------------------------------------------------- children


def _wait_cpus(total: float, timeout: float = 60) -> None:
    """Wait until the cluster has `total` CPUs, all free (a shut pool's actors gone)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= total:
            return
        time.sleep(0.05)
    raise TimeoutError(f"cluster CPUs not all free after {timeout} s: {ray.available_resources()}")


def calls_child(calls: int, big: bool, result: Path) -> None:
    """Warm no-op calls: live and detached at 4 ranks, and at 16 (when `big`); JSON out."""
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator import distribute

    ways = [("live", 4, False), ("detached", 4, True)]
    ways += [("live", 16, False), ("detached", 16, True)] if big else []
    per_node = max(ranks for _, ranks, _ in ways) // 2
    node_args = {"num_cpus": per_node, "object_store_memory": 200 << 20}
    # the ranks at the driver's niceness, as on the embedded instance and the local runtime
    # (Ray's default, 15, starves them whenever anything else runs on the machine)
    os.environ.setdefault("RAY_worker_niceness", "0")
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    out: dict[str, Any] = {"driver": _imported(), "ranks": {}, "times": {}}
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        os.environ["RAY_ADDRESS"] = cluster.address  # a detached job's Ray, found again
        for way, ranks, detach in ways:
            label = f"warm no-op call, {ranks} ranks, {way}"
            _wait_cpus(2 * per_node)
            fn = distribute(
                _noop,
                num_replicas=ranks,
                replicas_per_node=ranks // 2,
                log_dir=False,
                name=f"{way}{ranks}",
                detach=detach,
            )
            try:
                out["ranks"][label] = sorted(set(fn(True)))
                for _ in range(WARMUPS):
                    fn()
                out["times"][label] = timed_calls(fn, calls)
            finally:
                fn.shutdown()
            print(
                f"[bench] {label}: {1e3 * statistics.median(out['times'][label]):.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        ray.shutdown()
        cluster.shutdown()
    result.write_text(json.dumps(out))


def save_rank(rank: int, store: str, saves: int, result: Path) -> None:
    """One of 2 ranks saving snapshots through the other's keeper; rank 0 writes JSON."""
    import torch
    import torch.distributed as dist

    from orchestrator_workers import snapshot

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    snapshot.enter(rank, 2, restart_count=0, secret=b"s" * 32, host="127.0.0.1", node=f"n{rank}")
    times: dict[str, list[float]] = {}
    step = 0
    for label, size in SIZES.items():
        state = {"w": torch.zeros(max(size // 4, 1))}
        times[label] = []
        for i in range(WARMUPS + saves):
            dist.barrier()
            started = time.perf_counter()
            snapshot.save(step, state)
            if i >= WARMUPS:
                times[label].append(time.perf_counter() - started)
            step += 1
    dist.barrier()
    snapshot.leave()
    if rank == 0:
        files = [*_imported(), os.path.realpath(snapshot.__file__ or "")]
        result.write_text(json.dumps({"driver": files, "ranks": {}, "times": times}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent


@contextlib.contextmanager
def tree_folder(tree: Path) -> Any:
    """A temporary folder whose orchestrator, orchestrator_workers and benchmarks are
    `tree`'s two sides and this tree's benchmarks (links; the targets are left alone)."""
    folder = Path(tempfile.mkdtemp(prefix="bhp-"))
    try:
        (folder / "orchestrator").symlink_to(tree / "orchestrator", target_is_directory=True)
        (folder / "orchestrator_workers").symlink_to(tree / "workers", target_is_directory=True)
        (folder / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(argvs: list[list[str]], folder: Path, timeout: float) -> dict[str, Any]:
    """Run the children `argvs` (each with `--result FILE` appended; the first writes it) in
    `folder`'s tree and a fresh RAY_TMPDIR; what it wrote. Raises on a failure."""
    with fresh_ray_tmpdir() as tmp:
        env = clean_env(tmp)
        # only `folder` of ours on the path: this tree's root would offer its orchestrator
        env["PYTHONPATH"] = os.pathsep.join(
            [str(folder), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        ).rstrip(os.pathsep)
        result = Path(tmp) / "result.json"
        logs = [Path(tmp) / f"log{i}.txt" for i in range(len(argvs))]
        procs = []
        for argv, log in zip(argvs, logs, strict=True):
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [PYTHON, "-m", "benchmarks.bench_hotpaths", *argv, "--result", str(result)],
                        cwd=folder,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            left = stop_leftovers("RAY_TMPDIR", tmp)
        text = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
        if any(p.returncode for p in procs) or not result.exists():
            raise RuntimeError(f"{argvs[0][:2]} failed ({[p.returncode for p in procs]}):\n{text}")
        if left:
            print(f"  [bench] stopped, left behind: {', '.join(left)}", file=sys.stderr)
        return json.loads(result.read_text())  # type: ignore[no-any-return]


def _check(got: dict[str, Any], tree: Path, other: Path) -> int:
    """Every file the child and its ranks imported is `tree`'s, not `other`'s (which may lie
    inside it), or raise; how many were checked."""
    files = list(got["driver"]) + [f for fs in got["ranks"].values() for f in fs]
    inside = other.is_relative_to(tree)
    wrong = [
        f
        for f in files
        if not Path(f).is_relative_to(tree) or (inside and Path(f).is_relative_to(other))
    ]
    if wrong or not files:
        raise RuntimeError(f"a child of {tree} imported another tree's code: {wrong or files}")
    return len(files)


def _fmt(values: list[float]) -> str:
    return f"{1e3 * min(values):.2f}..{1e3 * max(values):.2f}"


def report(title: str, medians: dict[str, dict[str, list[float]]]) -> Table:
    """The table: per measurement, each tree's median of round medians, spread, ratio."""
    headers = ["measurement (ms)", "old", "old min..max", "new", "new min..max", "new/old"]
    table = Table(title, [*headers, "per round"])
    for label, by_tree in medians.items():
        old, new = by_tree["old"], by_tree["new"]
        ratios = [n / o for o, n in zip(old, new, strict=True)]
        table.rows.append(
            [
                label,
                f"{1e3 * statistics.median(old):.2f}",
                _fmt(old),
                f"{1e3 * statistics.median(new):.2f}",
                _fmt(new),
                f"{statistics.median(new) / statistics.median(old):.3f}",
                f"{min(ratios):.2f}..{max(ratios):.2f}",
            ]
        )
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of an older commit")
    parser.add_argument("--rounds", type=int, help="rounds, each tree once (default 4)")
    parser.add_argument("--calls", type=int, help="warm calls timed per pool (default 200)")
    parser.add_argument("--saves", type=int, help="saves timed per size (default 20)")
    parser.add_argument("--no-16", dest="big", action="store_false", help="skip 16 ranks")
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds, 50 calls, 10 saves, no 16 ranks"
    )
    parser.add_argument("--child", choices=("calls", "save"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = {"rounds": 2, "calls": 50, "saves": 10} if args.quick else {}
    for name, default in (("rounds", 4), ("calls", 200), ("saves", 20)):
        if getattr(args, name) is None:
            setattr(args, name, quick.get(name, default))
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1")
    args.big = args.big and not args.quick
    if args.child is None:
        tree = args.baseline_tree
        if tree is None:
            parser.error("--baseline-tree is required: a checkout of the commit to compare with")
        if not (
            (tree / "orchestrator" / "__init__.py").is_file()
            and (tree / "workers" / "snapshot.py").is_file()
        ):
            parser.error(
                f"--baseline-tree={tree}: no orchestrator/ and workers/snapshot.py "
                "there; give a checkout of this repository, e.g. `git worktree add "
                "/tmp/old HEAD~1`"
            )
        args.baseline_tree = tree.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, then print the table."""
    args = parse_args(argv)
    if args.child == "calls":
        calls_child(args.calls, args.big, args.result)
        return 0
    if args.child == "save":
        save_rank(args.rank, args.store, args.saves, args.result)
        return 0
    trees = {"old": args.baseline_tree, "new": ROOT}
    other = {"old": "new", "new": "old"}
    medians: dict[str, dict[str, list[float]]] = {}
    checked = {"old": 0, "new": 0}
    started = time.perf_counter()
    print(
        f"bench_hotpaths: old {trees['old']}, new {trees['new']}; {args.rounds} rounds, "
        f"{args.calls} calls, {args.saves} saves{' (quick)' if args.quick else ''}; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    calls = ["--child", "calls", "--calls", str(args.calls), *([] if args.big else ["--no-16"])]
    with tree_folder(trees["old"]) as old_folder, tree_folder(ROOT) as new_folder:
        folders = {"old": old_folder, "new": new_folder}
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for kind in ("calls", "save"):
                for name in order:
                    t0 = time.perf_counter()
                    if kind == "calls":
                        got = _run([calls], folders[name], timeout=600)
                    else:
                        store = Path(tempfile.mkdtemp(prefix="bhs-")) / "store"
                        try:
                            got = _run(
                                [
                                    [
                                        "--child",
                                        "save",
                                        "--saves",
                                        str(args.saves),
                                        "--rank",
                                        str(rank),
                                        "--store",
                                        str(store),
                                    ]
                                    for rank in (0, 1)
                                ],
                                folders[name],
                                timeout=300,
                            )
                        finally:
                            shutil.rmtree(store.parent, ignore_errors=True)
                    checked[name] += _check(got, trees[name], trees[other[name]])
                    for label, times in got["times"].items():
                        key = label if kind == "calls" else f"snapshot.save, {label}"
                        medians.setdefault(key, {"old": [], "new": []})[name].append(
                            statistics.median(times)
                        )
                    print(
                        f"  [bench] round {r + 1}/{args.rounds} {kind} {name}: "
                        f"{time.perf_counter() - t0:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    title = (
        f"Hot paths, old {trees['old']} vs new {trees['new']}: median of {args.rounds} round "
        f"medians ({args.calls} warm calls, {args.saves} saves per size each)"
    )
    table = report(title, medians)
    table.notes += [
        f"run time {time.perf_counter() - started:.0f} s; load average now "
        f"{os.getloadavg()[0]:.2f} (only comparable on a quiet machine)",
        f"imports checked: {checked['old']} files of old (drivers, ranks, saving ranks) all "
        f"under {trees['old']}, {checked['new']} of new all under {trees['new']}",
    ]
    print(f"\n{render(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
