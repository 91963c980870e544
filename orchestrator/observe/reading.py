"""What a page reads of one job, as plain data ready for JSON: its rank table, its numbers
over time, its newest output, each rank's whole log and its stacks grouped.

A job is read through its public methods (`table`, `status`, `metrics`, `stacks`, `logs`).
A job of this process is also read through its runner's hold on it (`job.JobControl`): its
running attempt's view (host, pid, figures, the ranks of a stall) and its console's newest
shown lines; a followed job, through the console it shows its output with. A
detached job's numbers come from its supervisor, asked at most once a second however many
pages read them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.job import Job, JobControl
from orchestrator.observe.series import JobMetrics
from orchestrator_workers.figures import Figures

if TYPE_CHECKING:
    from orchestrator.call import Call
    from orchestrator.show.logs import Console
    from orchestrator.view import CallView

ASK_EVERY_S = 1.0
"""A job's numbers over time are gathered at most this often (pages share them)."""
PLOTTED = ("at", "step_s", "samples_per_s", "cpu", "rss_mb", "gpu_mb", "gpu_busy")
"""The columns of each rank process's readings a page plots (see series.DETAIL_COLUMNS)."""


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures as last read, with where its process runs (for /metrics)."""

    rank: int
    node: str
    pid: int
    figures: Figures
    slow: bool
    stalled: bool


class Reader:
    """One job as pages read it; safe across the page server's threads."""

    def __init__(self, key: str, job: Job[Any]) -> None:
        """Read `job`, named `key` in the page's addresses."""
        self.key = key
        self.job = job
        self._lock = threading.Lock()
        self._asked = -math.inf
        self._metrics: JobMetrics | None = None

    def summary(self) -> dict[str, Any]:
        """The job in the list of jobs: its key, name, state and ranks."""
        job = self.job
        state = "cancelled" if job.cancelled() else str(job.status().state)
        return {"id": self.key, "name": job.name, "state": state, "ranks": job.num_ranks}

    def table(self) -> dict[str, Any]:
        """The rank table: each rank's state, place, step and figures, the findings and
        the root cause."""
        job = self.job
        table, status, view = job.table(), job.status(), _live_view(job)
        latest = self._latest(view)
        stalled = _stalled(view)
        stopped = view.stopped.rank if view is not None and view.stopped is not None else None
        rows = []
        for row in table.rows:
            rank = status.ranks[row.rank]
            seen = view.ranks[row.rank] if view is not None else None
            figures = latest.get(row.rank)
            rows.append(
                {
                    "rank": row.rank,
                    "state": str(row.state),
                    "node": row.node,
                    "host": (seen.hostname if seen is not None else None) or "",
                    "pid": rank.pid,
                    "last_line": row.last_line,
                    "silent_s": row.silent_s,
                    "root_cause": row.root_cause,
                    "slow": row.slow,
                    "stalled": row.rank in stalled,
                    "stopped": row.stopped or stopped == row.rank,
                    **_figures(figures),
                }
            )
        return {
            "id": self.key,
            "name": job.name,
            "title": table.title,
            "state": "cancelled" if job.cancelled() else str(status.state),
            "cause": table.cause,
            "stall": table.stall,
            "stopped": view.stopped.line() if view is not None and view.stopped else None,
            "slow": table.slow,
            "waiting_for": status.waiting_for,
            "restarts": status.restarts,
            "events": [{"at": e.at, "kind": e.kind, "text": e.text} for e in status.events],
            "rows": rows,
            "at": time.time(),
        }

    def metrics(self, since: float = 0.0) -> dict[str, Any]:
        """Each rank process's readings after `since` (wall clock), the columns a page
        plots, oldest first; NaN as null."""
        found = self._gathered()
        processes = []
        for process in found.processes:
            at = process.detail["at"]
            first = next((i for i, t in enumerate(at) if t > since), len(at))
            columns = {name: _plain(process.detail[name][first:]) for name in PLOTTED}
            processes.append(
                {
                    "rank": process.rank,
                    "node": process.node_ip,
                    "pid": process.pid,
                    "detail": columns,
                }
            )
        return {"now": time.time(), "processes": processes}

    def output(self, after: int = 0, source: int = 0) -> dict[str, Any]:
        """The newest lines shown (folded as the console shows them) after line number
        `after` of console `source` (another console, a new attempt's: from its start)."""
        console = _console(self.job)
        if console is None:
            return {"source": 0, "next": 0, "lines": []}
        if id(console) != source:
            after = 0
        lines = [
            {"n": n, "stream": stream, "text": text}
            for n, stream, text in _copy(console.shown)
            if n > after
        ]
        return {"source": id(console), "next": console.shown_count, "lines": lines}

    def stacks(self) -> list[dict[str, Any]]:
        """Each rank's stacks, ranks with the same stacks as one group, the fewest first."""
        groups: dict[str, list[int]] = {}
        for rank, text in sorted(self.job.stacks().items()):
            groups.setdefault(text, []).append(rank)
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
        return [{"ranks": ranks, "text": text} for text, ranks in ordered]

    def log(self, rank: int) -> str:
        """Everything rank `rank` wrote during the job (so far)."""
        if not 0 <= rank < self.job.num_ranks:
            raise ValueError(f"rank={rank}: job {self.key} has ranks 0-{self.job.num_ranks - 1}")
        return self.job.logs(rank)

    def figures(self) -> list[RankFigures]:
        """Each running rank's figures as last read (for /metrics)."""
        job = self.job
        if job.done():
            return []
        view = _live_view(job)
        latest = self._latest(view)
        status = job.status()
        stalled = _stalled(view)
        slow = {rank for rank, seen in enumerate(view.ranks) if seen.slow} if view else set()
        found = []
        for rank, figures in sorted(latest.items()):
            where = status.ranks[rank] if rank < len(status.ranks) else None
            node = (where.node_ip if where is not None else None) or ""
            pid = (where.pid if where is not None else None) or 0
            found.append(RankFigures(rank, node, pid, figures, rank in slow, rank in stalled))
        return found

    def _latest(self, view: CallView | None) -> dict[int, Figures]:
        """Each rank's figures as last read: from the running call's view where this process
        runs it, else from the job's numbers over time (its supervisor's)."""
        if view is not None:
            return {seen.rank: seen.figures for seen in view.ranks if seen.figures is not None}
        if _call(self.job) is not None:
            return {}  # this process's job, no longer running: nothing current
        return {
            rank: process.latest
            for rank, process in self._gathered().by_rank().items()
            if process.latest is not None
        }

    def _gathered(self) -> JobMetrics:
        """The job's numbers over time, gathered at most once every ASK_EVERY_S."""
        with self._lock:
            now = time.monotonic()
            if self._metrics is None or now - self._asked >= ASK_EVERY_S:
                self._metrics, self._asked = self.job.metrics(), now
            return self._metrics


def _live_view(job: Job[Any]) -> CallView | None:
    """The running attempt of a job of this process, as its call sees it now (None: a
    detached job, or not running)."""
    call = _call(job)
    if call is None or not job.running():
        return None
    view: CallView = call.view()
    return view


def _console(job: Job[Any]) -> Console | None:
    """The console that shows a job's output in this process: its running (or last)
    attempt's, or a followed job's."""
    call = _call(job)
    if call is not None:
        return call.console
    console: Console | None = getattr(job, "console", None)  # a followed job's
    return console


def _call(job: Job[Any]) -> Call | None:
    """A job of this process: its running (or last) attempt's call, once its ranks
    started; None for a followed job."""
    return JobControl(job).call if isinstance(job, Job) else None


def _stalled(view: CallView | None) -> set[int]:
    """The ranks the view's stall report names without progress."""
    report = view.stall if view is not None else None
    if report is None:
        return set()
    return {rank for group in report.groups if not group.moving for rank in group.ranks}


def _figures(figures: Figures | None) -> dict[str, Any]:
    """A rank's figures as fields of its row (None: not read)."""
    if figures is None:
        return dict.fromkeys(("step", "step_s", "samples_per_s", "cpu", "rss_mb", "gpu_mb"))
    return {
        "step": figures.step if figures.last_step_at is not None else None,
        "step_s": figures.step_s,
        "samples_per_s": _number(figures.samples_per_s),
        "cpu": figures.cpu,
        "rss_mb": figures.rss_mb,
        "gpu_mb": figures.gpu_mb,
        "gpu_busy": figures.gpu_busy,
        "scalars": {k: _number(v) for k, v in figures.scalars.items()},
        "read_at": figures.at,
    }


def _number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def _plain(values: Sequence[float]) -> list[float | None]:
    """`values` with NaN as None (JSON has no NaN)."""
    return [None if v != v else v for v in values]  # noqa: PLR0124 - NaN is not itself


def _copy(lines: Iterable[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """A copy of a deque another thread appends to."""
    for _ in range(3):
        try:
            return list(lines)
        except RuntimeError:  # it changed while copied
            continue
    return []
