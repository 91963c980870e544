"""Time from a rank's crash to every rank running the function again, ours vs torchrun.

    python -m benchmarks.bench_restarts [--repeats 3]

One node, 4 ranks, gloo. On attempt 0, rank 1 writes time.time() and SIGKILLs itself
while the other ranks wait in an all_reduce. Ours: distribute(..., max_restarts=1) on an
embedded local Ray. torchrun: `torchrun --standalone --nproc_per_node=4 --max-restarts=1`
on the same body as a script. On attempt 1 every rank writes time.time() when the
function (the script's first line) starts, and again after init_process_group returns.
Reported: max over ranks of each, minus the crash time; median of --repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrator import Job, State, distribute

RANKS = 4
CRASHING_RANK = 1
POLL_S = 0.005
"""How often the driver's clock reads the job's status while it runs."""

_SCRIPT = """
import time
started = time.time()
import os, signal, sys
from pathlib import Path
import torch, torch.distributed as dist
folder, rank = Path(sys.argv[1]), os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
# torchrun reuses its store across restarts and attempt 1's gloo reads attempt 0's dead
# peers' addresses from it ("Connection refused"): a prefix per attempt works around that.
master = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
store = dist.PrefixStore(f"attempt-{attempt}", master)
world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", store=store, rank=int(rank), world_size=world)
(folder / f"start-{attempt}-{rank}").write_text(f"{started!r} {time.time()!r}")
if attempt == "0":
    if rank == "1":
        time.sleep(1.0)
        (folder / "crash").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


def _crashing(folder: str) -> None:
    started = time.time()
    import torch
    import torch.distributed as dist

    rank, attempt = os.environ["RANK"], os.environ["RESTART_COUNT"]
    dist.init_process_group("gloo")
    (Path(folder) / f"start-{attempt}-{rank}").write_text(f"{started!r} {time.time()!r}")
    if attempt == "0":
        if rank == str(CRASHING_RANK):
            time.sleep(1.0)
            (Path(folder) / "crash").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def _stamps(folder: Path) -> dict[str, float]:
    """Seconds from the crash to the last rank of attempt 1 starting and joining."""
    crash = float((folder / "crash").read_text())
    pairs = [
        tuple(map(float, (folder / f"start-1-{rank}").read_text().split())) for rank in range(RANKS)
    ]
    return {
        "start": max(p[0] for p in pairs) - crash,
        "joined": max(p[1] for p in pairs) - crash,
    }


def _watch(job: Job[Any]) -> tuple[float, float]:
    """When the driver saw the crash (the job's first failed attempt recorded, its ranks
    stopped) and when its new ranks ran, read from the job's status as it runs."""
    detected = running = None
    while running is None and not job.done():
        status = job.status()
        now = time.time()
        if detected is None and status.restarts:
            detected = now
        if detected is not None and status.state == State.RUNNING:
            running = now
        time.sleep(POLL_S)
    job.result()
    assert detected is not None and running is not None, "the restart was not seen"
    return detected, running


def ours(folder: Path) -> dict[str, float]:
    """One crash and restart under distribute(max_restarts=1); the timings in seconds."""
    fn = distribute(
        _crashing,
        num_replicas=RANKS,
        replicas_per_node=RANKS,
        max_restarts=1,
        log_dir=False,
        log_ranks=[],
        name="restarts",
    )
    with fn:
        detected, running = _watch(fn.submit(str(folder)))
    result = _stamps(folder)
    crash = float((folder / "crash").read_text())
    result["detected"] = detected - crash
    result["pool"] = running - crash
    return result


def torchrun(folder: Path, script: Path) -> dict[str, float]:
    """One crash and restart under torchrun --max-restarts=1; the timings in seconds."""
    argv = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc_per_node={RANKS}",
        "--max-restarts=1",
        str(script),
        str(folder),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return _stamps(folder)


def _median(runs: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in runs if key in r]
    return f"{statistics.median(values):.3f}s" if values else "-"


def main(argv: list[str] | None = None) -> int:
    """Measure both launchers --repeats times and print the medians as a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # short: Ray's sockets live here
    os.environ["RAY_TMPDIR"] = str(tmp)  # a private embedded Ray, never someone else's
    os.environ.pop("RAY_ADDRESS", None)
    script = tmp / "crash.py"
    script.write_text(_SCRIPT)
    mine: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    try:
        for i in range(args.repeats):
            for runs, measure in ((mine, ours), (theirs, None)):
                folder = tmp / f"{'ours' if measure else 'torchrun'}-{i}"
                folder.mkdir()
                runs.append(measure(folder) if measure else torchrun(folder, script))
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\nCrash of rank {CRASHING_RANK} of {RANKS} (SIGKILL, 1 node, gloo) -> all ranks "
        f"running attempt 1 (median of {args.repeats})"
    )
    print(f"{'':<36}{'distribute':>12}{'torchrun':>12}")
    rows = (
        ("driver saw the crash, ranks stopped", "detected"),
        ("new ranks running (pool started)", "pool"),
        ("all ranks in the function", "start"),
        ("all ranks past init_process_group", "joined"),
    )
    for label, key in rows:
        print(f"{label:<36}{_median(mine, key):>12}{_median(theirs, key):>12}")
    print("target: not slower than torchrun")
    return 0


if __name__ == "__main__":
    sys.exit(main())
