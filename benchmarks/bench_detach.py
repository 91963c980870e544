"""Detached jobs (issue 36): the warm call beside a live one, getting a job back, `orchestrator
logs` into a pipe, the output latency while a driver follows, and listing a sweep's kept jobs.

    python -m benchmarks.bench_detach [--repeats 40] [--lines 100000] [--kept 1000] [--block 10]

Starts its own cluster (`ray.cluster_utils.Cluster`, one head of 40 logical CPUs: a live and
a detached 16-rank pool side by side; its own temp dir).
Prints one table. Goals: a detached warm call costs at most one extra Ray round trip at 4
ranks (about 2 ms here) and at most 1.2x at 16 (the detached warm call is the issue's
"direct mode" since session 31; beside it, session 28's floor of that mode: a live call
plus the least its supervisor's watching would cost); a 16-rank
job that printed 100,000 lines is got back (table and newest 1,000 lines shown) in under
1 s, and `orchestrator logs` pipes all of it in under 2 s; a followed job's lines arrive
with p50 <= 20 ms, p99 <= 100 ms.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_logs import _percentile, _timed_prints

ROOT = Path(__file__).resolve().parent.parent


WAYS = ("live", "detached", "direct floor")
"""The warm call's ways, in the table's order."""


def _noop() -> None:
    return None


def _print_then_wait(lines: int, go: str) -> int:
    """Print `lines` numbered lines, say so in a file, then wait until the file `go` exists."""
    rank = os.environ["RANK"]
    for i in range(lines):
        print(f"rank {rank} line {i} of a training log")
    sys.stdout.flush()
    Path(f"{go}.printed.{rank}").touch()
    while not os.path.exists(go):
        time.sleep(0.05)
    return lines


class _Counter(io.TextIOBase):
    """Stands in for stdout: counts lines, notes when the n-th came, and sample latencies."""

    def __init__(self, wanted: int = 0) -> None:
        self.lines = 0
        self.wanted = wanted
        self.reached: float | None = None
        self.latencies: list[float] = []

    def write(self, text: str) -> int:
        now = time.time()
        for line in text.splitlines():
            self.lines += 1
            if " at " in line:
                self.latencies.append((now - float(line.rsplit(" at ", 1)[1])) * 1000)
        if self.reached is None and self.wanted and self.lines >= self.wanted:
            self.reached = time.perf_counter()
        return len(text)

    def flush(self) -> None:
        pass


def _warm_calls(ranks: int, repeats: int, block: int) -> dict[str, list[float]]:
    """Warm no-op calls, live, detached, and the floor of the issue's direct mode,
    alternated in blocks; each one's seconds, by way."""
    import ray

    from orchestrator import distribute

    live = distribute(_noop, num_replicas=ranks, log_dir=False, name=f"live{ranks}")
    detached = distribute(
        _noop, num_replicas=ranks, log_dir=False, name=f"detached{ranks}", detach=True
    )
    stand_in = ray.remote(num_cpus=0)(_StandIn).remote()
    watcher = ray.remote(num_cpus=0, max_concurrency=64)(_Watcher).remote(stand_in)
    told = pickle.dumps(("a job's record", b"its payload" * 150, True, b"its options" * 50))

    def direct() -> object:
        watcher.watch.remote(told)  # the supervisor is told, not waited for
        return live()

    try:
        return _alternated(
            {"live": live, "detached": detached, "direct floor": direct}, repeats, block
        )
    finally:
        live.shutdown()
        detached.shutdown()
        ray.kill(watcher)
        ray.kill(stand_in)


class _StandIn:
    """Stands for rank 0, whose hand would give the supervisor the call's outcomes."""

    def collect(self, call: bytes) -> bytes:
        return call * 20


class _Watcher:
    """The least a supervisor watching a call the driver made would do: take the driver's
    word of it (record, payload, options), and collect the outcomes from rank 0 once."""

    def __init__(self, rank_0: Any) -> None:
        self.rank_0 = rank_0

    def watch(self, told: bytes) -> bytes:
        import ray

        pickle.loads(told)  # noqa: S301 - our own bytes
        return ray.get(self.rank_0.collect.remote(told[:10]))  # type: ignore[no-any-return]


def _alternated(
    ways: dict[str, Callable[[], object]], repeats: int, block: int = 1
) -> dict[str, list[float]]:
    """Each way called twice to warm it, then all in turn, `block` calls of each at a time,
    until each made `repeats`: each call's seconds, by way. In blocks, what a call leaves
    to do after it returns falls mostly on its own way's next call, as in a loop of calls;
    alternated call by call, it falls on the other way's."""
    for call in ways.values():
        call()
        call()
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(max(1, repeats // block)):
        for way, call in ways.items():
            for _ in range(block):
                started = time.perf_counter()
                call()
                times[way].append(time.perf_counter() - started)
    return times


def _round_trip(repeats: int) -> float:
    """The median of one Ray actor call here (an empty method), seconds."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> None:
            return None

    echo = Echo.remote()  # type: ignore[attr-defined]
    ray.get(echo.ping.remote())
    found = []
    for _ in range(repeats):
        started = time.perf_counter()
        ray.get(echo.ping.remote())
        found.append(time.perf_counter() - started)
    ray.kill(echo)
    return statistics.median(found)


def _get_back(lines: int, address: str, work: Path) -> dict[str, Any]:
    """A 16-rank detached job that printed `lines` lines in all and waits: get it back
    (how long until its table and newest 1,000 lines are shown), and pipe `orchestrator
    logs` of it (how long for every line)."""
    from orchestrator import distribute, get_job

    go = work / "go"
    fn = distribute(_print_then_wait, num_replicas=16, detach=True, name="flood", log_dir=False)
    real, sys.stdout = sys.stdout, _Counter()
    try:
        job = fn.submit(lines // 16, str(go))
        while len(list(work.glob("go.printed.*"))) < 16:  # every line printed
            time.sleep(0.1)
        time.sleep(1)  # and taken in by the supervisor
        job.unfollow()
        counter = _Counter(wanted=1000)
        sys.stdout = counter
        started = time.perf_counter()
        again = get_job(job.id)
        while counter.reached is None and time.perf_counter() - started < 30:
            time.sleep(0.001)
        shown_s = (counter.reached or time.perf_counter()) - started
    finally:
        sys.stdout = real
    again.unfollow()
    started = time.perf_counter()
    piped = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", job.id, "--address", address],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    logs_s = time.perf_counter() - started
    go.touch()
    job.result(timeout=60)
    after = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", job.id, "--address", address],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    job.release()
    fn.shutdown()
    return {
        "shown_s": shown_s,
        "logs_s": logs_s,
        "logs_lines": piped.stdout.count("\n"),
        "lines_at_end": after.stdout.count("\n"),
    }


def _latency(samples: int) -> list[float]:
    """Lines of a followed 4-rank detached job at 50 lines/s per rank: ms from print to shown."""
    from orchestrator import distribute

    fn = distribute(_timed_prints, num_replicas=4, detach=True, name="latency", log_dir=False)
    fn(1, 0)
    fn(1, 0)  # warm, and whole in its answer: the supervisor lends the pool, so the call
    # timed is started by this driver, then taken over by the supervisor as it prints
    real, sink = sys.stdout, _Counter()
    sys.stdout = sink
    try:
        fn(samples, 0.02)
    finally:
        sys.stdout = real
        fn.shutdown()
    return sink.latencies


def _listing(kept: int) -> dict[str, float]:
    """`kept` finished jobs of one detached 2-rank function: how long `list_jobs` and
    `get_job` by name take (medians of 3), and the calls' own median."""
    from orchestrator import distribute, get_job, list_jobs

    fn = distribute(_noop, num_replicas=2, log_dir=False, name="sweep", detach=True)
    calls = []
    real, sys.stdout = sys.stdout, io.StringIO()  # each call's line saying its id
    try:
        for _ in range(kept):
            started = time.perf_counter()
            fn()
            calls.append(time.perf_counter() - started)
    finally:
        sys.stdout = real
    listed, named = [], []
    for _ in range(3):
        started = time.perf_counter()
        found = list_jobs()
        listed.append(time.perf_counter() - started)
        started = time.perf_counter()
        get_job("sweep", show=False).unfollow()
        named.append(time.perf_counter() - started)
    fn.shutdown()
    assert sum(not info.is_pool for info in found) >= kept, len(found)
    return {
        "call_s": statistics.median(calls),
        "list_s": statistics.median(listed),
        "name_s": statistics.median(named),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--kept", type=int, default=1000, help="jobs kept when listing")
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="warm calls of one way in a row (1: alternate call by call)",
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bd", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(work)
    os.environ.pop("RAY_ADDRESS", None)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 40})
    ray.init(address=cluster.address, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = cluster.address
    rows = []
    try:
        trip = _round_trip(args.repeats)
        for ranks in (4, 16):
            times = _warm_calls(ranks, args.repeats, args.block)
            rows.append((ranks, *(statistics.median(times[way]) for way in WAYS)))
        back = _get_back(args.lines, cluster.address, work)
        latencies = _latency(args.samples)
        listing = _listing(args.kept)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)  # Ray's files and the jobs' logs
    print(
        f"\nDetached jobs: {args.repeats} warm calls per size and way, alternated "
        f"{args.block} at a time; one Ray round trip here {trip * 1000:.2f} ms (median)"
    )
    print(
        f"  {'warm no-op call':<34}{'live':>10}{'detached':>10}{'extra':>10}{'ratio':>8}"
        f"{'direct floor':>14}{'extra':>8}{'ratio':>8}  goal"
    )
    for ranks, live_s, detached_s, floor_s in rows:
        goal = "<= 1 round trip" if ranks == 4 else "<= 1.2x"
        extra, floor_extra = (detached_s - live_s) * 1000, (floor_s - live_s) * 1000
        print(
            f"  {f'{ranks} ranks (ms, median)':<34}{live_s * 1000:>10.2f}"
            f"{detached_s * 1000:>10.2f}{extra:>10.2f}{detached_s / live_s:>7.2f}x"
            f"{floor_s * 1000:>14.2f}{floor_extra:>8.2f}{floor_s / live_s:>7.2f}x  {goal}"
        )
    print(
        "  (detached: a blocking warm call, started on the ranks by this driver while the "
        "supervisor watches; direct floor: a live call plus one notice to a stand-in "
        "supervisor and one collect from a stand-in rank 0, session 28's least cost of it)"
    )
    print(
        f"  get a 16-rank job back ({args.lines:,} lines printed): table and newest 1,000 "
        f"lines shown in {back['shown_s']:.2f} s (goal < 1 s)"
    )
    print(
        f"  orchestrator logs ID | ...: {back['logs_lines']:,} lines in {back['logs_s']:.2f} s "
        f"(goal: all, < 2 s); {back['lines_at_end']:,} once the job ended"
    )
    print(
        f"  output latency while following (4 ranks, {len(latencies)} lines): "
        f"p50 {_percentile(latencies, 0.5):.1f} ms (goal <= 20), "
        f"p99 {_percentile(latencies, 0.99):.1f} ms (goal <= 100)"
    )
    print(
        f"  {args.kept:,} finished jobs kept (a sweep of 2-rank calls, "
        f"{listing['call_s'] * 1000:.2f} ms each): list_jobs {listing['list_s']:.2f} s, "
        f"get_job(name) {listing['name_s']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
