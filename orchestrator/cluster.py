"""Connect to Ray, or start the embedded local instance; what the cluster has."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from orchestrator import _ray_compat, discovery, messages
from orchestrator.errors import ClusterUnreachableError, ConfigError
from orchestrator_workers import private

_lock = threading.Lock()
_embedded = False


@dataclass(frozen=True)
class Node:
    """A live node as Ray reports it."""

    node_id: str
    ip: str
    resources: dict[str, float]


def connect(address: str | None, *, min_cpus: float = 0, standalone: bool = False) -> bool:
    """Make sure this process is connected to Ray; return True on the embedded instance.

    Order: an initialized Ray; `address`; RAY_ADDRESS; a live local cluster started
    with `ray start`; else a fresh local instance with at least `min_cpus` CPUs.
    `standalone`: the fresh local instance, whatever RAY_ADDRESS or `ray start` say.
    """
    global _embedded  # noqa: PLW0603 - one Ray connection per process
    with _lock:
        if ray.is_initialized():
            return _embedded
        given = None if standalone else address or os.environ.get("RAY_ADDRESS")
        live, stale = (None, None) if given or standalone else discovery.local_cluster()
        target = given or live
        if target:
            if given:
                check_reachable(given, "address" if address else "RAY_ADDRESS")
            local_token(target)  # only where it is the local runtime's address
            ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)
            return False
        if stale:
            messages.say(f"the Ray cluster recorded in {stale} is gone; starting a fresh local one")
        in_lasting_thread(lambda: _start_local(min_cpus))
        _embedded = True
        return True


def in_lasting_thread(start: Callable[[], None]) -> None:
    """Run `start` (which starts Ray's daemons) in a thread that lives as long as this process.

    Ray starts its GCS and raylet with PR_SET_PDEATHSIG, which Linux sends when the
    thread that started them ends, not the process: started from a pool thread or a
    request handler, they would be killed with it. The main thread lasts; others
    hand the start to a thread of ours that waits until the process exits.
    """
    if threading.current_thread() is threading.main_thread():
        start()
        return
    done = threading.Event()
    failure: list[BaseException] = []

    def host() -> None:
        try:
            start()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failure.append(exc)
        finally:
            done.set()
        threading.Event().wait()  # Ray's daemons live as long as this thread

    threading.Thread(target=host, name="orchestrator-ray-host", daemon=True).start()
    done.wait()
    if failure:
        raise failure[0]


REACH_TIMEOUT_S = 5.0
"""How long a given address may take to answer before the call fails (Ray retries for minutes)."""
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, or its
client server for ray://) answers with a SETTINGS frame of its own."""


def check_reachable(address: str, given_as: str) -> None:
    """Raise ClusterUnreachableError, naming `address`, unless a Ray server answers there.

    Ray itself retries a dead address for minutes, deaf to Ctrl-C and SIGTERM, and may
    then end the process. Addresses without a port ("auto", "local") are Ray's to read.
    """
    scheme, _, host_port = address.rpartition("://")
    host, colon, port = host_port.rpartition(":")
    if not colon or not port.isdigit():
        return
    host = host.strip("[]")
    where = f"no Ray cluster at {given_as}={address!r}"
    local = "give no address to run on this machine"
    fix = (
        "check that Ray runs there (`ray start --head` prints the address to give) and that "
        f"this machine can reach it, or {local}"
    )
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS server waits for a TLS hello: the open port is all we ask
            sock.sendall(_H2_PREFACE)
            reply = sock.recv(9)
            answers = len(reply) == 9 and reply[3] == 4  # SETTINGS
            answers = answers and _answers_rpc(sock, host_port, int.from_bytes(reply[:3], "big"))
    except TimeoutError:
        tried = f"{host}:{port} did not answer within {REACH_TIMEOUT_S:g} s"
        raise ClusterUnreachableError(f"{where}: {tried}; {fix}") from None
    except OSError as exc:
        tried = f"connecting to {host}:{port} failed ({exc.strerror or exc})"
        raise ClusterUnreachableError(f"{where}: {tried}; {fix}") from None
    if not answers:
        kind = "Ray Client server (ray://)" if scheme else "GCS (`ray start --head --port`)"
        raise ClusterUnreachableError(
            f"{where}: {host}:{port} accepts connections but does not answer as a Ray {kind} "
            f"would; give the address of the cluster's head, or {local}"
        )


def _answers_rpc(sock: socket.socket, authority: str, skip: int) -> bool:
    """Whether the HTTP/2 server on `sock` answers a gRPC call within REACH_TIMEOUT_S.

    Any answer counts, an error status included (the method is Ray's GCS's; a Ray Client
    server says it has none, a GCS with token auth may refuse us): silence does not. A
    server that only greets would otherwise hold Ray's connect for minutes, deaf to
    signals. One call by hand (Ray ships no gRPC for Python): HEADERS, then an empty
    message, on stream 1. `skip`: bytes of the server's first frame still unread.
    """

    def literal(name: bytes, value: bytes) -> bytes:  # HPACK, not indexed, new name
        return bytes([0, len(name)]) + name + bytes([len(value)]) + value

    path = b"/ray.rpc.NodeInfoGcsService/GetClusterId"
    block = (
        b"\x83\x86"  # :method POST, :scheme http (HPACK's static table)
        + b"\x04" + bytes([len(path)]) + path
        + b"\x01" + bytes([len(authority)]) + authority.encode()
        + literal(b"content-type", b"application/grpc")
        + literal(b"te", b"trailers")
    )
    stream = (1).to_bytes(4, "big")
    sock.sendall(
        bytes([0, 0, 0, 4, 1]) + b"\0\0\0\0"  # SETTINGS ACK
        + len(block).to_bytes(3, "big") + bytes([1, 4]) + stream + block  # HEADERS
        + (5).to_bytes(3, "big") + bytes([0, 1]) + stream + b"\0\0\0\0\0"  # DATA, END_STREAM
    )
    deadline = time.monotonic() + REACH_TIMEOUT_S
    buffer = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:
            return False
        if not chunk:
            return False
        buffer += chunk
        dropped = min(skip, len(buffer))
        buffer, skip = buffer[dropped:], skip - dropped
        while len(buffer) >= 9:
            size, kind, number = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[5:9]
            if kind in (1, 3) and int.from_bytes(number, "big") & 0x7FFFFFFF == 1:
                return True  # HEADERS (an answer) or RST_STREAM (a refusal) for our call
            if kind == 7:  # GOAWAY: it speaks HTTP/2 and hung up on us, as a server does
                return True
            buffer = buffer[9 + size :]
    return False


_rank_pids: set[int] = set()
_WORKER_PID = re.compile(r"Worker PID: (\d+)")
_MANY_WORKERS = "PYTHON worker processes have been started on node"
"""Ray's warning when many actors start at once: a pool's ranks do, by design."""


def quiet_crash_notices(pids: list[int]) -> None:
    """Drop Ray's own "(raylet) A worker died ..." notice for these ranks' processes.

    The crash is reported, with its rank, by our own error. Ray's warning that many
    workers started at once goes too: pools start one per rank. ORCHESTRATOR_VERBOSE=1
    keeps both. Ray offers no switch, so its printer is wrapped (when present).
    """
    _rank_pids.update(pids)
    if not _verbose():
        _ray_compat.wrap_log_printer(_without_our_notices)


def _without_our_notices(batch: dict[str, Any]) -> dict[str, Any] | None:
    """A batch of log lines without the raylet's notices about our ranks; None if empty."""
    if batch.get("pid") != "raylet":
        return batch
    lines = [line for line in batch.get("lines", []) if not _ours(line)]
    return {**batch, "lines": lines} if lines else None


def _ours(line: str) -> bool:
    if _MANY_WORKERS in line:
        return True
    match = _WORKER_PID.search(line)
    return match is not None and int(match.group(1)) in _rank_pids


def count_nodes(address: str) -> int | None:
    """Live nodes of the cluster at `address`, asked without joining it; None if unknown."""
    local_token(address)
    return _ray_compat.alive_nodes(address)


def nodes() -> list[Node]:
    """The cluster's live nodes."""
    return [
        Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def node_lost(node_id: str, timeout: float = 1.0) -> bool:
    """Whether Ray on a node is gone: the GCS says so, or its raylet no longer answers.

    The GCS takes its health checks' time (seconds) to notice; a raylet's closed port
    says it at once.
    """
    try:
        found = [n for n in ray.nodes() if n["NodeID"] == node_id]
    except Exception:  # noqa: BLE001 - the GCS itself is gone, and every node with it
        return True
    if not found or not found[0].get("Alive"):
        return True
    address = (found[0]["NodeManagerAddress"], int(found[0]["NodeManagerPort"]))
    try:
        with socket.create_connection(address, timeout=timeout):
            return False
    except OSError:
        return True


LOCAL_SLOTS = 64
"""Logical CPUs of the embedded instance: slots for ranks, not cores (torchrun has no limit)."""


def _start_local(min_cpus: float) -> None:
    cpus = max(LOCAL_SLOTS, int(min_cpus + 0.999))
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":  # Ray's default for a local start
        ensure_token(ConfigError)
    # Ray's banner and token notice are noise to a user who did not ask for Ray.
    quiet = logging.getLogger("ray")
    level = quiet.level
    ray_level = logging.INFO if _verbose() else logging.ERROR
    quiet.setLevel(ray_level)
    try:
        with _ray_compat.lean_head():
            ray.init(
                address="local",
                _temp_dir=head_temp_dir(lasting=False),
                num_cpus=cpus,
                include_dashboard=False,
                logging_level=ray_level,
                log_to_driver=False,  # ranks' output comes through our own capture
                # Ray starts workers 15 nice levels below the raylet: a rank, and the data
                # loader workers it forks, would yield to everything else on the machine.
                _system_config=_ray_compat.same_niceness(),
            )
    finally:
        quiet.setLevel(level)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    messages.say(
        f"running locally on an embedded Ray instance ({os.cpu_count()} cores, {gpus} GPUs); "
        "`orchestrator local start` keeps one warm between scripts"
    )


def ensure_token(error: type[Exception]) -> None:
    """Make the token Ray's token mode needs (~/.ray/auth_token) where none is set up.

    For this user alone (0600, in a 0700 ~/.ray when it makes that too): whoever reads it
    can join this user's clusters. Ray would make it 0644. `error` is raised where the
    configured token file does not exist.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    custom = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if custom:
        if not Path(custom).expanduser().exists():
            raise error(
                f"RAY_AUTH_TOKEN_PATH={custom} does not exist: create the token there "
                "(`ray get-auth-token --generate`), or unset RAY_AUTH_TOKEN_PATH"
            )
        return
    folder = Path.home() / ".ray"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    made = folder / "auth_token"
    with (
        contextlib.suppress(FileExistsError),  # the user's own, as it is
        os.fdopen(os.open(made, flags, 0o600), "w") as token,
    ):
        token.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate`


def at_exit() -> None:
    """Interpreter exit: no thread starts a new Ray from here on; stop the embedded one now.

    A late Ray call from a thread would otherwise start a fresh local instance (Ray's
    auto-init). Stopping the embedded instance here skips Ray's exit hook's 0.5 s wait
    for log lines, of which it sends none (log_to_driver=False).
    """
    _ray_compat.stop_auto_init()
    if _embedded and ray.is_initialized():
        ray.shutdown()


def is_embedded() -> bool:
    """Whether this process runs the embedded local instance."""
    return _embedded


def local_token(address: str) -> None:
    """Send the token if `address` is the local runtime and it runs with token auth.

    Ray's drivers send it only in token mode (RAY_AUTH_MODE=token); without it they
    retry for 20 s, then fail with InvalidAuthToken. Other clusters are left to Ray.
    """
    record = discovery.runtime_record(address)
    if record is not None and record.auth == "token" and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        _ray_compat.reload_auth_mode()  # Ray read its config at import


SOCKET_PATH_ROOM = 107 - len("/session_2026-12-01_15-45-14_123456_4194304/sockets/plasma_store")
"""How long Ray's temp folder may be: its sockets' paths must fit in 107 bytes."""


def head_temp_dir(*, lasting: bool, name: str = "ray") -> str | None:
    """Ray's temp folder for a head this product starts; None: Ray's own ($RAY_TMPDIR/ray).

    Ray makes its folders open to every user (0777, not sticky): in its default, /tmp/ray,
    another user could swap its address file for a link, or read and plant session files.
    A RAY_TMPDIR that no other user can enter is kept; otherwise the head's files go in
    this user's private folder, as `name` (`lasting`: one that outlives the login session).
    """
    chosen = os.environ.get("RAY_TMPDIR")
    if chosen:
        why = private.unsafe(Path(chosen), closed=True)
        if why is None:
            return None
        messages.say(
            f"not putting Ray's files in RAY_TMPDIR={chosen}, as {why} and Ray makes its "
            "folders writable by all; using a private folder (make RAY_TMPDIR 0700 to keep it)"
        )
    try:
        folder = private.folder(lasting=lasting)
        if len(str(folder / name)) > SOCKET_PATH_ROOM:
            folder = private.folder(lasting=True)  # a long XDG_RUNTIME_DIR: the short temp dir
    except private.UnsafeFolderError as exc:
        made = tempfile.mkdtemp(prefix="orchestrator-ray-")  # 0700, a name nobody can guess
        messages.say(f"{exc}. Ray's files go in {made} instead")
        return made
    path = folder / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return str(path)


def _verbose() -> bool:
    """ORCHESTRATOR_VERBOSE=1: let Ray's own messages through."""
    return os.environ.get("ORCHESTRATOR_VERBOSE", "") not in ("", "0")

