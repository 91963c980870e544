"""What a rank's process uses, read cheaply from inside it: CPU, memory, GPU, collectives.

Each probe says nothing (0, None, '') rather than raise, and none loads what the rank
has not loaded: no torch, no CUDA context, no NVML before CUDA is initialized.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
from typing import Any

from orchestrator_workers import _compat


def rss_mb() -> float:
    """This process's resident memory (statm: pages)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def activity(waits_of: int | None = None) -> tuple[float, int]:
    """CPU seconds this process and its children (a data loader's workers) have used, and
    those thread `waits_of` (the function's, by native id) and the children waited for
    (runnable on a busy machine's run queue: a rank that wants CPU and gets little is
    busy, not stopped; a Ray worker's other threads wake often, and each wake-up waits
    there too), and the bytes it has read and written (files, pipes and sockets alike),
    so far."""
    used = time.process_time()
    try:
        with open("/proc/self/io", "rb") as io:
            fields = dict(line.split(b":") for line in io.read().splitlines())
        moved = int(fields[b"rchar"]) + int(fields[b"wchar"])
    except (OSError, ValueError, KeyError):
        moved = 0
    tick = os.sysconf("SC_CLK_TCK")
    children: list[str] = []
    for task in _tasks():
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/self/task/{task}/children", "rb") as listed:
                children += listed.read().decode().split()
            if task == str(waits_of):
                used += _waited(f"/proc/self/task/{task}/schedstat")
    for child in children:
        try:
            with open(f"/proc/{child}/stat", "rb") as stat:
                after_name = stat.read().rsplit(b")", 1)[1].split()
            used += (int(after_name[11]) + int(after_name[12])) / tick  # utime, stime
            used += _waited(f"/proc/{child}/schedstat")
        except (OSError, ValueError, IndexError):
            continue
    return used, moved


def _tasks() -> list[str]:
    """This process's threads, by native id."""
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []


def _waited(schedstat: str) -> float:
    """Seconds a thread spent runnable but waiting for a CPU (schedstat: ns on the CPU,
    ns waiting on a run queue, time slices); 0 where the kernel does not say."""
    try:
        with open(schedstat, "rb") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_clock() -> int:
    """The calling thread's CPU clock, for other threads of this process to read."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not on this platform: its own clock only
        return time.CLOCK_THREAD_CPUTIME_ID


def cpu_s(clock: int) -> float:
    """CPU seconds a thread has used, by its clock (one system call, no file)."""
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has ended
        return 0.0


def gpu_mb(device: int | None) -> float | None:
    """torch's CUDA memory allocated on the rank's device (None: the current one), where
    CUDA is initialized (never initialized here: that would take a GPU context)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return round(torch.cuda.memory_allocated(device) / 2**20, 1)
    except Exception:  # noqa: BLE001 - no CUDA build, or a driver problem: not shown
        return None


_nvml: dict[str, Any] = {}
"""NVML, once loaded: the module, and a handle per device (empty: not tried yet)."""


def gpu_busy(device: int | None) -> int | None:
    """How busy the rank's GPU (None: the current device) was over NVML's last sample
    period, in percent, where CUDA is initialized and NVML can be loaded (see
    `_compat.nvml`). The GPU is found by its UUID, as CUDA and NVML number GPUs
    differently; one NVML cannot read (a MIG slice) says nothing, once and for all."""
    torch = sys.modules.get("torch")
    if torch is None or _nvml.get("broken"):
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        if not _nvml:
            nvml = _compat.nvml()
            if nvml is None:
                raise RuntimeError("no NVML bindings")
            nvml.nvmlInit()
            _nvml["module"] = nvml
        nvml = _nvml["module"]
        index = torch.cuda.current_device() if device is None else device
        handle = _nvml.get(f"handle{index}")
        if handle is None:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            )
            _nvml[f"handle{index}"] = handle
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no NVML, no driver, a MIG slice: not shown
        _nvml["broken"] = True
        return None


def last_collective() -> str:
    """The last collective this process began, from torch's flight recorder:
    'gloo:all_reduce #42, not done'; '' where there is none (no torch, no group).

    The ranks' environment turns the recorder on; `_compat.flight_recorder` reads it.
    """
    if "torch.distributed" not in sys.modules:
        return ""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return ""
        dump = _compat.flight_recorder()
        if dump is None:
            return ""
        entries = pickle.loads(dump(True, False, False)).get("entries") or []  # noqa: S301 - torch's own
    except Exception:  # noqa: BLE001 - no recorder in this process: nothing to add
        return ""
    if not entries:
        return ""
    last = entries[-1]
    done = last.get("retired") or last.get("state") == "completed"
    name = last.get("profiling_name", "?")
    return f"{name} #{last.get('collective_seq_id', '?')}, {'done' if done else 'not done'}"
