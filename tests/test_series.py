"""A job's numbers over time (orchestrator/observe/series.py) and a rank's progress
(orchestrator_workers/progress.py): pure, from records made here and a real optimizer."""

from __future__ import annotations

import math
import time

import pytest
import torch

from orchestrator.observe import series
from orchestrator.observe.series import Series
from orchestrator_workers.progress import Progress, report
from orchestrator_workers.protocol import NodeInfo
from orchestrator_workers.where import Where


def _info(pid: int, node: str = "n1") -> NodeInfo:
    return NodeInfo(node, "10.0.0.1", "h", pid, gpu_ids=(), interface=None)


def _record(
    steps: list[tuple[int, float, float]], *, age_s: float = 0.0, call: str = "c1", **fields
) -> Where:
    return Where(
        rank=-1,
        frames=(),
        running=True,
        still_s=0.0,
        age_s=age_s,
        call=call,
        steps=steps[-1][0] if steps else 0,
        recent_steps=tuple(steps[-32:]),
        process_cpu=fields.pop("cpu", 1.0),
        rss_mb=fields.pop("rss_mb", 100.0),
        **fields,
    )


def test_each_step_is_kept_once_with_its_own_time_and_the_figures_per_reading():
    kept = Series()
    now = time.time()
    steps = [(n, now - 10 + n, 1.0) for n in range(1, 6)]
    kept.add(0, _info(11), _record(steps[:3]), "c1")
    kept.add(0, _info(11), _record(steps, cpu=2.0), "c1")  # steps 1-3 again: not twice
    kept.add(0, _info(11), _record(steps, call="old"), "c1")  # another call's record
    process = kept.metrics().by_rank()[0]
    assert tuple(process.steps["step"]) == (1, 2, 3, 4, 5)
    assert tuple(process.steps["at"]) == tuple(s[1] for s in steps)
    assert tuple(process.detail["step"]) == (3, 5)
    assert tuple(process.detail["cpu"]) == (1.0, 2.0)
    assert process.latest is not None and process.latest.step == 5
    assert process.latest.use() == "2.0 cores, 0.1 GB"
    assert kept.latest()[0].step_s == 1.0


def test_series_are_kept_by_process_with_the_rank_over_time_and_a_new_attempt_counts_again():
    kept = Series()
    now = time.time()
    kept.add(3, _info(11), _record([(1, now, 0.5)]), "c1")
    kept.add(2, _info(11), _record([(2, now + 1, 0.5)]), "c1")  # renumbered: same process
    kept.add(3, _info(12, "n2"), _record([(1, now + 2, 0.4)]), "c1")  # its replacement
    kept.add(3, _info(12, "n2"), _record([(1, now + 3, 0.3)], call="c2"), "c2")  # restart
    metrics = kept.metrics()
    assert [p.pid for p in metrics.processes] == [11, 12]
    first = metrics.processes[0]
    assert [rank for _, rank in first.ranks] == [3, 2] and tuple(first.steps["step"]) == (1, 2)
    assert tuple(metrics.processes[1].steps["step"]) == (1, 1)  # the restart's step 1 is new
    assert {rank: p.pid for rank, p in metrics.by_rank().items()} == {2: 11, 3: 12}


def test_samples_per_second_and_reported_scalars_over_time():
    kept = Series()
    now = time.time()
    for i in range(4):  # a reading a second, 32 samples a second, loss falling
        record = _record(
            [(i + 1, now + i, 1.0)],
            age_s=-i,  # written i seconds after the first (a clock that runs ahead)
            scalars={"loss": 1.0 / (i + 1)},
            reported_at=now + i,
            samples_total=32.0 * (i + 1),
        )
        kept.add(0, _info(11), record, "c1")
    kept.add(0, _info(11), record, "c1")  # read again after its call ended: no new report
    process = kept.metrics().processes[0]
    rates = process.detail["samples_per_s"]
    assert math.isnan(rates[0]) and math.isnan(rates[-1])
    assert tuple(rates[1:4]) == pytest.approx((32.0, 32.0, 32.0), rel=0.05)
    loss = process.scalars["loss"]
    assert tuple(loss["detail"]["value"]) == pytest.approx((1.0, 0.5, 1 / 3, 0.25))  # 4-byte floats
    assert len(loss["minutes"]["value"]) in (1, 2)  # the mean a minute, so far


def test_minutes_are_summed_per_process_and_across_processes_within_the_bound():
    kept = Series()
    start = math.floor(time.time() / 60) * 60 - 3600  # an hour ago, on a minute
    for second in range(0, 600, 1):  # 10 minutes of 4 ranks, a step a second
        for rank in range(4):
            at = start + second
            record = _record([(second + 1, at, 1.0 + rank)], age_s=time.time() - at, cpu=rank)
            kept.add(rank, _info(100 + rank), record, "c1")
    metrics = kept.metrics()
    minutes = metrics.processes[3].minutes
    assert tuple(minutes["steps"][:9]) == (60,) * 9
    assert minutes["step_s"][0] == pytest.approx(4.0) and minutes["cpu"][0] == pytest.approx(3)
    across = metrics.minutes
    assert across["processes"][0] == 4
    assert across["step_s_min"][0] == pytest.approx(1.0)
    assert across["step_s_max"][0] == pytest.approx(4.0)
    assert len(metrics.processes[0].detail["at"]) == series.DETAIL  # the newest kept
    assert metrics.processes[0].detail["at"][-1] == pytest.approx(start + 599, abs=0.1)
    bound = kept.bound_bytes(128)
    assert 30e6 < bound < 45e6, bound  # 128 ranks, 24 hours: about 41 MB, as the module says


def test_the_first_optimizer_to_step_is_counted_and_report_never_fails():
    progress = Progress()
    listened: list[int] = []
    progress.on_step(listened.append)
    progress.begin()  # torch's optimizers are loaded here: the hook goes in
    weights = torch.nn.Parameter(torch.zeros(2))
    first = torch.optim.SGD([weights], lr=0.1)
    second = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for _ in range(3):
        weights.sum().backward()
        first.step()
        second.step()  # a GAN's second optimizer: not a step of its own
    progress.report({"loss": 0.5, "samples": 8, "name": "text", "big": 10**400, "lr": None})
    steps, recent, scalars, _, samples = progress.taken()
    assert steps == 3 and [n for n, _, _ in recent] == [1, 2, 3] and listened == [1, 2, 3]
    assert all(seconds >= 0 for _, _, seconds in recent)
    assert scalars == {"loss": 0.5, "samples": 8.0} and samples == 8.0
    progress.end()
    first.step()  # between calls: not counted
    assert progress.taken()[0] == 3
    report(loss=object())  # the module's own, outside a rank: nothing happens, nothing fails


def test_a_function_without_an_optimizer_counts_its_own_steps():
    progress = Progress()
    progress.begin()
    for step in (10, 11, 12):
        progress.report({"step": step, "loss": 1.0})
    progress.report({"step": math.nan})
    steps, recent, _, _, _ = progress.taken()
    assert steps == 12 and [n for n, _, _ in recent] == [10, 11, 12]
