"""A job's numbers over time: each rank process's steps, CPU, memory, GPU figures and
reported scalars, from the records its monitor reads (see `diagnose.monitor`), kept
within a stated bound however long the job runs.

Series are kept by process (node and pid), each with its rank over time: a rank may be
renumbered, a restart's new process starts a series of its own. Per process:

- `detail`: one sample per reading (about a second apart) for the newest DETAIL samples;
- `steps`: the newest STEPS_KEPT steps, each with its own end and length;
- `minutes`: a summary a minute (steps, step time mean and max, CPU, memory, GPU) for the
  newest MINUTES_KEPT minutes;
- `scalars`: what the function reported, for at most SCALAR_NAMES names, in detail and by
  the minute as above.

Per job, across its processes, a summary a minute (percentiles of each figure) for the
newest JOB_MINUTES_KEPT minutes. Numbers are kept in arrays, not objects (times as
doubles, figures as 4-byte floats): at 128 ranks, once 24 hours have filled every ring,
about 41 MB at the most (`bound_bytes`), nearly half of it the minutes of reported
scalars where a function reports SCALAR_NAMES names; far less where it reports a few.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.observe.ring import Column, Ring
from orchestrator_workers.figures import Figures, from_record
from orchestrator_workers.progress import SamplesRate

if TYPE_CHECKING:
    from orchestrator_workers.protocol import NodeInfo
    from orchestrator_workers.where import Where

DETAIL = 600
"""Samples kept per process (about 10 minutes at one reading a second)."""
STEPS_KEPT = 1024
MINUTES_KEPT = 1440
"""Per process: 24 hours by the minute."""
SCALAR_NAMES = 8
"""Reported names kept over time per process (the first ones reported; the newest value
of every name is kept besides)."""
JOB_MINUTES_KEPT = 43_200
"""Across processes: 30 days by the minute."""

DETAIL_COLUMNS = (
    "at",
    "step",
    "step_s",
    "samples_per_s",
    "cpu",
    "rss_mb",
    "gpu_mb",
    "gpu_busy",
)
STEP_COLUMNS = ("step", "at", "seconds")
MINUTE_COLUMNS = (
    "minute",
    "steps",
    "step_s",
    "step_s_max",
    "cpu",
    "rss_mb",
    "gpu_mb",
    "gpu_busy",
)
"""A minute's summary: when it began (wall clock), steps completed in it, their mean and
longest time, mean CPU (cores), most memory, most GPU memory, mean GPU use (NaN: none)."""
SPREAD_FIGURES = ("step_s", "cpu", "rss_mb", "gpu_mb", "gpu_busy")
SPREAD = ("min", "p50", "p90", "max")
JOB_COLUMNS = ("minute", "processes", *(f"{f}_{q}" for f in SPREAD_FIGURES for q in SPREAD))


@dataclass(frozen=True)
class ProcessMetrics:
    """One rank process's numbers over time, as plain data (columns: arrays, oldest first)."""

    node_id: str
    node_ip: str
    pid: int
    ranks: tuple[tuple[float, int], ...]
    """Its rank over time: (since when, wall clock; rank)."""
    detail: dict[str, Column]
    """DETAIL_COLUMNS, a row per reading (NaN: not known)."""
    steps: dict[str, Column]
    """STEP_COLUMNS, a row per step."""
    minutes: dict[str, Column]
    """MINUTE_COLUMNS, a row per minute."""
    scalars: dict[str, dict[str, dict[str, Column]]]
    """Per reported name: `detail` (`at` and `value` columns, a row per report) and
    `minutes` (`minute` and `value`, the mean a minute)."""
    latest: Figures | None
    """Its figures as last read."""

    @property
    def rank(self) -> int:
        """Its rank now."""
        return self.ranks[-1][1]


@dataclass(frozen=True)
class JobMetrics:
    """A job's numbers over time, per rank process and across them (see `Job.metrics`)."""

    processes: tuple[ProcessMetrics, ...]
    minutes: dict[str, Column] = field(default_factory=dict)
    """JOB_COLUMNS, a row per minute: percentiles across the processes that reported."""

    def by_rank(self) -> dict[int, ProcessMetrics]:
        """The process that holds each rank now (the newest, where a restart replaced one)."""
        found: dict[int, ProcessMetrics] = {}
        for process in self.processes:
            kept = found.get(process.rank)
            if kept is None or process.ranks[-1][0] >= kept.ranks[-1][0]:
                found[process.rank] = process
        return dict(sorted(found.items()))


class _Process:
    """One process's series, as they grow."""

    def __init__(self, node_id: str, node_ip: str, pid: int) -> None:
        self.node_id, self.node_ip, self.pid = node_id, node_ip, pid
        self.ranks: list[tuple[float, int]] = []
        self.detail = Ring(DETAIL_COLUMNS, DETAIL)
        self.steps = Ring(STEP_COLUMNS, STEPS_KEPT)
        self.minutes = Ring(MINUTE_COLUMNS, MINUTES_KEPT)
        self.scalars: dict[str, _Scalar] = {}
        self.latest: Figures | None = None
        self.call = ""
        self.last_step = 0
        self.samples = SamplesRate()
        self.minute: _Minute | None = None

    def add(self, rank: int, where: Where, at: float, call: str) -> None:
        """Take a reading of this process for `call` (`at`: when it was written)."""
        if not self.ranks or self.ranks[-1][1] != rank:
            self.ranks.append((at, rank))
        if call != self.call:  # another attempt: its steps count from 1 again
            self.call, self.last_step = call, 0
            self.samples.reset()
        new_steps = [s for s in where.recent_steps if s[0] > self.last_step]
        for step in new_steps:
            self.steps.add(step)
            self._minute(step[1]).step(step[2])
        if new_steps:
            self.last_step = new_steps[-1][0]
        rate = self.samples.of(where.reported_at, where.samples_total)
        figures = from_record(where, at, rate)
        self.latest = figures
        self.detail.add(_detail(figures, at))
        self._minute(at).sample(figures)
        for name, value in (where.scalars or {}).items():
            scalar = self.scalars.get(name)
            if scalar is None and len(self.scalars) < SCALAR_NAMES:
                scalar = self.scalars[name] = _Scalar()
            if scalar is not None:
                scalar.add(where.reported_at, value)

    def _minute(self, at: float) -> _Minute:
        """The minute that `at` falls in, the one before summed up where it ended."""
        start = math.floor(at / 60) * 60
        minute = self.minute
        if minute is None or start > minute.start:
            if minute is not None:
                self.minutes.add(minute.row())
            minute = self.minute = _Minute(start)
        return minute

    def metrics(self) -> ProcessMetrics:
        minutes = self.minutes.rows()
        if self.minute is not None:  # the minute under way, so far
            for column, value in zip(minutes.values(), self.minute.row(), strict=True):
                column.append(value)
        return ProcessMetrics(
            self.node_id,
            self.node_ip,
            self.pid,
            tuple(self.ranks),
            self.detail.rows(),
            self.steps.rows(),
            minutes,
            {name: scalar.rows() for name, scalar in self.scalars.items()},
            self.latest,
        )

    def nbytes(self) -> int:
        rings = [self.detail, self.steps, self.minutes]
        rings += [ring for scalar in self.scalars.values() for ring in scalar.rings]
        return sum(ring.nbytes() for ring in rings)


class _Scalar:
    """One reported name of one process: each report, and a mean a minute."""

    def __init__(self) -> None:
        self.detail = Ring(("at", "value"), DETAIL)
        self.minutes = Ring(("minute", "value"), MINUTES_KEPT)
        self.rings = (self.detail, self.minutes)
        self.minute, self.sum, self.count = -math.inf, 0.0, 0

    def add(self, at: float, value: float) -> None:
        """A report made at `at` (one already taken is not taken again)."""
        if at <= (self.detail.last("at") or 0.0):
            return
        self.detail.add((at, value))
        start = math.floor(at / 60) * 60
        if start > self.minute:
            if self.count:
                self.minutes.add((self.minute, self.sum / self.count))
            self.minute, self.sum, self.count = start, 0.0, 0
        self.sum, self.count = self.sum + value, self.count + 1

    def rows(self) -> dict[str, dict[str, Column]]:
        """Its reports (`detail`), and its means by the minute so far (`minutes`)."""
        minutes = self.minutes.rows()
        if self.count:  # the minute under way, so far
            minutes["minute"].append(self.minute)
            minutes["value"].append(self.sum / self.count)
        return {"detail": self.detail.rows(), "minutes": minutes}


class _Minute:
    """One minute of one process, summed as it goes."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.steps, self.step_sum, self.step_max = 0, 0.0, math.nan
        self.samples, self.cpu = 0, 0.0
        self.rss, self.gpu_mb = math.nan, math.nan
        self.busy_n, self.busy = 0, 0.0

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_sum += seconds
        self.step_max = seconds if math.isnan(self.step_max) else max(self.step_max, seconds)

    def sample(self, figures: Figures) -> None:
        self.samples += 1
        self.cpu += figures.cpu
        self.rss = _max(self.rss, figures.rss_mb)
        self.gpu_mb = _max(self.gpu_mb, figures.gpu_mb)
        if figures.gpu_busy is not None:
            self.busy_n, self.busy = self.busy_n + 1, self.busy + figures.gpu_busy

    def row(self) -> tuple[float, ...]:
        return (
            self.start,
            self.steps,
            self.step_sum / self.steps if self.steps else math.nan,
            self.step_max,
            self.cpu / self.samples if self.samples else math.nan,
            self.rss,
            self.gpu_mb,
            self.busy / self.busy_n if self.busy_n else math.nan,
        )


def _detail(figures: Figures, at: float) -> tuple[float, ...]:
    """`figures` as a row of DETAIL_COLUMNS (NaN: not known)."""
    return (
        at,
        float(figures.step),
        _nan(figures.step_s),
        _nan(figures.samples_per_s),
        figures.cpu,
        figures.rss_mb,
        _nan(figures.gpu_mb),
        _nan(figures.gpu_busy),
    )


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _max(kept: float, value: float | None) -> float:
    if value is None:
        return kept
    return value if math.isnan(kept) else max(kept, value)


class Series:
    """One job's numbers over time, fed by its calls' monitors; safe across threads."""

    def __init__(self) -> None:
        """Nothing read yet."""
        self._processes: dict[tuple[str, int], _Process] = {}
        self._lock = threading.Lock()
        self._job = Ring(JOB_COLUMNS, JOB_MINUTES_KEPT)
        self._closed = -math.inf
        """The newest minute summed up across processes."""
        self._newest = -math.inf
        """The newest minute a reading fell in."""

    def add(self, rank: int, info: NodeInfo, where: Where, call: str) -> None:
        """Take a reading of rank `rank` (its process: `info`) during `call`."""
        if where.call != call or where.age_s is None:
            return  # another call's record, or none yet
        at = time.time() - where.age_s  # when it was written, on this clock
        with self._lock:
            key = (info.node_id, info.pid)
            process = self._processes.get(key)
            if process is None:
                process = self._processes[key] = _Process(info.node_id, info.node_ip, info.pid)
            process.add(rank, where, at, call)
            minute = math.floor(at / 60) * 60
            if minute > self._newest:  # a new minute: the one two before is summed up
                self._newest = minute
                self._close(minute - 120)

    def _close(self, upto: float) -> None:
        """Sum up across processes each minute up to `upto` not yet summed (a minute is
        summed once every process's next one began)."""
        by_minute: dict[float, list[dict[str, float]]] = {}
        for process in self._processes.values():
            for row in process.minutes.tail(3):
                if self._closed < row["minute"] <= upto:
                    by_minute.setdefault(row["minute"], []).append(row)
        for minute, rows in sorted(by_minute.items()):
            spread: list[float] = [minute, len(rows)]
            for figure in SPREAD_FIGURES:
                spread += _quantiles([row[figure] for row in rows])
            self._job.add(spread)
            self._closed = minute

    def metrics(self) -> JobMetrics:
        """What is kept now, as plain data."""
        with self._lock:
            processes = tuple(p.metrics() for p in self._processes.values())
            return JobMetrics(processes, self._job.rows())

    @property
    def stepping(self) -> bool:
        """Whether any rank was seen to complete a step or report a number."""
        with self._lock:
            return any(p.last_step or p.scalars for p in self._processes.values())

    def recent(self, count: int) -> dict[int, tuple[int, list[float]]]:
        """Each rank's steps completed and its newest `count` steps' lengths (its newest
        process's)."""
        with self._lock:
            found: dict[int, tuple[float, int, list[float]]] = {}
            for process in self._processes.values():
                if not process.ranks:
                    continue
                since, rank = process.ranks[-1]
                if rank not in found or since >= found[rank][0]:
                    seconds = process.steps.tail(count)
                    found[rank] = (since, process.last_step, [s["seconds"] for s in seconds])
            return {rank: (done, seconds) for rank, (_, done, seconds) in found.items()}

    def latest(self) -> dict[int, Figures]:
        """Each rank's figures as last read (its newest process's)."""
        with self._lock:
            found: dict[int, tuple[float, Figures]] = {}
            for process in self._processes.values():
                if process.latest is None or not process.ranks:
                    continue
                since, rank = process.ranks[-1]
                if rank not in found or since >= found[rank][0]:
                    found[rank] = (since, process.latest)
            return {rank: figures for rank, (_, figures) in found.items()}

    def bound_bytes(self, processes: int) -> int:
        """What the numbers of `processes` processes take at the most (full rings)."""
        one = _Process("", "", 0)
        one.scalars = {str(name): _Scalar() for name in range(SCALAR_NAMES)}
        return processes * one.nbytes() + self._job.nbytes()


def _quantiles(values: Sequence[float]) -> list[float]:
    """min, median, 90th percentile, max of `values` that are known (NaN: none is)."""
    known = sorted(v for v in values if not math.isnan(v))
    if not known:
        return [math.nan] * len(SPREAD)
    at = lambda q: known[min(len(known) - 1, int(q * len(known)))]  # noqa: E731
    return [known[0], at(0.5), at(0.9), known[-1]]
