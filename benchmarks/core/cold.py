"""Section 1 of bench_core: a cold start from a fresh process, distribute() vs torchrun."""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from benchmarks.core.common import (
    PYTHON,
    RANKS,
    ROOT,
    Check,
    SectionResult,
    Settings,
    Table,
    clean_env,
    fmt_mb,
    fmt_s,
    fmt_spread,
    fresh_ray_tmpdir,
    launch,
    median,
    progress,
    stop_leftovers,
    torchrun,
)


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


def _cold_ours(env: dict[str, str], root: Path = ROOT) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        result_file = Path(out) / "result.json"
        argv = [PYTHON, "-m", "benchmarks._cold_ours", str(result_file)]
        run = launch(argv, env, cwd=root)
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


def run(s: Settings) -> SectionResult:
    """Fresh `python` through distribute() vs torchrun, taking turns at going first.

    Ours twice: with nothing running (the embedded Ray starts and stops with the
    script), and with `orchestrator local start` running (warm spare ranks). With a
    baseline tree, its embedded start takes turns with ours and torchrun's.
    """
    runs: dict[str, list[dict[str, float]]] = {
        "local": [],
        "torchrun beside it": [],
        "embedded": [],
        "torchrun": [],
    }
    baseline = Path(s.baseline_tree) if s.baseline_tree else None
    if baseline:
        runs["baseline"] = []
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
    for root in (ROOT, *([baseline] if baseline else [])):  # as pip's install would have
        for folder in ("orchestrator", "workers", "benchmarks"):
            compileall.compile_dir(root / folder, quiet=1)
    turns = ["embedded", "torchrun", *(["baseline"] if baseline else [])]
    for i in range(s.cold_runs):
        for who in turns[i % len(turns) :] + turns[: i % len(turns)]:
            progress(f"cold run {i + 1}/{s.cold_runs}: {who}")
            if who == "torchrun":
                runs[who].append(run_torchrun())
                continue
            root = baseline if who == "baseline" and baseline else ROOT
            with fresh_ray_tmpdir() as tmp:
                runs[who].append(_cold_ours(clean_env(tmp, root), root))
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
    if baseline:
        labels["baseline"] = f"distribute, nothing running, baseline tree {baseline}"
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
    pairs = [("local", "torchrun beside it"), ("embedded", "torchrun")]
    for who, theirs in pairs + ([("baseline", "torchrun")] if baseline else []):
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
        "bytecode: the trees' modules are compiled first, as a normal install has them (with "
        "PYTHONDONTWRITEBYTECODE set, as on this machine, each run would compile ours anew)",
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
