"""Jobs: submit(), several jobs on one cluster, waiting for resources, cancel, asyncio."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

import pytest
from ray.util import placement_group_table

from orchestrator import (
    BusyError,
    PlacementError,
    PlacementTimeoutError,
    distribute,
    runner,
    testing,
)
from tests.helpers import wait_resources_back

from .helpers import wait_for


def all_reduce_and_sleep(seconds: float) -> tuple[float, float, float]:
    """A gloo all_reduce of rank+1, then `seconds` of sleep; (sum, start, end)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    dist.barrier()
    dist.destroy_process_group()
    return value.item(), start, end


def pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def group_states(prefix: str) -> list[str]:
    return [g["state"] for g in placement_group_table().values() if g["name"].startswith(prefix)]


def gone(pids: list[int]) -> bool:
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_two_jobs_run_at_once_and_a_third_waits_for_resources(cluster):
    wait_resources_back()
    a, b, c = (
        distribute(all_reduce_and_sleep, num_replicas=2, replicas_per_node=1, name=name)
        for name in ("a", "b", "c")
    )
    job_a, job_b = a.submit(4.0), b.submit(4.0)
    wait_for(lambda: job_a.running() and job_b.running(), 90, "both running")
    job_c = c.submit(0.1)  # the 4 GPUs are held: it must wait
    wait_for(lambda: job_c.status().state == "pending", 10, "pending")
    status = job_c.status()
    assert "GPU" in (status.waiting_for or ""), status
    assert {r.state for r in status.ranks} == {"pending"}

    jobs = {"a": job_a, "b": job_b, "c": job_c}
    results = {name: job.result(timeout=120) for name, job in jobs.items()}
    for ranks in results.values():
        assert [total for total, _, _ in ranks] == [3.0, 3.0]  # 1 + 2 on every rank
    start = {name: min(s for _, s, _ in ranks) for name, ranks in results.items()}
    end = {name: max(e for _, _, e in ranks) for name, ranks in results.items()}
    assert max(start["a"], start["b"]) < min(end["a"], end["b"]), "a and b did not overlap"
    assert start["c"] >= min(end["a"], end["b"]), "c ran before a or b had finished"
    assert job_c.status().state == "finished"
    assert {r.state for r in job_c.status().ranks} == {"finished"}
    for fn in (a, b, c):
        fn.shutdown()
    wait_resources_back()


def test_placement_timeout_cancel_pending_and_cancel_running(cluster):
    wait_resources_back()
    blocker = distribute(pid_after, num_replicas=4, replicas_per_node=2, name="blocker")
    running = blocker.submit(120)
    wait_for(lambda: running.status().state == "running", 90, "running")
    pids = blocker.pids()
    assert len(pids) == 4

    # The cluster could hold it, but other jobs hold the GPUs now.
    late = distribute(os.getpid, num_replicas=2, replicas_per_node=1, placement_timeout=2)
    started = time.monotonic()
    with pytest.raises(PlacementTimeoutError, match=r"placement_timeout=2 s.*GPU") as info:
        late()
    assert 1.5 <= time.monotonic() - started < 60  # it waited placement_timeout, then gave up
    assert isinstance(info.value, TimeoutError)

    # The cluster can never hold 3 GPUs on one node: at once, with each node's resources.
    never = distribute(os.getpid, num_replicas=3, replicas_per_node=3, name="never")
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"GPU: 2") as info:
        never.submit()
    assert time.monotonic() - started < 30  # at once: it waited for no placement
    assert str(info.value).count("GPU: 2") >= 2  # both nodes listed

    # A pending job withdraws its request when cancelled.
    waiting = distribute(os.getpid, num_replicas=2, replicas_per_node=1, name="waiting").submit()
    wait_for(lambda: waiting.status().state == "pending", 30, "pending")
    assert waiting.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        waiting.result(timeout=5)
    assert waiting.status().state == "cancelled"
    assert group_states("waiting-"), "it never asked for its placement group"
    wait_for(
        lambda: set(group_states("waiting-")) == {"REMOVED"}, 10, "its placement group removed"
    )

    # A running job stops its ranks and gives back its resources.
    assert "blocker" in runner.settle(0.2)  # what the exit would name as still ending
    assert not running.done(), (running, running.status(), running.exception() or running.result())
    assert running.cancel()
    wait_for(lambda: gone(pids), 10, "ranks stopped")  # at once: the job had 120 s to run
    assert "blocker" not in runner.settle(30)  # its thread left Ray: the exit would wait no more
    assert running.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        running.result(timeout=5)
    assert {r.state for r in running.status().ranks} == {"stopped"}
    wait_resources_back()
    assert not running.cancel() or running.cancelled()

    # The function runs again, on fresh actors.
    again = blocker.submit(0).result(timeout=90)
    assert set(again).isdisjoint(pids)
    blocker.shutdown()
    wait_resources_back()


def echo_after(seconds: float, word: str) -> tuple[str, int]:
    time.sleep(seconds)
    return word, os.getpid()


def test_queued_calls_run_in_turn_with_their_own_arguments_and_options(cluster):
    fn = distribute(echo_after, num_replicas=1, gpus_per_replica=0, name="queued")
    first = fn.submit(1.5, "first")
    second = fn.with_options(timeout=30).submit(0, "second")
    third = fn.submit(0, "third")
    assert second.status().state == "queued"
    with pytest.raises(BusyError, match="queue=True"):
        fn.with_options(queue=False).submit(0, "refused")
    assert third.cancel()  # a queued job is withdrawn, and waiters see it at once
    done, _ = concurrent.futures.wait([third], timeout=1)
    assert done == {third}
    [(word1, pid1)] = first.result(timeout=90)
    [(word2, pid2)] = second.result(timeout=90)
    assert (word1, word2) == ("first", "second")
    assert pid1 == pid2  # the same warm actor, in turn
    assert not testing.live_jobs()  # the refused and the cancelled job are forgotten

    # A copy made with with_options keeps the pool alive after the original is gone.
    copy = fn.with_options(timeout=60)
    del fn
    import gc

    gc.collect()
    [(word, pid)] = copy(0, "copy")
    assert (word, pid) == ("copy", pid1)
    copy.shutdown()


def test_asyncio_gather_futures_and_callbacks(cluster):
    f = distribute(pid_after, num_replicas=1, gpus_per_replica=0, name="f")
    g = distribute(pid_after, num_replicas=2, replicas_per_node=1, gpus_per_replica=0, name="g")

    async def both() -> list[list[int]]:
        return await asyncio.gather(f.submit(0.5), g.submit(0.5))

    pf, pg = asyncio.run(both())
    assert len(pf) == 1 and len(pg) == 2

    seen: list[str] = []
    jobs = [f.submit(0.2), g.submit(0.1)]
    for job in jobs:
        job.add_done_callback(lambda j: seen.append(j.name))
    done = list(concurrent.futures.as_completed(jobs, timeout=60))
    assert set(done) == set(jobs)
    wait_for(lambda: len(seen) == 2, 5, "callbacks called")
    assert sorted(seen) == ["f", "g"]
    f.shutdown()
    g.shutdown()
