"""What a training process inherits, as seen from inside it; run under torchrun or distribute.

    torchrun --standalone --nproc_per_node=N tests/inherit_probe.py   (a JSON line per rank)
    python tests/inherit_probe.py N [N ...]   (through distribute(), on the embedded default)

tests/test_inheritance.py compares the two; docs/ranks.md "What a rank inherits" explains each
difference it allows.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

TAG = "INHERITS"


def signal_dispositions() -> dict[str, str]:
    """Each signal's disposition as the kernel holds it: caught, ignored or default."""
    masks = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigIgn", "SigCgt"):
            masks[key] = int(value.strip(), 16)
    found = {}
    for sig in sorted(signal.valid_signals()):
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        bit = 1 << (sig - 1)
        caught = masks["SigCgt"] & bit
        found[sig.name] = "caught" if caught else "ignored" if masks["SigIgn"] & bit else "default"
    return found


def _pipe_ends_beyond_stdio() -> int:
    """Fds other than 1 and 2 on the pipes (or files) that fds 1 and 2 are."""
    fd_dir = Path("/proc/self/fd")
    stdio = {os.readlink(fd_dir / str(fd)) for fd in (1, 2)}
    count = 0
    for entry in fd_dir.iterdir():
        fd = int(entry.name)
        if fd in (0, 1, 2):
            continue
        try:
            if os.readlink(entry) in stdio and os.readlink(entry).startswith("pipe:"):
                count += 1
        except OSError:
            continue
    return count


def _child_facts(queue: mp.Queue) -> None:
    queue.put(
        {
            "signals": signal_dispositions(),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "threads": len(os.listdir("/proc/self/task")),
            "pipe_ends": _pipe_ends_beyond_stdio(),
        }
    )


def _nothing() -> None:
    pass


def _square(x: int) -> int:
    return x * x


def _pool_map(method: str) -> list[int] | str:
    """mp.Pool.map of a function of this module: run as a script, of `__main__`."""
    try:
        with mp.get_context(method).Pool(1) as pool:
            return pool.map(_square, [2, 3])
    except Exception as exc:  # noqa: BLE001 - the comparison shows it
        return f"{type(exc).__name__}: {exc}"


def facts() -> dict:
    """What this process was given, and what a child forked from it gets."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    mask = os.umask(0o022)
    os.umask(mask)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_facts, args=(queue,))
    child.start()
    forked = queue.get(timeout=60)
    child.join()
    started = time.perf_counter()
    empty = ctx.Process(target=_nothing)
    empty.start()
    empty.join()
    fork_s = time.perf_counter() - started
    loader = iter(DataLoader(TensorDataset(torch.zeros(64, 2)), batch_size=8, num_workers=2))
    next(loader)
    started = time.perf_counter()
    del loader
    teardown_s = time.perf_counter() - started
    return {
        "rank": int(os.environ["RANK"]),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "start_method": mp.get_start_method(),
        "main_thread": threading.current_thread() is threading.main_thread(),
        "signals": signal_dispositions(),
        "umask": mask,
        "flags": list(sys.flags),
        "rlimits": {
            name: list(resource.getrlimit(getattr(resource, name)))
            for name in ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_STACK", "RLIMIT_CORE")
        },
        "forked": forked,
        "pool_map": {method: _pool_map(method) for method in ("fork", "spawn")},
        "fork_s": fork_s,
        "loader_teardown_s": teardown_s,
    }


def main() -> None:
    """Under a launcher, print this rank's facts; else run them through distribute()."""
    if "RANK" in os.environ:
        print(TAG, json.dumps(facts()), flush=True)
        return
    from orchestrator import distribute

    for ranks in map(int, sys.argv[1:]):
        with distribute(facts, num_replicas=ranks, name=f"probe{ranks}") as probe:
            for found in probe():
                print(TAG, json.dumps({**found, "world": ranks}), flush=True)


if __name__ == "__main__":
    main()
