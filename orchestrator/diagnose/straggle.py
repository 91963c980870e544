"""Ranks slower than their peers, named while the job runs, with where their time goes.

Each rank counts where its function is, five looks a second (places and phases, see
`orchestrator_workers.sampler`); the driver reads the counts one rank per node. Over
the last `WINDOW_S`, a rank that spends a share of its time at one place that is
`EXCESS` or more above its peers' (the median of all ranks) holds them back, and they
wait for it at the place where their share is above its own the most:

    rank 5 spends 41% of its time at loader.py:88 in __getitem__ (others 6%); its peers
    wait for it in backward at train.py:60 (46% of their time, its 12%)

Python stacks cannot tell DDP's backward compute from its all-reduce wait (both sit in
`backward()`); the comparison can: the slow rank's extra time is where its peers have
none, and its peers' waiting shows as time in backward that it does not spend. The
CPU the processes use there says the same thing from another side: a rank computing
its backward uses its cores, a rank waiting for an all-reduce does not.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from orchestrator_workers.places import BACKWARD, in_collective
from orchestrator_workers.where import OTHER_FUNCTIONS, OTHER_PLACES, Where

WINDOW_S = 30.0
"""The span of the latest looks the shares are taken over."""
_LINE = re.compile(r":\d+")
"""In a place's name (a line of code); a function's has none ('in _spin at train.py')."""
MIN_LOOKS = 75
"""Looks a rank needs in the window (15 s at five a second) before it is compared."""
EXCESS = 0.12
"""How far above its peers' share of time at one place makes a rank slow, at least (a
rank 30% slower per step spends 23% of its time where its peers spend none)."""
Z = 4.0
"""And at least this many standard deviations of its share over its looks (a share of
0.5 over 150 looks: 16 points), so that chance over many places and ranks names nobody."""
RATIO = 2.0
"""And at least this many times its peers' share there: a rank that waits a little more
than its peers where they all wait (in backward, for the slow one) is not slow itself."""
CONFIRM_S = 5.0
"""How long a rank must keep being found slow before it is said to be."""
STALE_S = 20.0
"""A rank not read for this long is not compared."""


@dataclass(frozen=True)
class Straggler:
    """A rank slower than its peers: where its extra time goes, and where they wait."""

    rank: int
    place: str
    share: float
    """Its share of time at `place` in the window."""
    others: float
    """Its peers' (the median rank's) share there."""
    waits: str = ""
    """Where its peers wait for it ('' where no place stands out)."""
    their_wait: float = 0.0
    its_wait: float = 0.0
    cpu: tuple[float, float] | None = None
    """Where they wait in backward: the cores its peers' processes use there, and its."""

    def sentence(self) -> str:
        """'rank 5 spends 41% of its time at loader.py:88 ... (others 6%); its peers ...'."""
        place = self.place if self.place.startswith(("at ", "in ")) else f"at {self.place}"
        text = f"rank {self.rank} spends {self.share:.0%} of its time {place}"
        text += f" (others {self.others:.0%})"
        if self.waits:
            text += (
                f"; its peers wait for it {self.waits} ({self.their_wait:.0%} of their "
                f"time, its {self.its_wait:.0%}"
            )
            if self.cpu is not None:
                text += f"; their CPU there {self.cpu[0]:.1f} cores, its {self.cpu[1]:.1f}"
            text += ")"
        return text


Counts = tuple[int, dict[str, int], dict[str, tuple[int, float]]]
"""A reading's looks, its looks per place and function, and per phase (looks, CPU)."""


class Shares:
    """Each rank's counts of where its time went, kept over the window."""

    def __init__(self) -> None:
        """No readings yet."""
        self._history: dict[int, deque[tuple[float, Counts]]] = {}
        self._named: dict[int, float] = {}
        """Ranks found slow, and since when (they are said to be once it lasts)."""

    def add(self, where: Where, now: float) -> None:
        """Take one reading of a rank (at `now`, monotonic)."""
        if not where.samples or not where.running:
            return
        counts = {**(where.places or {}), **(where.functions or {})}
        history = self._history.setdefault(where.rank, deque())
        if history and history[-1][1][0] > where.samples:
            return  # an older look than the last one kept
        history.append((now, (where.samples, counts, dict(where.phases or {}))))
        # Keep the newest reading older than the window: the window's start.
        while len(history) > 2 and history[1][0] <= now - WINDOW_S:
            history.popleft()

    def stragglers(self, ranks: Collection[int], now: float) -> list[Straggler]:
        """The ranks among `ranks` slower than their peers (for `CONFIRM_S` at least,
        so that one unlucky window names nobody), the slowest first."""
        found = self._compare(ranks, now)
        self._named = {s.rank: self._named.get(s.rank, now) for _, s in found}
        return [s for _, s in found if now - self._named[s.rank] >= CONFIRM_S]

    def _compare(self, ranks: Collection[int], now: float) -> list[tuple[float, Straggler]]:
        windows = {}
        for rank in ranks:
            history = self._history.get(rank)
            if not history or history[-1][0] < now - STALE_S:
                continue  # never read, or not lately: not compared
            (began, oldest), (ended, last) = history[0], history[-1]
            # The counts start with the call: a window as long as the call takes them all.
            first = oldest if began <= ended - WINDOW_S else None
            looks = last[0] - (first[0] if first is not None else 0)
            if looks >= MIN_LOOKS:
                windows[rank] = (looks, _diff(last, first))
        if len(windows) < 3:
            return []
        shares = {
            rank: {place: n / looks for place, n in places.items()}
            for rank, (looks, (places, _)) in windows.items()
        }
        everywhere = set().union(*(s.keys() for s in shares.values())) - {
            OTHER_PLACES,
            OTHER_FUNCTIONS,
        }
        collectives = {p for p in everywhere if in_collective(p)}
        usual = {p: statistics.median(s.get(p, 0.0) for s in shares.values()) for p in everywhere}
        found = []
        for rank, share in shares.items():
            looks = windows[rank][0]

            def margin(p: str, looks: int = looks, share: dict[str, float] = share) -> float:
                """How far its share at `p` is above the usual one, less what chance gives."""
                q = min(1.0, max(share.get(p, 0.0), usual[p]))
                return share.get(p, 0.0) - usual[p] - max(EXCESS, Z * (q * (1 - q) / looks) ** 0.5)

            # More time in a collective is waiting for someone else: never a rank's own.
            place = max(everywhere - collectives, key=margin, default="")
            if not place:
                continue
            if margin(place) < 0 or share.get(place, 0.0) < RATIO * usual[place]:
                continue  # by chance, or where its peers spend most of their time too
            waits, gap = max(  # a line, not a whole function
                ((p, usual[p] - share.get(p, 0.0)) for p in everywhere if _LINE.search(p)),
                key=lambda x: x[1],
                default=("", 0.0),
            )
            slow = Straggler(rank, place, share.get(place, 0.0), usual[place])
            if gap >= EXCESS / 2:
                slow = Straggler(
                    rank,
                    place,
                    share.get(place, 0.0),
                    usual[place],
                    waits,
                    usual[waits],
                    share.get(waits, 0.0),
                    _backward_cpu(rank, windows) if "backward" in waits else None,
                )
            found.append((share.get(place, 0.0) - usual[place], slow))
        if len(found) > max(1, len(shares) // 3):
            return []  # not a few slow ranks: the job runs in two kinds of step
        return sorted(found, key=lambda f: -f[0])


def _diff(
    last: Counts, first: Counts | None
) -> tuple[dict[str, int], dict[str, tuple[int, float]]]:
    """The counts between two readings (`first` None: since the call began).

    Places (lines) and functions are counted alike: their names never meet ('at
    train.py:9 in f' against 'in f at train.py'), and whichever stands out more is named.
    """
    was_places = first[1] if first is not None else {}
    was_phases = first[2] if first is not None else {}
    places = {p: n - was_places.get(p, 0) for p, n in last[1].items()}
    phases = {}
    for phase, (n, cpu) in last[2].items():
        was_n, was_cpu = was_phases.get(phase, (0, 0.0))
        phases[phase] = (n - was_n, cpu - was_cpu)
    return {p: n for p, n in places.items() if n > 0}, phases


def _backward_cpu(
    rank: int,
    windows: dict[int, tuple[int, tuple[dict[str, int], dict[str, tuple[int, float]]]]],
) -> tuple[float, float] | None:
    """The cores its peers' processes used during their looks in backward, and its."""
    rates = {}
    for r, (_, (_, phases)) in windows.items():
        n, cpu = phases.get(BACKWARD, (0, 0.0))
        if n:
            rates[r] = cpu / n
    if rank not in rates or len(rates) < 2:
        return None
    peers = [v for r, v in rates.items() if r != rank]
    return statistics.median(peers), rates[rank]
