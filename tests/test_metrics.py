"""A job's numbers over time from a live call's ranks: their steps (torch's optimizer
hook, no change to the function), samples per second and what they report, in
`job.metrics()` and the table; nothing counted where `stall_after=None`; a stopped rank
named in seconds, a busy pause not."""

from __future__ import annotations

import math
import time
from pathlib import Path

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
        # stall_after=None: nothing looked at, nothing counted (the same warm ranks; 2.4 s,
        # long enough for two readings where it is watched)
        unwatched = fn.with_options(stall_after=None).submit(8, 0.3)
        assert unwatched.result(timeout=120) == [8, 8]
        assert unwatched.metrics().processes == ()
    assert sorted(kept) == [0, 1]
    for process in kept.values():
        assert process.steps["step"][-1] == 16  # the last ones too, read as the call ended
        assert list(process.steps["step"]) == sorted(set(process.steps["step"]))
        assert all(s >= 0.2 for s in process.steps["seconds"][1:]), process.steps  # each its own
        rates = [r for r in process.detail["samples_per_s"] if not math.isnan(r)]
        assert rates and all(5 < r < 40 for r in rates), rates  # 8 samples every 0.25 s
        assert len(process.scalars["loss"]["detail"]["value"]) >= 2
        assert process.latest is not None and process.latest.step == 16


def pauses(steps: int, pause: float, eval_s: float, folder: str) -> int:
    """`steps` quick steps, then rank 0 evaluates (on CPU) for `eval_s` while rank 1 waits
    in all_reduce; `steps` more, then rank 1 stops (sleeps, having made `stopping` in
    `folder`) while rank 0 waits, until `go` is there (at most 120 s); then one more step
    each."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    weights = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weights], lr=0.01)

    def step() -> None:
        grad = torch.ones(4)
        dist.all_reduce(grad)
        weights.grad = grad
        optimizer.step()
        time.sleep(pause)

    for _ in range(steps):
        step()
    until = time.monotonic() + eval_s
    while rank == 0 and time.monotonic() < until:  # an evaluation: a pause, not a stop
        sum(i * i for i in range(10_000))
    step()
    for _ in range(steps):
        step()
    if rank == 1:  # stopped: no progress, no CPU, no I/O, for as long as it takes
        (Path(folder) / "stopping").touch()
        until = time.monotonic() + 120
        while not (Path(folder) / "go").exists() and time.monotonic() < until:
            time.sleep(0.2)
    step()
    dist.destroy_process_group()
    return rank


def test_a_stopped_rank_is_named_in_seconds_and_a_busy_pause_is_not(cluster, tmp_path):
    seen: list[tuple[float, str]] = []
    stopping = None  # when rank 1 began its stop, as seen here
    with distribute(pauses, num_replicas=2, stall_after=60, log_dir=False, name="pauses") as fn:
        job = fn.submit(12, 0.05, 11.0, str(tmp_path))
        while not job.done():
            stall = job.status().stall
            seen.append((time.monotonic(), stall or ""))
            if stopping is None and (tmp_path / "stopping").exists():
                stopping = time.monotonic()
            if "stopped" in (stall or ""):  # named: rank 1 may go on
                (tmp_path / "go").touch()
            time.sleep(0.5)
        assert job.result(timeout=5) == [0, 1]  # never ends the call
    named = [(at, text) for at, text in seen if "stopped" in text]
    assert named, "rank 1 was never named stopped"
    assert all(
        text.startswith("[pauses] rank 1 stopped: no progress, CPU or I/O") for _, text in named
    )
    assert "waits in all_reduce" in named[0][1] or "wait" in named[0][1], named[0][1]
    # Named only in its stop, never in rank 0's evaluation.
    assert stopping is not None and named[0][0] >= stopping
    assert not any("rank 0 stopped" in text for _, text in seen)
