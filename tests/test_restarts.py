"""Fault tolerance: max_restarts restarts every rank on a fresh pool, on the nodes alive;
through distribute() and `orchestrator run --max-restarts`."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray.util import placement_group_table

from orchestrator import (
    DistributedError,
    DistributedFunction,
    Job,
    PlacementError,
    distribute,
    restart,
    testing,
)
from orchestrator_workers import handoff
from tests.helpers import CPUS_PER_NODE, GPUS_PER_NODE, wait_resources_back

from .helpers import cli, show, write


def crash_once(folder: str, crash: str | None = "3") -> tuple[str, str, int, float]:
    """Rank `crash` kills its own process on attempt 0; every rank notes each attempt it saw."""
    import torch
    import torch.distributed as dist

    rank, attempt = os.environ["RANK"], os.environ["RESTART_COUNT"]
    with open(Path(folder) / f"rank{rank}", "a") as seen:
        seen.write(f"{attempt} {os.environ['TORCHELASTIC_RESTART_COUNT']} {os.getpid()}\n")
    dist.init_process_group("gloo")
    if rank == crash and attempt == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return attempt, os.environ["NODE_RANK"], os.getpid(), total.item()


@pytest.mark.parametrize(
    "case",
    [("3", False), ("2", True), ("0", True)],
    ids=["a-node-s-second-rank", "a-node-s-first-rank-called-by-rank-0", "rank-0-calling-all"],
)
def test_a_crashed_rank_restarts_the_whole_group(cluster, tmp_path, capfd, monkeypatch, case):
    """A node's first rank (rank 2 on the second node) hands calls to its node's ranks;
    on many nodes (`tree`, here made 2) rank 0 hands them to each node's first rank (see
    handoff): the death of either must not take the other ranks' outcomes with it."""
    dead, tree = case
    if tree:
        monkeypatch.setenv(handoff.TREE, "2")
    # A survivor that is still failing out of gloo after the settle time is replaced: on a
    # 2-core machine busy with the other test process, 5 s was once too short for rank 1.
    monkeypatch.setattr(restart, "SETTLE_S", 30.0)
    fn = distribute(crash_once, num_replicas=4, replicas_per_node=2, max_restarts=2, name="ft")
    job = fn.submit(str(tmp_path), dead)
    results = job.result(timeout=180)
    assert bool(testing.pool(fn).routes.others) == tree  # calls went through rank 0, or not
    assert [(a, node, total) for a, node, _, total in results] == [
        ("1", "0", 4.0),
        ("1", "0", 4.0),
        ("1", "1", 4.0),
        ("1", "1", 4.0),
    ]
    pids_seen = {}
    for rank in range(4):  # every rank saw attempt 0, then attempt 1
        lines = (tmp_path / f"rank{rank}").read_text().splitlines()
        assert [line.rsplit(" ", 1)[0] for line in lines] == ["0 0", "1 1"]
        pids_seen[rank] = [int(line.rsplit(" ", 1)[1]) for line in lines]
    # Only the dead rank got a new process; the others kept theirs (torch already loaded).
    dead_rank = int(dead)
    status, err = job.status(), capfd.readouterr().err
    assert pids_seen[dead_rank][0] != pids_seen[dead_rank][1]
    kept = [rank for rank in range(4) if rank != dead_rank]
    # Once in many runs a survivor was replaced too (rank-0-calling-all: rank 2, rank 3),
    # likely for an error not taken for a peer's (see the store test below); its failure,
    # as the driver saw it, tells why (a str: pytest would cut a tuple's repr short).
    why = f"pids {pids_seen}\nfailed attempts:\n{status.failed_attempts}\n{err[-4000:]}"
    assert all(pids_seen[rank][0] == pids_seen[rank][1] for rank in kept), why
    assert status.state == "finished" and status.restarts == 1
    assert f"rank {dead}" in status.failed_attempts[0] and "crashed" in status.failed_attempts[0]
    log = job.logs(dead_rank)
    assert "--- attempt 2 (restart 1) ---\n" in log, log
    assert f"[ft] attempt 1 failed: rank {dead} (local rank {dead_rank % 2})" in err
    assert "restarting all 4 ranks" in err

    # The pool of the successful attempt is the warm pool now: same processes, attempt 0.
    pids = [pid for _, _, pid, _ in results]
    again = fn(str(tmp_path), None)
    assert [pid for _, _, pid, _ in again] == pids
    assert {a for a, _, _, _ in again} == {"0"}
    fn.shutdown()
    wait_resources_back()


def always_raises() -> None:
    raise ValueError(f"bad batch on rank {os.environ['RANK']}")


def test_restart_on_crash_only_and_the_earlier_attempts_in_the_error(cluster, capfd):
    only_crashes = distribute(
        always_raises, num_replicas=2, replicas_per_node=1, max_restarts=3, restart_on="crash"
    )
    with pytest.raises(ValueError, match="bad batch") as info:
        only_crashes()
    assert info.value.earlier_attempts == ()  # a raise is not a crash: no restart
    assert "restarting" not in capfd.readouterr().err

    anything = only_crashes.with_options(restart_on="any", max_restarts=1)
    with pytest.raises(DistributedError, match="bad batch") as info:
        anything()
    assert len(info.value.earlier_attempts) == 1
    assert "The 1 earlier attempt(s) failed too:\n  attempt 1: rank" in str(info.value)
    assert capfd.readouterr().err.count("restarting all 2 ranks") == 1

    # max_restarts=0 (the default) fails fast, as before.
    with pytest.raises(ValueError):
        distribute(always_raises, num_replicas=2, replicas_per_node=1)()
    assert "restarting" not in capfd.readouterr().err
    only_crashes.shutdown()
    wait_resources_back()


def _advance_then_join(step: str) -> tuple[float, str]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if step == "advance":
        if os.environ["RANK"] == "1":
            # What an init_process_group that failed half-way (a peer died while the
            # group connected) leaves behind: torch's group counter advanced, no group.
            distributed_c10d._world.group_count += 1
        return 0.0, os.environ["RANK"]
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item(), os.environ["RANK"]


def store_host_dies(folder: str) -> tuple[str, int]:
    """On attempt 0, rank 1 waits on the rendezvous store for a key never set, and rank 0,
    whose process serves that store, kills itself; each rank notes its pid per attempt."""
    import torch.distributed as dist

    rank, attempt = os.environ["RANK"], os.environ["RESTART_COUNT"]
    (Path(folder) / f"rank{rank}.{attempt}").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    if attempt == "0":
        store = dist.distributed_c10d._get_default_store()
        if rank == "0":
            time.sleep(1.0)  # rank 1 waits in store.get by then
            os.kill(os.getpid(), signal.SIGKILL)
        store.get("never-set")  # "Failed to recv, got 0 bytes. Connection was likely closed"
    dist.destroy_process_group()
    return attempt, os.getpid()


def test_a_rank_whose_store_connection_closed_is_not_the_root_cause_and_is_kept(
    cluster, tmp_path, monkeypatch
):
    """The rendezvous store lives in rank 0's process: a peer waiting on it when rank 0
    dies fails as a consequence (torch's words: "Connection was likely closed"). Rank 0 is
    the root cause; the peer keeps its process for the restart."""
    monkeypatch.setattr(restart, "SETTLE_S", 30.0)
    with distribute(
        store_host_dies, num_replicas=2, replicas_per_node=1, max_restarts=1, name="store"
    ) as fn:
        job = fn.submit(str(tmp_path))
        results = job.result(timeout=180)
    status = job.status()
    assert status.restarts == 1 and [a for a, _ in results] == ["1", "1"]
    first = status.failed_attempts[0]
    assert first.startswith("rank 0 (local rank 0)") and "crashed" in first.split("\n")[0], first
    pids = {
        name: int((tmp_path / name).read_text())
        for name in ("rank0.0", "rank0.1", "rank1.0", "rank1.1")
    }
    assert pids["rank0.0"] != pids["rank0.1"], pids  # the dead rank: a new process
    assert pids["rank1.0"] == pids["rank1.1"], (pids, first)  # its peer kept its own
    wait_resources_back()


def test_a_rank_kept_after_a_half_done_init_joins_the_next_group(cluster):
    """Found by bench_soak: a restart whose kept rank had a failed init hung for ever."""
    with distribute(_advance_then_join, num_replicas=2, replicas_per_node=1, timeout=60) as fn:
        fn("advance")
        assert fn("join") == [(2.0, "0"), (2.0, "1")]


def test_max_restarts_restarts_a_crashed_script(cluster, tmp_path):
    project = write(
        tmp_path / "p",
        {
            "flaky.py": """\
                import os, signal
                import torch.distributed as dist

                dist.init_process_group("gloo")
                attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
                if os.environ["RANK"] == "1" and attempt == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()
                print(f"attempt {attempt} done", flush=True)
            """
        },
    )
    proc = cli(
        f"run --nproc 2 --per-node 1 --max-restarts 1 --address {cluster.address} flaky.py",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert "[flaky] attempt 1 failed: rank 1" in proc.stderr, show(proc)
    assert sorted(re.findall(r"\[flaky r(\d)\] attempt 1 done", proc.stdout)) == ["0", "1"]
    assert "attempt 0 done" not in proc.stdout


def hold_then_sum(seconds: float) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RESTART_COUNT"] == "0":
        time.sleep(seconds)  # the node is removed meanwhile
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    import ray

    return os.environ["RESTART_COUNT"], ray.get_runtime_context().get_node_id()


@dataclass
class LostNodes:
    """Two jobs, each using a node that was then lost, both nodes at the same moment."""

    restarting: DistributedFunction
    job: Job
    second_node: str
    """The node of the job's ranks 2-3, lost."""
    holder: DistributedFunction
    held: Job
    """Holding the `special` node, lost."""
    waiter: DistributedFunction
    waiting: Job
    waiting_state: str
    """The waiting job's state just before the nodes went."""


@pytest.fixture(scope="module")
def lost_nodes(cluster) -> Iterator[LostNodes]:
    """A 4-rank job with max_restarts, and a job holding the only `special` node while
    another waits for it; then the node of the first job's ranks 2-3 and the `special`
    node are lost together, so that the two waits for Ray to notice overlap.

    Its tests come last in the module: a job left running would hold resources the
    module's other tests wait for."""
    wait_resources_back()
    cluster.add_node(wait=False, num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
    special = cluster.add_node(wait=False, num_cpus=2, resources={"special": 2})
    cluster.wait_for_nodes()
    restarting = distribute(
        hold_then_sum, num_replicas=4, replicas_per_node=2, max_restarts=1, name="lose"
    )
    holder = distribute(
        time.sleep, num_replicas=1, gpus_per_replica=0, resources_per_replica={"special": 2}
    )
    waiter = distribute(
        os.getpid, num_replicas=1, gpus_per_replica=0, resources_per_replica={"special": 1}
    )
    try:
        job, held = restarting.submit(120), holder.submit(300)
        deadline = time.monotonic() + 90
        while {job.status().state, held.status().state} != {"running"}:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        waiting = waiter.submit()
        while waiting.status().state != "pending" and time.monotonic() < deadline:
            time.sleep(0.1)
        waiting_state = waiting.status().state
        view = testing.view(job)
        assert view is not None
        second_node = view.ranks[2].node_id  # ranks 2-3: never the driver's (head) node
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == second_node)
        cluster.remove_node(victim, allow_graceful=False)
        cluster.remove_node(special, allow_graceful=False)
        yield LostNodes(restarting, job, second_node, holder, held, waiter, waiting, waiting_state)
    finally:
        for fn in (restarting, holder, waiter):
            fn.shutdown()
    wait_resources_back()  # whichever node went, the session's cluster has 2 x 2 GPUs again


def test_losing_a_node_restarts_the_job_on_the_remaining_nodes(lost_nodes):
    job = lost_nodes.job
    results = job.result(timeout=180)
    assert [attempt for attempt, _ in results] == ["1"] * 4
    assert lost_nodes.second_node not in {node for _, node in results}
    assert job.status().restarts == 1
    [attempt] = job.status().failed_attempts  # said as a lost node, not a bare crash
    assert "its node left the Ray cluster" in attempt, attempt
    # One live placement group, none leaked: the same one with the lost node's bundles
    # placed again where ranks 0-1 were healthy (they failed out of the rendezvous while
    # ranks 2-3 had not joined yet: in place), or a new one beside the old, removed, where
    # they were still running (in their sleep: a whole new pool).
    groups = [g for g in placement_group_table().values() if g["name"].startswith("lose-")]
    states = sorted(g["state"] for g in groups)
    assert states in (["CREATED"], ["CREATED", "REMOVED"]), states
    lost_nodes.restarting.shutdown()


def test_a_waiting_job_fails_once_a_lost_node_leaves_the_cluster_unable_to_hold_it(lost_nodes):
    assert lost_nodes.waiting_state == "pending"
    with pytest.raises(PlacementError, match="special"):
        lost_nodes.waiting.result(timeout=60)  # not a wait for ever
    with pytest.raises(DistributedError):
        lost_nodes.held.result(timeout=60)  # its node is gone
    lost_nodes.holder.shutdown()
    lost_nodes.waiter.shutdown()
