"""A job's numbers over time from a live call's ranks: their steps (torch's optimizer
hook, no change to the function), samples per second and what they report, in
`job.metrics()` and the table; nothing counted where `stall_after=None`."""

from __future__ import annotations

import math
import time

from orchestrator import distribute
from tests.helpers import wait_for


def train(steps: int, pause: float) -> int:
    """A DDP loop on gloo: `steps` optimizer steps, `pause` s each; reports its loss."""
    import torch
    import torch.distributed as dist

    import orchestrator

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        optimizer.step()
        orchestrator.report(loss=loss.item(), samples=8)
        time.sleep(pause)
    dist.destroy_process_group()
    return steps


def test_a_live_job_s_steps_figures_and_reports_over_time(cluster):
    with distribute(train, num_replicas=2, stall_after=30, log_dir=False, name="steps") as fn:
        job = fn.submit(16, 0.25)

        def stepping() -> bool:
            table = job.table()
            return all(row.step for row in table.rows) and job.running()

        wait_for(stepping, 90, "both ranks' steps in the table while the job runs")
        assert job.result(timeout=120) == [16, 16]
        kept = job.metrics().by_rank()
    assert sorted(kept) == [0, 1]
    for process in kept.values():
        assert process.steps["step"][-1] == 16  # the last ones too, read as the call ended
        assert list(process.steps["step"]) == sorted(set(process.steps["step"]))
        assert all(s >= 0.2 for s in process.steps["seconds"][1:]), process.steps  # each its own
        rates = [r for r in process.detail["samples_per_s"] if not math.isnan(r)]
        assert rates and all(5 < r < 40 for r in rates), rates  # 8 samples every 0.25 s
        assert len(process.scalars["loss"]["detail"]["value"]) >= 2
        assert process.latest is not None and process.latest.step == 16


def test_stall_after_none_counts_nothing(cluster):
    with distribute(train, num_replicas=2, stall_after=None, log_dir=False, name="unwatched") as fn:
        job = fn.submit(6, 0.25)
        assert job.result(timeout=120) == [6, 6]
    assert job.metrics().processes == ()
