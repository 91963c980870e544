"""What two or more of bench_core's sections share: settings, results, formatting, processes."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
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
    baseline_tree: str = ""
    """Another checkout (e.g. a `git worktree` of an older commit) whose cold start the cold
    section alternates with this tree's; "" for none."""

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


def clean_env(ray_tmpdir: str | None = None, root: Path = ROOT) -> dict[str, str]:
    """This environment without RAY_ADDRESS, with `ray_tmpdir` and `root` (this repo, or a
    baseline checkout) first on PYTHONPATH.

    The orchestrator's per-call log folders go under `ray_tmpdir` too (removed afterwards),
    not under the user's home.
    """
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if ray_tmpdir:
        env["RAY_TMPDIR"] = ray_tmpdir
        env["ORCHESTRATOR_LOG_DIR"] = str(Path(ray_tmpdir) / "orchestrator-logs")
    paths = [str(root), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    if root != ROOT:
        paths.insert(0, _workers_of(root))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["OMP_NUM_THREADS"] = "1"  # what torchrun and distribute() pick for several ranks a node
    return env


@functools.cache
def _workers_of(root: Path) -> str:
    """A private folder whose `orchestrator_workers` is `root`'s workers/: the editable
    install maps that name to this repository's folder, which PYTHONPATH cannot shadow."""
    shim = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    atexit.register(shutil.rmtree, shim, ignore_errors=True)  # the link only, not its target
    (shim / "orchestrator_workers").symlink_to(root / "workers", target_is_directory=True)
    return str(shim)


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


def launch(argv: list[str], env: dict[str, str], timeout: float = 300, cwd: Path = ROOT) -> Launch:
    """Run `argv` in its own process group, polling its peak RSS; kill the group on timeout."""
    with tempfile.TemporaryFile() as log:
        started = time.time()
        cpu0 = machine_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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


class Echo:
    """A Ray actor that does nothing: the floor of a call to warm actors."""

    def ping(self) -> int:
        """Return 0."""
        return 0

    def fetch(self, refs: list[Any]) -> int:
        """Get the object `refs[0]` points to (from the object store) and drop it."""
        import ray

        ray.get(refs[0])
        return 0
