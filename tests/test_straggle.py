"""Ranks slower than their peers, named while the job runs (issue 24, part 2).

The comparison is tested on made-up counts; then a real 4-rank gloo DDP loop on the
session's 2-node cluster, once balanced (never named) and once with one rank 30% slower
per step (named, with where its extra time goes and where its peers wait for it).
"""

from __future__ import annotations

import time

import pytest

from orchestrator import distribute, testing
from orchestrator.diagnose.straggle import CONFIRM_S, MIN_LOOKS, Shares
from orchestrator_workers.places import BACKWARD, COMPUTE
from orchestrator_workers.where import Where
from tests.helpers import wait_resources_back

LOADER = "at loader.py:88 in __getitem__ (`return load(i)`)"
BACK = "in torch._tensor.backward at train.py:60"
FORWARD = "at train.py:58 in step (`out = model(x)`)"


def _where(rank: int, looks: int, places: dict[str, float], cpu: float = 1.0) -> Where:
    counts = {p: round(share * looks) for p, share in places.items()}
    back = counts.get(BACK, 0)
    phases = {BACKWARD: (back, back * cpu), COMPUTE: (looks - back, (looks - back) * 1.0)}
    return Where(rank, (), True, 0.1, 0.1, samples=looks, places=counts, phases=phases)


def _slow(readings: dict[int, list[Where]]) -> list:
    """The slow ranks once the readings (15 s apart) have been compared twice, CONFIRM_S apart."""
    shares = Shares()
    for seen in readings.values():
        for i, where in enumerate(seen):
            shares.add(where, now=100.0 + 15 * i)
    last = 100.0 + 15 * (max(len(seen) for seen in readings.values()) - 1)
    shares.stragglers(readings, last)
    return shares.stragglers(readings, last + CONFIRM_S)


def test_the_slow_rank_is_named_with_its_place_and_where_its_peers_wait():
    start = {r: _where(r, 0, {}) for r in range(8)}
    usual = {FORWARD: 0.48, BACK: 0.46, LOADER: 0.06}
    later = {r: _where(r, 150, usual, cpu=0.1) for r in range(8)}
    later[5] = _where(5, 150, {FORWARD: 0.47, BACK: 0.12, LOADER: 0.41}, cpu=0.9)
    slow = _slow({r: [start[r], later[r]] for r in range(8)})
    assert [s.rank for s in slow] == [5]
    assert slow[0].sentence() == (
        f"rank 5 spends 41% of its time {LOADER} (others 6%); its peers wait for it "
        f"{BACK} (46% of their time, its 12%; their CPU there 0.1 cores, its 0.9)"
    )


def test_a_balanced_job_and_too_few_looks_name_nobody():
    usual = {FORWARD: 0.48, BACK: 0.46, LOADER: 0.06}
    noisy = {
        r: [_where(r, 0, {}), _where(r, 150, {FORWARD: 0.42 + r / 100, BACK: 0.52 - r / 100})]
        for r in range(8)
    }
    assert _slow(noisy) == []
    # A peer that waits a little longer where every rank waits is not slow itself.
    waits = {r: [_where(r, 0, {}), _where(r, 150, usual)] for r in range(8)}
    waits[4] = [_where(4, 0, {}), _where(4, 150, {FORWARD: 0.2, BACK: 0.74, LOADER: 0.06})]
    assert _slow(waits) == []
    # Nor is one that waits far longer in a collective: it waits for someone else.
    stop = "in all_reduce at train.py:64"
    usual_stop = {FORWARD: 0.4, BACK: 0.46, stop: 0.14}
    waits = {r: [_where(r, 0, {}), _where(r, 150, usual_stop)] for r in range(8)}
    waits[1] = [_where(1, 0, {}), _where(1, 150, {FORWARD: 0.2, BACK: 0.42, stop: 0.38})]
    assert _slow(waits) == []
    few = {r: [_where(r, 0, {}), _where(r, MIN_LOOKS - 1, usual)] for r in range(8)}
    few[5] = [_where(5, 0, {}), _where(5, MIN_LOOKS - 1, {LOADER: 1.0})]
    assert _slow(few) == []


# A real DDP loop: `slow_rank` spends an extra 30% of each step at one line. It runs for
# `seconds`, or until the test makes `stop` (it asserts while the loop runs, then ends it).
# The straggler's thresholds are lowered through the test hook: named sooner, a shorter test.
QUICK = {"min_looks": 55, "confirm_s": 1.0}
"""55 looks: about what a 30% slower rank needs to stand out by Z (11 s at five a second)."""


def _ddp(seconds: float, slow_rank: int, busy: bool, stop_file: str = "") -> int:
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    steps, end = 0, time.monotonic() + seconds
    stop = torch.zeros(1)
    while True:
        began = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        ended = time.monotonic() >= end or (stop_file and os.path.exists(stop_file))
        stop.fill_(bool(ended))  # every rank takes as many steps as the others
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # (before the extra: peers wait in DDP's)
        if stop.item():
            break
        if rank == slow_rank:
            extra = 0.3 * (time.perf_counter() - began)
            if busy:
                _spin(extra)
            else:
                time.sleep(extra)
    return steps


def _spin(seconds: float) -> None:
    """Busy work as a model's is: torch computing (the GIL let go), not a Python loop."""
    import torch

    a = torch.randn(96, 96)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        a = torch.tanh(a @ a)


def _flagged(job, limit_s: float) -> list:
    """The slow ranks the job names within `limit_s`, once it names any."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not job.done():
        view = testing.view(job)
        if view is not None and view.slow:
            return list(view.slow)
        time.sleep(0.5)
    return []


@pytest.fixture(scope="module")
def loop(cluster):
    fn = distribute(  # read every second (stall_after / 10): named sooner, a shorter test
        _ddp, num_replicas=4, replicas_per_node=2, gpus_per_replica=0, log_dir=False, stall_after=10
    )
    yield fn
    fn.shutdown()
    wait_resources_back()


def test_a_balanced_ddp_loop_is_never_named(loop):
    with testing.straggler_thresholds(**QUICK):  # compared from 11 s on, named after 1 s more
        job = loop.submit(18.0, -1, False)
        assert _flagged(job, 40.0) == []
        assert min(job.result()) > 0


@pytest.mark.parametrize("busy", [False, True], ids=["sleep", "busy"])
def test_a_rank_30_percent_slower_is_named_with_its_line(loop, busy, tmp_path):
    stop = tmp_path / "stop"
    with testing.straggler_thresholds(**QUICK):
        job = loop.submit(60.0, 2, busy, str(stop))
        try:
            _named_while_running(job, busy)
        finally:
            stop.touch()
        assert min(job.result()) > 0


def _named_while_running(job, busy: bool) -> None:
    """Rank 2 is named, with where its time goes, in the job's view and table."""
    slow = _flagged(job, 45.0)
    assert [s.rank for s in slow] == [2], slow
    text = slow[0].sentence()
    assert "rank 2 spends" in text, text
    assert ("in _spin" if busy else "(`time.sleep(extra)`)") in text, text
    # In DDP's gradient all_reduce, in backward; on a starved machine (2 cores for this and
    # a test beside it) the step's own all_reduce can take that place: a collective either way.
    waits = ("in torch._tensor.backward at test_straggle.py", "in all_reduce at test_straggle.py")
    assert any(f"its peers wait for it {place}" in text for place in waits), text
    table = job.table()
    assert table.slow is not None and "rank 2 spends" in table.slow
    row = next(r for r in table.rows if r.rank == 2)
    assert (row.state, row.slow) == ("running", True)
    assert "running (slow)" in table.text(), table.text()
    assert "cores" in next(r for r in table.rows if r.rank == 0).use
