"""Shrink (issue 58): a restart whose lost node nothing can replace goes on with the ranks
left, renumbered, each restoring its own in-memory snapshot."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import DistributedError, DistributedFunction, Job, distribute, testing
from tests.helpers import wait_for, wait_resources_back

STEPS = 10


def shrinking(folder: str, fail_after: bool = False) -> dict[str, object]:
    """Adds step+1 (summed over the ranks, divided by the world) to a state every step, so
    the sum is the same whatever the world; a snapshot every 2 steps. On the first attempt
    every rank waits after step 5's snapshot for its peers to fail (a node removed); on the
    second, rank 1 raises at step 8 where `fail_after` says so."""
    import torch
    import torch.distributed as dist

    from orchestrator import snapshot

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["RESTART_COUNT"])
    state = {"w": torch.zeros(4)}
    restored = snapshot.restore(state)
    start = 0 if restored is None else restored.step + 1
    for step in range(start, STEPS):
        if fail_after and attempt == 1 and rank == 1 and step == 8:
            raise ValueError("after the shrink")
        grad = torch.full((4,), float(step + 1))
        dist.all_reduce(grad)
        state["w"] += grad / world
        if step % 2 == 1:
            snapshot.save(step, state, data=step + 1)
        if attempt == 0 and step == 5:
            (Path(folder) / f"saved-{rank}").touch()
            while True:  # until a peer's node is gone and this collective fails
                dist.all_reduce(torch.zeros(1))
                time.sleep(0.05)
    return {
        "rank": rank,
        "world": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "step": None if restored is None else restored.step,
        "saved_world": None if restored is None else restored.world_size,
        "source": None if restored is None else restored.source,
        "w": state["w"].tolist(),
    }


@pytest.fixture
def two_nodes(cluster) -> Iterator[list]:
    """Two nodes, each the only ones with the resource `shrinky` (2 ranks' worth)."""
    wait_resources_back()
    nodes = [cluster.add_node(num_cpus=2, resources={"shrinky": 2}) for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        yield nodes
    finally:
        for node in nodes:
            if node in cluster.list_all_nodes():
                cluster.remove_node(node)
        wait_resources_back()


def _shrinking() -> DistributedFunction:
    return distribute(
        shrinking,
        num_replicas=4,
        replicas_per_node=2,
        gpus_per_replica=0,
        resources_per_replica={"shrinky": 1},
        max_restarts=1,
        min_replicas=2,
        name="shrinks",
    )


def _lose_rank_0_s_node(job: Job, nodes: list, cluster, folder: Path) -> None:
    """Once every rank saved step 5, remove rank 0's node (ranks 0-1 go with it)."""
    wait_for(lambda: len(list(folder.glob("saved-*"))) == 4, 120, "step 5's snapshot")
    view = testing.view(job)
    assert view is not None
    [victim] = [n for n in nodes if n.node_id == view.ranks[0].node_id]
    cluster.remove_node(victim, allow_graceful=False)


def test_a_lost_node_nothing_can_replace_leaves_the_job_running_on_the_others(
    cluster, two_nodes, tmp_path, capfd
):
    fn = _shrinking()
    with fn:
        job = fn.submit(str(tmp_path))
        _lose_rank_0_s_node(job, two_nodes, cluster, tmp_path)
        results = job.result(timeout=180)
        status = job.status()
        assert testing.pool(fn) is None  # shrunk: the next call asks for its full size
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["world"] for r in results} == {2}
    assert [r["local_rank"] for r in results] == [0, 1]
    assert {r["step"] for r in results} == {5} and {r["saved_world"] for r in results} == {4}
    assert {r["source"] for r in results} == {"own"}  # each its own copy, kept as rank 2, 3
    assert all(r["w"] == [55.0] * 4 for r in results), results  # 1 + 2 + ... + 10
    assert status.restarts == 1 and len(status.ranks) == 2
    assert any(e.kind == "shrunk" for e in status.events)
    err = capfd.readouterr().err
    assert "going on with 2 of 4 ranks: rank(s) 0-1 lost" in err, err
    assert "renumbered 2->0, 3->1" in err, err
    assert "waiting for" not in err, err  # no live node could hold it: no wait for one
    wait_resources_back()


def test_a_rank_failing_after_a_shrink_is_named_by_its_new_number(cluster, two_nodes, tmp_path):
    fn = _shrinking()
    with fn:
        job = fn.submit(str(tmp_path), fail_after=True)
        _lose_rank_0_s_node(job, two_nodes, cluster, tmp_path)
        with pytest.raises(DistributedError) as raised:
            job.result(timeout=180)
    root = raised.value.root_cause
    assert root is not None and root.rank == 1, str(raised.value)  # was rank 3
    assert "after the shrink" in str(raised.value)
    assert len(job.status().ranks) == 2
    wait_resources_back()
