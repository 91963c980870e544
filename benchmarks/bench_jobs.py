"""Eight 1-replica jobs submitted at once vs the same eight one after another.

    python -m benchmarks.bench_jobs [--jobs 8] [--work 2.0] [--repeats 3]

Each job joins a 1-rank gloo group, "trains" for --work seconds (a sleep: the time a
GPU would be busy, which needs no driver CPU) and leaves. Cold: each job starts its
own actor. Warm: the eight pools already run and only the calls are timed. The
speed-up is sequential time / concurrent time; with no serialization in the driver
it approaches the number of jobs when --work dominates (on 2 cores, cold starts are
bound by the cores: eight processes import torch at once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from orchestrator import DistributedFunction, distribute


def work(seconds: float) -> float:
    """One rank's job: a gloo group of one, `seconds` of busy GPU, an all_reduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    time.sleep(seconds)
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return value.item()


def _functions(count: int) -> list[DistributedFunction]:
    return [distribute(work, num_replicas=1, name=f"job{i}", log_dir=False) for i in range(count)]


def _sequential(fns: list[DistributedFunction], seconds: float) -> float:
    start = time.perf_counter()
    for fn in fns:
        assert fn(seconds) == [1.0]
    return time.perf_counter() - start


def _concurrent(fns: list[DistributedFunction], seconds: float) -> float:
    start = time.perf_counter()
    jobs = [fn.submit(seconds) for fn in fns]
    assert all(job.result() == [1.0] for job in jobs)
    return time.perf_counter() - start


def _close(fns: list[DistributedFunction]) -> None:
    for fn in fns:
        fn.shutdown()


def measure(count: int, seconds: float, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds per mode (cold, warm) and order (one job, sequential, concurrent)."""
    rows: dict[str, dict[str, list[float]]] = {
        mode: {"one": [], "sequential": [], "concurrent": []} for mode in ("cold", "warm")
    }
    for _ in range(repeats):
        for order, run in (("sequential", _sequential), ("concurrent", _concurrent)):
            fns = _functions(count)
            rows["cold"][order].append(run(fns, seconds))
            rows["warm"][order].append(run(fns, seconds))
            _close(fns)
        one = _functions(1)
        rows["cold"]["one"].append(_sequential(one, seconds))
        rows["warm"]["one"].append(_sequential(one, seconds))
        _close(one)
    return {
        mode: {order: statistics.median(times) for order, times in orders.items()}
        for mode, orders in rows.items()
    }


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def cancel_latency(repeats: int) -> float:
    """Median seconds from cancel() of a running 4-rank job until its processes are gone."""
    times = []
    for _ in range(repeats):
        fn = distribute(_sleep, num_replicas=4, replicas_per_node=2, log_dir=False)
        job = fn.submit(300)
        while job.status().state != "running":
            time.sleep(0.01)
        pids = fn.pids()
        start = time.perf_counter()
        job.cancel()
        while any(os.path.exists(f"/proc/{pid}") for pid in pids):
            time.sleep(0.005)
        times.append(time.perf_counter() - start)
        fn.shutdown()
    return statistics.median(times)


def main() -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--work", type=float, default=2.0, help="seconds each job works")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _close(_functions(1))  # start Ray before timing anything
    results = measure(args.jobs, args.work, args.repeats)
    print(f"\n{args.jobs} jobs x 1 rank, {args.work:g} s of work each, median of {args.repeats}\n")
    print("| start | one job alone | one after another | all at once | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for mode, row in results.items():
        speed_up = row["sequential"] / row["concurrent"]
        print(
            f"| {mode} | {row['one']:.2f} s | {row['sequential']:.2f} s | "
            f"{row['concurrent']:.2f} s | {speed_up:.2f}x |"
        )
    latency = cancel_latency(args.repeats)
    print(f"\ncancel() of a running 4-rank job: its processes gone after {latency:.3f} s (median)")


if __name__ == "__main__":
    main()
