"""What a job's numbers over time cost the driver (or a detached job's supervisor): the
memory of `observe.series.Series` fed 24 hours of synthetic readings at the real rate
(one per rank a second, a step a second, two reported scalars), at 16 and 128 ranks,
and the driver's time each reading costs.

    python -m benchmarks.bench_series [--ranks 16 128] [--hours 24]

Prints a table: ranks, hours fed, readings, the memory the series holds (the process's
resident memory after, less before, a full collection each), the stated bound
(`Series.bound_bytes`), and the median cost of one reading (us).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.observe.series import Series
from orchestrator_workers.protocol import NodeInfo
from orchestrator_workers.where import Where


def feed(ranks: int, hours: float) -> tuple[int, int, int, float]:
    """Readings fed, bytes held, the bound, median microseconds per reading."""
    start = time.time() - hours * 3600
    infos = node_infos(ranks)
    gc.collect()
    before = _rss()
    kept = Series()
    costs: list[float] = []
    readings = 0
    clock = start
    with mock.patch("orchestrator.observe.series.time.time", lambda: clock):
        for second in range(int(hours * 3600)):
            clock = start + second
            for rank in range(ranks):
                record = reading(rank, second, clock)
                began = time.perf_counter()
                kept.add(rank, infos[rank], record, "c")
                if second % 600 == 0:
                    costs.append(time.perf_counter() - began)
                readings += 1
    gc.collect()
    held = _rss() - before
    del kept
    return readings, held, Series().bound_bytes(ranks), statistics.median(costs) * 1e6


def node_infos(ranks: int) -> list[NodeInfo]:
    """Where each of `ranks` ranks runs: nodes of 8."""
    return [
        NodeInfo(f"n{r // 8}", f"10.0.{r // 8}.1", "h", 1000 + r, (), None) for r in range(ranks)
    ]


def reading(rank: int, second: int, clock: float) -> Where:
    """Rank `rank`'s record at `second` of the run (wall clock `clock`): a step a second
    since the start, two reported scalars, 32 samples a step."""
    return Where(
        rank=-1,
        frames=(),
        running=True,
        still_s=0.0,
        age_s=0.0,
        call="c",
        steps=second + 1,
        recent_steps=((second + 1, clock, 1.0 + rank / 1000),),
        process_cpu=1.0,
        rss_mb=2000.0 + second / 3600,
        gpu_mb=30_000.0,
        gpu_busy=90,
        scalars={"loss": 1.0 / (second + 1), "lr": 0.001},
        reported_at=clock,
        samples_total=32.0 * (second + 1),
        sampled=clock,
    )


ROW = "{:>6} {:>6} {:>11} {:>9} {:>9} {:>11}"


def _rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    """Feed each size, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args()
    head = ("ranks", "hours", "readings", "held MB", "bound MB", "us/reading")
    print(ROW.format(*head))
    for ranks in args.ranks:
        readings, held, bound, cost = feed(ranks, args.hours)
        row = (ranks, f"{args.hours:g}", readings, f"{held / 1e6:.1f}", f"{bound / 1e6:.1f}")
        print(ROW.format(*row, f"{cost:.1f}"), flush=True)


if __name__ == "__main__":
    main()
