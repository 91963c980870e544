"""The rank side's uses of Ray's and torch's private parts, in one place.

As in `orchestrator/_ray_compat.py`: each touch checks the private part's shape first,
falls back to a named degraded mode, and records why in `degraded()`;
`tests/test_compat.py` fails when an upgrade makes one fall back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

_degraded: dict[str, str] = {}


def degraded() -> dict[str, str]:
    """The touches that fell back in this process, with why: {} when all work."""
    return dict(_degraded)


def job_states() -> dict[str, bool] | None:
    """Every Ray job of the cluster: hex id -> still running; None when Ray cannot tell.

    Asked of this worker's GCS client (no public API tells it). Degraded (None): the
    local runtime's spares end with their pool only, not also when their driver's job is
    gone.
    """
    try:
        import ray

        worker: Any = ray._private.worker.global_worker  # its GCS client is private
        get_all = worker.gcs_client.get_all_job_info
    except AttributeError as exc:
        _degraded.setdefault("job_states", str(exc))
        return None
    try:
        try:  # without these, the GCS asks every running driver about its tasks each time
            jobs = get_all(skip_submission_job_info_field=True, skip_is_running_tasks_field=True)
        except TypeError:
            jobs = get_all()
        return {job_id.hex(): not info.is_dead for job_id, info in jobs.items()}
    except Exception:  # noqa: BLE001 - the GCS did not answer this time
        return None


def reset_group_counter() -> None:
    """After the default process group is gone, have torch name the next unnamed group "0".

    torch names an unnamed group after a counter that only destroying the default group
    resets. An init_process_group that failed half-way (a peer died while the group
    connected) leaves it advanced: this process would name its next group "1" while a
    fresh peer names it "0", and both would wait for each other for ever. Degraded: a
    restart that reuses this process after such a failure may hang until its timeout.
    """
    import torch.distributed as dist

    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    if world is None or not hasattr(world, "group_count"):
        _degraded.setdefault("reset_group_counter", "torch's _world.group_count is gone")
        return
    if not dist.is_initialized():
        with contextlib.suppress(Exception):
            world.group_count = 0


_TRACKER_WAIT_S = 10.0
"""How long a rank waits for multiprocessing's resource tracker to leave its process group."""


def tracker_in_own_session() -> None:
    """Have multiprocessing's resource tracker, when this rank starts one, leave the rank's
    process group, so that it outlives the rank's death and removes what the rank left.

    A rank creates named semaphores (spawn or forkserver multiprocessing, a DataLoader with
    such a context); the tracker unlinks them when the rank dies without doing so. Ray
    ends a rank's actor by killing its whole process group, the tracker with it, and the
    `/dev/shm/sem.mp-*` files stayed. Degraded: they stay, as before.
    """
    try:
        from multiprocessing import resource_tracker, util

        original = util.spawnv_passfds
        source = inspect.getsource(resource_tracker.ResourceTracker.ensure_running)
        if "spawnv_passfds" not in source or "resource_tracker import main" not in source:
            raise AttributeError("ResourceTracker.ensure_running no longer spawns as expected")
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        _degraded.setdefault("tracker_in_own_session", str(exc))
        return
    if getattr(original, "__wrapped__", None) is not None:
        return

    @functools.wraps(original)
    def spawn(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
        last = args[-1] if args else None
        if not (isinstance(last, str) and "resource_tracker import main" in last):
            return original(path, args, passfds)
        pid = original(path, [*args[:-1], "import os; os.setsid(); " + last], passfds)
        # Until its interpreter is up and has left, a kill of the rank's process group
        # takes it too (seen on a busy machine): wait for that, a moment, once per rank.
        deadline = time.monotonic() + _TRACKER_WAIT_S
        with contextlib.suppress(OSError):  # gone already: nothing to wait for
            while os.getsid(pid) == os.getsid(0) and time.monotonic() < deadline:
                time.sleep(0.005)
        return pid

    util.spawnv_passfds = spawn


def serve_store(sock: socket.socket) -> Any:
    """torch's TCPStore server on the listening `sock` (bound to the ranks' interface) alone.

    torch binds a store it opens itself to every interface; handed a listening socket
    (`master_listen_fd`), it serves there. Degraded (a torch without it, or whose backend
    refuses it): the store listens on every interface, on the same port.
    """
    from torch.distributed import TCPStore

    host, port = sock.getsockname()[:2]
    fd = sock.detach()
    try:
        return TCPStore(
            host, port, None, is_master=True, wait_for_workers=False, master_listen_fd=fd
        )
    except (TypeError, RuntimeError, ValueError) as exc:
        os.close(fd)
        _degraded.setdefault(
            "serve_store",
            "the store listens on every interface, and another local user could take its "
            f"port in the moment between the product's socket closing and torch's bind: {exc}",
        )
        return TCPStore(host, port, None, is_master=True, wait_for_workers=False)


NVML_CALLS = ("nvmlInit", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetUtilizationRates")
"""What a rank asks of NVML (see `probes.gpu_busy`)."""


def nvml() -> Any:
    """NVML's Python bindings, not initialized: nvidia-ml-py where the user has it, else
    the copy Ray ships in its private `ray._private.thirdparty`.

    Degraded (None): a rank's record shows no GPU busy share.
    """
    with warnings.catch_warnings():  # the old pynvml package warns on import
        warnings.simplefilter("ignore")
        try:
            import pynvml  # nvidia-ml-py, where the user has it
        except ImportError:
            try:
                from ray._private.thirdparty import pynvml
            except ImportError as exc:
                _degraded.setdefault("nvml", f"no NVML bindings, and none in Ray: {exc}")
                return None
    missing = [name for name in NVML_CALLS if not hasattr(pynvml, name)]
    if missing:
        _degraded.setdefault("nvml", f"{pynvml.__name__} lacks {', '.join(missing)}")
        return None
    return pynvml


def flight_recorder() -> Callable[[bool, bool, bool], bytes] | None:
    """torch's flight recorder of this process's collectives, as a function that returns
    it pickled (arguments: include collectives, stack traces, only active ones).

    A recent torch records gloo's and NCCL's collectives (`_dump_fr_trace`); an older
    one NCCL's only (`_dump_nccl_trace`). Degraded (the older one): a stall's report
    names no gloo collective; (neither, None): it names none.
    """
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError as exc:
        _degraded.setdefault("flight_recorder", str(exc))
        return None
    dump: Callable[[bool, bool, bool], bytes] | None = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        dump = getattr(c10d, "_dump_nccl_trace", None)
        _degraded.setdefault(
            "flight_recorder",
            "torch has no _dump_fr_trace"
            + (": only NCCL's collectives are named" if dump else " nor _dump_nccl_trace"),
        )
    return dump
