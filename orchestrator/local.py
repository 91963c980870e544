"""The local runtime: a Ray head on this machine that outlives scripts, with warm ranks.

`orchestrator local start` starts it; a script's `distribute(...)` then finds it
(as it finds any `ray start` cluster here) and takes CPU-only ranks from its
spares, processes that imported torch before the script began.
`orchestrator local stop` ends it; so does `--idle-timeout` without drivers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

from orchestrator import cluster
from orchestrator.errors import OrchestratorError
from workers.spares import BROKER_NAME, NAMESPACE, Claim, RemoteBroker, RuntimeInfo, code_id

_START_TIMEOUT_S = 120.0
_mismatch_said = threading.Event()


class LocalRuntimeError(OrchestratorError):
    """The local runtime cannot be started, found or stopped as asked."""


def spares_for(
    pool_name: str, pool_id: str, ranks_by_node: dict[str, list[int]]
) -> dict[int, tuple[Any, int]]:
    """Claim warm spares of the local runtime for these ranks: {rank: (actor, pid)}.

    Empty where no local runtime runs, or it has none ready on the ranks' node.
    """
    if cluster.is_embedded():
        return {}
    try:
        broker = ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:  # no local runtime on this cluster
        return {}
    owner = ray.get_runtime_context().get_job_id()
    code = code_id()
    their_code, taken = ray.get(
        broker.claim.remote(owner, pool_name, pool_id, ranks_by_node, code), timeout=30
    )
    if their_code != code and not _mismatch_said.is_set():
        _mismatch_said.set()
        cluster.say(
            "the local runtime runs other orchestrator code or another Python (started before "
            "an update?), so its warm processes are not used; restart it: "
            "orchestrator local stop && orchestrator local start"
        )
    for rank, (actor, _) in taken.items():
        actor.claim.remote(pool_name, rank, owner)  # first in the actor's queue
    return taken


def start(*, spares: int, port: int, cpus: int | None, idle_timeout: float | None) -> RuntimeInfo:
    """Start the runtime and wait for its spares; raise LocalRuntimeError if it cannot."""
    if spares < 0:
        raise LocalRuntimeError(f"--spares={spares}: give 0 or more warm rank processes")
    if idle_timeout is not None and idle_timeout <= 0:
        raise LocalRuntimeError(f"--idle-timeout={idle_timeout:g}: give seconds > 0, or none")
    live, _ = cluster.local_cluster()
    if live:
        if _runtime(live) is not None:
            raise LocalRuntimeError(f"the local runtime already runs at {live}")
        raise LocalRuntimeError(
            f"a Ray cluster started with `ray start` already runs here at {live}; "
            "distribute() uses it as it is. Stop it first (`ray stop`) to start the local runtime"
        )
    log = _log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        *_ray_command(),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={cpus or cluster.LOCAL_SLOTS}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # On SIGTERM Ray would wait up to 30 s for busy nodes to drain; spares never are.
            env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **os.environ},
            start_new_session=True,  # a Ctrl-C in this terminal later must not stop it
        )
    try:
        address = _wait_for_head(process, log)
        (cluster.ray_root() / cluster.RUNTIME_RECORD).write_text(address)
        cluster.connect(address)
        broker = RemoteBroker.options(
            name=BROKER_NAME, namespace=NAMESPACE, lifetime="detached"
        ).remote(spares, idle_timeout, process.pid)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            info: RuntimeInfo = ray.get(broker.info.remote(), timeout=30)
            if len(info.ready) >= spares or time.monotonic() > deadline:
                return info
            time.sleep(0.2)
    except BaseException:
        (cluster.ray_root() / cluster.RUNTIME_RECORD).unlink(missing_ok=True)
        process.terminate()
        process.wait(30)
        raise


def stop() -> int:
    """Stop the runtime's Ray processes; the pid that was stopped."""
    live, _ = cluster.local_cluster()
    info = _runtime(live) if live else None
    if info is None:
        where = f"the Ray cluster at {live} was not started by it" if live else "no Ray runs here"
        raise LocalRuntimeError(f"no local runtime is running ({where})")
    ray.shutdown()
    (cluster.ray_root() / cluster.RUNTIME_RECORD).unlink(missing_ok=True)
    if _alive(info.runtime_pid):
        os.kill(info.runtime_pid, signal.SIGTERM)  # `ray start --block` stops what it started
    deadline = time.monotonic() + 60
    while _alive(info.runtime_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(info.runtime_pid):
        raise LocalRuntimeError(f"the local runtime (pid {info.runtime_pid}) did not stop in 60 s")
    return info.runtime_pid


def status() -> tuple[str, RuntimeInfo] | None:
    """(address, state) of the runtime running here, or None."""
    live, _ = cluster.local_cluster()
    info = _runtime(live) if live else None
    return (live, info) if live and info else None


def claims() -> list[Claim]:
    """The ranks running in the connected cluster's spares (none without a local runtime)."""
    try:
        broker = ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:
        return []
    return ray.get(broker.info.remote(), timeout=30).claims


def cpus() -> tuple[float, float]:
    """(free, total) logical CPUs of the connected cluster."""
    return ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)


def _runtime(address: str) -> RuntimeInfo | None:
    """The broker's state on the cluster at `address`, or None where it has none."""
    cluster.connect(address)
    try:
        broker = ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(broker.info.remote(), timeout=30)


def _wait_for_head(process: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-2000:]
            raise LocalRuntimeError(f"`ray start` exited with {process.returncode}:\n{tail}")
        live, _ = cluster.local_cluster()
        if live and "--block" in log.read_text():  # Ray prints its --block notice when up
            return live
        time.sleep(0.2)
    raise LocalRuntimeError(f"Ray did not start within {_START_TIMEOUT_S:g} s; see {log}")


def _ray_command() -> list[str]:
    beside = Path(sys.executable).with_name("ray")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ray")
    if found:
        return [found]
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def _log_path() -> Path:
    return cluster.ray_root() / "orchestrator-local.log"


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (an orphan whose reaper has not run yet)."""
    if not Path("/proc/self/stat").exists():  # not Linux: no zombie check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
