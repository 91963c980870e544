"""Folding: the lines many ranks write alike, shown once with the ranks that wrote them.

Lines of one shape (their text with every number taken out) on one stream fold together:
`Rank 2: Epoch 3, Loss 0.21` from 128 ranks is shown once as
`[train r0-127] Rank 0..127: Epoch 3, Loss -1.01..0.44`. A rank's line joins the oldest
fold of its shape not shown yet that lacks it, else starts one. A fold is shown once
every rank it waits for has joined it, or `FOLD_WAIT_S` after its first line, whichever
is first; folds are shown in the order of their first line, so no line waits much
longer than that. A line that comes after its fold was shown without it is late: it
starts a fold of its own, which only other ranks late with that line join.

Each rank's lines keep their order: a rank whose own earlier lines wait, alone, in folds
after the one it joins has them shown just before that fold; it joins no fold older than
an earlier line of its that others share. Errors, warnings and tracebacks on stderr are
never folded.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from orchestrator.options import FOLD_FROM_RANKS

FOLD_WAIT_S = 0.5
"""The longest a fold waits for the ranks that have not written its line yet."""
LATE_S = 10.0
"""A rank's line this long after its fold was shown without it is no longer late."""

_NUMBER = re.compile(
    r"((?:(?<![\w.])[-+])?(?<![0-9.])(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)"
)
"""A number as ranks print them: 3, -1.01, .5, 2e-05 (a sign only where no word precedes).
Split by it, a line is its text and numbers in turn."""
_ALARM = re.compile(
    r"error|exception|warn|fatal|critical|fail|abort|panic|segmentation fault|traceback"
    r"|^\[?[EWF]\d{0,4}[ \]]",
    re.IGNORECASE,
)
"""What an error or a warning looks like (NCCL WARN, UserWarning, glog's W0412 ...)."""
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def fold_by_default(shown_ranks: int) -> bool:
    """Whether output is folded when the caller left it to us (fold_output=None)."""
    return shown_ranks >= FOLD_FROM_RANKS


@dataclass(frozen=True)
class Folded:
    """One line to show: its text and the ranks (in order) that wrote it."""

    ranks: tuple[int, ...]
    stream: str
    text: str


_Shape = tuple[str, tuple[str, ...]]
_Key = tuple[str, tuple[str, ...], bool]


@dataclass
class _Debts:
    """The ranks that owe a line of one shape: its folds were shown without them."""

    until: float
    counts: dict[int, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Fold:
    """The ranks' lines of one shape gathered so far."""

    seq: int
    """Its place in the order of first lines."""
    stream: str
    parts: tuple[str, ...]
    """The line's text around its numbers."""
    deadline: float
    joinable: bool
    """Whether other ranks' lines may still join it (in Folder._waiting)."""
    late: bool = False
    """Gathers lines that came after their fold was shown without them."""
    numbers: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Per rank, the numbers it wrote, as written."""
    complete: bool = False
    before: list[_Fold] = field(default_factory=list)
    """Lone earlier lines of its ranks, moved here to be shown just before it."""
    moved: bool = False
    """Shown before a fold it was moved to, not in its own place."""

    @property
    def shape(self) -> _Shape:
        """Its stream and the text around its numbers."""
        return self.stream, self.parts

    @property
    def key(self) -> _Key:
        """What a line must be to join it: of its shape, late or not as it is."""
        return self.stream, self.parts, self.late

    def folded(self) -> Folded:
        """The line to show for every rank in it."""
        ranks = tuple(sorted(self.numbers))
        columns = zip(*self.numbers.values(), strict=True)
        text = self.parts[0]
        for column, part in zip(columns, self.parts[1:], strict=True):
            text += _span(column) + part
        return Folded(ranks, self.stream, text)


class Folder:
    """Folds the lines of the ranks it waits for; gives back lines to show, in order."""

    def __init__(self, ranks: Collection[int], wait_s: float = FOLD_WAIT_S) -> None:
        """`ranks`: those whose lines come in (the ones shown); a fold waits for them all."""
        self.ranks = frozenset(ranks)
        self.wait_s = wait_s
        self._queue: deque[_Fold] = deque()
        """Folds not shown yet, in the order of their first line (moved ones skipped)."""
        self._waiting: dict[_Key, deque[_Fold]] = {}
        """Per stream, shape and lateness, its folds open to more ranks, oldest first."""
        self._owed: dict[_Shape, _Debts] = {}
        """Per stream and shape, the ranks whose line of it is late; soonest to expire first."""
        self._pending: dict[int, deque[_Fold]] = {}
        """Per rank, the folds its lines not shown yet are in, in the order it wrote them."""
        self._shared: dict[int, int] = {}
        """Per rank, the newest fold (seq) with a line of its and others': it joins none
        older. Its lines in newer folds are alone there."""
        self._in_traceback: set[int] = set()
        self._seq = 0

    @property
    def due(self) -> float | None:
        """When the oldest fold not shown yet is to be shown (None: nothing pending)."""
        return self._queue[0].deadline if self._queue else None

    def add(self, rank: int, stream: str, line: str, now: float) -> list[Folded]:
        """Take rank `rank`'s `line`; return the lines now ready to show."""
        if self._never_folded(rank, stream, line):
            fold = self._new(stream, (line,), now, joinable=False)
            fold.numbers[rank] = ()
            fold.complete = True
        else:
            pieces = _NUMBER.split(line)
            parts = tuple(pieces[::2])
            late = self._pays_debt(rank, (stream, parts), now)
            fold = self._join(rank, (stream, parts, late), now)
            fold.numbers[rank] = tuple(pieces[1::2])
            if late:  # waits only for the other ranks late with it
                fold.complete = (stream, parts) not in self._owed
            else:
                fold.complete = len(fold.numbers) >= len(self.ranks)
        self._pending.setdefault(rank, deque()).append(fold)
        return self.tick(now)

    def tick(self, now: float) -> list[Folded]:
        """The lines ready at `now`: folds complete or waited for long enough, in order."""
        shown: list[Folded] = []
        while self._queue:
            fold = self._queue[0]
            if not (fold.moved or fold.complete or fold.deadline <= now):
                break
            self._queue.popleft()
            if not fold.moved:
                shown += self._shown(fold)
        while self._owed:
            shape, debts = next(iter(self._owed.items()))
            if debts.until > now:
                break
            del self._owed[shape]
        return shown

    def flush(self) -> list[Folded]:
        """Every line not shown yet (the end of a call), in order."""
        shown: list[Folded] = []
        while self._queue:
            fold = self._queue.popleft()
            if not fold.moved:
                shown += self._shown(fold)
        return shown

    def _join(self, rank: int, key: _Key, now: float) -> _Fold:
        """The fold `rank`'s line of this shape goes into: the oldest it may join, or new."""
        waiting = self._waiting.setdefault(key, deque())
        # Past the rank's newest shared fold, its own folds come first, then ones to join.
        start = bisect_right(waiting, self._shared.get(rank, 0), key=lambda f: f.seq)
        at = bisect_left(waiting, True, lo=start, key=lambda f: rank not in f.numbers)
        if at == len(waiting):
            fold = self._new(key[0], key[1], now, joinable=True, late=key[2])
            waiting.append(fold)
            return fold
        fold = waiting[at]
        if len(fold.numbers) == 1:  # its first rank now shares it too
            (first,) = fold.numbers
            self._shared[first] = max(self._shared.get(first, 0), fold.seq)
        self._shared[rank] = fold.seq
        mine = self._pending.get(rank, deque())
        moved = []
        while mine and mine[-1].seq > fold.seq:  # its earlier lines, each alone in a fold
            earlier = mine.pop()
            earlier.moved = True
            if earlier.joinable:
                self._unwait(earlier)
            moved.append(earlier)
        fold.before += reversed(moved)
        return fold

    def _new(
        self, stream: str, parts: tuple[str, ...], now: float, *, joinable: bool, late: bool = False
    ) -> _Fold:
        self._seq += 1
        fold = _Fold(self._seq, stream, parts, now + self.wait_s, joinable, late)
        self._queue.append(fold)
        return fold

    def _shown(self, fold: _Fold) -> list[Folded]:
        """`fold`'s line, after those moved before it; it leaves every list it is in."""
        shown = [line for earlier in fold.before for line in self._shown(earlier)]
        if not fold.moved:
            if fold.joinable:
                self._unwait(fold)
            for rank in fold.numbers:
                mine = self._pending[rank]
                if mine and mine[0] is fold:  # shown in order: each rank's oldest
                    mine.popleft()
        if fold.joinable and not fold.late:
            self._owe(fold)
        shown.append(fold.folded())
        return shown

    def _owe(self, fold: _Fold) -> None:
        """The ranks `fold` is shown without owe its line, if most wrote it: theirs is late."""
        missing = set(self.ranks.difference(fold.numbers))
        if not missing or len(missing) > len(fold.numbers):
            return  # a line most ranks do not write is late for none
        for later in self._waiting.get((*fold.shape, False), ()):
            missing.difference_update(later.numbers)  # theirs came, in a later fold
        debts = self._owed.pop(fold.shape, None)
        if debts is None or debts.until <= fold.deadline:
            debts = _Debts(fold.deadline + LATE_S)
        for rank in missing:
            debts.counts[rank] = debts.counts.get(rank, 0) + 1
        debts.until = fold.deadline + LATE_S
        self._owed[fold.shape] = debts  # the last to expire, last

    def _pays_debt(self, rank: int, shape: _Shape, now: float) -> bool:
        """Whether `rank`'s line of `shape` is late (its fold was shown without it)."""
        debts = self._owed.get(shape)
        if debts is None or debts.until <= now or rank not in debts.counts:
            return False
        debts.counts[rank] -= 1
        if not debts.counts[rank]:
            del debts.counts[rank]
            if not debts.counts:
                del self._owed[shape]
        return True

    def _unwait(self, fold: _Fold) -> None:
        """No more ranks join `fold`: a line of its shape that comes later is in another."""
        waiting = self._waiting[fold.key]
        if waiting[0] is fold:
            waiting.popleft()
        else:
            waiting.remove(fold)  # moved: rare, and its shape has few folds open
        if not waiting:
            del self._waiting[fold.key]

    def _never_folded(self, rank: int, stream: str, line: str) -> bool:
        """A line of a traceback on stderr, or one that looks like an error or a warning."""
        if stream != "stderr":
            return False
        if "Traceback (most recent call last):" in line or line.startswith(_CHAINED):
            self._in_traceback.add(rank)  # until a line not indented: the exception's
            return True
        if rank in self._in_traceback:
            if line and not line[:1].isspace():
                self._in_traceback.discard(rank)
            return True
        return bool(_ALARM.search(line))


def fold_lines(lines: Mapping[int, str]) -> list[Folded]:
    """One line per shape of these ranks' `lines` (rank -> line), the most ranks first."""
    folds: dict[tuple[str, ...], dict[int, tuple[str, ...]]] = {}
    for rank, line in sorted(lines.items()):
        pieces = _NUMBER.split(line)
        folds.setdefault(tuple(pieces[::2]), {})[rank] = tuple(pieces[1::2])
    shown = []
    for parts, numbers in folds.items():
        text = parts[0]
        for column, part in zip(zip(*numbers.values(), strict=True), parts[1:], strict=True):
            text += _span(column) + part
        shown.append(Folded(tuple(numbers), "stdout", text))
    return sorted(shown, key=lambda folded: (-len(folded.ranks), folded.ranks[0]))


def _span(numbers: tuple[str, ...]) -> str:
    """One number as the ranks wrote it, or the range lowest..highest where they differ."""
    if all(number == numbers[0] for number in numbers):
        return numbers[0]
    ordered = sorted(numbers, key=lambda number: (float(number), number))
    return f"{ordered[0]}..{ordered[-1]}"
