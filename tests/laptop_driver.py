"""Driver for test_bare_nodes.py's laptop: scenario after scenario through Ray Client.

Usage: python laptop_driver.py REPORT_JSON

Run on the laptop (tests/hosts.py: `Hosts.laptop_argv`): a network namespace that is no Ray
node, with /tmp, /dev/shm and HOME of its own, RAY_ADDRESS=ray://HEAD:10001 and the
cluster's token. It runs in its project folder, seen there as /mnt, beside
tests/scenarios.py. Its functions travel by value. Each scenario runs under its own time
limit; its result, or its error, goes into the report, written again after each.

In `detached`, the test takes the laptop's link down once the job has started (the file
`started` holds the job's id), past Ray Client's grace period, and brings it back; while it
is down, it touches `link-down` (seen by the nodes in LAPTOP_HOST_FOLDER), which makes a
second detached job's rank kill that job's supervisor.
"""

from __future__ import annotations

import io
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scenarios import failure_of, run_all

from orchestrator import distribute, get_job

SCENARIO_S = 150
HERE = Path("/mnt")
DETACHED_LINES = 200
"""Lines each rank of the detached job prints, one every 0.1 s."""


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
        # A moment for the capture thread to copy the line to its keeper: a write at the
        # very instant of a SIGKILL may die with the thread reading it (docs/usage.md).
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return 0


def stop_on_rank_1() -> int:
    secret = 6 * 7
    if os.environ["RANK"] == "1":
        breakpoint()
    return secret


def fail_sharing(table: Any) -> int:
    """Rank 1 plants what a rank killed before it counted itself would leave in its node's
    /dev/shm (named after the call's copy it maps), then fails; the others wait."""
    from orchestrator_workers import sharing

    if os.environ["RANK"] != "1":
        time.sleep(60)
        return 0
    maps = Path("/proc/self/maps").read_text()
    mapped = re.search(rf"{sharing.SHM}/({sharing.PREFIX}\S+)", maps)
    if mapped is None:
        raise RuntimeError("no node copy of the call's buffers is mapped here")
    planted = f"{mapped.group(1)}-lost"
    (sharing.SHM / planted).write_bytes(b"x")
    raise ValueError(f"rank 1 fails ({float(table.sum()):g}); planted {planted}")


def kill_own_supervisor(folder: str) -> int:
    """Once the laptop's link is down (`link-down` in `folder`), rank 0 kills this job's
    supervisor; the ranks go with it."""
    import ray

    deadline = time.monotonic() + SCENARIO_S
    while not Path(folder, "link-down").exists():
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.1)
    if os.environ["RANK"] == "0":
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].startswith("supervisor-doomed-"):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    time.sleep(SCENARIO_S)
    return 0


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


def _failure(fn: Callable[[], int]) -> dict[str, Any]:
    """What a call of `fn` on a pair of ranks raised ({"type": None} if it returned)."""
    with distribute(fn, num_replicas=2, replicas_per_node=1, name="pair") as pair:
        try:
            pair()
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            return failure_of(exc)
    return {"type": None}


def raises() -> dict[str, Any]:
    """A rank's exception arrives with its traceback."""
    return _failure(raise_on_rank_1)


def crash() -> dict[str, Any]:
    """A rank SIGKILLed after a line: its last words, read on its node, are shown."""
    return _failure(die_on_rank_1)


def shm() -> dict[str, Any]:
    """A failed call's /dev/shm buffers are removed on the nodes, by a laptop that is no
    node (the test looks at the nodes' /dev/shm)."""
    import torch

    table = torch.ones(1 << 20)  # 4 MB: shared through /dev/shm by each node's two ranks
    with distribute(fail_sharing, num_replicas=4, replicas_per_node=2, name="shm") as fn:
        try:
            fn(table)
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            return failure_of(exc)
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
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
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
    works; then the detached job is got back by other processes. A third job, detached,
    loses its supervisor meanwhile: said clearly once the link is back."""
    doomed_fn = distribute(
        kill_own_supervisor, num_replicas=2, replicas_per_node=1, detach=True, name="doomed"
    )
    doomed = doomed_fn.submit(os.environ["LAPTOP_HOST_FOLDER"])
    deadline = time.monotonic() + SCENARIO_S / 2
    while doomed.status().state != "running":  # its ranks wait for the link to go down
        if time.monotonic() > deadline or doomed.done():
            return {"error": f"the doomed job never ran: {doomed.status()}"}
        time.sleep(0.2)
    live = distribute(count, num_replicas=2, replicas_per_node=1, name="live")
    running = live.submit(DETACHED_LINES)
    fn = distribute(count, num_replicas=2, replicas_per_node=1, detach=True, name="count")
    job = fn.submit(DETACHED_LINES)
    (HERE / "started").write_text(job.id)
    started = time.monotonic()
    result: dict[str, Any] = {"id": job.id, "result": job.result(timeout=SCENARIO_S)}
    result["seconds_to_result"] = round(time.monotonic() - started, 2)
    for key, get in (
        ("doomed", lambda: doomed.result(timeout=SCENARIO_S)),
        ("doomed_again", lambda: get_job(doomed.id, show=False)),
    ):
        try:
            result[key] = {"type": None, "result": repr(get())}
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            result[key] = failure_of(exc)
    doomed_fn.shutdown()
    try:
        result["live"] = {"type": None, "result": running.result(timeout=SCENARIO_S)}
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        result["live"] = failure_of(exc)
    result["live_again"] = live(3)  # a new session, a new pool
    live.shutdown()
    begun = time.monotonic()
    logs = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", job.id],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    result["logs"], result["logs_exit"] = logs.stdout, logs.returncode
    result["logs_stderr"] = logs.stderr[-2000:]
    result["logs_seconds"] = round(time.monotonic() - begun, 2)
    begun = time.monotonic()
    again = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import orchestrator, json; j = orchestrator.get_job("
            f"{job.id!r}, show=False); print(json.dumps(j.result(timeout=60)))",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
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
            [sys.executable, "-c", program],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
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
    shm,
    debugger,
    detached,
]


def main() -> None:
    """Run every scenario (or those LAPTOP_SCENARIOS names), each under its limit; write
    the report after each."""
    chosen = os.environ.get("LAPTOP_SCENARIOS", "").split()  # by hand: some of them
    run_all(
        [(s.__name__, s) for s in SCENARIOS if not chosen or s.__name__ in chosen],
        Path(sys.argv[1]),
        SCENARIO_S,
        report={"tmp": sorted(os.listdir("/tmp")), "home": os.environ["HOME"]},
    )


if __name__ == "__main__":
    main()
