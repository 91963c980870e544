"""Columns of numbers kept within a fixed size, the oldest dropped first: what a series
grows in. Times are doubles; the figures, 4-byte floats (7 digits: enough to plot and
compare, half the memory)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

Column = array
"""A column of a series: an array of doubles (times) or floats (figures), oldest first."""

TIMES = frozenset({"at", "minute"})
"""Columns that hold a time (wall clock): doubles."""


class Ring:
    """Columns of numbers, the newest `size` rows kept (oldest dropped first)."""

    def __init__(self, columns: Sequence[str], size: int) -> None:
        """An empty ring of `columns`; those named in TIMES hold doubles, the rest floats."""
        self.columns = tuple(columns)
        self.size = size
        self.data = [array("d" if name in TIMES else "f") for name in self.columns]
        self.added = 0

    def add(self, row: Iterable[float]) -> None:
        """Add one row (a value per column)."""
        index = self.added % self.size
        for column, value in zip(self.data, row, strict=True):
            if self.added < self.size:
                column.append(value)
            else:
                column[index] = value
        self.added += 1

    def last(self, column: str) -> float | None:
        """The newest row's value in `column` (None: no row)."""
        if not self.added:
            return None
        return self.data[self.columns.index(column)][(self.added - 1) % self.size]

    def tail(self, count: int) -> list[dict[str, float]]:
        """The newest `count` rows (or fewer), oldest first."""
        kept = min(count, self.added, self.size)
        found = []
        for back in range(kept, 0, -1):
            index = (self.added - back) % self.size
            found.append({name: c[index] for name, c in zip(self.columns, self.data, strict=True)})
        return found

    def rows(self) -> dict[str, Column]:
        """Each column, oldest first: a copy, as an array (copied in one piece)."""
        start = self.added % self.size if self.added > self.size else 0
        return {
            name: column[start:] + column[:start]
            for name, column in zip(self.columns, self.data, strict=True)
        }

    def nbytes(self) -> int:
        """What its numbers take when full."""
        return sum(column.itemsize for column in self.data) * self.size
