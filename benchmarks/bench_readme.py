"""The README's example from a fresh process, against torchrun running the same training.

    python -m benchmarks.bench_readme [--runs 7] [--baseline-tree PATH]

`python examples/linear_ddp.py` (4 ranks, 2 per simulated node, on the embedded local Ray
the script starts and stops: the README's first command) against `torchrun --standalone
--nproc_per_node=4` running the same `train_loop(epochs=10)`; with `--baseline-tree`, that
checkout's example too. Fresh processes taking turns, the order rotating; each in its own
RAY_TMPDIR, with whatever it left stopped by pid. Prints one table: wall time to exit,
medians. Goal (issue 33): at most 1.2x torchrun.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.core.common import (
    PYTHON,
    RANKS,
    ROOT,
    clean_env,
    fresh_ray_tmpdir,
    launch,
    stop_leftovers,
    torchrun,
)


def _ours(root: Path) -> float:
    """The README's example from `root`'s tree: its wall time to exit."""
    with fresh_ray_tmpdir() as tmp:
        run = launch(
            [PYTHON, str(root / "examples" / "linear_ddp.py")], clean_env(tmp, root), cwd=root
        )
        left = stop_leftovers("RAY_TMPDIR", tmp)
    if run.returncode or left:
        raise RuntimeError(
            f"the example failed ({run.returncode}, left {left}):\n{run.output[-3000:]}"
        )
    return run.wall_s


def main() -> None:
    """Time the ways in turn, then print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per way (default 7)")
    parser.add_argument("--baseline-tree", type=Path, help="another checkout's example too")
    args = parser.parse_args()
    ways = {
        "distribute (this tree)": lambda: _ours(ROOT),
        "torchrun --standalone": lambda: torchrun("readme")[0].wall_s,
    }
    if args.baseline_tree:
        tree = args.baseline_tree.resolve()
        ways[f"distribute ({tree})"] = lambda: _ours(tree)
    walls: dict[str, list[float]] = {way: [] for way in ways}
    names = list(ways)
    for i in range(args.runs):
        for way in names[i % len(names) :] + names[: i % len(names)]:
            walls[way].append(ways[way]())
            print(f"  [bench] run {i + 1}/{args.runs}: {way} {walls[way][-1]:.2f} s", flush=True)
    theirs = statistics.median(walls["torchrun --standalone"])
    print(f"\nThe README's example, {RANKS} ranks, from a fresh process (median of {args.runs})")
    print(f"  {'way':<44}{'wall to exit':>14}{'min..max':>16}{'x torchrun':>12}")
    for way, times in walls.items():
        median = statistics.median(times)
        spread = f"{min(times):.2f}..{max(times):.2f} s"
        print(f"  {way:<44}{median:>12.2f} s{spread:>16}{median / theirs:>12.2f}")
    print("  goal: distribute at most 1.2x torchrun")


if __name__ == "__main__":
    main()
