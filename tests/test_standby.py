"""Warm spares kept by the pool (orchestrator.standby): a failed rank is replaced by its
node's spare, which takes the rank's GPU; a spare taken is made again; none outlives the pool."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from orchestrator import distribute, testing
from orchestrator.cli.lookup import running_jobs
from tests.helpers import wait_for, wait_resources_back


def killed_once(folder: str) -> tuple[int, int, str]:
    """Rank 1 kills its own process on attempt 0 once told to; every rank notes what it
    had on each attempt: (rank, pid, CUDA_VISIBLE_DEVICES)."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ["RESTART_COUNT"])
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    (Path(folder) / f"{rank}-{attempt}").write_text(f"{os.getpid()} {devices}")
    if rank == 1 and attempt == 0:
        while not (Path(folder) / "go").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank, os.getpid(), devices


def _spare_pids(fn) -> list[int]:
    pool = testing.pool(fn)
    return [pid for pids in pool.standby.pids().values() for pid in pids] if pool else []


def test_a_failed_rank_is_replaced_by_its_node_s_warm_spare_with_its_gpu(cluster, tmp_path):
    fn = distribute(
        killed_once,
        num_replicas=2,
        replicas_per_node=2,
        gpus_per_replica=1,
        max_restarts=1,  # spares_per_node's default: then one a node
        name="standby",
    )
    with fn:
        job = fn.submit(str(tmp_path))
        wait_for(lambda: bool(_spare_pids(fn)), 120, "the pool's warm spare")
        [spare] = _spare_pids(fn)
        (tmp_path / "go").touch()
        (_, pid0, gpu0), (_, pid1, gpu1) = job.result(timeout=180)
        before = {r: (tmp_path / f"{r}-0").read_text().split(" ") for r in (0, 1)}
        assert pid1 == spare, "rank 1 must be served by the spare, not a cold start"
        assert pid0 == int(before[0][0]), "the surviving rank keeps its process"
        # A node's ranks see its GPUs (cuda:LOCAL_RANK is theirs): the same two, in order.
        assert gpu1 == before[1][1] and gpu0 == before[0][1], "each rank keeps its GPU"
        assert len(set(gpu1.split(","))) == 2, gpu1
        assert job.status().restarts == 1
        # `orchestrator stacks` finds the rank the spare serves (its actor keeps its name).
        [ranks] = [r for (name, _), r in running_jobs().items() if name == "standby"]
        assert sorted(ranks) == [0, 1] and "spare" in ranks[1], ranks
        # The spare taken is made again, so that a second failure finds one too.
        wait_for(lambda: bool(set(_spare_pids(fn)) - {spare}), 120, "a new spare")
        [refilled] = _spare_pids(fn)
    wait_for(lambda: not Path(f"/proc/{refilled}").exists(), 30, "the spare gone with its pool")
    wait_resources_back()


def test_a_spare_that_died_idle_is_passed_over_and_made_again(cluster, tmp_path):
    fn = distribute(
        killed_once, num_replicas=2, replicas_per_node=2, gpus_per_replica=0, max_restarts=1
    )
    with fn:
        job = fn.submit(str(tmp_path))
        wait_for(lambda: bool(_spare_pids(fn)), 120, "the pool's warm spare")
        [spare] = _spare_pids(fn)
        os.kill(spare, signal.SIGKILL)  # as Ray's memory monitor would
        (tmp_path / "go").touch()
        (_, pid0, _), (_, pid1, _) = job.result(timeout=180)
        assert pid1 != spare
        assert pid0 == int((tmp_path / "0-0").read_text().split(" ")[0]), "rank 0 is kept"
        wait_for(lambda: bool(set(_spare_pids(fn)) - {spare}), 120, "a new spare")


def test_no_spares_without_restarts_unless_a_call_or_the_option_asks(cluster):
    plain = distribute(os.getpid, num_replicas=1, gpus_per_replica=0, name="nospare")
    with plain:
        plain()
        assert testing.pool(plain).standby.per_node == 0
        plain.with_options(max_restarts=2)()  # the same pool: now it may restart
        assert testing.pool(plain).standby.per_node == 1
        wait_for(lambda: len(_spare_pids(plain)) == 1, 120, "a warm spare")
    spared = distribute(os.getpid, num_replicas=1, gpus_per_replica=0, spares_per_node=2)
    with spared:
        spared()
        assert testing.pool(spared).standby.per_node == 2
        wait_for(lambda: len(_spare_pids(spared)) == 2, 120, "two warm spares")
        pids = _spare_pids(spared)
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 30, "spares gone")
    wait_resources_back()
