"""Naming the rank that holds a job back (issue 24): how soon, how right, at what cost.

    python -m benchmarks.bench_diagnose                      # 8, 16, 32; 128 (~50 min)
    python -m benchmarks.bench_diagnose --sizes 8 --repeats 1 --watch-sizes ""
    python -m benchmarks.bench_diagnose --sizes 4 --per-node 2 ...  # the tests' 2 nodes

For each size a `ray.cluster_utils.Cluster` runs N/8 nodes of 8 CPUs on this machine,
and one warm gloo job (`distribute(..., replicas_per_node=8, stall_after=10)`) is held
back by one rank in each way below, for a while, then goes on (the pool stays warm):

- sleep: a rank sleeps before an all_reduce (its peers wait in it);
- lock: a rank blocks on a lock before it;
- gil: a rank (the local rank 0 of the last node: its node's reader) calls libc's sleep
  through ctypes.PyDLL, which holds the GIL, so it cannot look at its own stack;
- sigstop: a rank stops itself (SIGSTOP), as on a node cut off; the driver sends SIGCONT;
- busy: a rank computes in a tight loop while its peers wait: its stack may read the
  same at each look, its CPU tells it apart.

And a small gloo DDP loop (40 s) in which one rank adds 30% to each step, as a sleep and
as busy torch work (`ddp-sleep`, `ddp-busy`): when the slow rank was named, counted from
its first slow step (its counts need 15 s of looks; the call's setup before the loop,
`init_process_group` and DDP's first import on 2 shared cores, can take longer than
that, and is shown apart), and whether the report named that rank, its line and its
peers' wait in backward.

Each case reports when the job's report first named that rank (as the odd one out, or
as the one still moving for `busy`), counted from the moment the rank began to hold the
job back, and whether the first report the job gave was right. `stall_after` is 10 s
here, not the default 60, so that the run fits in half an hour: what counts is the
time beyond it. Then, with the detector on and off in turns (7 runs each): a balanced
DDP loop's steps per second (and whether it was ever reported, hung or slow: it must
not be), the driver's CPU, the rank's sampler thread's CPU per rank-minute, and a warm
empty call. Last, on a cluster of 16 nodes, 128 idle ranks in a 40 s call, watched (the
default stall_after) and not, in turns: the driver's CPU, and how many node readings it
took (`--watch-sizes`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PER_NODE = 8
STALL_AFTER_S = 10.0
HELD_S = {"sleep": 20, "lock": 20, "gil": 25, "sigstop": 0, "busy": 20}
CASES = tuple(HELD_S)
SLOW = ("ddp-sleep", "ddp-busy")
SLOW_RUN_S = 40.0
"""How long each straggler run's loop lasts (the slow rank must be named within 30 s)."""
_NAME_LIMIT_S = 60.0


def job(case: str, held_rank: int = -1, held: float = 0.0, marks: str = "", steps: int = 0) -> Any:
    """The job every case runs: an all_reduce, one rank holding the others back, another."""
    if case == "noop":
        return 0
    import ctypes
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    if case.startswith("ddp"):  # ddp, ddp-sleep, ddp-busy: held_rank 30% slower
        return _ddp(dist, rank, held_rank, case.removeprefix("ddp-"), steps, marks=marks)
    if rank == held_rank:
        Path(marks, case).write_text(str(time.time()))
        if case == "sleep":
            time.sleep(held)
        elif case == "lock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire(timeout=held)
        elif case == "gil":
            ctypes.PyDLL(None).sleep(int(held))
        elif case == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif case == "busy":
            end = time.monotonic() + held
            while time.monotonic() < end:
                total = sum(range(1000))
                total += 1
    dist.all_reduce(t)
    return rank


def _ddp(dist: Any, rank: int, slow_rank: int, how: str, seconds: float, *, marks: str) -> float:
    """A small DDP loop for `seconds`; `slow_rank` adds 30% to each step (sleep or busy
    torch work) after the step's last collective, and marks when it first did. Steps per
    second."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    stop, steps = torch.zeros(1), 0
    started = time.perf_counter()
    end = time.monotonic() + seconds
    while True:
        began = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        stop.fill_(time.monotonic() >= end)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        if rank == slow_rank:
            if steps == 1 and marks:
                Path(marks, f"ddp-{how}").write_text(str(time.time()))
            extra = 0.3 * (time.perf_counter() - began)
            if how == "busy":
                _busy(extra)
            else:
                time.sleep(extra)
    return steps / (time.perf_counter() - started)


def _busy(seconds: float) -> None:
    import torch

    a = torch.randn(96, 96)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        a = torch.tanh(a @ a)


def _held_rank(case: str, size: int) -> int:
    if case == "gil":
        return size - PER_NODE  # its node's reader
    return size - 3 if case != "sigstop" else size - 5


def _named(report: Any, case: str, rank: int) -> bool:
    """Whether `report` names `rank` as the case has it."""
    if report is None or not report.groups:
        return False
    if case == "busy":  # the odd one out or the one still moving, on CPU either way
        ours = [g for g in report.groups if g.ranks == (rank,) and g.cpu >= 0.5]
        return bool(ours) and (ours[0].moving or ours[0] is report.groups[0])
    first = next((g for g in report.groups if not g.moving), None)
    if first is None or first.ranks != (rank,):
        return False
    if case in ("gil", "sigstop"):
        return not first.answers
    return True


def run_case(fn: Any, case: str, size: int, marks: Path) -> dict[str, Any]:
    """One held-back call: when the rank was named, and whether the first report was right."""
    rank = _held_rank(case, size)
    mark = marks / case
    mark.unlink(missing_ok=True)
    job_ = fn.submit(case, rank, HELD_S[case], str(marks))
    first_right: bool | None = None
    named_at = None
    pid = fn.pids()[rank] if case == "sigstop" else None
    deadline = time.monotonic() + 240
    try:
        while not job_.done() and time.monotonic() < deadline:
            call = job_.call
            report = call.stall if call is not None else None
            if report is not None and first_right is None:
                first_right = _named(report, case, rank) or (
                    case in ("gil", "sigstop") and report.groups[0].ranks == (rank,)
                )
                if not first_right:
                    print(f"[bench] {case}: first report: {report.line()}", flush=True)
            if named_at is None and _named(report, case, rank):
                named_at = time.time()
                if pid is not None:
                    os.kill(pid, signal.SIGCONT)
            late = mark.exists() and time.time() - float(mark.read_text()) > _NAME_LIMIT_S
            if pid is not None and late:
                os.kill(pid, signal.SIGCONT)  # not named in time: let it go on
            time.sleep(0.2)
        job_.result(timeout=240)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    began = float(mark.read_text()) if mark.exists() else None
    return {
        "case": case,
        "named_s": None if named_at is None or began is None else named_at - began,
        "first_right": bool(first_right),
    }


def run_slow(fn: Any, case: str, size: int, marks: Path) -> dict[str, Any]:
    """One DDP loop with a slow rank: when it was named (from its first slow step, and from
    the call's start), and whether the report was right."""
    rank = size - 3
    mark = marks / case
    mark.unlink(missing_ok=True)
    started = time.time()
    job_ = fn.submit(case, rank, 0.0, str(marks), SLOW_RUN_S)
    named_at, right, first = None, False, ""
    while not job_.done():
        call = job_.call
        slow = call.slow if call is not None else []
        if slow and named_at is None:
            named_at = time.time()
            first = "; ".join(s.sentence() for s in slow)
            word = "_busy" if case.endswith("busy") else "time.sleep(extra)"
            right = [s.rank for s in slow] == [rank] and word in first and "backward" in first
        time.sleep(0.25)
    job_.result()
    began = float(mark.read_text()) if mark.exists() else None
    return {
        "case": case,
        "named_s": None if named_at is None or began is None else named_at - began,
        "from_call_s": None if named_at is None else named_at - started,
        "first_right": right,
        "first": first,
    }


def _looking(call: Any) -> dict[int, tuple[float, float]]:
    """Per rank: the CPU seconds its looking had cost, and when that was read."""
    watch = call.watch if call is not None else None
    if watch is None:
        return {}
    return {rank: (w.sampler_s, at) for rank, (w, at) in list(watch.where.items())}


def overhead(fn: Any, runs: int, steps: float) -> dict[str, Any]:
    """The detector on vs off, in turns: a balanced DDP loop's steps/s (for `steps`
    seconds), the driver's CPU, the sampler's, a warm empty call."""
    off = fn.with_options(stall_after=None)
    rate: dict[str, list[float]] = {"on": [], "off": []}
    driver: dict[str, list[float]] = {"on": [], "off": []}
    call_ms: dict[str, list[float]] = {"on": [], "off": []}
    sampler_s, ranks_s, reported = 0.0, 0.0, 0
    for _ in range(runs):
        for mode, f in (("on", fn), ("off", off)):
            before_cpu, before_s = time.process_time(), time.monotonic()
            job_ = f.submit("ddp", -1, 0.0, "", steps)
            first: dict[int, tuple[float, float]] = {}
            while not job_.done():
                call = job_.call
                if mode == "on" and call is not None and (call.stall or call.slow):
                    reported += 1
                    print(f"[bench] balanced loop reported: {call.stall or call.slow}")
                if mode == "on":  # each rank's first reading: counted from there
                    first = {**_looking(call), **first}
                time.sleep(0.2)
            for rank, (used, at) in _looking(job_.call).items():  # its last, less its first
                if rank in first and at > first[rank][1]:
                    sampler_s += used - first[rank][0]
                    ranks_s += at - first[rank][1]
            rates = job_.result()
            took = time.monotonic() - before_s
            rate[mode].append(statistics.median(rates))
            driver[mode].append((time.process_time() - before_cpu) / took)
            for _ in range(10):
                started = time.perf_counter()
                f("noop")
                call_ms[mode].append((time.perf_counter() - started) * 1e3)
    med = statistics.median
    return {
        "steps_on": med(rate["on"]),
        "steps_off": med(rate["off"]),
        "driver_on": med(driver["on"]),
        "driver_off": med(driver["off"]),
        "call_on": med(call_ms["on"]),
        "call_off": med(call_ms["off"]),
        "sampler_per_rank_min": sampler_s / ranks_s * 60 if ranks_s else 0.0,
        "balanced_reported": reported,
    }


def simulated_cluster(size: int, tmp: str) -> Any:
    """A simulated cluster of `size / PER_NODE` nodes on this machine, this process its driver."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = tmp
    args = {"num_cpus": PER_NODE, "object_store_memory": 96 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args=args)
    for _ in range(size // PER_NODE - 1):
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def idle(seconds: float) -> int:
    """A long call that uses no torch (so ranks skip its preload: 128 of them fit here)."""
    time.sleep(seconds)
    return 0


def watching(size: int, runs: int, seconds: float, tmp: str) -> dict[str, Any]:
    """The driver's CPU over a long call of `size` idle ranks, watched (the default
    stall_after) and not, in turns; and what a reading of every node costs it."""
    import ray

    from orchestrator import distribute, testing

    cluster = simulated_cluster(size, tmp)
    on = distribute(
        idle,
        num_replicas=size,
        replicas_per_node=PER_NODE,
        cpus_per_replica=1,
        gpus_per_replica=0,
        log_dir=False,
        name="watch",
    )
    off = on.with_options(stall_after=None)
    driver: dict[str, list[float]] = {"on": [], "off": []}
    readings = []
    try:
        on(0.0)  # the pool starts
        for _ in range(runs):
            for mode, f in (("on", on), ("off", off)):
                before_cpu, before_s = time.process_time(), time.monotonic()
                job_ = f.submit(seconds)
                while not job_.done():
                    time.sleep(0.5)
                if mode == "on":
                    readings.append(testing.readings(job_))
                job_.result()
                took = time.monotonic() - before_s
                driver[mode].append((time.process_time() - before_cpu) / took)
        print(f"[bench] {size} ranks watched: {driver}, node readings {readings}", flush=True)
    finally:
        on.shutdown()
        ray.shutdown()
        cluster.shutdown()
    med = statistics.median
    return {
        "size": size,
        "nodes": size // PER_NODE,
        "on": med(driver["on"]),
        "off": med(driver["off"]),
        "readings": med(readings),
        "seconds": seconds,
        "runs": runs,
    }


def measure(
    size: int, repeats: int, runs: int, steps: float, tmp: str, *, only: tuple[str, ...]
) -> dict[str, Any]:
    """Every case `repeats` times and the overhead, on a fresh simulated cluster."""
    import ray

    from orchestrator import distribute

    cluster = simulated_cluster(size, tmp)
    marks = Path(tempfile.mkdtemp(prefix="marks", dir=tmp))
    fn = distribute(
        job,
        num_replicas=size,
        replicas_per_node=PER_NODE,
        cpus_per_replica=1,
        gpus_per_replica=0,
        log_dir=False,
        stall_after=STALL_AFTER_S,
        name="diag",
    )
    try:
        fn("noop")  # the pool starts
        cases = [
            run_case(fn, case, size, marks)
            for _ in range(repeats)
            for case in CASES
            if case in only
        ]
        cases += [
            run_slow(fn, case, size, marks) for _ in range(repeats) for case in SLOW if case in only
        ]
        for c in cases:
            named = "-" if c["named_s"] is None else f"{c['named_s']:.1f} s"
            print(
                f"[bench] {size} ranks, {c['case']}: named after {named}, "
                f"first report right: {c['first_right']} {c.get('first', '')}",
                flush=True,
            )
        costs = overhead(fn, runs, steps) if runs else {}
        print(f"[bench] {size} ranks, detector on/off: {costs}", flush=True)
    finally:
        fn.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return {"size": size, "cases": cases, **costs}


def main() -> None:
    """Run the sizes asked for, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,16,32", help="rank counts, multiples of --per-node")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case per size")
    parser.add_argument(
        "--runs", type=int, default=7, help="on/off runs of the balanced loop (0: none)"
    )
    parser.add_argument("--steps", type=float, default=12.0, help="seconds per balanced run")
    parser.add_argument(
        "--cases", default=",".join(CASES + SLOW), help="which cases (default: all of them)"
    )
    parser.add_argument(
        "--watch-sizes", default="128", help="rank counts for the driver's cost of watching"
    )
    parser.add_argument(
        "--per-node", type=int, default=8, help="ranks (and CPUs) per simulated node"
    )
    parser.add_argument("--watch-s", type=float, default=40.0, help="seconds per watched call")
    args = parser.parse_args()
    global PER_NODE  # noqa: PLW0603 - one setting for the whole run
    PER_NODE = args.per_node
    only = tuple(args.cases.split(","))
    if unknown := set(only) - set(CASES + SLOW):
        parser.error(f"unknown cases {sorted(unknown)}; valid: {', '.join(CASES + SLOW)}")
    os.environ.setdefault("ORCHESTRATOR_STATUS", "0")  # the reports are read, not shown
    started = time.monotonic()
    rows = []
    for size in [int(s) for s in args.sizes.split(",") if s]:
        tmp = tempfile.mkdtemp(prefix="rd", dir="/tmp")
        try:
            rows.append(measure(size, args.repeats, args.runs, args.steps, tmp, only=only))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    watched = []
    for size in [int(s) for s in args.watch_sizes.split(",") if s]:
        tmp = tempfile.mkdtemp(prefix="rd", dir="/tmp")
        try:
            watched.append(watching(size, max(args.runs // 2, 1), args.watch_s, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _tables(rows, watched, args, only, time.monotonic() - started)


def _tables(
    rows: list[dict[str, Any]],
    watched: list[dict[str, Any]],
    args: argparse.Namespace,
    only: tuple[str, ...],
    took: float,
) -> None:
    """Print what was measured."""
    print(
        f"\nbench_diagnose: {os.cpu_count()} cores; nodes of {PER_NODE} CPUs on this machine; "
        f"stall_after={STALL_AFTER_S:g} s; {args.repeats} run(s) per case; {took / 60:.1f} min"
    )
    if rows:
        print("ranks | case | named after (median, max) | beyond stall_after | first report right")
    for row in rows:
        for case in [c for c in CASES + SLOW if c in only]:
            got = [c for c in row["cases"] if c["case"] == case]
            times = [c["named_s"] for c in got if c["named_s"] is not None]
            right = sum(c["first_right"] for c in got)
            if times:
                named = f"{statistics.median(times):.1f} s, {max(times):.1f} s"
                beyond = f"{statistics.median(times) - STALL_AFTER_S:+.1f} s"
                if case in SLOW:  # counted from the first slow step; and from the call's start
                    calls = [c["from_call_s"] for c in got if c["from_call_s"] is not None]
                    beyond = f"({max(calls):.1f} s from the call's start, at most)"
            else:
                named, beyond = "never", "-"
            missed = len(got) - len(times)
            named += f" ({missed} of {len(got)} not named)" if missed else ""
            print(f"{row['size']} | {case} | {named} | {beyond} | {right} of {len(got)}")
    costs = [r for r in rows if "steps_on" in r]
    if costs:
        print(
            f"\nDetector on vs off, {args.runs} runs each in turns (a balanced gloo DDP loop "
            f"for {args.steps:g} s; medians):"
        )
        print(
            "ranks | steps/s on / off | driver CPU on / off | sampler CPU per rank-minute | "
            "warm empty call on / off | balanced loop reported (hang or slow)"
        )
    for row in costs:
        print(
            f"{row['size']} | {row['steps_on']:.1f} / {row['steps_off']:.1f} | "
            f"{row['driver_on']:.1%} / {row['driver_off']:.1%} | "
            f"{row['sampler_per_rank_min'] * 1e3:.2f} ms ({row['sampler_per_rank_min'] / 60:.4%} "
            f"of a core) | {row['call_on']:.1f} / {row['call_off']:.1f} ms | "
            f"{row['balanced_reported']} times"
        )
    if watched:
        print(
            "\nThe driver watching a long call of idle ranks (the default stall_after, "
            "read every 5 s) and not, in turns (medians):"
        )
        print("ranks | nodes | driver CPU watched / not | node readings per call")
    for row in watched:
        print(
            f"{row['size']} | {row['nodes']} | {row['on']:.1%} / {row['off']:.1%} of a core "
            f"| {row['readings']:g} in {row['seconds']:g} s ({row['runs']} runs each)"
        )


if __name__ == "__main__":
    main()
