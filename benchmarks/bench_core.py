"""Core benchmarks: `distribute` against torchrun, 4 ranks on one node, gloo, CPU.

    python -m benchmarks.bench_core                  # everything (about 16 min on 2 cores)
    python -m benchmarks.bench_core --quick          # fewest repetitions: a smoke check
    python -m benchmarks.bench_core --only warm,shipping --verbose

Sections (each runs in a fresh driver process with its own RAY_TMPDIR and no
RAY_ADDRESS, so it starts its own Ray and never joins another cluster):

  cold      fresh `python` through distribute() vs `torchrun --standalone`  (target ratio <= 0.8),
            with nothing running and with `orchestrator local start` running
  warm      the same job again on the warm pool (< 0.1 s); a rank-only call (< 5 ms)
  train     DDP steps/s inside the ranks: warm pool, fresh pool, torchrun, rotated (>= 0.98)
  loader    examples/resnet.py fed by a DataLoader with 0/2/4 workers, 1 and 2 ranks, fresh
            processes through distribute() and torchrun, alternating         (each >= 0.98)
  memory    peak RSS of a rank (ours vs a torchrun worker: at most +100 MB) and of the driver
  shipping  a 200 MB closure called on 1 and on 8 ranks                   (8 ranks <= 1.5x)
  growth    2..16 ranks over 1..8 simulated nodes (ray.cluster_utils.Cluster): cold and warm

Every process a section starts carries a tag in its environment; after the section
those still alive (Ray daemons, workers, torchrun children) are stopped by pid and
reported as left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SECTIONS = ("cold", "warm", "train", "loader", "memory", "shipping", "growth")
TAG = "BENCH_CORE_TAG"
"""Environment variable every process started by one run carries (value: the run's id)."""
RANKS = 4


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """How many repetitions each section makes."""

    cold_runs: int = 3
    warm_calls: int = 20
    rank_calls: int = 200
    train_reps: int = 5
    train_steps: int = 150
    train_warmup: int = 10
    train_width: int = 512
    train_batch: int = 64
    loader_reps: int = 3
    loader_layouts: tuple[tuple[int, int], ...] = tuple(
        (ranks, workers) for ranks in (1, 2) for workers in (0, 2, 4)
    )
    memory_train_steps: int = 20
    shipping_mb: int = 200
    shipping_calls: int = 5
    growth_calls: int = 10
    growth_layouts: tuple[tuple[int, int], ...] = ((2, 1), (4, 2), (8, 4), (16, 8))
    verbose: bool = False

    @classmethod
    def quick(cls) -> Settings:
        """The fewest repetitions that still fill every table."""
        return cls(
            cold_runs=1,
            warm_calls=5,
            rank_calls=50,
            train_reps=1,
            train_steps=40,
            train_warmup=5,
            loader_reps=1,
            memory_train_steps=10,
            shipping_calls=2,
            growth_calls=2,
        )


@dataclass
class Table:
    """One printed table: title, column names, rows of cells, notes under it."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Check:
    """One target: what was measured against what was wanted."""

    name: str
    value: str
    target: str
    met: bool


@dataclass
class SectionResult:
    """What a section hands back to the parent process."""

    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def fmt_s(seconds: float) -> str:
    """Seconds with a readable unit: '12.34 s', '45.6 ms', '789 us'."""
    if math.isnan(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def fmt_spread(values: Sequence[float]) -> str:
    """'min..max' of `values` in fmt_s units, '-' for fewer than two."""
    if len(values) < 2:
        return "-"
    return f"{fmt_s(min(values))}..{fmt_s(max(values))}"


def timing_row(label: str, times: Sequence[float], first: float | None = None) -> list[str]:
    """[label, count, median, mean, min..max, how many over 1 s, first call] of `times`."""
    return [
        label,
        str(len(times)),
        fmt_s(median(times)),
        fmt_s(statistics.fmean(times)) if times else "-",
        fmt_spread(times),
        str(sum(t > 1 for t in times)),
        "-" if first is None else fmt_s(first),
    ]


def fmt_mb(mb: float) -> str:
    """Mebibytes with one decimal."""
    return f"{mb:.1f} MB"


def progress(message: str) -> None:
    """A progress line; the parent shows lines with this prefix while the section runs."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


_NUMBER = re.compile(r"^[-+]?\d[\d.]*( [A-Za-z/]+)?(\.\.\d[\d.]*( [A-Za-z/]+)?)?$")
"""A cell right-aligned in tables: a number with an optional unit, or a 'min..max' range."""


def render(table: Table) -> str:
    """The table as aligned plain text: numbers right-aligned, text left-aligned."""
    cells = [table.headers, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.headers))]

    def line(row: list[str]) -> str:
        parts = []
        for i, cell in enumerate(row):
            numeric = _NUMBER.match(cell) is not None
            parts.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [table.title, "=" * len(table.title), line(table.headers), rule]
    out += [line(row) for row in table.rows]
    out += [f"  {note}" for note in table.notes]
    return "\n".join(out)


def vm_hwm_mb(pid: int) -> float:
    """Peak RSS so far of process `pid` (VmHWM), 0 when it is gone."""
    try:
        for text in Path(f"/proc/{pid}/status").read_text().splitlines():
            if text.startswith("VmHWM:"):
                return int(text.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def tagged_processes(key: str, value: str) -> list[psutil.Process]:
    """Live processes (not this one) whose environment has `key`=`value`."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(key) == value:
                found.append(proc)
    return found


def stop_leftovers(key: str, value: str, grace: float = 10.0) -> list[str]:
    """Wait up to `grace` s for tagged processes to exit, then stop the rest by pid.

    Returns 'pid name' of each process that had to be stopped.
    """
    deadline = time.monotonic() + grace
    left = tagged_processes(key, value)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tagged_processes(key, value)
    names = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} {proc.name()}")
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=3)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return names


@contextlib.contextmanager
def fresh_ray_tmpdir() -> Iterator[str]:
    """A new short RAY_TMPDIR (Ray's socket paths must stay short); removed afterwards."""
    path = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def clean_env(ray_tmpdir: str | None = None) -> dict[str, str]:
    """This environment without RAY_ADDRESS, with `ray_tmpdir` and the repo on PYTHONPATH.

    The orchestrator's per-call log folders go under `ray_tmpdir` too (removed afterwards),
    not under the user's home.
    """
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if ray_tmpdir:
        env["RAY_TMPDIR"] = ray_tmpdir
        env["ORCHESTRATOR_LOG_DIR"] = str(Path(ray_tmpdir) / "orchestrator-logs")
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["OMP_NUM_THREADS"] = "1"  # what torchrun and distribute() pick for several ranks a node
    return env


def machine_cpu_s() -> float:
    """CPU time every process on this machine has used since boot (from /proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@dataclass
class Launch:
    """One finished subprocess: wall time, peak RSS of the process itself, its exit code."""

    wall_s: float
    peak_rss_mb: float
    returncode: int
    started: float
    """time.time() just before the process was started."""
    output: str
    cpu_s: float
    """CPU time the whole machine used meanwhile: the run's processes, their daemons, us."""


def launch(argv: list[str], env: dict[str, str], timeout: float = 300) -> Launch:
    """Run `argv` in its own process group, polling its peak RSS; kill the group on timeout."""
    with tempfile.TemporaryFile() as log:
        started = time.time()
        cpu0 = machine_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        peak = 0.0
        try:
            while proc.poll() is None:
                peak = max(peak, vm_hwm_mb(proc.pid))
                if time.perf_counter() - t0 > timeout:
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.01)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        wall = time.perf_counter() - t0
        cpu = machine_cpu_s() - cpu0
        log.seek(0)
        output = log.read().decode(errors="replace")
    return Launch(wall, peak, proc.returncode, started, output, cpu)


TORCHRUN_TRIES = 3
INCIDENTS: list[str] = []
"""Failures a section worked around (a crashed torchrun retried); shown under its tables."""


def torchrun(job: str, extra: list[str] | None = None) -> tuple[Launch, list[dict[str, Any]]]:
    """`torchrun --standalone --nproc_per_node=4 _jobs.py JOB`; (launch, per-rank results).

    A run whose process exits non-zero is retried (up to TORCHRUN_TRIES runs in all) and
    recorded in INCIDENTS, so one crash of the baseline does not lose a whole section.
    """
    argv = [TORCHRUN, "--standalone", f"--nproc_per_node={RANKS}"]
    argv += [str(ROOT / "benchmarks" / "_jobs.py"), job]
    for attempt in range(1, TORCHRUN_TRIES + 1):
        with tempfile.TemporaryDirectory(prefix="bct") as out:
            run = launch([*argv, "--out", out, *(extra or [])], clean_env())
            files = [Path(out) / f"rank{r}.json" for r in range(RANKS)]
            if not run.returncode:
                return run, [json.loads(f.read_text()) for f in files]
            written = sum(f.exists() for f in files)
        lines = [line.strip() for line in run.output.splitlines()]
        why = next(
            (
                line
                for key in ("terminate called", "error:", "exitcode")
                for line in lines
                if key in line
            ),
            "",
        )
        INCIDENTS.append(
            f"torchrun {job} exited with {run.returncode} (try {attempt}/{TORCHRUN_TRIES}, "
            f"{written}/{RANKS} ranks had written results): {why[:160]}"
        )
        progress(INCIDENTS[-1])
    raise RuntimeError(f"torchrun {job} failed {TORCHRUN_TRIES} times:\n{run.output[-3000:]}")


def timed_calls(fn: Callable[[], Any], count: int) -> list[float]:
    """Wall time of each of `count` calls of `fn`."""
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def train_args(settings: Settings, steps: int | None = None) -> list[str]:
    """The training job's options on torchrun's command line."""
    return [
        "--steps",
        str(steps or settings.train_steps),
        "--warmup",
        str(settings.train_warmup),
        "--width",
        str(settings.train_width),
        "--batch",
        str(settings.train_batch),
    ]


def train_kwargs(settings: Settings, steps: int | None = None) -> dict[str, int]:
    """The same options as keyword arguments of `_jobs.train`."""
    return {
        "steps": steps or settings.train_steps,
        "warmup": settings.train_warmup,
        "width": settings.train_width,
        "batch": settings.train_batch,
    }


def ray_processes_rss_mb(exclude: set[int]) -> tuple[int, float]:
    """(count, total RSS) of this run's Ray processes other than `exclude` and this one."""
    tmpdir = os.environ.get("RAY_TMPDIR", "")
    procs = [p for p in tagged_processes("RAY_TMPDIR", tmpdir) if p.pid not in exclude]
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss / (1 << 20)
    return len(procs), total


# --------------------------------------------------------------------------- sections


@contextlib.contextmanager
def local_runtime(spares: int) -> Iterator[tuple[dict[str, str], Callable[[], list[float]]]]:
    """`orchestrator local start` in a private RAY_TMPDIR: (its env, wait-until-idle).

    The wait returns the RSS (MB) of each ready spare; it is what idling costs.
    """
    with fresh_ray_tmpdir() as tmp:
        env = clean_env(tmp)
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [PYTHON, "-m", "orchestrator", "local", *args],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )

        started = cli("start", f"--spares={spares}", f"--port={port}")
        if started.returncode:
            raise RuntimeError(f"orchestrator local start failed:\n{started.stderr[-3000:]}")

        def idle() -> list[float]:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                spare = [p for p in psutil.process_iter(["cmdline"]) if _is_spare(p, tmp)]
                status = cli("status")
                if f"{spares} of {spares} warm" in status.stdout and "in use" not in status.stdout:
                    return [p.memory_full_info().uss / 2**20 for p in spare]
                time.sleep(0.5)
            raise RuntimeError(f"the local runtime did not get its spares back: {status.stdout}")

        try:
            yield env, idle
        finally:
            cli("stop")
            stop_leftovers("RAY_TMPDIR", tmp)


def _is_spare(proc: psutil.Process, tmp: str) -> bool:
    try:
        cmd = proc.info["cmdline"] or []
        return (
            bool(cmd)
            and cmd[0].startswith("ray::Spare")
            and proc.environ().get("RAY_TMPDIR") == tmp
        )
    except (psutil.Error, OSError):
        return False


def _cold_ours(env: dict[str, str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        result_file = Path(out) / "result.json"
        run = launch([PYTHON, "-m", "benchmarks._cold_ours", str(result_file)], env)
        if run.returncode:
            raise RuntimeError(f"cold start failed ({run.returncode}):\n{run.output[-3000:]}")
        data = json.loads(result_file.read_text())
    return {
        "wall": run.wall_s,
        "result": data["result_at"] - run.started,
        "python + imports": data["imported"] - run.started,
        "Ray start or connect": data["ray_up"] - data["imported"],
        "pool + 1st call": data["result_at"] - data["ray_up"],
        "exit": run.wall_s - (data["result_at"] - run.started),
        "driver": data["driver_peak_rss_mb"],
        "cpu": run.cpu_s,
    }


def section_cold(s: Settings) -> SectionResult:
    """Fresh `python` through distribute() vs torchrun, taking turns at going first.

    Ours twice: with nothing running (the embedded Ray starts and stops with the
    script), and with `orchestrator local start` running (warm spare ranks).
    """
    runs: dict[str, list[dict[str, float]]] = {
        "local": [],
        "torchrun beside it": [],
        "embedded": [],
        "torchrun": [],
    }
    leftovers: list[str] = []
    spare_rss: list[float] = []

    def run_torchrun() -> dict[str, float]:
        run, ranks = torchrun("trivial")
        done = max(r["done_at"] for r in ranks) - run.started
        spawned = min(r["process_started"] for r in ranks) - run.started
        return {
            "wall": run.wall_s,
            "result": done,
            "launcher until ranks spawned": spawned,
            "ranks' imports + job": done - spawned,
            "exit": run.wall_s - done,
            "driver": run.peak_rss_mb,
            "cpu": run.cpu_s,
        }

    # Apart: a second Ray beside the local runtime starts 3-4 s slower (seen here).
    for i in range(s.cold_runs):
        for who in ("embedded", "torchrun") if i % 2 == 0 else ("torchrun", "embedded"):
            progress(f"cold run {i + 1}/{s.cold_runs}: {who}")
            if who == "torchrun":
                runs[who].append(run_torchrun())
                continue
            with fresh_ray_tmpdir() as tmp:
                runs[who].append(_cold_ours(clean_env(tmp)))
                leftovers += stop_leftovers("RAY_TMPDIR", tmp)
    with local_runtime(RANKS) as (local_env, idle):
        for i in range(s.cold_runs):
            for who in ("local", "torchrun beside it")[:: 1 if i % 2 == 0 else -1]:
                spare_rss = idle()  # nobody competes with the run for the 2 cores
                progress(f"cold run {i + 1}/{s.cold_runs}: {who}")
                runs[who].append(_cold_ours(local_env) if who == "local" else run_torchrun())

    def med(who: str, key: str) -> float:
        return median([r[key] for r in runs[who]])

    def breakdown(who: str) -> str:
        keys = [k for k in runs[who][0] if k not in ("wall", "result", "driver", "cpu")]
        return ", ".join(f"{k} {fmt_s(med(who, k))}" for k in keys)

    table = Table(
        f"1. Cold start: trivial gloo job on {RANKS} ranks from a fresh process "
        f"(median of {s.cold_runs})",
        [
            "launcher",
            "wall to exit",
            "min..max",
            "to result",
            "machine CPU",
            "driver peak RSS",
            "breakdown",
        ],
    )
    labels = {
        "local": "distribute, `orchestrator local start` running",
        "torchrun beside it": "torchrun --standalone, beside the idle local runtime",
        "embedded": "distribute, nothing running (embedded Ray)",
        "torchrun": "torchrun --standalone, alone",
    }
    for who, label in labels.items():
        table.rows.append(
            [
                label,
                fmt_s(med(who, "wall")),
                fmt_spread([r["wall"] for r in runs[who]]),
                fmt_s(med(who, "result")),
                fmt_s(med(who, "cpu")),
                fmt_mb(med(who, "driver")),
                breakdown(who),
            ]
        )
    ratios = {}
    for who, theirs in (("local", "torchrun beside it"), ("embedded", "torchrun")):
        ratios[who] = med(who, "wall") / med(theirs, "wall")
        result_ratio = med(who, "result") / med(theirs, "result")
        cpu_ratio = med(who, "cpu") / med(theirs, "cpu")
        table.rows.append(
            [
                f"ratio {who}/{theirs}",
                f"{ratios[who]:.2f}",
                "",
                f"{result_ratio:.2f}",
                f"{cpu_ratio:.2f}",
                "",
                "",
            ]
        )
    table.notes += [
        "to result: process start until our driver has every rank's result / until torchrun's "
        "last rank returned; exit: from then until the process is gone (Ray's shutdown, teardown)",
        "machine CPU: CPU time all processes used during the run (/proc/stat; the run's own, "
        f"Ray's daemons, this benchmark's polling); on {os.cpu_count()} cores no run can take "
        f"less wall time than machine CPU / {os.cpu_count()}",
        "driver peak RSS: our driver process / torchrun's launcher process (polled VmHWM)",
        f"local runtime: {RANKS} spares; each run beside it starts once they are all back "
        f"(replaced after every script, in the background); idle, each spare holds "
        f"{fmt_mb(median(spare_rss) if spare_rss else 0)} of its own memory (USS)",
    ]
    if leftovers:
        table.notes.append(f"LEFT BEHIND after exit (stopped by pid): {', '.join(leftovers)}")
    return SectionResult(
        [table],
        [
            Check(
                "cold start wall, local runtime/torchrun",
                f"{ratios['local']:.2f}",
                "<= 0.8",
                ratios["local"] <= 0.8,
            ),
            Check(
                "cold start wall, embedded/torchrun",
                f"{ratios['embedded']:.2f}",
                "<= 0.8",
                ratios["embedded"] <= 0.8,
            ),
        ],
    )


def section_warm(s: Settings) -> SectionResult:
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
    echo_cls = ray.remote(num_cpus=1)(_Echo)
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


class _Echo:
    """A Ray actor that does nothing: the floor of a call to warm actors."""

    def ping(self) -> int:
        """Return 0."""
        return 0

    def fetch(self, refs: list[Any]) -> int:
        """Get the object `refs[0]` points to (from the object store) and drop it."""
        import ray

        ray.get(refs[0])
        return 0


def section_train(s: Settings) -> SectionResult:
    """The same DDP loop through distribute() and torchrun, rotated; steps/s in the ranks."""
    from benchmarks._jobs import train
    from orchestrator import distribute

    progress("train: starting the warm pool and a warm-up call")
    job = distribute(train, num_replicas=RANKS)
    job(**train_kwargs(s, steps=s.train_warmup))
    launchers = ("warm", "fresh", "torchrun")
    rates: dict[str, list[float]] = {k: [] for k in launchers}
    walls: dict[str, list[float]] = {k: [] for k in launchers}
    threads: set[int] = set()
    for i in range(s.train_reps):
        order = launchers[i % 3 :] + launchers[: i % 3]  # each goes first in turn
        for who in order:
            progress(f"train rep {i + 1}/{s.train_reps}: {who}")
            t0 = time.perf_counter()
            if who == "warm":
                ranks = job(**train_kwargs(s))
            elif who == "fresh":
                with distribute(train, num_replicas=RANKS, name="fresh") as fresh:
                    ranks = fresh(**train_kwargs(s))
            else:
                _, ranks = torchrun("train", train_args(s))
            walls[who].append(time.perf_counter() - t0)
            rates[who].append(ranks[0]["steps_per_s"])
            threads |= {r["threads"] for r in ranks}
    job.shutdown()
    theirs = median(rates["torchrun"])
    ratio = {k: median(rates[k]) / theirs for k in ("warm", "fresh")}
    table = Table(
        f"3. DDP training throughput, {RANKS} ranks, gloo (MLP width {s.train_width}, batch "
        f"{s.train_batch}, {s.train_steps} timed steps after {s.train_warmup}; "
        f"median of {s.train_reps})",
        ["launcher", "steps/s", "min..max steps/s", "ratio to torchrun", "wall per run"],
    )
    for who, label in (
        ("warm", "distribute, warm pool"),
        ("fresh", "distribute, fresh pool"),
        ("torchrun", "torchrun --standalone"),
    ):
        table.rows.append(
            [
                label,
                f"{median(rates[who]):.2f}",
                f"{min(rates[who]):.2f}..{max(rates[who]):.2f}",
                f"{ratio[who]:.3f}" if who in ratio else "-",
                fmt_s(median(walls[who])),
            ]
        )
    pairs = [a / b for a, b in zip(rates["warm"], rates["torchrun"], strict=True)]
    table.notes += [
        "steps/s: timed inside the ranks (barrier to barrier, slowest rank), start-up excluded; "
        f"torch threads per rank: {sorted(threads)}",
        f"warm/torchrun per rep: {', '.join(f'{p:.3f}' for p in pairs)}",
        "warm pool: ranks that already ran the loop; fresh pool: new actors per run, like "
        "torchrun's new processes; wall: the whole call / the whole torchrun process",
    ]
    return SectionResult(
        [table],
        [
            Check(f"training steps/s, {k} pool/torchrun", f"{r:.3f}", ">= 0.98", r >= 0.98)
            for k, r in ratio.items()
        ],
    )


LOADER_TRAINING = ("--arch=resnet18", "--image-size=64", "--batch-size=16", "--steps=30",
                   "--warmup=5")
"""examples/resnet.py's settings in the loader section: bench_gpu's CPU settings."""


def section_loader(s: Settings) -> SectionResult:
    """A DataLoader-fed ResNet through distribute() and torchrun, fresh processes alternating.

    The example times its steps inside the ranks, loader teardown included (as an
    epoch's end has it). Neither launcher gets OMP_NUM_THREADS: each picks its default.
    """
    from benchmarks import bench_gpu

    os.environ.pop("OMP_NUM_THREADS", None)
    table = Table(
        f"DataLoader-fed training: resnet18, 64 px synthetic, batch 16 per rank, 30 steps "
        f"(5 not timed), gloo; images/s, median (min..max) of {s.loader_reps}",
        ["ranks", "loader workers", "distribute", "torchrun", "ratio"],
    )
    checks = []
    for ranks, workers in s.loader_layouts:
        args = bench_gpu.parse_args([*LOADER_TRAINING, f"--workers={workers}"])
        launchers = bench_gpu.commands(args, ranks)
        rates: dict[str, list[float]] = {name: [] for name in launchers}
        for rep in range(s.loader_reps):
            order = list(launchers) if rep % 2 == 0 else list(reversed(launchers))
            for name in order:
                progress(f"loader: {ranks} rank(s), {workers} workers, rep {rep + 1}: {name}")
                rates[name].append(bench_gpu.run(launchers[name], args.timeout)[0])
        ratio = median(rates["distribute"]) / median(rates["torchrun"])
        cells = [f"{median(r):.1f} ({min(r):.1f}..{max(r):.1f})" for r in rates.values()]
        table.rows.append([str(ranks), str(workers), *cells, f"{ratio:.3f}"])
        what = f"DataLoader training, {ranks} rank(s), {workers} workers, distribute/torchrun"
        checks.append(Check(what, f"{ratio:.3f}", ">= 0.98", ratio >= 0.98))
    table.notes.append(
        "each run a fresh process: `python examples/resnet.py` (embedded Ray) or `torchrun "
        "--standalone`; the order alternates per repeat; images/s timed inside the ranks"
    )
    return SectionResult([table], checks)


def section_memory(s: Settings) -> SectionResult:
    """Memory of ranks (ours vs torchrun workers), of Ray's daemons, drivers and references."""
    import ray

    from benchmarks._jobs import train, trivial
    from benchmarks._memory import memory, memory_after_torch
    from orchestrator import distribute

    ranks_table = Table(
        f"4a. Memory of a rank, {RANKS} ranks (max over ranks, measured inside the job)",
        ["job", "launcher", "peak RSS", "anon RSS", "file RSS", "idle RSS"],
    )
    checks = []
    launcher_peaks = []
    daemons = (0, 0.0)
    cols = ("peak_rss_mb", "anon_mb", "file_mb")
    for label, fn, kwargs, job_name, extra in (
        ("trivial gloo job", trivial, {}, "trivial", []),
        (
            f"DDP MLP, {s.memory_train_steps} steps",
            train,
            train_kwargs(s, steps=s.memory_train_steps),
            "train",
            train_args(s, steps=s.memory_train_steps),
        ),
    ):
        progress(f"memory: {label} through distribute")
        job = distribute(fn, num_replicas=RANKS)
        ours = job(**kwargs)
        pids = job.pids()
        idle = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                idle.append(psutil.Process(pid).memory_info().rss / (1 << 20))
        daemons = ray_processes_rss_mb(set(pids))
        job.shutdown()
        progress(f"memory: {label} under torchrun")
        run, theirs = torchrun(job_name, extra)
        launcher_peaks.append(run.peak_rss_mb)
        worst_ours = {c: max(r[c] for r in ours) for c in cols}
        worst_theirs = {c: max(r[c] for r in theirs) for c in cols}
        ranks_table.rows += [
            [label, "distribute", *(fmt_mb(worst_ours[c]) for c in cols), fmt_mb(max(idle))],
            ["", "torchrun", *(fmt_mb(worst_theirs[c]) for c in cols), "-"],
            ["", "difference", *(f"{worst_ours[c] - worst_theirs[c]:+.1f} MB" for c in cols), ""],
        ]
        diff = worst_ours["peak_rss_mb"] - worst_theirs["peak_rss_mb"]
        checks.append(
            Check(
                f"rank peak RSS, ours - torchrun ({label})",
                f"{diff:+.1f} MB",
                "<= +100 MB",
                diff <= 100,
            )
        )

    progress("memory: bare Ray actor, Ray actor with torch, plain python with torch")
    bare = ray.get(ray.remote(num_cpus=1)(memory).remote())
    with_torch = ray.get(ray.remote(num_cpus=1)(memory_after_torch).remote())
    code = "import json, benchmarks._memory as m; print(json.dumps(m.memory_after_torch()))"
    plain = launch([PYTHON, "-c", code], clean_env())
    plain_torch = json.loads(plain.output.strip().splitlines()[-1])
    ray.shutdown()
    driver = memory()

    ranks_table.notes += [
        "peak: ru_maxrss at the job's end; anon: the process's own pages (RssAnon) at the "
        "job's end; file: mapped shared libraries (RssFile), shared with other processes",
        "idle: current RSS of the warm rank process after the call (ours only)",
    ]
    ref = Table(
        "4b. Memory of the other processes, and of reference processes",
        ["process", "peak RSS", "anon RSS", "file RSS"],
    )
    ref.rows += [
        [
            "this section's driver (torch, Ray driver, pools)",
            fmt_mb(driver["peak_rss_mb"]),
            fmt_mb(driver["anon_mb"]),
            fmt_mb(driver["file_mb"]),
        ],
        ["torchrun launcher (polled VmHWM, whole life)", fmt_mb(max(launcher_peaks)), "-", "-"],
        [f"Ray daemons, {daemons[0]} processes (current RSS)", fmt_mb(daemons[1]), "-", "-"],
        *(
            [name, fmt_mb(m["peak_rss_mb"]), fmt_mb(m["anon_mb"]), fmt_mb(m["file_mb"])]
            for name, m in (
                ("bare Ray actor (Ray's worker code only)", bare),
                ("Ray actor after `import torch`", with_torch),
                ("plain python after `import torch`", plain_torch),
            )
        ),
    ]
    ref.notes.append(
        f"Ray's worker code in a torch process: "
        f"{with_torch['anon_mb'] - plain_torch['anon_mb']:+.1f} MB anon, "
        f"{with_torch['file_mb'] - plain_torch['file_mb']:+.1f} MB file; "
        "Ray daemons: gcs, raylet, agents of the embedded instance (torchrun has none)"
    )
    ref.notes.append("a cold user script's driver peak: see section 1")
    return SectionResult([ranks_table, ref], checks)


def section_shipping(s: Settings) -> SectionResult:
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
    fetch_cls = ray.remote(num_cpus=1)(_Echo)
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


def section_growth(s: Settings) -> SectionResult:
    """Cold and warm calls for 2..16 ranks over 1..8 simulated nodes (2 CPUs, 2 ranks each)."""
    import logging

    import ray
    from ray.cluster_utils import Cluster

    from benchmarks._jobs import trivial
    from orchestrator import distribute

    node_args = {"num_cpus": 2, "object_store_memory": 200 << 20}
    progress("growth: starting the head node")
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        nodes = 1
        add_s = time.perf_counter() - t0
        for ranks, want in s.growth_layouts:
            t0 = time.perf_counter()
            while nodes < want:
                cluster.add_node(**node_args)
                nodes += 1
            cluster.wait_for_nodes()
            _wait_cpus(2 * nodes)
            add_s += time.perf_counter() - t0
            progress(f"growth: {ranks} ranks on {nodes} node(s): cold call")
            t0 = time.perf_counter()
            job = distribute(
                trivial,
                num_replicas=ranks,
                replicas_per_node=ranks // nodes,
                cpus_per_replica=1,
                address=cluster.address,
                name=f"grow{ranks}",
            )
            first = job()
            cold = time.perf_counter() - t0
            assert [r["world"] for r in first] == [ranks] * ranks, first
            progress(f"growth: {ranks} ranks on {nodes} node(s): {s.growth_calls} warm calls")
            warm = timed_calls(job, s.growth_calls)
            job.shutdown()
            _wait_cpus(2 * nodes)
            row = timing_row(str(ranks), warm, cold)
            rows.append([row[0], str(nodes), row[-1], *row[2:6], fmt_s(add_s)])
            add_s = 0.0
    finally:
        ray.shutdown()
        cluster.shutdown()
    table = Table(
        "6. Growth: trivial gloo job, 2 ranks and 2 CPUs per simulated node "
        f"(ray.cluster_utils.Cluster; warm: median of {s.growth_calls})",
        [
            "ranks",
            "nodes",
            "cold (pool + 1st call)",
            "warm median",
            "warm mean",
            "warm min..max",
            "> 1 s",
            "adding nodes",
        ],
    )
    table.rows += rows
    table.notes.append(
        f"all nodes share this machine's {os.cpu_count()} cores: the cost of more ranks here "
        "is mostly CPU contention"
    )
    return SectionResult([table])


def _wait_cpus(total: float, timeout: float = 60) -> None:
    """Wait until the cluster has `total` CPUs and all of them are free."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            ray.cluster_resources().get("CPU", 0) >= total
            and ray.available_resources().get("CPU", 0) >= total
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"cluster CPUs not all free: {ray.available_resources()}")


RUNNERS: dict[str, Callable[[Settings], SectionResult]] = {
    "cold": section_cold,
    "warm": section_warm,
    "train": section_train,
    "loader": section_loader,
    "memory": section_memory,
    "shipping": section_shipping,
    "growth": section_growth,
}


# --------------------------------------------------------------------------- parent


def run_section(
    name: str, settings: Settings, run_id: str, timeout: float
) -> tuple[SectionResult | None, str]:
    """Run one section in a fresh driver process; (result or None, text for a failure).

    A section still running after `timeout` s is killed with everything it started.
    """
    with fresh_ray_tmpdir() as tmp, tempfile.TemporaryDirectory(prefix="bcr") as out:
        result_file = Path(out) / "result.json"
        log_file = Path(out) / "log.txt"
        env = clean_env(tmp)
        env[TAG] = run_id
        argv = [PYTHON, "-m", "benchmarks.bench_core", "--worker", name]
        argv += ["--settings", json.dumps(asdict(settings)), "--result", str(result_file)]
        with log_file.open("wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        shown = 0
        deadline = time.monotonic() + timeout
        try:
            while True:
                done = proc.poll() is not None
                shown = _show_progress(log_file, shown, settings.verbose)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"section {name} still running after {timeout:.0f} s")
                time.sleep(0.2)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            stop_leftovers(TAG, run_id, grace=0)
            raise
        leftovers = stop_leftovers(TAG, run_id)
        if proc.returncode or not result_file.exists():
            tail = log_file.read_text(errors="replace")[-4000:]
            return None, f"section {name} failed (exit {proc.returncode}):\n{tail}"
        data = json.loads(result_file.read_text())
    result = SectionResult(
        [Table(**t) for t in data["tables"]], [Check(**c) for c in data["checks"]]
    )
    if leftovers:
        result.tables[-1].notes.append(
            "LEFT BEHIND after the section's driver exited (stopped by pid): "
            + ", ".join(leftovers)
        )
    return result, ""


def _show_progress(log_file: Path, shown: int, verbose: bool) -> int:
    """Print the log's new complete lines (only '[bench]' ones unless `verbose`)."""
    text = log_file.read_bytes()[shown:]
    end = text.rfind(b"\n") + 1
    for raw in text[:end].decode(errors="replace").splitlines():
        if verbose or raw.startswith("[bench]"):
            print(f"    {raw}", file=sys.stderr, flush=True)
    return shown + end


def worker(name: str, settings: Settings, result_file: Path) -> None:
    """Child side: run section `name` and write its tables and checks as JSON."""
    result = RUNNERS[name](settings)
    if INCIDENTS and result.tables:
        result.tables[-1].notes += [f"INCIDENT: {text}" for text in INCIDENTS]
    result_file.write_text(json.dumps(asdict(result)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewest repetitions (smoke check)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--cold-runs", type=int, help="cold starts per launcher (default 3)")
    parser.add_argument("--train-reps", type=int, help="training runs per launcher (default 5)")
    parser.add_argument(
        "--section-timeout",
        type=float,
        default=900,
        help="seconds before a section is killed (default 900)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the sections' full output")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(
            f"--only: unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}"
        )
    for opt in ("cold_runs", "train_reps"):
        value = getattr(args, opt)
        if value is not None and value < 1:
            parser.error(f"--{opt.replace('_', '-')}={value}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections one after another and print their tables; 1 on failure."""
    args = parse_args(argv)
    if args.worker:
        data = json.loads(args.settings)
        for layouts in ("growth_layouts", "loader_layouts"):
            data[layouts] = tuple(tuple(x) for x in data[layouts])
        worker(args.worker, Settings(**data), Path(args.result))
        return 0
    settings = Settings.quick() if args.quick else Settings()
    settings.verbose = args.verbose
    if args.cold_runs:
        settings.cold_runs = args.cold_runs
    if args.train_reps:
        settings.train_reps = args.train_reps
    run_id = uuid.uuid4().hex
    started = time.perf_counter()
    print(
        f"bench_core: {', '.join(args.sections)}{' (quick)' if args.quick else ''}; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
        f"python {sys.version.split()[0]}",
        flush=True,
    )
    checks: list[Check] = []
    failed = []
    for name in args.sections:
        t0 = time.perf_counter()
        print(f"\n--- {name} ---", file=sys.stderr, flush=True)
        try:
            result, error = run_section(name, settings, run_id, args.section_timeout)
        except Exception:  # noqa: BLE001 - report and go on with the next section
            result, error = None, traceback.format_exc()
        if result is None:
            failed.append(name)
            print(f"\n{error}", flush=True)
            continue
        for table in result.tables:
            print(f"\n{render(table)}", flush=True)
        print(f"  (section took {time.perf_counter() - t0:.0f} s)", flush=True)
        checks += result.checks
    summary = Table(
        "Targets",
        ["target", "measured", "wanted", "met"],
        [[c.name, c.value, c.target, "yes" if c.met else "NO"] for c in checks],
    )
    if failed:
        summary.notes.append(f"FAILED sections: {', '.join(failed)}")
    summary.notes.append(
        f"total run time {time.perf_counter() - started:.0f} s; load average now "
        f"{os.getloadavg()[0]:.2f} (numbers are only comparable on a quiet machine)"
    )
    print(f"\n{render(summary)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
