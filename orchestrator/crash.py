"""A rank whose process died: what it wrote in its last instant, and why it died (also
while its pool started, before it had said where it runs)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import cloudpickle
import ray
from ray.exceptions import RayActorError, RayError, RuntimeEnvSetupError

from orchestrator.connect import cluster, rankside
from orchestrator.errors import CRASH, DistributedError, distributed_error
from orchestrator.show import notices
from orchestrator_workers.protocol import NodeInfo, OutputChunk, RankFailure
from orchestrator_workers.tail import read_tail

_LEFTOVER_WAIT_S = 0.5
"""How long to wait for a dead rank's keeper process to save its unread output."""
_READ_S = 15.0
"""How long the task that reads them may take on a node that is alive: a busy node may
start a worker process for it first (seconds); a lost node is given up at once."""
_PID = re.compile(r"\bpid[:=] ?(\d+)")
_IP = re.compile(r"\bip[:=] ?([0-9A-Fa-f.:]+[0-9A-Fa-f])")
"""Where Ray's word on a dead actor names its process and node: "pid: 12" or "pid=12"."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def last_words(info: NodeInfo, shown: int) -> list[OutputChunk]:
    """What the rank at `info` wrote after chunk `shown` and before it died, as its keeper
    saved it (read on the rank's own node); numbered on from `shown`."""
    if not info.tail_path:
        return []
    if info.node_id == cluster.driver_node():
        leftovers = read_tail(info.tail_path, _LEFTOVER_WAIT_S)
    else:
        leftovers = _read_on_node(info, _READ_S)
    unseen = [(s, stream, text) for s, stream, text in leftovers or [] if s == 0 or s > shown]
    last = max([shown, *(seq for seq, _, _ in unseen)])
    return [OutputChunk(seq or last + 1, stream, text.encode()) for seq, stream, text in unseen]


def _read_on_node(info: NodeInfo, limit_s: float) -> list[tuple[int, str, str]] | None:
    """The dead rank's saved output, read by a task on its node; None where the node is
    gone (now or meanwhile) or the read took longer than `limit_s`."""
    ref = rankside.task(info.node_id, read_tail, info.tail_path, _LEFTOVER_WAIT_S)
    deadline = time.monotonic() + limit_s
    while True:
        done, _ = ray.wait([ref], timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if done:
            try:
                return ray.get(done[0])
            except RayError:  # its node is gone meanwhile (unschedulable there)
                return None
        if time.monotonic() >= deadline or cluster.node_lost(info.node_id):
            with contextlib.suppress(Exception):  # gone with its node, or done meanwhile
                ray.cancel(ref, force=True)
            return None


def on_lost_nodes(ranks: Collection[int], infos: Sequence[NodeInfo]) -> list[int]:
    """Those of `ranks` whose node is lost (its raylet gone: see cluster.lost_nodes)."""
    lost = cluster.lost_nodes({infos[rank].node_id for rank in ranks}) if ranks else set()
    return sorted(rank for rank in ranks if infos[rank].node_id in lost)


def failure(
    rank: int,
    local_rank: int,
    info: NodeInfo,
    exc: RayActorError,
    *,
    exit_code: int | None,
    last_words: str,
) -> RankFailure:
    """`rank`'s failure, its actor gone (`exc`, Ray's word on why): see `reason`."""
    node_gone = cluster.node_lost(info.node_id)
    return RankFailure(
        rank=rank,
        local_rank=local_rank,
        node_ip=info.node_ip,
        hostname=info.hostname,
        pid=info.pid,
        time=time.time(),
        exc_type=CRASH,
        message=reason(exc, exit_code, last_words, node_gone=node_gone),
        traceback="",
    )


def died_starting(
    asked: Mapping[int, ray.ObjectRef],
    placed: Callable[[int], tuple[str, int]],
    exc: RayActorError | RuntimeEnvSetupError,
) -> DistributedError | RayError:
    """The error for the ranks whose actors died, or never started, while their pool
    started, before the function ran: `asked` (rank -> what it was asked then) brought
    RayActorError or RuntimeEnvSetupError (`exc`, the first) for them; `placed(rank)`: the
    node Ray placed it on, and its local rank there. `exc` itself where none of them can
    be told apart."""
    failures = []
    for rank, ref in asked.items():
        if not ray.wait([ref], timeout=0)[0]:
            continue  # alive, still answering: not one of them
        try:
            ray.get(ref)
        except (RayActorError, RuntimeEnvSetupError) as died:
            failures.append(_at_start(rank, *placed(rank), died))
    notices.quiet_crash_notices([failure.pid for failure in failures])  # said here instead
    return distributed_error(failures) if failures else exc


def _at_start(
    rank: int, node_id: str, local_rank: int, exc: RayActorError | RuntimeEnvSetupError
) -> RankFailure:
    text = _ANSI.sub("", str(exc))
    node: dict[str, Any] = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    pid, ip = _PID.search(text), _IP.search(text)
    where = {
        "rank": rank,
        "local_rank": local_rank,
        "node_ip": ip[1] if ip else node.get("NodeManagerAddress", "?"),
        "hostname": node.get("NodeManagerHostname", "?"),
        "pid": int(pid[1]) if pid else 0,
        "time": time.time(),
    }
    if isinstance(exc, RuntimeEnvSetupError):  # no process: Ray's setup failed first
        said = [line for line in text.strip().splitlines() if line.strip()]
        return RankFailure(
            **{**where, "pid": 0},
            exc_type=f"{RuntimeEnvSetupError.__module__}.RuntimeEnvSetupError",
            traceback=text,
            exception=cloudpickle.dumps(exc),
            message=(
                "its runtime_env could not be set up on its node, before its process "
                f"started: {said[-1] if said else 'Ray gave no reason'} (Ray's whole "
                "report is below). Change runtime_env=, or leave it out; Ray logs the "
                "setup on that node in its session's logs/runtime_env_setup-*.log"
            ),
        )
    hook = _hook_failed(text)
    if hook is not None:  # Ray ended the process: the setup hook it ran first raised
        report, raised = hook
        kind, _, message = raised.partition(": ")
        return RankFailure(
            **where,
            exc_type=kind if message else CRASH,
            traceback=report,
            message=(
                "its runtime_env's worker_process_setup_hook failed as its process started, "
                f"before the function ran: {message or raised}. Fix the hook, or leave it "
                "out of runtime_env="
            ),
        )
    if exc.actor_init_failed:  # our actor's start raised: its own traceback says where
        raised = text.strip().rsplit("\n", 1)[-1]
        kind, _, message = raised.partition(": ")
        return RankFailure(
            **where,
            exc_type=kind if message else CRASH,
            traceback=text,
            message=f"its actor failed to start, before the function ran: {message or raised}",
        )
    why = reason(exc, None, "", node_gone=cluster.node_lost(node_id))
    return RankFailure(
        **where,
        exc_type=CRASH,
        traceback="",
        message=f"while its pool started, before the function ran, {why}",
    )


def _hook_failed(text: str) -> tuple[str, str] | None:
    """Where Ray says a rank's process ended because its setup hook failed (raised, or
    could not be loaded): its report (the hook's traceback), and the line that says what
    was raised."""
    said = re.search(r"Worker exit detail: (Failed to \w+ the setup hook.*?)(?:\n\n|$)", text, re.S)
    if said is None:
        return None
    lines = [line for line in said.group(1).strip().splitlines() if line.strip()]
    return said.group(1).strip(), lines[-1].strip()


def reason(
    exc: RayActorError, exit_code: int | None, last_words: str, *, node_gone: bool = False
) -> str:
    """Why a rank's process died, as far as its exit status, last words and node tell."""
    if exit_code is not None:
        return f"its process called os._exit({exit_code})"
    fatal = re.search(r"Fatal Python error: ([^\n]+)", last_words)
    if fatal:
        return f"its process died: {fatal.group(1).strip()} (its stack is in its last lines above)"
    detail = re.search(r"Worker exit detail: ([^.]*)", str(exc))
    ray_says = f"; Ray says: {detail.group(1)}" if detail else ""
    if node_gone:
        return (
            "its node left the Ray cluster (Ray stopped there, or the machine was lost), "
            f"taking the rank with it{ray_says}"
        )
    return (
        "its process died without a word: killed by a signal (such as SIGKILL), "
        f"the out-of-memory killer, or its node was lost{ray_says}"
    )
