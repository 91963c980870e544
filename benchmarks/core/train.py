"""Section 3 of bench_core: DDP steps/s through distribute() and torchrun."""

from __future__ import annotations

import time

from benchmarks.core.common import (
    RANKS,
    Check,
    SectionResult,
    Settings,
    Table,
    fmt_s,
    median,
    progress,
    torchrun,
    train_args,
    train_kwargs,
)


def run(s: Settings) -> SectionResult:
    """The same DDP loop through distribute() and torchrun, rotated; steps/s in the ranks."""
    from benchmarks._jobs import train
    from orchestrator import distribute

    progress("train: starting the warm pool and a warm-up call")
    job = distribute(train, num_replicas=RANKS)
    job(**train_kwargs(s, steps=s.train_warmup))
    launchers = ("warm", "fresh", "torchrun")
    rates: dict[str, list[float]] = {k: [] for k in launchers}
    walls: dict[str, list[float]] = {k: [] for k in launchers}
    threads: set[int] = set()
    for i in range(s.train_reps):
        order = launchers[i % 3 :] + launchers[: i % 3]  # each goes first in turn
        for who in order:
            progress(f"train rep {i + 1}/{s.train_reps}: {who}")
            t0 = time.perf_counter()
            if who == "warm":
                ranks = job(**train_kwargs(s))
            elif who == "fresh":
                with distribute(train, num_replicas=RANKS, name="fresh") as fresh:
                    ranks = fresh(**train_kwargs(s))
            else:
                _, ranks = torchrun("train", train_args(s))
            walls[who].append(time.perf_counter() - t0)
            rates[who].append(ranks[0]["steps_per_s"])
            threads |= {r["threads"] for r in ranks}
    job.shutdown()
    theirs = median(rates["torchrun"])
    ratio = {k: median(rates[k]) / theirs for k in ("warm", "fresh")}
    table = Table(
        f"3. DDP training throughput, {RANKS} ranks, gloo (MLP width {s.train_width}, batch "
        f"{s.train_batch}, {s.train_steps} timed steps after {s.train_warmup}; "
        f"median of {s.train_reps})",
        ["launcher", "steps/s", "min..max steps/s", "ratio to torchrun", "wall per run"],
    )
    for who, label in (
        ("warm", "distribute, warm pool"),
        ("fresh", "distribute, fresh pool"),
        ("torchrun", "torchrun --standalone"),
    ):
        table.rows.append(
            [
                label,
                f"{median(rates[who]):.2f}",
                f"{min(rates[who]):.2f}..{max(rates[who]):.2f}",
                f"{ratio[who]:.3f}" if who in ratio else "-",
                fmt_s(median(walls[who])),
            ]
        )
    pairs = [a / b for a, b in zip(rates["warm"], rates["torchrun"], strict=True)]
    table.notes += [
        "steps/s: timed inside the ranks (barrier to barrier, slowest rank), start-up excluded; "
        f"torch threads per rank: {sorted(threads)}",
        f"warm/torchrun per rep: {', '.join(f'{p:.3f}' for p in pairs)}",
        "warm pool: ranks that already ran the loop; fresh pool: new actors per run, like "
        "torchrun's new processes; wall: the whole call / the whole torchrun process",
    ]
    return SectionResult(
        [table],
        [
            Check(f"training steps/s, {k} pool/torchrun", f"{r:.3f}", ">= 0.98", r >= 0.98)
            for k, r in ratio.items()
        ],
    )
