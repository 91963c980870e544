"""One call in flight: start every rank at once, watch them all, stream output, collect."""

from __future__ import annotations

import re
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from orchestrator.errors import CRASH, describe_rank, distributed_error, timeout_error
from orchestrator.pool import Pool
from workers.capture import EXIT_STREAM
from workers.protocol import Payload, RankFailure, RankResult

_GATHER_S = 0.3
"""After the first failure, how long to keep listening for the others' (for the report)."""
_DRAIN_POLL_S = 30.0
"""How long one output request waits on an idle rank before returning empty."""


_STACKS_WAIT_S = 3.0
"""How long to wait for the ranks' stacks before reporting without them."""


def run(pool: Pool, payload: Payload, timeout: float | None = None) -> list[Any]:
    """Run the shipped function on every rank of `pool`; results by rank.

    Ranks are watched as they complete, not in rank order. On the first failure the
    caller must tear the pool down (the other ranks may be blocked in a collective
    forever): a DistributedError is raised after a short wait for the others' reports.
    """
    ref = ray.put(payload)  # once, whatever the number of ranks
    specs = pool.specs_for_call()
    runs = {
        actor.run.remote(spec, ref): spec.rank
        for actor, spec in zip(pool.actors, specs, strict=True)
    }
    console = pool.console
    owed: dict[int, int] = {}  # rank -> output seq still to show before it counts as done
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    deadline: float | None = None
    time_limit = None if timeout is None else time.monotonic() + timeout
    while runs or any(console.printed[r] < seq for r, seq in owed.items() if r not in pool.dead):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if time_limit is not None and now >= time_limit and runs:
            console.flush()
            where = {rank: _where(pool, rank) for rank in range(len(specs))}
            raise timeout_error(timeout or 0.0, stacks(pool), where, console.log_dir)
        for rank, actor in enumerate(pool.actors):
            if rank not in pool.drains and rank not in pool.dead:
                pool.drains[rank] = actor.drain.remote(_DRAIN_POLL_S)
        draining = {ref: rank for rank, ref in pool.drains.items()}
        wake = [t for t in (deadline, time_limit, console.tick(now)) if t is not None]
        wait_s = max(0.0, min(wake) - now) if wake else None
        done, _ = ray.wait([*runs, *draining], num_returns=1, timeout=wait_s)
        for ready in done:
            if ready in runs:
                outcome = _outcome(pool, runs.pop(ready), ready)
                owed[outcome.rank] = outcome.output_seq
                if isinstance(outcome, RankFailure):
                    failures.append(outcome)
                    deadline = deadline or time.monotonic() + _GATHER_S
                else:
                    results[outcome.rank] = outcome.value
                    if outcome.next_master_port is not None:
                        pool.next_port = outcome.next_master_port
            else:
                _show(pool, draining[ready], ready)
    console.flush()
    if failures:
        raise distributed_error(failures, console.log_dir)
    return [results[rank] for rank in range(len(specs))]


def stacks(pool: Pool) -> dict[int, str]:
    """Each rank's current stacks, asked of all ranks at once; never blocks for long."""
    refs = {actor.stacks.remote(): rank for rank, actor in enumerate(pool.actors)}
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_STACKS_WAIT_S)
    found = {rank: f"(no answer within {_STACKS_WAIT_S:g} s)" for rank in refs.values()}
    for ref in done:
        try:
            found[refs[ref]] = ray.get(ref)
        except RayActorError:
            found[refs[ref]] = "(its process is gone)"
    return found


def _where(pool: Pool, rank: int) -> str:
    info = pool.infos[rank]
    return describe_rank(rank, pool.specs[rank].local_rank, info.node_ip, info.hostname, info.pid)


def _show(pool: Pool, rank: int, ref: ray.ObjectRef) -> None:
    del pool.drains[rank]
    try:
        chunks = ray.get(ref)
    except RayActorError:
        pool.dead.add(rank)
        return
    for chunk in chunks:
        if chunk.stream == EXIT_STREAM:
            pool.exit_codes[rank] = int(chunk.data)
    pool.console.write(rank, [c for c in chunks if c.stream != EXIT_STREAM])


def _outcome(pool: Pool, rank: int, ref: ray.ObjectRef) -> RankResult | RankFailure:
    try:
        return ray.get(ref)
    except RayActorError as exc:
        pool.dead.add(rank)
        info = pool.infos[rank]
        return RankFailure(
            rank=rank,
            local_rank=pool.specs[rank].local_rank,
            node_ip=info.node_ip,
            hostname=info.hostname,
            pid=info.pid,
            time=time.time(),
            exc_type=CRASH,
            message=_crash_reason(exc, pool.exit_codes.get(rank)),
            traceback="",
        )


def _crash_reason(exc: RayActorError, exit_code: int | None) -> str:
    if exit_code is not None:
        return f"its process called os._exit({exit_code})"
    detail = re.search(r"Worker exit detail: ([^.]*)", str(exc))
    ray_says = f"; Ray says: {detail.group(1)}" if detail else ""
    return (
        "its process died without a word: killed by a signal (SIGKILL, SIGSEGV), "
        f"the out-of-memory killer, or its node was lost{ray_says}"
    )
