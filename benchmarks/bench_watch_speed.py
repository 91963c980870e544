"""What watching a job costs its training speed: DDP on 4 ranks and the DataLoader-fed CNN
(examples/resnet.py, 2 loader workers a rank), watching on (`stall_after=60`, the
default: the sampler's looks, steps, figures, Ray's metrics) against off
(`stall_after=None`), in one driver, call by call, alternating.

    python -m benchmarks.bench_watch_speed [--runs 7] [--seconds 20]

Two warm pools of the same function, one per setting, called in turn (which goes first
alternates run by run), so that both meet the same machine. Each call trains for about
--seconds and returns the speed rank 0 measured inside the call after a warm-up (steps a
second for DDP, images a second for the CNN). The table: the median speed of each
setting, and on/off as the median of the runs' ratios with their spread (min..max).
Goal (issue 57): within 0.5% (on the 16-core GPU machine; a 2-core one shows its noise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"on": 60.0, "off": None}


def ddp_speed(seconds: float) -> float:
    """DDP steps a second of a small MLP on gloo, after 10 warm-up steps (rank 0's)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, started = -10, 0.0
    done = torch.zeros(1)
    while True:
        optimizer.zero_grad()
        model(torch.randn(32, 256)).sum().backward()
        optimizer.step()
        steps += 1
        if steps == 0:
            started = time.monotonic()
        if steps > 0 and steps % 20 == 0:  # every rank stops at the same step
            done[0] = float(time.monotonic() - started >= seconds)
            dist.broadcast(done, 0)
            if done[0]:
                break
    speed = steps / (time.monotonic() - started)
    dist.destroy_process_group()
    return speed


def cnn_speed(seconds: float) -> float:
    """examples/resnet.py's images a second (resnet18, 32 px, 2 loader workers a rank)."""
    sys.path.insert(0, str(ROOT))
    from examples import resnet

    batch = 16
    steps = max(10, int(seconds * 4))
    argv = ["--arch", "resnet18", "--batch_size", str(batch), "--steps", str(steps)]
    argv += ["--workers", "2", "--warmup", "3", "--backend", "gloo"]
    args = resnet.parse_args(argv)
    return float(resnet.train(args))


WORKLOADS = {"ddp": (ddp_speed, 4, "steps/s"), "cnn": (cnn_speed, 2, "images/s")}


def main() -> None:
    """Run each workload --runs times per setting, alternating; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args()
    from orchestrator import distribute

    rows = []
    for name in args.workloads:
        fn, ranks, unit = WORKLOADS[name]
        pools = {
            setting: distribute(
                fn, num_replicas=ranks, stall_after=after, log_dir=False, name=f"{name}-{setting}"
            )
            for setting, after in SETTINGS.items()
        }
        speeds: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        try:
            for pool in pools.values():
                pool(min(args.seconds, 3.0))  # warm: the pool made, torch imported
            for run in range(args.runs):
                order = list(SETTINGS) if run % 2 == 0 else list(SETTINGS)[::-1]
                for setting in order:
                    speed = pools[setting](args.seconds)[0]
                    speeds[setting].append(speed)
                    print(f"  {name} run {run + 1} {setting}: {speed:.2f} {unit}", flush=True)
        finally:
            for pool in pools.values():
                pool.shutdown()
        ratios = [a / b for a, b in zip(speeds["on"], speeds["off"], strict=True)]
        rows.append((name, ranks, unit, speeds, ratios))
    print(f"\nTraining speed, watching on (stall_after=60) against off, {args.runs} runs each")
    print(f"  {'workload':<9}{'ranks':>6}{'on':>12}{'off':>12}{'on/off':>9}  spread")
    for name, ranks, unit, speeds, ratios in rows:
        on, off = statistics.median(speeds["on"]), statistics.median(speeds["off"])
        print(
            f"  {name:<9}{ranks:>6}{on:>12.2f}{off:>12.2f}{statistics.median(ratios):>9.4f}"
            f"  {min(ratios):.4f}..{max(ratios):.4f} ({unit})"
        )
    print("  goal: on/off at least 0.995")


if __name__ == "__main__":
    main()
