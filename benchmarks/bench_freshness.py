"""Freshness: from a rank's step to its number on the page and in `/metrics`, at 16 and
128 simulated ranks (ranks that import no torch: each steps with `report(step=N)`).

    python -m benchmarks.bench_freshness [--sizes 16 128] [--seconds 60] [--every 0.37]

For each size a `ray.cluster_utils.Cluster` runs N/8 nodes of 8 CPUs on this machine (as
`bench_scale` does), and one driver submits a job of N ranks (`stall_after=60`, today's
default sampling) whose every rank steps every `--every` s, reporting the step's wall time
as a scalar. Two threads of the driver ask its page, every 50 ms, for the job's table
(`/api/table`, as the page does) and for `/metrics` (as Prometheus does). Each time a
rank's step is seen to change, its freshness is the time seen less the time that step
ended (the table: the reported wall time; `/metrics`: the rank's
`orchestrator_rank_last_step_timestamp_seconds`). All on one clock, one machine.

The default step, 0.37 s, falls at every phase of the driver's once-a-second read; steps
of exactly 1 s fall at one phase, and every step waits about the same (`--every 1`).

Prints per size and source: steps seen, the median, 95th percentile and largest
freshness. Goal: median at most 1 s, 95th percentile at most 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLL_S = 0.05


def stepping(seconds: float, every: float) -> int:
    """Step every `every` s for `seconds`, each step's end time reported with it."""
    import orchestrator

    step = 0
    until = time.time() + seconds
    while time.time() < until:
        time.sleep(every)
        step += 1
        orchestrator.report(step=step, ended=time.time())
    return step


def _get(url: str, token: str) -> bytes:
    ask = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})  # noqa: S310
    with urllib.request.urlopen(ask, timeout=30) as answer:  # noqa: S310 - our own page
        return bytes(answer.read())


def watch_table(base: str, token: str, key: str, stop: threading.Event, seen: list[float]) -> None:
    """Each rank step first seen in the page's table of job `key`: now less the step's end."""
    last: dict[int, float] = {}
    while not stop.is_set():
        table = json.loads(_get(f"{base}api/table?job={key}", token))
        now = time.time()
        for row in table["rows"]:
            ended = (row.get("scalars") or {}).get("ended")
            if ended is not None and row.get("step") and last.get(row["rank"]) != ended:
                last[row["rank"]] = ended
                seen.append(now - ended)
        stop.wait(POLL_S)


def watch_metrics(base: str, token: str, stop: threading.Event, seen: list[float]) -> None:
    """Each rank step first seen in /metrics: now less the rank's last step's end."""
    from prometheus_client.parser import text_string_to_metric_families

    name = "orchestrator_rank_last_step_timestamp_seconds"
    last: dict[str, float] = {}
    while not stop.is_set():
        text = _get(base + "metrics", token).decode()
        now = time.time()
        for family in text_string_to_metric_families(text):
            if family.name != name:
                continue
            for sample in family.samples:
                rank = sample.labels["rank"]
                if last.get(rank) != sample.value:
                    last[rank] = sample.value
                    seen.append(now - sample.value)
        stop.wait(POLL_S)


def measure(ranks: int, seconds: float, every: float) -> dict[str, list[float]]:
    """Freshness on the page and in /metrics for a job of `ranks` ranks."""
    import ray

    from benchmarks.bench_diagnose import PER_NODE, simulated_cluster
    from orchestrator import distribute
    from orchestrator.observe import dashboard

    cluster = simulated_cluster(ranks, tempfile.mkdtemp(prefix="rf", dir="/tmp"))
    found: dict[str, list[float]] = {"page": [], "/metrics": []}
    try:
        fn = distribute(
            stepping,
            num_replicas=ranks,
            replicas_per_node=PER_NODE,
            cpus_per_replica=1,
            gpus_per_replica=0,
            log_dir=False,
            stall_after=60,
            name="fresh",
        )
        fn.fn = lambda seconds, every: 0
        fn(0, 0)  # the pool started: what follows is the steps' alone
        fn.fn = stepping
        job = fn.submit(seconds, every)
        address = dashboard.link(job)
        assert address is not None
        base, rest = address.split("?token=")
        token, key = rest.split("#job=")
        stop = threading.Event()
        threads = [
            threading.Thread(target=watch_table, args=(base, token, key, stop, found["page"])),
            threading.Thread(target=watch_metrics, args=(base, token, stop, found["/metrics"])),
        ]
        for thread in threads:
            thread.start()
        job.result(timeout=seconds + 300)
        stop.set()
        for thread in threads:
            thread.join()
        fn.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return found


def _row(ranks: int, source: str, seen: list[float]) -> str:
    if not seen:
        return f"{ranks:>6} {source:>9} {0:>7}"
    ordered = sorted(seen)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    median = statistics.median(ordered)
    return f"{ranks:>6} {source:>9} {len(seen):>7} {median:>8.2f} {p95:>8.2f} {ordered[-1]:>8.2f}"


def main() -> None:
    """Measure each size; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=0.37)
    args = parser.parse_args()
    os.environ.setdefault("ORCHESTRATOR_STATUS", "0")
    rows = []
    for ranks in args.sizes:
        found = measure(ranks, args.seconds, args.every)
        rows += [_row(ranks, source, seen) for source, seen in found.items()]
        print(f"size {ranks} done", file=sys.stderr, flush=True)
    print(f"freshness, s (a step every {args.every:g} s for {args.seconds:g} s)")
    print("goal: median <= 1, p95 <= 2")
    print(f"{'ranks':>6} {'source':>9} {'steps':>7} {'median':>8} {'p95':>8} {'max':>8}")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
