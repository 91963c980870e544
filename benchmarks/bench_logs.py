"""Per-rank output: latency from a rank's print to the driver's console, and throughput.

    python -m benchmarks.bench_logs [--lines 50000] [--ranks 4] [--samples 200]

Runs on the embedded local Ray (its own temp dir). Prints two tables.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from orchestrator import distribute


class _Stamped(io.TextIOBase):
    """Stands in for the driver's stdout: notes when each line arrives."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, str]] = []
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        now = time.time()
        for line in text.splitlines():
            self.lines.append(line)
            if " at " in line:
                self.arrivals.append((now, line))
        return len(text)

    def by_rank(self) -> dict[str, list[str]]:  # rank (as a string) -> its lines
        """Each rank's lines as shown, a line shown in pieces (cut short, then the rest)
        joined again: what the rank printed, if every byte was shown once, in order."""
        found: dict[str, list[str]] = {}
        for line in self.lines:
            prefix, _, text = line.partition("] ")
            shown = found.setdefault(prefix.rpartition(" r")[2], [])  # "[name r3": "3"
            if shown and not shown[-1].endswith(_FLOOD_END):  # the rest of a line cut short
                shown[-1] += text
            else:
                shown.append(text)
        return found

    def flush(self) -> None:
        pass


def _timed_prints(samples: int, gap_s: float) -> int:
    for i in range(samples):
        print(f"sample {i} at {time.time():.6f}", flush=True)
        time.sleep(gap_s)
    return samples


_FLOOD_END = " of a training log"


def _flood(lines: int) -> dict[str, float]:
    started = time.perf_counter()
    for i in range(lines):
        print(f"rank {os.environ['RANK']} line {i}{_FLOOD_END}")
    sys.stdout.flush()
    captured = time.perf_counter() - started
    with open(os.devnull, "w") as devnull:
        started = time.perf_counter()
        for i in range(lines):
            print(f"rank {os.environ['RANK']} line {i} of a training log", file=devnull)
        devnull.flush()
    return {"captured": captured, "devnull": time.perf_counter() - started}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    os.environ.pop("RAY_ADDRESS", None)

    with distribute(_timed_prints, num_replicas=args.ranks, log_dir=False) as fn:
        fn(1, 0)  # warm the pool
        real_stdout, sink = sys.stdout, _Stamped()
        sys.stdout = sink
        try:
            fn(args.samples, 0.02)  # low rate: 50 lines/s per rank
        finally:
            sys.stdout = real_stdout
        latencies = [
            (arrived - float(line.rsplit(" at ", 1)[1])) * 1000 for arrived, line in sink.arrivals
        ]
    print(
        f"\nLatency, print(flush=True) on a rank -> line on the driver ({args.ranks} ranks, "
        f"{len(latencies)} lines at 50 lines/s per rank)"
    )
    print(f"  p50 {_percentile(latencies, 0.5):7.2f} ms   (target < 20 ms)")
    print(f"  p99 {_percentile(latencies, 0.99):7.2f} ms   (target < 100 ms)")
    print(f"  max {max(latencies):7.2f} ms")

    with distribute(_flood, num_replicas=args.ranks, log_dir=False) as fn:
        fn(10)
        real_stdout, sink = sys.stdout, _Stamped()
        sys.stdout = sink
        started = time.perf_counter()
        try:
            result: list[dict[str, Any]] = fn(args.lines)
        finally:
            sys.stdout = real_stdout
        wall = time.perf_counter() - started
    expected = args.ranks * args.lines
    shown = sink.by_rank()
    once = all(
        shown.get(str(rank)) == [f"rank {rank} line {i}{_FLOOD_END}" for i in range(args.lines)]
        for rank in range(args.ranks)
    )
    pieces = len(sink.lines) - sum(len(lines) for lines in shown.values())
    slowdown = statistics.median(r["captured"] / r["devnull"] for r in result)
    print(f"\nThroughput, {args.ranks} ranks x {args.lines} lines as fast as they can")
    verdict = "every line once, in order" if once else "MISSING, TWICE OR OUT OF ORDER"
    print(f"  delivered      {expected} lines: {verdict} ({pieces} shown cut short, then the rest)")
    print(f"  lines/s        {expected / wall:,.0f} (call wall {wall:.2f} s)")
    print(
        f"  rank slowdown  {slowdown:.2f}x printing to the captured stdout vs /dev/null "
        f"(median over ranks; {statistics.median(r['captured'] for r in result):.2f} s "
        f"vs {statistics.median(r['devnull'] for r in result):.2f} s)"
    )
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
