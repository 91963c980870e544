"""A quiet call's status line on a terminal: `[train] 4 ranks running 0:42; last output 0:12 ago`.

Shown once a call has run 10 s and its ranks have printed nothing for 10 s: redrawn in
place (once a second) when stderr is a terminal and the application has not set up
logging, else printed at most once a minute. It goes through
`logging.getLogger("orchestrator.status")` (see `messages`), so standard logging
silences it, and ORCHESTRATOR_STATUS=0 turns it off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator.show import messages
from orchestrator.show.summary import states_line
from orchestrator.show.text import clock

if TYPE_CHECKING:
    from orchestrator.view import CallView, Notice

logger = logging.getLogger("orchestrator.status")
QUIET_S = 10.0
"""How long a call runs, and its ranks stay silent, before the line is shown."""
REDRAW_S = 1.0
"""How often the line is redrawn in place on a terminal."""
REPEAT_S = 60.0
"""How often it is printed again where stderr is not a terminal (a log file, CI)."""


def enabled() -> bool:
    """Whether status lines are shown at all (ORCHESTRATOR_STATUS=0 turns them off)."""
    return os.environ.get("ORCHESTRATOR_STATUS", "1") != "0"


class StatusLine:
    """The status line of one call of job `name` on `num_ranks` ranks, started at `started`."""

    def __init__(
        self,
        name: str,
        num_ranks: int,
        started: float,
        view: Callable[[], CallView] | None = None,
    ) -> None:
        """A line not shown yet; `tick` decides when. `view()`: the call as it is now,
        asked only when the line is drawn; where its ranks' states differ, the line says
        which ranks are in which."""
        self.name = name
        self.num_ranks = num_ranks
        self.started = started
        self._view = view
        self._notice_shown: object = None
        self._shown_at: float | None = None
        self._in_place: bool | None = None
        """Whether stderr is a terminal: asked once the line is first due (a call costs less)."""

    def tick(self, now: float, last_output: float, notice: Notice | None = None) -> float | None:
        """Show the line if it is due; return when it may next be due (None: never).

        `notice`: what the user must know now (ranks without progress, slow ranks; the
        call's view's notice), if anything: the line says it instead, at once when it
        changed (and in full, with a stack per place, where the line is not redrawn in
        place)."""
        if not enabled():
            return None
        quiet_since = max(last_output, self.started)
        due = max(self.started + QUIET_S, quiet_since + QUIET_S)
        if notice is None:
            self._notice_shown = None  # the same notice, back later, is said at once
        if now < due and notice is None:
            return due
        # Redrawn only on a terminal of ours: an application's handler (or pytest's) would
        # make each redraw a line of its own.
        if self._in_place is None:
            self._in_place = _is_terminal()
        in_place = self._in_place and not messages.configured(logger)
        every = REDRAW_S if in_place else REPEAT_S
        if notice is not None:
            return self._show_notice(notice, now, in_place, every)
        if self._shown_at is not None and now < self._shown_at + every:
            return self._shown_at + every
        self._shown_at = now
        view = self._view() if self._view is not None else None
        states = [(r.rank, r.state) for r in view.ranks] if view is not None else []
        running = f"{self.num_ranks} ranks running"
        if len({state for _, state in states}) > 1:  # e.g. one waits for a debugger
            running = f"{self.num_ranks} ranks ({states_line(states)})"
        text = f"{running} {clock(now - self.started)}; last output {clock(now - quiet_since)} ago"
        messages.emit(logger, logging.INFO, f"[{self.name}] {text}", in_place=in_place)
        return now + every

    def _show_notice(self, notice: Notice, now: float, in_place: bool, every: float) -> float:
        """Say it: at once when it changed, else as the line would."""
        changed = notice.key != self._notice_shown
        if not changed and self._shown_at is not None and now < self._shown_at + every:
            return self._shown_at + every
        self._shown_at, self._notice_shown = now, notice.key
        text = notice.full if changed and not in_place else notice.line
        messages.emit(logger, logging.WARNING, text, in_place=in_place)
        return now + every


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
