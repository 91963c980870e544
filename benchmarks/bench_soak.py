"""Soak: threads submit jobs with random faults for minutes; nothing wrong, nothing left.

    python -m benchmarks.bench_soak                   (5 minutes, 4 threads, 1..4 ranks)
    python -m benchmarks.bench_soak --minutes 2 --max-ranks 3
    python -m benchmarks.bench_soak --quick           (30 s, 2 threads, 1..2 ranks: a test)

One driver on the embedded default (the run starts its own Ray in a fresh RAY_TMPDIR).
Each thread keeps one distributed function per size, warm, and calls a random one again
and again; a failure replaces that function's pool, as it would for a user. Each job draws
its outcome: most succeed (the result is checked), the rest raise, call os._exit, SIGKILL
themselves, hang until `timeout=`, are cancelled, or SIGKILL themselves on their first
attempt with `max_restarts=1` (and must then succeed). A quarter of the jobs carry a 2 MB
tensor (shared through /dev/shm). Prints a table of the targets; exit status 1 if one is
missed. The driver's memory target is its private RSS (RssAnon): pages of Ray's object
store that it maps are the store's, bounded by its size, and shown apart.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTCOMES = {
    "ok": 60,
    "raise": 8,
    "exit": 8,
    "kill": 8,
    "hang": 6,
    "cancel": 5,
    "restart": 5,
}
"""How often each outcome is drawn (weights)."""
FAILING = ("raise", "exit", "kill")
"""Outcomes timed from the rank's failure to the error on the driver."""
HANG_TIMEOUT_S = 2.0
CALL_LIMIT_S = 180.0
"""A call still running this long after the soak's end is stuck: its stack is shown."""
PAYLOAD_ELEMENTS = 1 << 19  # 2 MB of float32: above the 1 MiB out-of-band threshold
TAG = "ORCHESTRATOR_SOAK"
"""Set in this process's environment before Ray starts, so every process of the run has it."""


def job(outcome: str, victim: int, seed: int, stamp: str, payload: Any) -> tuple:
    """One rank's part: fail as drawn (rank `victim`), else all_reduce and report."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    first_attempt = os.environ["RESTART_COUNT"] == "0"
    dist.init_process_group("gloo")
    if rank == victim and outcome in (*FAILING, "restart") and first_attempt:
        Path(stamp).write_text(repr(time.time()))
        if outcome == "raise":
            raise ValueError(f"soak {seed}")
        if outcome == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    if outcome in ("hang", "cancel"):
        time.sleep(3600)
    total = torch.tensor([float(rank + seed)])
    dist.all_reduce(total)
    checksum = float(payload.sum()) if payload is not None else 0.0
    return rank, total.item(), checksum, os.getpid()


def expected(world: int, seed: int, payload: Any) -> list[tuple[int, float, float]]:
    """What every rank of a successful job returns, pids left out."""
    total = float(sum(rank + seed for rank in range(world)))
    checksum = float(payload.sum()) if payload is not None else 0.0
    return [(rank, total, checksum) for rank in range(world)]


@dataclass
class Tally:
    """What the threads saw, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: Counter = field(default_factory=Counter)
    wrong_results: list[str] = field(default_factory=list)
    wrong_errors: list[str] = field(default_factory=list)
    failure_to_error_s: list[float] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    rss_at_100: float | None = None
    shmem_at_100: float | None = None
    fds_at_100: int | None = None
    total: int = 0

    def count(self, outcome: str) -> None:
        """One call done; the driver's RSS and fds are sampled at the 100th."""
        with self.lock:
            self.calls[outcome] += 1
            self.total += 1
            if self.total == 100:
                self.rss_at_100, self.fds_at_100 = rss_mb(), open_fds()
                self.shmem_at_100 = rss_mb("RssShmem")


def rss_mb(kind: str = "RssAnon") -> float:
    """This process's resident memory of one kind, MB: RssAnon is its private memory,
    RssShmem the pages of Ray's object store it has mapped (the store's, not its own)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds() -> int:
    """This process's open file descriptors."""
    return len(os.listdir("/proc/self/fd"))


def check(  # noqa: PLR0911 - one verdict per outcome
    outcome: str, victim: int, error: BaseException | None, result: Any, want: Any
) -> str:
    """What was wrong with a call's outcome, or ''."""
    from orchestrator import DistributedError, JobTimeoutError
    from orchestrator.errors import CRASH

    if outcome in ("ok", "restart"):
        if error is not None:
            return f"{outcome}: raised {type(error).__name__}: {str(error)[:200]}"
        got = [tuple(r[:3]) for r in result]
        return "" if got == want else f"{outcome}: got {got}, want {want}"
    if outcome == "hang":
        return "" if isinstance(error, JobTimeoutError) else f"hang: got {error!r}"[:300]
    if outcome == "cancel":
        cancelled = isinstance(error, concurrent.futures.CancelledError)
        return "" if cancelled else f"cancel: got {error!r}"[:300]
    if not isinstance(error, DistributedError) or error.root_cause is None:
        return f"{outcome}: got {error!r}"[:300]
    root = error.root_cause
    kind = {"raise": "builtins.ValueError", "exit": CRASH, "kill": CRASH}[outcome]
    if root.rank != victim or root.exc_type != kind:
        return f"{outcome}: root cause rank {root.rank} {root.exc_type}, want {victim} {kind}"
    if outcome == "raise" and not isinstance(error, ValueError):
        return "raise: the error is not also a ValueError"
    if outcome == "exit" and "os._exit(7)" not in root.message:
        return f"exit: message {root.message!r}"
    return ""


def call_once(fn: Any, outcome: str, args: tuple) -> tuple[BaseException | None, Any]:
    """Make one call as drawn; (its error or None, its result)."""
    try:
        if outcome == "hang":
            return None, fn.with_options(timeout=HANG_TIMEOUT_S)(*args)
        if outcome == "restart":
            return None, fn.with_options(max_restarts=1)(*args)
        if outcome == "cancel":
            pending = fn.submit(*args)
            deadline = time.monotonic() + 30
            while pending.status().state != "running" and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            pending.cancel()
            return None, pending.result(timeout=60)
        return None, fn(*args)
    except BaseException as exc:  # noqa: BLE001 - judged by check()
        return exc, None


def submitter(
    thread: int,
    sizes: list[int],
    until: float,
    *,
    seed: int,
    weights: dict[str, float],
    tally: Tally,
    stamps: Path,
) -> None:
    """One user thread: a warm function per size, called with random outcomes until `until`."""
    import torch

    from orchestrator import distribute

    rng = random.Random(seed)  # noqa: S311 - a reproducible draw, not a secret
    # One tensor per thread, refilled: a user's data lives long. A new 2 MB tensor per
    # call would measure glibc's heap (its mmap threshold grows), not this driver.
    big = torch.empty(PAYLOAD_ELEMENTS)
    quiet = {"log_dir": False, "log_ranks": []}  # the ranks' own output is not the point
    fns = {n: distribute(job, num_replicas=n, name=f"soak-t{thread}-n{n}", **quiet) for n in sizes}
    try:
        number = 0
        while time.monotonic() < until:
            number += 1
            n = rng.choice(sizes)
            outcome = rng.choices(list(weights), weights=list(weights.values()))[0]
            victim, value = rng.randrange(n), rng.randrange(1000)
            payload = None
            if rng.random() < 0.25:
                payload = big.fill_(float(value))  # calls snapshot their arguments
            stamp = stamps / f"{thread}-{number}"
            args = (outcome, victim, value, str(stamp), payload)
            error, result = call_once(fns[n], outcome, args)
            failed_at = time.time()
            problem = check(outcome, victim, error, result, expected(n, value, payload))
            with tally.lock:
                if problem and outcome in ("ok", "restart"):
                    tally.wrong_results.append(problem)
                elif problem:
                    tally.wrong_errors.append(problem)
                if outcome in FAILING and not problem and stamp.exists():
                    tally.failure_to_error_s.append(failed_at - float(stamp.read_text()))
                if result:
                    tally.pids.update(r[3] for r in result)
                tally.pids.update(fns[n].pids())
            tally.count(outcome)
    finally:
        for fn in fns.values():
            fn.shutdown()


def leftovers(run_id: str, grace_s: float) -> list[str]:
    """This run's rank and keeper processes still alive after up to `grace_s` seconds.

    A dead rank's keeper holds its last words for 10 s, then exits by itself.
    """
    mark = f"{TAG}={run_id}".encode()
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            ours = "RankActor" in argv or "orchestrator_workers.tail" in argv
            if mark in environ and ours and state != "Z":
                found.append(f"{pid} {argv[:60]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def released(ray: Any, grace_s: float) -> tuple[list[str], dict[str, float]]:
    """(placement groups not removed, CPUs/GPUs still held) after up to `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        table = ray.util.placement_group_table().values()
        groups = [g["name"] for g in table if g["state"] != "REMOVED"]
        free, total = ray.available_resources(), ray.cluster_resources()
        held = {k: total[k] - free.get(k, 0) for k in ("CPU", "GPU") if total.get(k, 0)}
        held = {k: v for k, v in held.items() if v}
        if (not groups and not held) or time.monotonic() > deadline:
            return groups, held
        time.sleep(0.5)


def shm_files(since: float) -> list[str]:
    """Shared-buffer files in /dev/shm made since `since` (time.time())."""
    from orchestrator_workers.sharing import PREFIX, SHM

    found = []
    for path in SHM.glob(f"{PREFIX}*"):
        try:
            if path.stat().st_mtime >= since:
                found.append(path.name)
        except OSError:
            continue
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--max-ranks", type=int, default=4, help="sizes 1..N per thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--outcomes",
        default=",".join(f"{k}={v}" for k, v in OUTCOMES.items()),
        help="NAME=WEIGHT,... of the outcomes to draw (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="30 s, 2 threads, 1..2 ranks")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.threads, args.max_ranks = 0.5, 2, 2
    for name in ("minutes", "threads", "max_ranks"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be > 0")
    try:
        pairs = [item.split("=") for item in args.outcomes.split(",")]
        args.weights = {name.strip(): float(weight) for name, weight in pairs}
    except ValueError:
        parser.error(f"--outcomes={args.outcomes}: give NAME=WEIGHT,... ")
    unknown = sorted(set(args.weights) - set(OUTCOMES))
    if unknown or not any(args.weights.values()):
        problem = f"unknown {', '.join(unknown)}" if unknown else "every weight is 0"
        parser.error(f"--outcomes: {problem}; valid names: {', '.join(OUTCOMES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak, then print the targets; 1 if one is missed."""
    args = parse_args(argv)
    run_id = f"{os.getpid()}-{int(time.time())}"
    os.environ[TAG] = run_id
    os.environ.pop("RAY_ADDRESS", None)
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    os.environ["RAY_TMPDIR"] = ray_tmp  # the embedded default, fresh, never another Ray
    import ray

    started = time.time()
    until = time.monotonic() + args.minutes * 60
    tally = Tally()
    sizes = list(range(1, args.max_ranks + 1))
    with tempfile.TemporaryDirectory(prefix="soak") as stamps:
        threads = [
            threading.Thread(
                target=submitter,
                args=(t, sizes, until),
                kwargs={
                    "seed": args.seed * 1000 + t,
                    "weights": args.weights,
                    "tally": tally,
                    "stamps": Path(stamps),
                },
                name=f"soak-{t}",
            )
            for t in range(args.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:  # a call that never returns is the worst outcome of all
            thread.join(max(0.0, until + CALL_LIMIT_S - time.monotonic()))
        stuck = [thread for thread in threads if thread.is_alive()]
        if stuck:
            frames = sys._current_frames()
            for thread in stuck:
                print(
                    f"\nSTUCK: {thread.name}, a call still running {CALL_LIMIT_S:g} s after "
                    "the end:\n" + "".join(traceback.format_stack(frames[thread.ident]))
                )
            sys.stdout.flush()
            time.sleep(float(os.environ.get("SOAK_HOLD", "0")))
            os._exit(1)
    elapsed = time.time() - started
    rss_end, fds_end, shmem_end = rss_mb(), open_fds(), rss_mb("RssShmem")
    left = leftovers(run_id, grace_s=20)
    alive = sorted(
        pid
        for pid in tally.pids
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    )
    shm = shm_files(started)
    groups, held = released(ray, grace_s=20)

    calls = tally.total
    per_100 = None
    if tally.rss_at_100 is not None and calls > 100:
        per_100 = (rss_end - tally.rss_at_100) / ((calls - 100) / 100)
    times = sorted(tally.failure_to_error_s)
    p50 = statistics.median(times) if times else float("nan")
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else float("nan")
    print(
        f"\nsoak: {elapsed:.0f} s, {args.threads} threads x sizes {sizes[0]}..{sizes[-1]} "
        f"ranks, {calls} calls ({calls / elapsed * 60:.0f}/min), seed {args.seed}, "
        f"{os.cpu_count()} cores\n"
    )
    print("calls per outcome: " + ", ".join(f"{k} {tally.calls[k]}" for k in OUTCOMES))
    rows = [
        ("wrong results", str(len(tally.wrong_results)), "0", not tally.wrong_results),
        (
            "errors with a wrong root cause or type",
            str(len(tally.wrong_errors)),
            "0",
            not tally.wrong_errors,
        ),
        (
            "rank and keeper processes left after shutdown()",
            str(len(left) + len(alive)),
            "0",
            not left and not alive,
        ),
        (
            "driver fds after shutdown() minus at call 100",
            "-" if tally.fds_at_100 is None else str(fds_end - tally.fds_at_100),
            "<= 0",
            tally.fds_at_100 is None or fds_end <= tally.fds_at_100,
        ),
        ("/dev/shm buffer files left", str(len(shm)), "0", not shm),
        ("placement groups left", str(len(groups)), "0", not groups),
        ("resources still held", str(held or 0), "0", not held),
        (
            "driver private RSS growth per 100 calls after the first 100",
            "-" if per_100 is None else f"{per_100:.2f} MB",
            "<= 5 MB",
            per_100 is None or per_100 <= 5,
        ),
        (
            "  object store pages it mapped meanwhile (Ray's, bounded by the store)",
            "-" if tally.shmem_at_100 is None else f"{shmem_end - tally.shmem_at_100:+.1f} MB",
            "-",
            True,
        ),
        (
            "failure to error, p50 / p99",
            f"{p50:.3f} / {p99:.3f} s ({len(times)} failures)",
            "-",
            True,
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'target':<{width}}  {'measured':>26}  {'wanted':>7}  met")
    for name, value, wanted, met in rows:
        print(f"{name:<{width}}  {value:>26}  {wanted:>7}  {'yes' if met else 'NO'}")
    for problem in (tally.wrong_results + tally.wrong_errors)[:10]:
        print(f"  {problem}")
    for line in (left + [f"rank pid {pid}" for pid in alive])[:10]:
        print(f"  left: {line}")
    ray.shutdown()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return 0 if all(met for *_, met in rows) and calls else 1


if __name__ == "__main__":
    sys.exit(main())
