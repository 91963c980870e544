"""ResNet DDP images/s through distribute vs torchrun, same settings, side by side.

    python -m benchmarks.bench_gpu                       (on a GPU machine: nccl, every GPU)
    python -m benchmarks.bench_gpu --quick               (a smoke run; on CPU: gloo)

Each repeat runs examples/resnet.py twice from a fresh process, alternating which goes
first: once through distribute() (its embedded Ray, one actor per GPU) and once under
`torchrun --standalone --nproc_per_node=N`. The example times the steps after --warmup
inside the ranks (the slowest rank's time), so start-up is left out of both. Prints a
table with the medians and the ratio (target: distribute / torchrun >= 0.98).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "resnet.py"
_THROUGHPUT = re.compile(r"Throughput: ([0-9.]+) images/s")
TARGET = 0.98


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line settings; the training settings are passed to both launchers as they are."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=60, help="per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2, help="data loader processes per rank")
    parser.add_argument("--ranks", type=int, default=None, help="default: every GPU, else 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny settings, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.arch, args.batch_size, args.image_size = "resnet18", 8, 32
        args.steps, args.warmup, args.workers, args.repeats = 6, 2, 0, 1
    return args


def default_ranks() -> int:
    """One rank per GPU; 2 on a machine without one."""
    import torch

    return torch.cuda.device_count() or 2


def example_args(args: argparse.Namespace) -> list[str]:
    """The same training settings for both launchers."""
    return [
        f"--arch={args.arch}",
        f"--batch_size={args.batch_size}",
        f"--image-size={args.image_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--workers={args.workers}",
    ]


def run(argv: list[str], timeout: float) -> tuple[float, float]:
    """Run one launcher in a fresh process; (images/s it printed, wall seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    started = time.perf_counter()
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - started
    found = _THROUGHPUT.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(argv[:4])} ... failed (exit {proc.returncode})")
    return float(found[-1]), wall


def commands(args: argparse.Namespace, ranks: int) -> dict[str, list[str]]:
    """The two command lines, by launcher: the example through distribute(), and torchrun."""
    common = example_args(args)
    return {
        "distribute": [sys.executable, str(EXAMPLE), *common, f"--num-replicas={ranks}"],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(EXAMPLE),
            *common,
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table; exit status 1 when the target is missed."""
    args = parse_args(argv)
    ranks = args.ranks or default_ranks()
    launchers = commands(args, ranks)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in launchers}
    for repeat in range(args.repeats):
        order = list(launchers) if repeat % 2 == 0 else list(reversed(launchers))
        for name in order:
            print(f"    [bench] repeat {repeat + 1}/{args.repeats}: {name}", flush=True)
            results[name].append(run(launchers[name], args.timeout))

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    print(f"\n{args.arch}, {ranks} rank(s) on {device}, batch {args.batch_size} per rank,")
    print(f"{args.image_size}px synthetic, {args.steps} steps ({args.warmup} not timed),")
    print(f"torch {torch.__version__}, median of {args.repeats}\n")
    print(f"{'launcher':<12} {'images/s':>10} {'min..max':>20} {'wall per run':>13}")
    medians = {}
    for name, runs in results.items():
        rates = [rate for rate, _ in runs]
        medians[name] = statistics.median(rates)
        spread = f"{min(rates):.1f}..{max(rates):.1f}"
        wall = statistics.median(wall for _, wall in runs)
        print(f"{name:<12} {medians[name]:>10.1f} {spread:>20} {wall:>12.1f}s")
    ratio = medians["distribute"] / medians["torchrun"]
    met = ratio >= TARGET
    verdict = "met" if met else "NOT met"
    print(f"\nratio distribute/torchrun: {ratio:.3f} (target >= {TARGET}: {verdict})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
