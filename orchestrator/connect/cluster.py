"""Connect to Ray, or start the embedded local instance; what the cluster has."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import ray

from orchestrator import _ray_compat
from orchestrator.connect import discovery, head, probe, ray_files, refusals, tokens
from orchestrator.errors import ClusterUnreachableError, ConfigError
from orchestrator.show import messages, notices

_lock = threading.Lock()
_embedded = False
_local_runtime = False
_joined: str | None = None
"""The address this process last joined (a new Ray Client session goes there again)."""
_joined_job: str | None = None
"""The Ray job id of the session `join` began (at exit, ended only if still the current one)."""
_session = 0
"""How many times this process joined Ray: handles of an earlier session are void."""
_broken = False
"""Whether a Ray call said this process's Ray Client session is gone (see `lost_session`)."""


@dataclass(frozen=True)
class ClusterNode:
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
    global _embedded, _local_runtime  # noqa: PLW0603 - one Ray connection per process
    with _lock:
        if ray.is_initialized() and not _broken:
            return _embedded
        if ray.is_initialized():  # its Ray Client session is gone: a new one
            assert _joined is not None
            _rejoin()
            return False
        given = None if standalone else address or os.environ.get("RAY_ADDRESS")
        live, stale = (None, None) if given or standalone else discovery.local_cluster()
        if given:
            probe.check_reachable(given, "address" if address else "RAY_ADDRESS")
        elif live and (why := probe.problem(live)):  # found, not given: ours may be gone
            messages.say(
                f"not joining the Ray cluster found at {live} ({why}); starting a fresh local one"
            )
            live = None
        target = given or live
        if target:
            _local_runtime = discovery.runtime_record(target) is not None
            join(target)
            return False
        if stale:
            messages.say(f"the Ray cluster recorded in {stale} is gone; starting a fresh local one")
        in_lasting_thread(lambda: _start_local(min_cpus))
        _embedded = True
        return True


CLIENT_SERVER_TRIES = 3
"""Ray Client sessions asked for before giving up on a head whose per-session server dies."""


def join(address: str, **init: Any) -> None:
    """`ray.init(address)` (with `init`'s other arguments): the token where it is the local
    runtime's, and Ray's refusal of another Ray or Python said in one line.

    Through Ray Client, the head forks a server per session, and about one fork in ten
    dies at birth (ray#63202, a gRPC race in Ray's proxier): that session is asked for again.
    """
    global _joined, _session, _broken, _joined_job  # noqa: PLW0603 - one session at a time
    tokens.local_token(address)  # only where it is the local runtime's address
    for attempt in range(1, CLIENT_SERVER_TRIES + 1):
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **init)
            _joined, _session, _broken = address, _session + 1, False
            _joined_job = ray.get_runtime_context().get_job_id()
            if address.startswith("ray://"):
                # A Ray call in another thread (a second job's follower) after the session
                # was lost must not start a session of its own, racing `_rejoin`'s.
                _ray_compat.stop_auto_init()
            return
        except ConnectionAbortedError as exc:
            if not refusals.server_died(exc) or attempt == CLIENT_SERVER_TRIES:
                raise
            messages.say(
                f"the Ray Client server at {address} failed to start this session (Ray's "
                f"known fork race, ray#63202); asking again ({attempt + 1} of "
                f"{CLIENT_SERVER_TRIES})"
            )
            with contextlib.suppress(Exception):
                ray.shutdown()
        except RuntimeError as exc:
            mismatch = refusals.version_mismatch(str(exc), address)
            if mismatch is None:
                raise
            raise mismatch from None


def is_local_runtime() -> bool:
    """Whether this process joined the local runtime (`orchestrator local start`)."""
    return _local_runtime


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


def through_ray_client() -> bool:
    """Whether this process reaches Ray through Ray Client (`ray://`): it is no Ray node, and
    may not reach the nodes' own addresses (a laptop)."""
    return bool(ray.util.client.ray.is_connected())


def driver_node() -> str | None:
    """The Ray node this process runs on; None through Ray Client (its runtime context is
    the client server's, on the head, not this machine's)."""
    return None if through_ray_client() else ray.get_runtime_context().get_node_id()


def session() -> int:
    """This process's Ray session: it changes when `rejoin` makes a new one."""
    return _session


def rejoin(seen: int) -> bool:
    """After Ray Client lost this process's session (the link was down past its grace
    period, 30 s by default, and the cluster let the session go): a new session to the same
    address, unless another thread made one since session `seen`. True when connected.

    Whatever belonged to the old session (its non-detached actors, its handles) is gone;
    detached actors, such as a detached job's supervisor, are found again by name.
    """
    with _lock:
        if _session != seen:
            return True
        if _joined is None or not _joined.startswith("ray://"):
            return False
        try:
            _rejoin()
        except Exception:  # noqa: BLE001 - still unreachable: the caller tries again later
            return False
        return True


def _rejoin() -> None:
    """A new Ray Client session to the address joined last (the lock held)."""
    assert _joined is not None
    probe.check_reachable(_joined, "address")  # in seconds, while the link is still down
    with contextlib.suppress(Exception):  # the old session's client, already broken
        ray.shutdown()
    join(_joined)


_NOT_CONNECTED = ("Ray Client is not connected", "Ray has not been started yet")
"""What Ray raises for a call between two sessions: through Ray Client's handles, and
through Ray's own API."""


_VOID_HANDLE = "doesn't have a handle for"
"""What Ray Client's server says of a handle from an earlier session: one another thread's
new session made void, used before this process's session count moved on."""


def void_handle(exc: BaseException) -> bool:
    """Whether `exc` says a Ray Client handle is from an earlier session (find it again)."""
    return _VOID_HANDLE in str(exc)


def lost_session(exc: BaseException) -> bool:
    """Whether `exc`, raised by a Ray call, says Ray Client's session is gone for good, or
    not made again yet (the next `connect` then makes a new one)."""
    global _broken  # noqa: PLW0603 - one Ray connection per process
    through_client = bool(_joined and _joined.startswith("ray://"))
    between = any(words in str(exc) for words in _NOT_CONNECTED)
    lost = through_client and (isinstance(exc, ConnectionError) or between)
    _broken = _broken or lost
    return lost


def session_lost_error(exc: BaseException) -> ClusterUnreachableError:
    """What a call that is not detached raises when Ray Client's session ended under it."""
    return ClusterUnreachableError(
        f"this driver lost its Ray Client session to {_joined} ({exc}): its link was down "
        "for longer than Ray Client's grace period, so the cluster ended the session and "
        "this call's ranks with it. The next call makes a new session; for work that must "
        "outlive the network (a laptop that sleeps), use distribute(..., detach=True)"
    )


def count_nodes(address: str) -> int | None:
    """Live nodes of the cluster at `address`, asked without joining it; None if unknown."""
    tokens.local_token(address)
    return _ray_compat.alive_nodes(address)


def nodes() -> list[ClusterNode]:
    """The cluster's live nodes."""
    return [
        ClusterNode(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def node_lost(node_id: str, timeout: float = 1.0) -> bool:
    """Whether Ray on a node is gone (see `lost_nodes`)."""
    return bool(lost_nodes([node_id], timeout))


def lost_nodes(node_ids: Collection[str], timeout: float = 1.0) -> set[str]:
    """Those of `node_ids` whose Ray is gone: the GCS says so, or their raylet no longer
    answers.

    The GCS takes its health checks' time (seconds) to notice; a raylet's closed port
    says it at once (asked only from a process that is a node of the cluster).
    """
    try:
        found = {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in node_ids}
    except Exception:  # noqa: BLE001 - the GCS itself is gone, and every node with it
        return set(node_ids)
    lost = {node for node in node_ids if not found.get(node, {}).get("Alive")}
    if through_ray_client():  # the nodes' ports may be out of reach: the GCS's word only
        return lost
    for node in set(node_ids) - lost:
        address = (found[node]["NodeManagerAddress"], int(found[node]["NodeManagerPort"]))
        try:
            with socket.create_connection(address, timeout=timeout):
                pass
        except OSError:
            lost.add(node)
    return lost


LOCAL_SLOTS = 64
"""Logical CPUs of the embedded instance: slots for ranks, not cores (torchrun has no limit)."""


def _start_local(min_cpus: float) -> None:
    cpus = max(LOCAL_SLOTS, int(min_cpus + 0.999))
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":  # Ray's default for a local start
        tokens.ensure_token(ConfigError)
    # Ray's banner and token notice are noise to a user who did not ask for Ray.
    quiet = logging.getLogger("ray")
    level = quiet.level
    ray_level = logging.INFO if notices.verbose() else logging.ERROR
    quiet.setLevel(ray_level)
    try:
        for attempt in range(1, head.START_ATTEMPTS + 1):
            try:
                with _ray_compat.lean_head():
                    ray.init(
                        address="local",
                        _temp_dir=ray_files.head_temp_dir(lasting=False),
                        num_cpus=cpus,
                        include_dashboard=False,
                        logging_level=ray_level,
                        log_to_driver=False,  # ranks' output comes through our own capture
                        # Ray starts workers 15 nice levels below the raylet: a rank, and the
                        # data loader workers it forks, would yield to everything else here.
                        _system_config=_ray_compat.same_niceness(),
                    )
                break
            except Exception as exc:  # Ray's own: its raylet has 30 s to register
                if not head.overloaded(str(exc)) or attempt == head.START_ATTEMPTS:
                    raise
                ray.shutdown()  # what this start began
                messages.say(
                    "Ray's local start timed out registering its node on a busy machine "
                    f"(attempt {attempt} of {head.START_ATTEMPTS}); starting it again"
                )
    finally:
        quiet.setLevel(level)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    messages.say(
        f"running locally on an embedded Ray instance ({os.cpu_count()} cores, {gpus} GPUs); "
        "`orchestrator local start` keeps one warm between scripts"
    )


def at_exit() -> None:
    """Interpreter exit: no thread starts a new Ray from here on; end the Ray session this
    module began (the embedded instance, or the connection `join` made) now.

    A late Ray call from a thread would otherwise start a fresh local instance (Ray's
    auto-init). Ending it here skips Ray's exit hook's 0.5 s wait for log lines, of which
    our sessions send none (log_to_driver=False): `orchestrator logs` and every script on
    a cluster exit 0.5 s sooner. A session the user began stays for Ray's own hook.
    """
    _ray_compat.stop_auto_init()
    if not ray.is_initialized():
        return
    if _embedded or (_joined_job is not None and not _broken and _job_now() == _joined_job):
        ray.shutdown()


def _job_now() -> str | None:
    """The Ray job id of this process's session now; None where Ray cannot say."""
    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - a broken session: Ray's own hook ends it
        return None


def is_embedded() -> bool:
    """Whether this process runs the embedded local instance."""
    return _embedded
