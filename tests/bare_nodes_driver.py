"""Driver for test_bare_nodes.py: scenario after scenario against nodes without this package.

Usage: python bare_nodes_driver.py RAY_ADDRESS REPORT_JSON PROJECT_DIR

The test copies it into a project folder and runs it there, inside host 0's network
namespace, with the test venv's Python (the driver has the package; the nodes' Ray runs
from environments that lack it, or hold an older copy). It must import nothing of the
repository but the package (and tests/scenarios.py, copied beside it): its functions
travel by value. Each scenario runs under its
own time limit; its result, or its error and traceback, goes into the report, which is
written again after every scenario (a killed driver leaves those it finished).

The torch mismatch comes first, so that the driver's first look at the nodes is made
under `testing.driver_torch_version`: its pool (`where`, 4 ranks) tells where each rank's
`orchestrator_workers` comes from and writes lines on stdout and stderr; the same warm
pool then runs gloo across the hosts (`probe`), and the control call without
GLOO_SOCKET_IFNAME, which must fail; then the README's example runs as a second pool on
the same nodes, which must not warn again.

Pools cost most of the time, so scenarios share them where a call leaves its pool warm:
restarts, stall, raises and crash are calls of one 2-rank function (`pair`), whose pool a
failed call replaces.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from scenarios import failure_of, run_all

from orchestrator import DistributedFunction, distribute, testing

FAKE_TORCH = "2.0.0"
"""The torch version the driver is made to believe it has."""
SCENARIO_S = 120
STALL_AFTER_S = 3
GLOO_TIMEOUT = timedelta(seconds=20)
"""Far below gloo's 30 min default: a wrong address must fail the test, not hang it."""
CONTROL_TIMEOUT = timedelta(seconds=6)


# --- what runs in the ranks ----------------------------------------------------------------


def where() -> dict[str, Any]:
    """Where this rank runs and where its `orchestrator_workers` comes from; some output;
    whether `from orchestrator import snapshot` works (with none of the driver's machinery
    imported, before or after). (torch's version as installed: importing it would only
    slow the pool down.)"""
    import importlib.metadata

    import ray

    import orchestrator_workers

    rank = os.environ["RANK"]
    print(f"stdout line of rank {rank}", flush=True)
    os.write(2, f"stderr line of rank {rank}\n".encode())
    driver_side = "orchestrator" in sys.modules
    try:
        from orchestrator import snapshot

        snapshot_api: dict[str, Any] = {
            "file": os.path.realpath(snapshot.__file__ or ""),
            "save": snapshot.save.__module__,
            "restore": snapshot.restore.__module__,
        }
    except ImportError as exc:
        snapshot_api = {"error": f"{type(exc).__name__}: {exc}"}
    machinery = ("orchestrator.function", "orchestrator.runner", "orchestrator.pool")
    return {
        "rank": int(rank),
        "node_ip": ray.util.get_node_ip_address(),
        "executable": sys.executable,
        "workers_file": orchestrator_workers.__file__,
        "workers_real": os.path.realpath(orchestrator_workers.__file__ or ""),
        "older_copy": hasattr(orchestrator_workers, "OLDER_COPY"),
        "torch": importlib.metadata.version("torch"),
        "driver_side_before": driver_side,
        "snapshot": snapshot_api,
        "machinery": [name for name in machinery if name in sys.modules],
    }


def probe(*, drop_interface: bool = False) -> dict[str, Any]:
    """Init gloo from the environment, all-reduce the rank, report; `drop_interface`: with
    GLOO_SOCKET_IFNAME removed, so gloo falls back to the hostname, loopback on these hosts."""
    import socket

    import ray
    import torch
    import torch.distributed as dist

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if drop_interface:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    dist.init_process_group("gloo", timeout=CONTROL_TIMEOUT if drop_interface else GLOO_TIMEOUT)
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total)
    hostname = socket.gethostname()
    return {
        "rank": dist.get_rank(),
        "env_rank": int(os.environ["RANK"]),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["NODE_RANK"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "node_ip": ray.util.get_node_ip_address(),
        "sum": int(total.item()),
        "gloo_socket_ifname": interface,
        "hostname": hostname,
        "hostname_ip": socket.gethostbyname(hostname),
    }


def raise_on_rank_1() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        print("rank 1 about to fail", flush=True)
        raise ValueError("boom on a bare node")
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


def crash_once() -> tuple[str, str, float]:
    """Rank 1 kills its own process on attempt 0; every rank all-reduces on the next."""
    import ray
    import torch
    import torch.distributed as dist

    rank, attempt = os.environ["RANK"], os.environ["RESTART_COUNT"]
    dist.init_process_group("gloo")
    if rank == "1" and attempt == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return attempt, ray.util.get_node_ip_address(), total.item()


def held_back(go: str) -> int:
    """Rank 1 waits for `go` between two all_reduces: rank 0 waits for it."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        while not os.path.exists(go):
            time.sleep(0.1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return rank


def node_environment() -> dict[str, Any]:
    """A plain Ray task's view of its node: the raylet's interpreter."""
    import ray

    return {"node_ip": ray.util.get_node_ip_address(), "executable": sys.executable}


# --- the scenarios -------------------------------------------------------------------------


def mismatch_then_readme(address: str, work: Path) -> dict[str, Any]:
    """Under a faked driver torch: the `where` pool (`where`, then gloo across the hosts and
    the control call without the interface), then the README's example (a second pool on
    the same nodes)."""
    hook = getattr(testing, "driver_torch_version", None)
    result: dict[str, Any] = {"hook": hook is not None}
    steps: dict[str, float] = {}
    result["steps"] = steps
    step = time.monotonic()

    def took(name: str) -> None:
        nonlocal step
        steps[name] = round(time.monotonic() - step, 2)
        step = time.monotonic()

    with hook(FAKE_TORCH) if hook is not None else contextlib.nullcontext():
        try:
            with distribute(
                where, num_replicas=4, replicas_per_node=2, address=address, name="where"
            ) as fn:
                result["where"] = fn()
                took("where")
                fn.fn = probe
                result["gloo"] = fn()
                took("gloo")
                try:
                    fn(drop_interface=True)
                except Exception as exc:  # noqa: BLE001 - the report is the result
                    result["control"] = f"{type(exc).__name__}: {exc}"
                else:
                    result["control"] = None
        except Exception as exc:  # noqa: BLE001 - what it raised is the result
            result["where_error"] = "".join(traceback.format_exception(exc))
        took("control")
        result["readme"] = readme(work)
        took("readme")
    return result


def readme(work: Path) -> dict[str, Any]:
    """The README's example, verbatim (the test wrote it into the project folder), run as
    a script is (its functions in `__main__`); it gives no address: RAY_ADDRESS is set."""
    try:
        found = runpy.run_path(str(work / "readme_example.py"), run_name="__main__")
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        return {"error": "".join(traceback.format_exception(exc))}
    return {"losses": found.get("losses")}


_pair_fn: list[DistributedFunction[..., Any]] = []


def _pair(address: str) -> DistributedFunction[..., Any]:
    """The 2-rank function, one rank per host, that restarts, stall, raises and crash call
    in turn (each sets its `fn`): one warm pool serves them until a call fails."""
    if not _pair_fn:
        _pair_fn.append(
            distribute(
                crash_once, num_replicas=2, replicas_per_node=1, address=address, name="pair"
            )
        )
    return _pair_fn[0]


def _release_pair() -> None:
    while _pair_fn:
        _pair_fn.pop().shutdown()


def restarts(address: str, _work: Path) -> dict[str, Any]:
    """max_restarts=1: rank 1 crashes on attempt 0, attempt 1 succeeds (on the pair's new
    pool: its first call)."""
    fn = _pair(address)
    fn.fn = crash_once
    job = fn.with_options(max_restarts=1).submit()
    result = _outcome(job)
    status = job.status()
    result["restarts"] = status.restarts
    result["failed_attempts"] = list(status.failed_attempts)
    return result


def stall(address: str, work: Path) -> dict[str, Any]:
    """Rank 1 holds rank 0 back: the job's stall report names it, and where it is."""
    go = work / "stall-go"
    result: dict[str, Any] = {}
    fn = _pair(address)
    fn.fn = held_back
    job = fn.with_options(stall_after=STALL_AFTER_S).submit(str(go))
    started = time.monotonic()
    seen = None
    try:
        while time.monotonic() < started + 60 and not job.done():
            seen = job.status().stall
            if seen and "rank 1 is at" in seen:
                break
            time.sleep(0.3)
    finally:
        go.touch()
    result["report"] = seen
    result["seconds"] = time.monotonic() - started
    result.update(_outcome(job))
    return result


def raises(address: str, _work: Path) -> dict[str, Any]:
    """A rank that raises: its traceback reaches the driver; the next call (on a new pool:
    a failed call's pool is replaced) works."""
    fn = _pair(address)
    fn.fn = raise_on_rank_1
    warm = fn.pids()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        result = failure_of(exc)
    else:
        result = {"type": None}
    fn.fn = lambda: int(os.environ["RANK"])
    result["again"] = fn()
    result["pids"] = [warm, fn.pids()]
    return result


def crash(address: str, _work: Path) -> dict[str, Any]:
    """A rank SIGKILLed after a line: named as a crash, its last words shown."""
    fn = _pair(address)
    fn.fn = die_on_rank_1
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        return failure_of(exc)
    finally:
        _release_pair()
    return {"type": None}


def shm(address: str, work: Path) -> dict[str, Any]:
    """A failed call's /dev/shm buffers are removed, on both hosts (one machine's /dev/shm)."""
    import torch

    from orchestrator_workers import sharing

    table = torch.ones(1 << 20)  # 4 MB: shared through /dev/shm by each node's two ranks
    go = work / "shm-go"

    def fail_when_told() -> None:
        while not go.exists():
            time.sleep(0.05)
        if os.environ["RANK"] == "1":
            raise ValueError(f"rank 1 fails ({float(table.sum()):g})")
        time.sleep(60)  # the others are stopped with the pool

    result: dict[str, Any] = {}
    with distribute(
        fail_when_told, num_replicas=4, replicas_per_node=2, address=address, name="shm"
    ) as fn:
        job = fn.submit()
        deadline = time.monotonic() + 60
        while testing.view(job) is None and not job.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        view = testing.view(job)
        if view is None:
            go.touch()
            return {"error": f"no view of the call; done={job.done()}", **_outcome(job)}
        key = view.key
        # As a rank killed before it counted itself would leave it:
        left = sharing.SHM / f"{sharing.PREFIX}{key}-lost"
        left.write_bytes(b"x")
        result["planted"] = left.name
        go.touch()
        result.update(_outcome(job))
    deadline = time.monotonic() + 15
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    result["left"] = sorted(p.name for p in sharing.SHM.glob(f"{sharing.PREFIX}{key}*"))
    return result


def _outcome(job: Any) -> dict[str, Any]:
    try:
        return {"result": job.result(timeout=60)}
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        return {"failure": failure_of(exc)}


def environment(address: str, _work: Path) -> dict[str, Any]:
    """Each node's Ray, seen by plain Ray tasks: which interpreter its workers run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    task = ray.remote(num_cpus=0)(node_environment)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    return {
        "nodes": ray.get(
            [
                task.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote()
                for n in nodes
            ],
            timeout=60,
        )
    }


def hello() -> str:
    """Say which rank this is, and return it."""
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    return os.environ["RANK"]


def detached(address: str, _work: Path) -> dict[str, Any]:
    """A detached job: its supervisor runs on the head, which lacks our code too."""
    from orchestrator import get_job, list_jobs

    with distribute(
        hello, num_replicas=2, replicas_per_node=1, detach=True, address=address, name="detached"
    ) as fn:
        job = fn.submit()
        result: dict[str, Any] = {"id": job.id, **_outcome(job)}
        again = get_job(job.id, show=False)
        result["again"] = again.result(timeout=60)
        result["logs"] = [job.logs(rank) for rank in (0, 1)]
        result["listed"] = [(j.id, str(j.state)) for j in list_jobs()]
        job.release()
    return result


SCENARIOS: list[Callable[[str, Path], dict[str, Any]]] = [
    mismatch_then_readme,
    restarts,  # the pair's first pool: restarted in place, then warm for stall and raises
    stall,
    raises,  # fails: the pair's next pool runs `again` and crash
    crash,
    shm,
    detached,
    environment,
]


def main() -> None:
    """Run every scenario, each under its limit; write the report after each."""
    address, out, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    run_all(
        [(s.__name__, functools.partial(s, address, work)) for s in SCENARIOS],
        out,
        SCENARIO_S,
        after_error=_release_pair,  # the next scenario starts from a fresh pool
    )
    _release_pair()


if __name__ == "__main__":
    main()
