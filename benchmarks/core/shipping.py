"""Section 5 of bench_core: a big closure shipped to 1 and to 8 warm ranks."""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.core.common import (
    Check,
    Echo,
    SectionResult,
    Settings,
    Table,
    fmt_mb,
    fmt_s,
    fmt_spread,
    median,
    progress,
    timed_calls,
)


def run(s: Settings) -> SectionResult:
    """A function whose closure holds a big tensor, called on 1 and on 8 warm ranks."""
    import numpy as np
    import ray

    from benchmarks._jobs import shipping_job
    from orchestrator import distribute, shipping

    fn = shipping_job(s.shipping_mb)
    table = Table(
        f"5. Shipping a {s.shipping_mb} MB closure (warm pools, driver-side wall per call)",
        ["call", "ranks", "calls", "median", "min..max", "first call", "rank peak RSS"],
    )
    medians = {}
    for ranks in (1, 8):
        progress(f"shipping: {s.shipping_mb} MB closure, {ranks} rank(s): pool and first call")
        job = distribute(fn, num_replicas=ranks, name=f"ship{ranks}")
        t0 = time.perf_counter()
        first = job()
        first_s = time.perf_counter() - t0
        assert all(r["numel"] == s.shipping_mb * (1 << 20) // 4 for r in first), first
        progress(f"shipping: {s.shipping_calls} warm calls on {ranks} rank(s)")
        peaks: list[float] = []

        def call(job: Any = job, peaks: list[float] = peaks) -> None:
            peaks.append(max(r["peak_rss_mb"] for r in job()))

        times = timed_calls(call, s.shipping_calls)
        job.shutdown()
        medians[ranks] = median(times)
        table.rows.append(
            [
                "distribute",
                str(ranks),
                str(len(times)),
                fmt_s(medians[ranks]),
                fmt_spread(times),
                fmt_s(first_s),
                fmt_mb(max(peaks)),
            ]
        )
    ratio = medians[8] / medians[1]
    table.rows.append(["  ratio 8/1", "", "", f"{ratio:.2f}", "", "", ""])

    progress("shipping: the driver's share and Ray's floor")
    count = max(2, s.shipping_calls)
    payload_times = timed_calls(lambda: shipping.payload(fn, (), {}), count)
    data = shipping.payload(fn, (), {})
    put_times = timed_calls(lambda: ray.put(data), count)
    array = np.ones(s.shipping_mb * (1 << 20), dtype=np.uint8)
    fetch_cls = ray.remote(num_cpus=1)(Echo)
    for label, value in (
        ("Ray floor: ray.get of that payload", data),
        (f"Ray floor: ray.get of a {s.shipping_mb} MB numpy array", array),
    ):
        floors = {}
        for ranks in (1, 8):
            actors = [fetch_cls.remote() for _ in range(ranks)]
            ray.get([a.ping.remote() for a in actors])

            def fan_out(actors: list[Any] = actors, value: Any = value) -> None:
                ref = ray.put(value)
                ray.get([a.fetch.remote([ref]) for a in actors])

            times = timed_calls(fan_out, count)
            for actor in actors:
                ray.kill(actor)
            floors[ranks] = median(times)
            table.rows.append(
                [label, str(ranks), str(count), fmt_s(floors[ranks]), fmt_spread(times), "-", "-"]
            )
        table.rows.append(["  ratio 8/1", "", "", f"{floors[8] / floors[1]:.2f}", "", "", ""])
    ray.shutdown()
    table.notes += [
        f"driver side of every call (fixed, whatever the ranks): pickling (shipping.payload) "
        f"{fmt_s(median(payload_times))}, ray.put of the payload {fmt_s(median(put_times))}",
        "Ray floor: ray.put once, then that many plain actors each ray.get it (no unpickling "
        "of the function); a numpy array is read in place from the object store",
        f"first call: pool creation + first call (Ray already running); {os.cpu_count()} cores",
    ]
    return SectionResult(
        [table],
        [
            Check(
                f"{s.shipping_mb} MB closure, 8 ranks / 1 rank",
                f"{ratio:.2f}",
                "<= 1.5",
                ratio <= 1.5,
            )
        ],
    )
