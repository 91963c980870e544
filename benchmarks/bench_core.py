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

This file is the driver; each section is a module of benchmarks/core/ (its `run`), and
benchmarks/core/common.py holds what they share.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict
from pathlib import Path

from benchmarks.core.common import (
    INCIDENTS,
    PYTHON,
    ROOT,
    Check,
    SectionResult,
    Settings,
    Table,
    clean_env,
    fresh_ray_tmpdir,
    stop_leftovers,
)

SECTIONS = ("cold", "warm", "train", "loader", "memory", "shipping", "growth")
TAG = "BENCH_CORE_TAG"
"""Environment variable every process started by one run carries (value: the run's id)."""


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
    result = importlib.import_module(f"benchmarks.core.{name}").run(settings)
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
        "--baseline-tree",
        type=Path,
        help="another checkout (a `git worktree` of an older commit) whose cold start takes "
        "turns with this tree's and torchrun's",
    )
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
    tree = args.baseline_tree
    if tree is not None and not (tree / "benchmarks" / "_cold_ours.py").is_file():
        parser.error(
            f"--baseline-tree={tree}: no benchmarks/_cold_ours.py there; give a checkout of "
            "this repository, e.g. `git worktree add /tmp/old HEAD~1`"
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
    if args.baseline_tree:
        settings.baseline_tree = str(args.baseline_tree.resolve())
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
