"""Folding: how much the console shows of the README's training loop, folded and not.

    python -m benchmarks.bench_fold [--sizes 8,32,128] [--epochs 10]

No Ray: the ranks' lines are fed straight to the driver's Console, as its watch loop
does (each rank's line as it comes, a tick whenever the Console asks for one). Each rank
prints `Rank {r} of {n} initialized` once, then `Rank {r}: Epoch {e}, Loss {loss:.2f}`
once a second for `--epochs` epochs, each rank up to 0.1 s after the others; in the
"straggler" rows the last rank prints each line 0.7 s after the rest. Prints a table: the
lines and bytes the console shows, the lines the log files keep, the longest a line
waited to be shown, and the driver's time per line (best of 5).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from orchestrator.show.logs import Console
from orchestrator_workers.protocol import OutputChunk

EPOCH_S = 1.0
JITTER_S = 0.1
STRAGGLER_S = 0.7


def _lines(ranks: int, epochs: int, *, straggler: bool) -> list[tuple[float, int, str]]:
    """When each rank writes which line of the README loop, in time order."""
    rng = random.Random(0)  # noqa: S311 - a reproducible scatter, not a secret
    lines = [
        (rng.uniform(0, JITTER_S), r, f"Rank {r} of {ranks} initialized") for r in range(ranks)
    ]
    for epoch in range(epochs):
        for r in range(ranks):
            loss = rng.gauss(-0.3, 0.4)
            at = (epoch + 1) * EPOCH_S + rng.uniform(0, JITTER_S)
            at += STRAGGLER_S if straggler and r == ranks - 1 else 0.0
            lines.append((at, r, f"Rank {r}: Epoch {epoch}, Loss {loss:.2f}"))
    return sorted(lines)


def _feed(
    ranks: int,
    lines: list[tuple[float, int, str]],
    sink: Callable[[str, str], None],
    clock: list[float],
    *,
    fold: bool,
) -> float:
    """Feed `lines` to a Console as the driver's watch loop does; the driver's seconds."""
    console = Console("train_loop", ranks, sink=sink, fold=fold)
    events = lines[::-1]  # popped from the end: earliest first
    due: float | None = None
    driver_s = 0.0
    while events or due is not None:
        started = time.perf_counter()
        if events and (due is None or events[-1][0] <= due):
            clock[0], rank, line = events.pop()
            console.write(rank, [OutputChunk(0, "stdout", f"{line}\n".encode())], now=clock[0])
        else:
            assert due is not None
            clock[0] = due
        due = console.tick(now=clock[0])
        driver_s += time.perf_counter() - started
    console.flush()
    return driver_s


def measure(ranks: int, epochs: int, *, fold: bool, straggler: bool) -> dict[str, float]:
    """What one call's output shows on the console, how late, and at what cost."""
    lines = _lines(ranks, epochs, straggler=straggler)
    written: dict[int, list[float]] = {r: [] for r in range(ranks)}
    for at, rank, _ in lines:
        written[rank].append(at)
    seen = dict.fromkeys(range(ranks), 0)
    shown = {"lines": 0, "bytes": 0, "wait": 0.0}
    clock = [0.0]

    def sink(stream: str, text: str) -> None:
        shown["lines"] += text.count("\n")
        shown["bytes"] += len(text.encode())
        for line in text.splitlines():  # each rank's k-th line shown is its k-th written
            for r in _ranks(line.split(" r", 1)[1].split("]", 1)[0]):
                shown["wait"] = max(shown["wait"], clock[0] - written[r][seen[r]])
                seen[r] += 1

    _feed(ranks, lines, sink, clock, fold=fold)
    assert sum(seen.values()) == len(lines), "a line was lost"
    driver_s = min(_feed(ranks, lines, lambda s, t: None, [0.0], fold=fold) for _ in range(5))
    return {
        "shown_lines": shown["lines"],
        "shown_bytes": shown["bytes"],
        "log_lines": len(lines),
        "max_wait_s": shown["wait"],
        "us_per_line": driver_s / len(lines) * 1e6,
    }


def _ranks(label: str) -> list[int]:
    """A prefix's ranks: "0-2,5" -> [0, 1, 2, 5]."""
    found: list[int] = []
    for part in label.split(","):
        first, _, last = part.partition("-")
        found += range(int(first), int(last or first) + 1)
    return found


def main(argv: list[str] | None = None) -> int:
    """Measure each size per rank, folded, and folded with a straggler; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    print(
        "| ranks | console | lines shown | bytes shown | log-file lines | longest wait "
        "| driver per line |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    runs = (("per rank", False, False), ("folded", True, False), ("folded, straggler", True, True))
    for ranks in (int(size) for size in args.sizes.split(",")):
        for label, fold, straggler in runs:
            got = measure(ranks, args.epochs, fold=fold, straggler=straggler)
            print(
                f"| {ranks} | {label} | {got['shown_lines']:,} | {got['shown_bytes']:,} | "
                f"{got['log_lines']:,} | {got['max_wait_s']:.2f} s | "
                f"{got['us_per_line']:.0f} us |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
