"""A submitted job's rank output, shown in the notebook cell that submitted it.

A blocking call prints into its own cell like any code. A submitted job keeps
printing while later cells run; plain prints would land in whichever cell runs then,
or be dropped by the front end once the submitting cell is done. So the submitting
cell gets a display (with a display id) that is updated as lines arrive: front ends
update a display wherever it is. Updates are sent with the kernel's current parent
message, not the submitting cell's, because clients such as nbclient only read the
messages of the cell they are executing.
"""

from __future__ import annotations

import contextvars
import html
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.show import summary
from orchestrator.show.text import clock

if TYPE_CHECKING:
    from orchestrator.view import CallView

MAX_LINES = 1000
"""Lines a cell shows at most; older ones are only in the job's log files."""
_UPDATE_S = 0.25
"""A cell's display is redrawn at most this often."""
_TICK_S = 1.0
"""While its job runs, a cell's table is redrawn this often (elapsed times)."""


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (its output goes to notebook cells)."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


@dataclass(frozen=True)
class RankRow:
    """One rank's row of a job's table."""

    rank: int
    node: str
    state: str
    elapsed: float
    restarts: int
    last_line: str
    root_cause: bool = False
    silent_s: float | None = None
    """While it runs: how long since it last wrote anything."""
    slow: bool = False
    """While it runs: named slower than its peers."""
    use: str = ""
    """While it runs: its process's CPU and memory ('1.0 cores, 0.3 GB'), where read."""
    step: int | None = None
    """While it runs: the steps its function completed, where any is known."""
    stopped: bool = False
    """While it runs: named stopped while its peers wait for it (see diagnose.stopped)."""


def rank_table(
    name: str,
    state: str,
    ranks: Sequence[tuple[int, str | None, str]],
    last: CallView | None,
    *,
    running: bool,
    elapsed: float,
    restarts: int,
    root: tuple[int, str] | None,
) -> Table:
    """Job `name`'s table: each of `ranks` (rank, node IP, state) with what its last
    call (`last`) knows of it, and while `running` how it runs; `root`: the rank of the
    root cause, and the cause in a line."""
    view = last if running else None
    rows = []
    for rank, node_ip, rank_state in ranks:
        seen = view.ranks[rank] if view is not None else None
        figures = seen.figures if seen is not None else None
        rows.append(
            RankRow(
                rank=rank,
                node=node_ip or "-",
                state=rank_state,
                elapsed=elapsed,
                restarts=restarts,
                last_line=last.ranks[rank].last_line if last is not None else "",
                root_cause=root is not None and root[0] == rank,
                silent_s=seen.silent_s if seen is not None else None,
                slow=seen is not None and seen.slow,
                stopped=view is not None and view.stopped is not None and view.stopped.rank == rank,
                use=seen.use if seen is not None else "",
                step=figures.step if figures is not None and figures.last_step_at else None,
            )
        )
    rows.sort(key=lambda row: not row.root_cause)
    report = view.stall if view is not None else None
    stall = report.line().removeprefix(f"[{name}] ") if report is not None else None
    slowest = "; ".join(s.sentence() for s in view.slow) if view is not None else ""
    cause = root[1] if root is not None else None
    return Table(f"[{name}] {state}", tuple(rows), cause, stall, slowest or None)


def _state(row: RankRow) -> str:
    """The row's state as shown: 'running (slow)' for a slow rank."""
    if row.stopped:
        return f"{row.state} (stopped)"
    return f"{row.state} (slow)" if row.slow else row.state


_HEADER = ("rank", "node", "state", "elapsed", "restarts", "step", "CPU, memory", "last output")


@dataclass(frozen=True)
class Table:
    """A job's ranks as a table: the root cause's rank first, if one failed.

    From `summary.SUMMARY_FROM_RANKS` ranks it shows groups of ranks (by state and
    node, the odd ones first); `full=True` shows a row per rank anyway.
    """

    title: str
    rows: tuple[RankRow, ...]
    cause: str | None = None
    """The root cause, in one line, when the job failed."""
    stall: str | None = None
    """While it runs: the ranks without progress, and where they are, in one line."""
    slow: str | None = None
    """While it runs: the ranks slower than their peers, and where their time goes."""

    def summarized(self, full: bool | None = None) -> bool:
        """Whether it shows groups rather than a row per rank (`full`: None, by its size)."""
        return not full and len(self.rows) >= summary.SUMMARY_FROM_RANKS

    def groups(self) -> list[summary.StateGroup]:
        """Its ranks grouped by state and node, odd ones first (see orchestrator.summary)."""
        views = [
            summary.RankView(r.rank, r.node, _state(r), r.last_line, r.root_cause, r.silent_s)
            for r in self.rows
        ]
        return summary.group(views)

    def text(self, output: Sequence[str] = (), *, full: bool | None = None) -> str:
        """Plain text: title, root cause, its rows (see `summarized`), then `output`."""
        lines = [self.title] + ([f"root cause: {self.cause}"] if self.cause else [])
        lines += [line for line in (self.stall, self.slow) if line]
        cells = [_HEADER, *(row for row, _ in self._cells(full, width=80))]
        widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER) - 1)]
        for row in cells:
            head = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
            lines.append(f"{head}  {row[-1]}".rstrip())
        if self.summarized(full):
            lines.append(f"(a row per rank: job.table().text(full=True), {len(self.rows)} rows)")
        return "\n".join([*lines, *output])

    def html(self, output: Sequence[str] = (), *, full: bool | None = None) -> str:
        """HTML: the same, failed ranks marked in red, `output` below in a <pre>; a
        summary keeps the per-rank rows one click away (a closed <details>)."""
        esc = html.escape
        parts = [f"<div><b>{esc(self.title)}</b>"]
        if self.cause:
            parts.append(f'<div style="color:#b00020"><b>root cause:</b> {esc(self.cause)}</div>')
        notes = (self.stall, self.slow)
        parts += [f'<div style="color:#8a5300">{esc(n)}</div>' for n in notes if n]
        parts.append(self._html_table(full))
        if self.summarized(full):
            parts.append(
                f"<details><summary>every rank ({len(self.rows)} rows)</summary>"
                f"{self._html_table(True)}</details>"
            )
        if output:
            parts.append(f"<pre>{esc(chr(10).join(output))}</pre>")
        return "".join([*parts, "</div>"])

    def _html_table(self, full: bool | None) -> str:
        esc = html.escape
        head = "".join(f"<th>{name}</th>" for name in _HEADER)
        rows = [f"<table><tr>{head}</tr>"]
        for cells, failed in self._cells(full, width=120):
            style = ' style="color:#b00020;font-weight:bold"' if failed else ""
            *first, last = (esc(cell) for cell in cells)
            row = "".join(f"<td>{cell}</td>" for cell in first)
            rows.append(f"<tr{style}>{row}<td><code>{last}</code></td></tr>")
        return "".join([*rows, "</table>"])

    def _cells(self, full: bool | None, width: int) -> list[tuple[tuple[str, ...], bool]]:
        """Each row's cells, and whether it shows failed ranks."""
        if not self.summarized(full):
            return [
                (
                    (
                        f"r{r.rank}",
                        r.node,
                        _state(r) + (" (root cause)" if r.root_cause else ""),
                        clock(r.elapsed),
                        str(r.restarts),
                        str(r.step) if r.step is not None else "",
                        r.use,
                        r.last_line[:width],
                    ),
                    r.state == "failed",
                )
                for r in self.rows
            ]
        elapsed = clock(self.rows[0].elapsed) if self.rows else ""
        restarts = str(self.rows[0].restarts) if self.rows else ""
        return [
            (
                (
                    g.label,
                    g.where,
                    g.state + (" (root cause)" if g.root_cause else ""),
                    elapsed,
                    restarts,
                    "",
                    "",
                    g.last_line[:width],
                ),
                g.state == "failed",
            )
            for g in self.groups()
        ]


class CellOutput:
    """The display of the cell that submitted a job: its ranks' table, then its newest lines.

    Redrawn in place (one display, updated) as lines arrive and, while the job runs,
    every second for the elapsed times.
    """

    def __init__(self, title: str, table: Callable[[], Table | None] | None = None) -> None:
        """Show `title` (and `table()`, when it gives one) in the current cell."""
        from IPython.display import display

        self._title = title
        self._table = table or (lambda: None)
        self._lines: deque[str] = deque(maxlen=MAX_LINES)
        self._seen = 0
        self._lock = threading.RLock()
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._handle: Any = display(self._bundle(), raw=True, display_id=True)

    def write(self, stream: str, text: str) -> None:
        """Add `text` (whole lines, each ending in a newline) to the cell."""
        with self._lock:
            lines = text.splitlines()
            self._lines.extend(lines)
            self._seen += len(lines)
        self._soon()

    def set_title(self, title: str) -> None:
        """Change the first line (the job's state) and redraw."""
        with self._lock:
            self._title = title
        self.flush()

    def tick_while(self, running: Callable[[], bool]) -> None:
        """Redraw every second while `running()` (the elapsed times move on)."""

        def again() -> None:
            if running():
                self.flush()
                self._ticker(again)

        self._ticker(again)

    def flush(self) -> None:
        """Redraw the cell with the table and every line so far."""
        with self._lock:  # held while sending too, so that redraws arrive in order
            self._timer = None
            self._last = time.monotonic()
            # An empty context: the kernel's current parent message, not the submitter's.
            contextvars.Context().run(self._handle.update, self._bundle(), raw=True)

    def _soon(self) -> None:
        with self._lock:
            wait = self._last + _UPDATE_S - time.monotonic()
            if wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self.flush()

    @staticmethod
    def _ticker(then: Callable[[], None]) -> None:
        timer = threading.Timer(_TICK_S, then)
        timer.daemon = True
        timer.start()

    def _bundle(self) -> dict[str, str]:
        with self._lock:
            hidden = self._seen - len(self._lines)
            output = list(self._lines)
            if hidden:
                output.insert(0, f"... {hidden} earlier line(s) are in the job's log files")
            table = self._table()
            if table is None:
                text = "\n".join([self._title, *output])
                return {"text/plain": text}
            table = Table(self._title, table.rows, table.cause)
            return {"text/plain": table.text(output), "text/html": table.html(output)}
