"""The watching a call runs: where its ranks are, who makes no progress, who is slow, and
what each uses. The call asks it to look; it never looks back into the call."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.diagnose.stall import StallReport, Watch, report
from orchestrator.diagnose.stopped import N, Stopped, find, threshold
from orchestrator.diagnose.straggle import Straggler
from orchestrator.view import Findings, Notice

if TYPE_CHECKING:
    from orchestrator.observe.series import Series
    from orchestrator.pool import Pool

JUDGE_S = 0.5
"""While ranks are read, how often who makes no progress is worked out."""


class Monitor:
    """Watches one call's ranks (see `stall.Watch`): the stall report, the slow ranks, and
    what the status line must say, as last worked out."""

    def __init__(
        self, pool: Pool, started: float, after_s: float, on_stall: str, *, series: Series, key: str
    ) -> None:
        """A monitor of `pool`'s ranks for call `key` started at `started` (monotonic);
        what it reads goes into the job's `series` too."""
        self.name = pool.name
        self.watch = Watch(pool, started, after_s, series=series, key=key)
        self.on_stall = on_stall
        self.stall: StallReport | None = None
        """Ranks without progress for `after_s`: who is where (None: all move)."""
        self.slow: list[Straggler] = []
        """Ranks slower than their peers, the slowest first (see diagnose.straggle)."""
        self.notice: Notice | None = None
        """What the status line must say now, as last worked out."""
        self.stopped: Stopped | None = None
        """A rank that stopped while its peers wait for it (see diagnose.stopped)."""
        self._judged = 0.0
        self._compared = 0
        """Node readings the slow ranks were last worked out from."""

    @property
    def after_s(self) -> float:
        """How long ranks may make no progress before they are reported."""
        return self.watch.after_s

    def look(
        self,
        now: float,
        *,
        call_key: str,
        running: set[int],
        results: Collection[int],
        waits_on: Mapping[int, str],
        last_output: Sequence[float],
    ) -> float:
        """Read where the ranks are when due, and work out who makes no progress; when next.

        `running`: ranks whose outcome has not come; `results`: ranks that returned;
        `waits_on`: what ranks wait on beyond their work (a debugger holds the others).
        """
        watch = self.watch
        due = watch.tick(now)  # readings on their way wake the call's wait as they come
        if (watch.where or watch.mute) and now >= self._judged + JUDGE_S:
            self._judged = now
            returned = set(results) | {
                rank
                for rank, (where, _) in watch.where.items()
                if where.call == call_key and not where.running
            }  # a handed-off call's outcomes come together, once all are done
            moving = running - returned
            self.stall = self.stopped = None
            if not any(waits_on.values()):
                self.stopped = self._stopped(now, moving, last_output)
                self.stall = report(
                    self.name,
                    now,
                    watch.where,
                    moving,
                    last_output,
                    after_s=watch.after_s,
                    returned=returned,
                    mute=watch.mute,
                )
            if self.stall is not None:
                self.slow = []
            elif watch.readings != self._compared:  # new counts: compare the ranks again
                self._compared = watch.readings
                self.slow = watch.shares.stragglers(moving, now)
            self.notice = self._notice()
        return due  # judged at the next read, or as a reading comes

    def ends_call(self) -> StallReport | None:
        """The stall report that ends the call (on_stall='raise'), if any.

        Raise mode, the user's choice, ends the call once ranks have waited `after_s`,
        even for one that moves (rank 0 saving a checkpoint while its peers wait at a
        barrier): the report says just that.
        """
        return self.stall if self.on_stall == "raise" else None

    def findings(self) -> Findings:
        """What it worked out last, as plain data (see `view.snapshot`)."""
        latest = self.watch.series.latest()
        figures = {
            rank: latest[rank]
            for rank, (where, _) in self.watch.where.items()
            if where.running and rank in latest
        }
        return Findings(self.stall, tuple(self.slow), self.notice, self.stopped, figures)

    def _stopped(
        self, now: float, moving: set[int], last_output: Sequence[float]
    ) -> Stopped | None:
        """The rank that stopped, once every running rank completed enough steps."""
        after_s = threshold(self.watch.series.recent(N), moving)
        if after_s is None:
            return None
        where = self.watch.where
        found = report(self.name, now, where, moving, last_output, after_s=after_s)
        return find(found, where, now, after_s)

    def _notice(self) -> Notice | None:
        """What the status line must say now: ranks without progress, or slow ones."""
        if self.stall is not None:  # said again at once when who waits where changes
            key = tuple((g.ranks, str(g.place)) for g in self.stall.groups if not g.moving)
            return Notice(key, self.stall.line(), str(self.stall))
        if self.stopped is not None:
            return Notice(("stopped", self.stopped.rank), self.stopped.line(), str(self.stopped))
        if self.slow:
            line = f"[{self.name}] " + "; ".join(s.sentence() for s in self.slow)
            return Notice(tuple(s.rank for s in self.slow), line, line)
        return None
