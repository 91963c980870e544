"""Restarts: whether a failed attempt is followed by another, and which ranks are replaced.

Healthy ranks (finished, or failed only because a peer did) keep their warm processes,
so a restart costs one actor start, not a whole pool's.
"""

from __future__ import annotations

from ray.exceptions import RayActorError

from orchestrator.call import Call
from orchestrator.errors import (
    CRASH,
    DistributedError,
    JobTimeoutError,
    PlacementTimeoutError,
    is_secondary,
)
from orchestrator.job import JobControl
from orchestrator.options import Options
from orchestrator.pool import Pool, Shrunk

SETTLE_S = 5.0
"""Before a restart, how long ranks still running may take to return (else: stuck). A gloo
rank whose peer died returns in moments on a quiet node, but ranks run niced (Ray's
worker_niceness), and on a busy node 2 s replaced healthy ranks. Only ranks truly stuck
(NCCL's collectives wait for its own timeout) make a restart wait this long."""


def restartable(error: BaseException, options: Options, restarts: int) -> bool:
    """Whether a failed attempt is to be followed by another (max_restarts, restart_on)."""
    if restarts >= options.max_restarts:
        return False
    if isinstance(error, RayActorError):  # an actor lost while the pool started
        return True
    if not isinstance(error, DistributedError):
        return False
    root = error.root_cause
    return options.restart_on == "any" or (root is not None and root.exc_type == CRASH)


def repair(
    control: JobControl, pool: Pool | None, attempt: int, error: BaseException, options: Options
) -> bool:
    """Replace the failed call's broken ranks in `pool` for attempt number `attempt`, or
    go on with fewer ranks (`options.min_replicas`), and say which: whether the pool was
    kept; False where the whole pool must go instead (the call ran on another pool, or
    none; or anything went amiss, a stop too). PlacementTimeoutError: no node for a lost
    node's ranks.
    """
    call = control.call
    if call is None or call.pool is not pool:
        return False
    try:
        how = _repair(call, attempt, error, options)
    except PlacementTimeoutError:
        raise
    except Exception:  # noqa: BLE001 - anything amiss: a whole new pool
        return False
    if how is not None:
        control.repaired(how)
    return how is not None


def _repair(
    call: Call, attempt: int, error: BaseException, options: Options
) -> set[int] | Shrunk | None:
    """Ranks still running may first take SETTLE_S to return (a peer's death reaches gloo
    ranks in moments); none after a timeout, where they are all stuck."""
    if isinstance(error, JobTimeoutError):
        broken = settle(call, 0.0)
    else:
        # A rank waiting in a gloo collective on a peer that failed out would wait for
        # ever: the ranks still running shut their process group's connections first.
        for rank in call.running() - call.output.dead:
            call.pool.actors[rank].unblock.remote()  # its outcome comes as the run's
        broken = settle(call, SETTLE_S)
    return call.pool.replace(
        broken, attempt, min_ranks=options.min_replicas, shrink_after=options.shrink_after
    )


def settle(call: Call, settle_s: float) -> set[int]:
    """After `call` failed: the ranks whose actor must be replaced before a restart, once
    those still running had `settle_s` to return (a node's rest comes in a task of its own).

    Dead ones, ones still running (perhaps stuck in a collective), and ones that raised an
    error of their own (their process may be in a bad state, e.g. CUDA's). A rank that
    finished, or failed only because a peer did, is healthy.
    """
    call.let_return(settle_s)
    broken = call.running() | call.output.dead
    broken |= {f.rank for f in call.failures if f.exc_type == CRASH or not is_secondary(f)}
    return broken
