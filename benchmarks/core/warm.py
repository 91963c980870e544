"""Section 2 of bench_core: calls on a warm pool, and Ray's own floor."""

from __future__ import annotations

import inspect
import time

from benchmarks.core.common import (
    RANKS,
    Check,
    Echo,
    SectionResult,
    Settings,
    Table,
    fmt_s,
    median,
    progress,
    timed_calls,
    timing_row,
)


def run(s: Settings) -> SectionResult:
    """Calls on a warm pool: the trivial job, a rank-only function, and Ray's own floor."""
    import ray

    from benchmarks._jobs import rank_only, trivial
    from orchestrator import distribute, shipping

    progress("warm: starting the pool (embedded Ray)")
    t0 = time.perf_counter()
    job = distribute(trivial, num_replicas=RANKS)
    first = job()
    first_s = time.perf_counter() - t0
    assert [r["rank"] for r in first] == list(range(RANKS)), first
    progress(f"warm: {s.warm_calls} trivial calls")
    inside: list[float] = []

    def call_trivial() -> None:
        ranks = job()
        inside.append(max(r["elapsed_s"] for r in ranks))

    trivial_times = timed_calls(call_trivial, s.warm_calls)
    job.shutdown()

    ranks_fn = distribute(rank_only, num_replicas=RANKS)
    t0 = time.perf_counter()
    assert ranks_fn() == list(range(RANKS))
    rank_first_s = time.perf_counter() - t0
    progress(f"warm: {s.rank_calls} rank-only calls")
    rank_times = timed_calls(ranks_fn, s.rank_calls)
    pickle_times = timed_calls(lambda: shipping.payload(rank_only, (), {}), s.rank_calls)
    ranks_fn.shutdown()
    unlogged_times: list[float] = []
    if "log_dir" in inspect.signature(distribute).parameters:
        progress(f"warm: {s.rank_calls} rank-only calls with log_dir=False")
        with distribute(rank_only, num_replicas=RANKS, log_dir=False) as unlogged:  # type: ignore[call-arg]
            unlogged()
            unlogged_times = timed_calls(unlogged, s.rank_calls)

    # Ray's own floor: one trivial method call on each of 4 warm actors, all at once.
    echo_cls = ray.remote(num_cpus=1)(Echo)
    actors = [echo_cls.remote() for _ in range(RANKS)]
    ray.get([a.ping.remote() for a in actors])
    floor_times = timed_calls(lambda: ray.get([a.ping.remote() for a in actors]), s.rank_calls)
    for actor in actors:
        ray.kill(actor)
    ray.shutdown()

    trivial_med, rank_med = median(trivial_times), median(rank_times)
    table = Table(
        f"2. Warm calls on a {RANKS}-rank pool (embedded Ray, driver-side wall time)",
        ["call", "calls", "median", "mean", "min..max", "> 1 s", "first call"],
    )
    table.rows += [
        timing_row("trivial gloo job (init, all_reduce, destroy)", trivial_times, first_s),
        timing_row("  of which inside the slowest rank", inside),
        timing_row("rank-only function", rank_times, rank_first_s),
        timing_row("  of which pickling (shipping.payload)", pickle_times),
        *(
            [timing_row("rank-only function, log_dir=False", unlogged_times)]
            if unlogged_times
            else []
        ),
        timing_row(f"Ray floor: {RANKS} actors' no-op method", floor_times),
    ]
    table.notes += [
        "first call: distribute() + pool creation + first call, Ray already running "
        "(the rank-only pool's first call comes after the trivial pool existed)",
        "> 1 s: stalled calls; the ~5 s ones seen so far were torch TCPStore connects waiting "
        "on a reverse DNS lookup (glibc's 5 s resolver timeout): each call that used the "
        "rendezvous store opens a new one",
    ]
    return SectionResult(
        [table],
        [
            Check("warm trivial job call", fmt_s(trivial_med), "< 100 ms", trivial_med < 0.1),
            Check("warm rank-only call", fmt_s(rank_med), "< 5 ms", rank_med < 0.005),
        ],
    )
