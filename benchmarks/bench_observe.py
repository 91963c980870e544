"""What watching a job costs its ranks: CPU seconds per rank-minute with sampling on
(`stall_after=60`, the default) against off (`stall_after=None`), in this tree and in an
older checkout (the defaults before this round), paired in one run.

    python -m benchmarks.bench_observe [--baseline-tree PATH] [--rounds 3] [--seconds 30]

Each round, for each tree (alternating which goes first) and each setting, a driver
process makes a 4-rank pool (2 nodes x 2, simulated on this machine) and runs a training
loop for --seconds: an optimizer step on a small model every 50 ms, as a real loop's
step boundary is seen, with nothing else to do. The ranks' processes' CPU (utime + stime
from /proc, every thread) is read before and after the call. The table: per tree and
setting, the median over rounds of CPU seconds per rank-minute, and watching's cost (on
minus off) as a share of a core per rank. Goal (issue 57): at most 0.5% of a core a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
SETTINGS = {"on": 60.0, "off": None}


def loop(seconds: float) -> int:
    """A rank's training loop: a step every 50 ms for `seconds`."""
    import time

    import torch

    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        optimizer.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        steps += 1
        time.sleep(0.05)
    return steps


def _cpu_s(pid: int) -> float:
    """CPU seconds process `pid` used so far (every thread)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(seconds: float, stall_after: float | None) -> dict[str, float | str]:
    """In a driver process: one call of `loop` on 4 ranks; their CPU per rank-minute, and
    which `orchestrator` it imported."""
    import time

    import orchestrator
    from orchestrator import distribute, testing

    fn = distribute(
        loop,
        num_replicas=RANKS,
        replicas_per_node=2,
        stall_after=stall_after,
        log_dir=False,
        name="observe",
    )
    with fn:
        fn(0.2)  # the pool made, torch imported
        pool = testing.pool(fn)
        assert pool is not None
        pids = pool.pids()
        before = sum(_cpu_s(pid) for pid in pids)
        started = time.monotonic()
        fn(seconds)
        minutes = (time.monotonic() - started) / 60
        used = sum(_cpu_s(pid) for pid in pids) - before
    return {"cpu_per_rank_minute": used / RANKS / minutes, "imported": orchestrator.__file__}


def _run(tree: Path, seconds: float, setting: str) -> float:
    """`drive` with `tree`'s packages in a fresh process."""
    code = (
        "import json, sys; from benchmarks.bench_observe import drive; "
        f"print('RESULT', json.dumps(drive({seconds}, {SETTINGS[setting]!r})))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PYTHONPATH"] = f"{tree}:{ROOT}"
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="bo", dir="/tmp")
    env["HOME"] = tempfile.mkdtemp(prefix="boh", dir="/tmp")  # no local runtime found: its own Ray
    env["ORCHESTRATOR_DASHBOARD"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds * 4 + 300,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            found = json.loads(line.removeprefix("RESULT "))
            if not str(found["imported"]).startswith(str(tree)):
                raise RuntimeError(f"{tree}'s driver imported {found['imported']}")
            return float(found["cpu_per_rank_minute"])
    raise RuntimeError(f"{tree} ({setting}) failed:\n{proc.stderr[-3000:]}")


def _tree_copy(tree: Path, into: Path) -> Path:
    """`tree`'s two packages under `into`, importable by their names."""
    (into / "orchestrator").symlink_to(tree / "orchestrator")
    (into / "orchestrator_workers").symlink_to(tree / "workers")
    return into


def main() -> None:
    """Alternate trees and settings round by round; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bob", dir="/tmp"))
    trees = {"new": ROOT}
    if args.baseline_tree is not None:
        (work / "old").mkdir()
        trees["old"] = _tree_copy(args.baseline_tree.resolve(), work / "old")
    found: dict[tuple[str, str], list[float]] = {}
    for number in range(args.rounds):
        order = list(trees) if number % 2 == 0 else list(trees)[::-1]
        for name in order:
            for setting in SETTINGS if number % 2 == 0 else list(SETTINGS)[::-1]:
                value = _run(trees[name], args.seconds, setting)
                found.setdefault((name, setting), []).append(value)
                load = os.getloadavg()[0]
                print(f"  round {number + 1} {name} {setting}: {value:.3f} (load {load:.1f})")
    print(
        f"\nCPU seconds per rank-minute ({RANKS} ranks, a step every 50 ms, {args.rounds} rounds)"
    )
    print(f"  {'tree':<6}{'on':>8}{'off':>8}{'cost (% of a core a rank)':>28}")
    for name in trees:
        on = statistics.median(found[(name, "on")])
        off = statistics.median(found[(name, "off")])
        costs = [
            (a - b) / 60 * 100
            for a, b in zip(found[(name, "on")], found[(name, "off")], strict=True)
        ]
        spread = f"{min(costs):.2f}..{max(costs):.2f}"
        print(f"  {name:<6}{on:>8.3f}{off:>8.3f}{statistics.median(costs):>14.2f} ({spread})")
    print("  goal: watching costs at most 0.5% of a core a rank")


if __name__ == "__main__":
    main()
