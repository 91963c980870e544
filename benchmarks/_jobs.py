"""The jobs bench_core.py times: the same code runs through `distribute` and under torchrun.

Under torchrun (RANK set), `python benchmarks/_jobs.py JOB --out DIR [options]` runs JOB on
this rank and writes its result to DIR/rank{RANK}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

try:
    from benchmarks._memory import memory
except ImportError:  # run as a script (torchrun) without the repository on sys.path
    from _memory import memory  # type: ignore[no-redef]


def trivial() -> dict[str, Any]:
    """Init a gloo group, one all_reduce, destroy; this rank's rank, pid and peak RSS."""
    started = time.perf_counter()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    world = int(tensor.item())
    dist.destroy_process_group()
    return {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "done_at": time.time(),
        "process_started": psutil.Process().create_time(),
        "elapsed_s": time.perf_counter() - started,
        **memory(),
    }


def rank_only() -> int:
    """Only this rank's number (no process group): the warm path's fixed cost."""
    return int(os.environ["RANK"])


def train(steps: int = 100, warmup: int = 10, width: int = 512, batch: int = 64) -> dict[str, Any]:
    """DDP-train a 3-layer MLP for `warmup` + `steps` steps; steps/s of the timed steps only.

    The timed window starts after a barrier that follows the warmup steps and ends
    with a barrier; the job's rate is taken over the slowest rank's window.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(batch, width)
    targets = torch.randn(batch, 1)
    loss_fn = torch.nn.MSELoss()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    for _ in range(warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    loss = 0.0
    for _ in range(steps):
        loss = step()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "steps_per_s": steps / float(elapsed.item()),
        "loss": loss,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        **memory(),
    }


def shipping_job(megabytes: int) -> Callable[[], dict[str, Any]]:
    """A function whose closure holds a `megabytes` MB float32 tensor; it returns its size."""
    big = torch.ones(megabytes * (1 << 20) // 4)

    def holds_big_tensor() -> dict[str, Any]:
        return {"numel": big.numel(), "pid": os.getpid(), **memory()}

    return holds_big_tensor


def readme() -> dict[str, Any]:
    """The README's example's training function (examples/linear_ddp.py, 10 epochs)."""
    from examples.linear_ddp import train_loop

    return {"loss": train_loop(10), "done_at": time.time()}


def main(argv: list[str] | None = None) -> None:
    """Run one job on this torchrun rank and write its result to DIR/rank{RANK}.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=["trivial", "train", "readme"])
    parser.add_argument("--out", required=True, help="folder for rank{RANK}.json")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    if args.job == "trivial":
        result = trivial()
    elif args.job == "readme":
        result = readme()
    else:
        result = train(args.steps, args.warmup, args.width, args.batch)
    rank = os.environ["RANK"]
    path = Path(args.out) / f"rank{rank}.json"
    path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
