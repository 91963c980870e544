"""Each running rank's figures as Prometheus text (the page's `/metrics`): one gauge per
figure, labelled job, rank, node and pid, in base units (seconds, bytes, a ratio).

The ranks record the same figures under the same names in Ray's own metrics
(orchestrator_workers/raymetrics.py); the findings (slow, stalled) are the driver's alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.observe.reading import RankFigures
from orchestrator_workers.raymetrics import HELP, values

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus's text format, as its scrapers ask for it."""


@dataclass(frozen=True)
class Gauge:
    """One metric: its name, what it says, and its value from a rank's figures (None: not
    known, so no sample)."""

    name: str
    help: str
    value: Callable[[RankFigures], float | None]


def _figure(name: str) -> Gauge:
    """A gauge of a figure the ranks also record in Ray's metrics: named, said and
    converted as theirs are (raymetrics.values)."""
    return Gauge(name, HELP[name], lambda rank: values(rank.figures)[name])


GAUGES = (
    *(_figure(name) for name in HELP),
    Gauge(
        "orchestrator_rank_read_timestamp_seconds",
        "When the rank wrote these figures (Unix time).",
        lambda rank: rank.figures.at,
    ),
    Gauge(
        "orchestrator_rank_slow",
        "1 where the rank is named slower than its peers, else 0.",
        lambda rank: float(rank.slow),
    ),
    Gauge(
        "orchestrator_rank_stalled",
        "1 where the rank is named in a stall report (no progress for stall_after), else 0.",
        lambda rank: float(rank.stalled),
    ),
)


def text(jobs: Iterable[tuple[str, Iterable[RankFigures]]]) -> str:
    """The exposition of each (job label, its ranks' figures)."""
    ranks = [(job, rank) for job, figures in jobs for rank in figures]
    lines = []
    for gauge in GAUGES:
        lines += [f"# HELP {gauge.name} {gauge.help}", f"# TYPE {gauge.name} gauge"]
        for job, rank in ranks:
            value = gauge.value(rank)
            if value is not None and not math.isnan(value):  # NaN: not known
                lines.append(f"{gauge.name}{{{_labels(job, rank)}}} {value!r}")
    return "\n".join(lines) + "\n"


def _labels(job: str, rank: RankFigures) -> str:
    pairs = {"job": job, "rank": str(rank.rank), "node": rank.node, "pid": str(rank.pid)}
    return ",".join(f'{key}="{_escaped(value)}"' for key, value in pairs.items())


def _escaped(value: str) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
