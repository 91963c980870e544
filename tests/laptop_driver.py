"""Driver for test_bare_nodes.py's laptop: scenario after scenario through Ray Client.

Usage: python laptop_driver.py REPORT_JSON

Run on the laptop (tests/hosts.py: `Hosts.laptop_argv`): a network namespace that is no Ray
node, with /tmp, /dev/shm and HOME of its own, RAY_ADDRESS=ray://HEAD:10001 and the
cluster's token. It runs in its project folder, seen there as /mnt. Its functions travel
by value. Each scenario runs under its own time
limit; its result, or its error, goes into the report, written again after each.

In `detached`, the test takes the laptop's link down once the job has started (the file
`started` holds the job's id), past Ray Client's grace period, and brings it back.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orchestrator import DistributedError, distribute, get_job

SCENARIO_S = 150
HERE = Path("/mnt")
DETACHED_LINES = 200
"""Lines each rank of the detached job prints, one every 0.1 s."""


class ScenarioTimeout(Exception):
    """A scenario ran past SCENARIO_S."""


def _alarm(_signum: int, _frame: object) -> None:
    raise ScenarioTimeout(f"the scenario ran past {SCENARIO_S} s")


def _failure_of(exc: BaseException) -> dict[str, Any]:
    root = getattr(exc, "root_cause", None)
    return {
        "type": type(exc).__name__,
        "text": str(exc),
        "distributed": isinstance(exc, DistributedError),
        "root_rank": getattr(root, "rank", None),
        "root_exc_type": getattr(root, "exc_type", None),
    }


# --- what runs in the ranks ----------------------------------------------------------------


def raise_on_rank_1() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom, seen from a laptop")
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def die_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        print("last words of rank 1", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return 0


def stop_on_rank_1() -> int:
    secret = 6 * 7
    if os.environ["RANK"] == "1":
        breakpoint()
    return secret


def count(lines: int) -> int:
    for i in range(lines):
        print(f"line {i}", flush=True)
        time.sleep(0.1)
    return int(os.environ["RANK"])


# --- the scenarios -------------------------------------------------------------------------


def readme() -> dict[str, Any]:
    """The README's example, as a user on a laptop runs it."""
    runpy.run_path(str(HERE / "readme_example.py"), run_name="__main__")
    return {}


def raises() -> dict[str, Any]:
    """A rank's exception arrives with its traceback."""
    with distribute(raise_on_rank_1, num_replicas=2, replicas_per_node=1, name="pair") as fn:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            return _failure_of(exc)
    return {"type": None}


def crash() -> dict[str, Any]:
    """A rank SIGKILLed after a line: its last words, read on its node, are shown."""
    with distribute(die_on_rank_1, num_replicas=2, replicas_per_node=1, name="pair") as fn:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            return _failure_of(exc)
    return {"type": None}


class _Tee(io.TextIOBase):
    """stderr, kept as well as written."""

    def __init__(self, out: Any) -> None:
        self.out, self.kept = out, ""

    def write(self, text: str) -> int:
        self.kept += text
        return int(self.out.write(text))

    def flush(self) -> None:
        self.out.flush()


def debugger() -> dict[str, Any]:
    """breakpoint() in a rank; `orchestrator attach`, run on the laptop, drives its pdb."""
    line = r"DEBUG_TOKEN=([0-9a-f]{32}) python -m orchestrator attach ([\d.]+):(\d+)"
    tee = _Tee(sys.stderr)
    sys.stderr = tee
    try:
        with distribute(stop_on_rank_1, num_replicas=2, replicas_per_node=1, name="pdb") as fn:
            job = fn.submit()
            deadline = time.monotonic() + 60
            while (found := re.search(line, tee.kept)) is None:
                if time.monotonic() > deadline or job.done():
                    return {"error": "no attach line", "stderr": tee.kept[-3000:]}
                time.sleep(0.2)
            secret, host, port = found.groups()
            attach = subprocess.run(
                [sys.executable, "-m", "orchestrator", "attach", f"{host}:{port}"],
                input="p secret + 1\nc\n",
                env={**os.environ, "ORCHESTRATOR_DEBUG_TOKEN": secret},
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            return {
                "result": job.result(timeout=60),
                "host": host,
                "transcript": attach.stdout[-2000:],
                "attach_exit": attach.returncode,
            }
    finally:
        sys.stderr = tee.out


def detached() -> dict[str, Any]:
    """A detached job and a live one while the link is down past Ray Client's grace period:
    the detached one is followed on, the live one fails clearly and the next live call
    works; then the detached job is got back by other processes."""
    live = distribute(count, num_replicas=2, replicas_per_node=1, name="live")
    running = live.submit(DETACHED_LINES)
    fn = distribute(count, num_replicas=2, replicas_per_node=1, detach=True, name="count")
    job = fn.submit(DETACHED_LINES)
    (HERE / "started").write_text(job.id)
    started = time.monotonic()
    result: dict[str, Any] = {"id": job.id, "result": job.result(timeout=SCENARIO_S)}
    result["seconds_to_result"] = round(time.monotonic() - started, 2)
    try:
        result["live"] = {"type": None, "result": running.result(timeout=SCENARIO_S)}
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        result["live"] = _failure_of(exc)
    result["live_again"] = live(3)  # a new session, a new pool
    live.shutdown()
    begun = time.monotonic()
    logs = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", job.id],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    result["logs"], result["logs_exit"] = logs.stdout, logs.returncode
    result["logs_stderr"] = logs.stderr[-2000:]
    result["logs_seconds"] = round(time.monotonic() - begun, 2)
    begun = time.monotonic()
    again = subprocess.run(
        [sys.executable, "-c", f"import orchestrator, json; j = orchestrator.get_job("
         f"{job.id!r}, show=False); print(json.dumps(j.result(timeout=60)))"],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    result["again"] = again.stdout.strip().splitlines()[-1:] or again.stderr[-2000:]
    result["again_seconds"] = round(time.monotonic() - begun, 2)
    result["in_process"] = get_job(job.id, show=False).result(timeout=60)
    job.release()
    fn.shutdown()
    return result


def tokens() -> dict[str, Any]:
    """A driver without the cluster's token, and one with another: refused, at once, clearly."""
    found = {}
    program = "from orchestrator import distribute; distribute(abs, num_replicas=1)(-1)"
    for case, env in {
        "none": {"RAY_AUTH_TOKEN": "", "RAY_AUTH_MODE": ""},
        "wrong": {"RAY_AUTH_TOKEN": "0" * 64},
    }.items():
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", program], env={**os.environ, **env},
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
        found[case] = {
            "exit": proc.returncode,
            "last": (proc.stderr.strip().splitlines() or [""])[-1],
            "seconds": round(time.monotonic() - started, 2),
        }
    return found


SCENARIOS: list[Callable[[], dict[str, Any]]] = [
    tokens,
    readme,
    raises,
    crash,
    debugger,
    detached,
]


@contextlib.contextmanager
def _limit(seconds: int) -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main() -> None:
    """Run every scenario, each under its limit; write the report after each."""
    out = Path(sys.argv[1])
    report: dict[str, Any] = {"tmp": sorted(os.listdir("/tmp")), "home": os.environ["HOME"]}
    chosen = os.environ.get("LAPTOP_SCENARIOS", "").split()  # by hand: some of them
    for scenario in SCENARIOS:
        name = scenario.__name__
        if chosen and name not in chosen:
            continue
        print(f"=== {name} ===", flush=True)
        print(f"=== {name} ===", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            with _limit(SCENARIO_S):
                entry = scenario()
        except Exception as exc:  # noqa: BLE001 - a scenario's failure is its result
            entry = {"error": "".join(traceback.format_exception(exc))}
        entry["seconds"] = round(time.monotonic() - started, 2)
        report[name] = entry
        out.write_text(json.dumps(report, indent=1, default=repr))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
