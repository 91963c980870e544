"""bench_core's loader section: DataLoader-fed ResNet, distribute() vs torchrun."""

from __future__ import annotations

import os

from benchmarks.core.common import (
    Check,
    SectionResult,
    Settings,
    Table,
    median,
    progress,
)

LOADER_TRAINING = (
    "--arch=resnet18",
    "--image-size=64",
    "--batch-size=16",
    "--steps=30",
    "--warmup=5",
)
"""examples/resnet.py's settings in the loader section: bench_gpu's CPU settings."""


def run(s: Settings) -> SectionResult:
    """A DataLoader-fed ResNet through distribute() and torchrun, fresh processes alternating.

    The example times its steps inside the ranks, loader teardown included (as an
    epoch's end has it). Neither launcher gets OMP_NUM_THREADS: each picks its default.
    """
    from benchmarks import bench_gpu

    os.environ.pop("OMP_NUM_THREADS", None)
    table = Table(
        f"DataLoader-fed training: resnet18, 64 px synthetic, batch 16 per rank, 30 steps "
        f"(5 not timed), gloo; images/s, median (min..max) of {s.loader_reps}",
        ["ranks", "loader workers", "distribute", "torchrun", "ratio"],
    )
    checks = []
    for ranks, workers in s.loader_layouts:
        args = bench_gpu.parse_args([*LOADER_TRAINING, f"--workers={workers}"])
        launchers = bench_gpu.commands(args, ranks)
        rates: dict[str, list[float]] = {name: [] for name in launchers}
        for rep in range(s.loader_reps):
            order = list(launchers) if rep % 2 == 0 else list(reversed(launchers))
            for name in order:
                progress(f"loader: {ranks} rank(s), {workers} workers, rep {rep + 1}: {name}")
                rates[name].append(bench_gpu.run(launchers[name], args.timeout)[0])
        ratio = median(rates["distribute"]) / median(rates["torchrun"])
        cells = [f"{median(r):.1f} ({min(r):.1f}..{max(r):.1f})" for r in rates.values()]
        table.rows.append([str(ranks), str(workers), *cells, f"{ratio:.3f}"])
        what = f"DataLoader training, {ranks} rank(s), {workers} workers, distribute/torchrun"
        checks.append(Check(what, f"{ratio:.3f}", ">= 0.98", ratio >= 0.98))
    table.notes.append(
        "each run a fresh process: `python examples/resnet.py` (embedded Ray) or `torchrun "
        "--standalone`; the order alternates per repeat; images/s timed inside the ranks"
    )
    return SectionResult([table], checks)
