"""The local runtime: a Ray head on this machine that outlives scripts, with warm ranks.

`orchestrator local start` starts it; a script's `distribute(...)` then finds it
(as it finds any `ray start` cluster here) and takes CPU-only ranks from its
spares, processes that imported torch before the script began.
`orchestrator local stop` ends it; so does `--idle-timeout` without drivers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from orchestrator import _ray_compat
from orchestrator.connect import cluster, discovery, head, probe, ray_files, tokens
from orchestrator.errors import (
    ClusterUnreachableError,
    ConfigError,
    LocalRuntimeError,
    OrchestratorError,
)
from orchestrator.show import messages
from orchestrator_workers import private
from orchestrator_workers.spares import (
    BROKER_NAME,
    NAMESPACE,
    Claim,
    ClaimRequest,
    RemoteBroker,
    RuntimeInfo,
    code_id,
)

_said = threading.Event()
_SPARES_WAIT_S = 120.0
"""How long a start waits for its spares to be ready (then it says how many are)."""


@dataclass(frozen=True)
class DriverPaths:
    """Where a driver's ranks run on the local runtime: as Ray runs its own workers."""

    cwd: str
    """The driver's working directory: its ranks' own."""
    sys_path: tuple[str, ...]
    """First on its ranks' sys.path: its script's folder, its working directory (in an
    actor, its working directory only: its "script" is Ray's worker)."""


_acting_for: list[DriverPaths] = []
"""The driver this process starts ranks for, where it is not that driver (`act_for`)."""


def driver_paths() -> DriverPaths:
    """Where this driver's ranks run; in a detached function's supervisor, its driver's."""
    if _acting_for:
        return _acting_for[0]
    cwd = os.getcwd()
    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else ""
    script_dir = os.path.dirname(os.path.realpath(script)) if script else ""
    if script_dir and script_dir in sys.path and not in_actor:
        # Each once: two drivers whose ranks would run alike share a warm pool (its key).
        return DriverPaths(cwd, tuple(dict.fromkeys((script_dir, cwd))))
    return DriverPaths(cwd, (cwd,))


def act_for(paths: DriverPaths) -> None:
    """Start this process's ranks where the driver at `paths` runs (recorded at its submit):
    a supervisor's own working directory is never theirs."""
    _acting_for[:] = [paths]


def broker() -> Any | None:
    """The local runtime's broker on the connected cluster, or None where it has none."""
    if cluster.is_embedded():
        return None
    try:
        return ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def spares_for(
    runtime: Any, pool_name: str, pool_id: str, ranks_by_node: dict[str, list[int]]
) -> dict[int, tuple[Any, int]]:
    """Claim warm spares from the broker `runtime` for these ranks: {rank: (actor, pid)}.

    Empty where it has none ready on the ranks' node, or cannot answer (those ranks
    then start new actors, as anywhere else). Claimed from a named actor (a detached
    function's supervisor), they serve for as long as it lives, not its driver's job.
    """
    code = code_id()
    context = ray.get_runtime_context()
    actor = context.get_actor_name() if context.get_actor_id() is not None else None
    request = ClaimRequest(
        owner_job=context.get_job_id(),
        job_name=pool_name,
        pool_id=pool_id,
        ranks_by_node=ranks_by_node,
        code=code,
        paths=list(driver_paths().sys_path),
        owner_actor=actor or "",
    )
    try:
        their_code, taken = ray.get(runtime.claim.remote(request), timeout=60)
    except Exception as exc:  # noqa: BLE001 - never worse than no runtime
        _say_once(f"the local runtime did not hand out warm processes ({exc}); starting new ones")
        return {}
    if their_code != code:
        _say_once(
            "the local runtime runs other orchestrator code or another Python (started before "
            "an update?), so its warm processes are not used; restart it: "
            "orchestrator local stop && orchestrator local start"
        )
    return taken


def _say_once(message: str) -> None:
    if not _said.is_set():
        _said.set()
        messages.say(message)


def start(*, spares: int, port: int, cpus: int | None, idle_timeout: float | None) -> RuntimeInfo:
    """Start the runtime and wait for its spares; raise LocalRuntimeError if it cannot."""
    if spares < 0:
        raise ConfigError(f"--spares={spares}: give 0 or more warm rank processes")
    if idle_timeout is not None and idle_timeout <= 0:
        raise ConfigError(f"--idle-timeout={idle_timeout:g}: give seconds > 0, or 0 for never")
    if cpus is not None and cpus < 1:
        raise ConfigError(f"--cpus={cpus}: give 1 or more logical CPUs (slots for ranks)")
    live, _ = discovery.local_cluster()
    if live:
        if _runtime(live) is not None:
            raise LocalRuntimeError(f"the local runtime already runs at {live}")
        raise LocalRuntimeError(
            f"a Ray cluster started with `ray start` already runs here at {live}; "
            "distribute() uses it as it is. To start the local runtime instead, stop that "
            "`ray start` process first (by its pid)"
        )
    auth = os.environ.get("RAY_AUTH_MODE", "token")  # on unless the user turned it off
    if auth == "token":
        tokens.ensure_token(LocalRuntimeError)
    log = _log_path(port)
    temp_dir = _runtime_temp_dir(port)
    work = _work_folder()
    command = [
        *head.ray_command(),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={cpus or cluster.LOCAL_SLOTS}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    env = {
        # On SIGTERM Ray would wait up to 30 s for busy nodes to drain; spares never are.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        **_ray_compat.same_niceness_env(),
        **os.environ,
        "RAY_AUTH_MODE": auth,
    }
    address_file = Path(temp_dir) / discovery.ADDRESS_FILE
    record: Path | None = None
    process, address = head.start(command, env, work, log, address_file)
    try:
        record = discovery.record_path(port)
        fields = {"address": address, "pid": process.pid, "auth": auth, "temp_dir": temp_dir}
        private.write(record, json.dumps(fields))
        with _working_in(work):  # Ray puts it first on the sys.path of this job's spares
            cluster.connect(address)
        # Stopping itself when idle, it removes the files naming it, as `stop` does.
        names = [str(record), str(address_file)]
        broker: Any = RemoteBroker.options(  # an actor handle: Ray types its methods loosely
            name=BROKER_NAME, namespace=NAMESPACE, lifetime="detached"
        ).remote(spares, idle_timeout, process.pid, names)
        deadline = time.monotonic() + _SPARES_WAIT_S
        while True:
            info: RuntimeInfo = ray.get(broker.info.remote(), timeout=30)
            if len(info.ready) >= spares or time.monotonic() > deadline:
                return info
            time.sleep(0.2)
    except BaseException:
        if record is not None:
            record.unlink(missing_ok=True)
        head.end(process)
        address_file.unlink(missing_ok=True)
        raise


def stop() -> int:
    """Stop the runtime's Ray processes, however busy they are; the pid that was stopped.

    Its record names the pid: nothing is asked of Ray, which may be too busy to answer.
    """
    live, _ = discovery.local_cluster()
    record = discovery.runtime_record(live) if live else None
    if record is None or live is None:
        where = f"the Ray cluster at {live} was not started by it" if live else "no Ray runs here"
        raise LocalRuntimeError(f"no local runtime is running ({where})")
    pid = record.pid
    why_not = discovery.runtime_not_ours(pid, live)
    if why_not:
        raise LocalRuntimeError(
            f"not stopping pid {pid}: {why_not}. It is not this user's `ray start` for {live}; "
            "stop that runtime as the user who started it"
        )
    ray.shutdown()
    if discovery.alive(pid):
        os.kill(pid, signal.SIGTERM)  # `ray start --block` stops what it started
    deadline = time.monotonic() + head.STOP_WAIT_S
    while discovery.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if discovery.alive(pid) and os.getpgid(pid) == pid:  # its own session: `start` made it
        os.killpg(pid, signal.SIGKILL)  # its GCS, raylet and workers with it
        waited = head.STOP_WAIT_S
        messages.say(f"the local runtime (pid {pid}) did not stop in {waited:g} s: killed")
    # Ray leaves its address file behind: named by nobody, the port could be squatted.
    discovery.forget(record)
    return pid


@dataclass(frozen=True)
class Status:
    """The local runtime running here, as `orchestrator local status` shows it."""

    address: str
    pid: int
    """Its `ray start --block` process (from its record)."""
    info: RuntimeInfo | None
    """What its broker says; None where it did not answer (see `problem`)."""
    problem: str = ""


def status() -> Status | None:
    """The runtime running here, or None where none runs; one that runs but does not
    answer in time (a loaded machine) is said so, never taken for none."""
    live, _ = discovery.local_cluster()
    record = discovery.runtime_record(live) if live else None
    if live is None or record is None:
        return None
    try:
        info = _runtime(live)
    except ClusterUnreachableError:  # its GCS: a machine too busy, or a process stopped
        late = f"it did not answer within {probe.REACH_TIMEOUT_S:g} s (a busy machine?)"
        return Status(live, record.pid, None, late)
    except (OrchestratorError, RayError, ConnectionError, TimeoutError) as exc:
        return Status(live, record.pid, None, f"it did not answer ({exc})")
    if info is None:
        return Status(live, record.pid, None, "its broker, which keeps the warm processes, is gone")
    return Status(live, record.pid, info)


def claims() -> list[Claim]:
    """The ranks running in the connected cluster's spares (none without a local runtime)."""
    runtime = broker()
    return [] if runtime is None else ray.get(runtime.info.remote(), timeout=30).claims


def cpus() -> tuple[float, float]:
    """(free, total) logical CPUs of the connected cluster."""
    return ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)


def _runtime(address: str) -> RuntimeInfo | None:
    """The broker's state on the cluster at `address`, or None where it has none."""
    cluster.connect(address)
    runtime = broker()
    return None if runtime is None else ray.get(runtime.info.remote(), timeout=30)


def _log_path(port: int) -> Path:
    """`ray start`'s output, in this user's state folder (Ray's own is open to every user)."""
    return _private(private.state_folder) / f"local-runtime-{port}.log"


def _work_folder() -> Path:
    """The runtime's working folder, empty and this user's alone (0700, in the state folder,
    where no other user can make or replace it): its processes run there."""
    folder = _private(private.state_folder) / "work"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    return folder


@contextlib.contextmanager
def _working_in(folder: Path) -> Iterator[None]:
    """This process in `folder` for a while, then back where it was (even a removed one)."""
    back = os.open(".", os.O_RDONLY)
    try:
        os.chdir(folder)
        yield
    finally:
        os.fchdir(back)
        os.close(back)


def _runtime_temp_dir(port: int) -> str:
    """Ray's temp folder for the runtime: this user's own, never Ray's shared /tmp/ray.

    One per port: Ray's address file in it names this runtime alone.
    """
    made = _private(lambda: ray_files.head_temp_dir(lasting=True, name=f"ray-{port}"))
    return made or str(discovery.ray_root())


def _private(make: Callable[[], Any]) -> Any:
    """`make()`, a private folder; its UnsafeFolderError as a LocalRuntimeError that says why."""
    try:
        return make()
    except private.UnsafeFolderError as exc:
        raise LocalRuntimeError(f"cannot keep the local runtime's files private: {exc}") from None
