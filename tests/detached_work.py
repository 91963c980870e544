"""What the detached tests run (test_detach.py, test_direct.py), in a module their child
drivers and notebooks import too: a child never imports a test module (it would load
everything the test imports, and run nothing of it). Not collected: it holds no tests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from orchestrator import testing

LAYOUT: dict[str, Any] = {
    "num_replicas": 2,
    "replicas_per_node": 2,
    "gpus_per_replica": 0,
    "detach": True,
}
"""test_direct's: both ranks on one node (a driver's call goes to rank 0 alone); no GPU,
so no store is made for these calls, which never rendezvous."""


def count(lines: int, pause: float) -> int:
    """Print `lines` numbered lines, `pause` s apart, each a step it reports; the rank
    times 10."""
    import orchestrator

    rank = int(os.environ["RANK"])
    for i in range(lines):
        print(f"rank {rank} line {i}", flush=True)
        orchestrator.report(step=i + 1, line=i)
        time.sleep(pause)
    return rank * 10


def pid() -> int:
    """This rank's process id."""
    return os.getpid()


def rank_and(x: int, fail_once: str = "", kill: int = 0) -> tuple[int, int]:
    """(this rank, x). `fail_once`: rank 1 raises where that file is not there yet (and
    makes it); `kill`: rank 0 SIGKILLs that process (the driver), then the call goes on."""
    rank = int(os.environ["RANK"])
    if fail_once and rank == 1 and not os.path.exists(fail_once):
        Path(fail_once).touch()
        raise RuntimeError("the first attempt breaks")
    if kill:
        if rank == 0:
            os.kill(kill, signal.SIGKILL)
        time.sleep(0.5)  # well past the driver's wait: its word would have come by now
    return rank, x


def warm(fn: Any) -> None:
    """A cold call of `rank_and`, then warm ones through the supervisor until one lends
    the pool."""
    for x in range(4):
        assert fn(x) == [(0, x), (1, x)]
        if testing.lent(fn):
            return
    raise AssertionError("no call through the supervisor lent the pool to this driver")
