"""A job's output journal: every rank's chunks as they were taken in, with their arrival
times, bounded per rank, and read from any position by any number of readers.

A detached job's supervisor keeps one (issue 36): the driver that follows the job, or one
that gets it back later, reads pages of it and feeds them to its own `Console` at their
arrival times, so what it shows is folded as the live console folds. The journal holds
chunks, not lines: a line split across chunks is whole again on the reader's side, and
`orchestrator logs` can copy the bytes in bulk.

Past the bound, a rank's oldest chunks are dropped first; a reader told of them learns how
many lines it will never see (`Page.dropped`).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from orchestrator_workers.protocol import OutputChunk

BOUND_BYTES = 16 << 20
"""The default bound of each rank's output in the journal: 16 MiB (about 200,000 lines of
80 characters); older output is dropped first."""


@dataclass(frozen=True)
class Entry:
    """One chunk of one rank's output, where it is in the journal, and when it came."""

    position: int
    """Its place in the journal: increasing across all ranks, in arrival order."""
    rank: int
    chunk: OutputChunk
    at: float
    """When it was taken in (time.time() on the journal's machine)."""


@dataclass(frozen=True)
class Page:
    """Entries after a position, in arrival order, and where to read on from."""

    entries: tuple[Entry, ...]
    next: int
    """The position to read after next time (the last entry's, or the one asked for)."""
    dropped: dict[int, int] = field(default_factory=dict)
    """By rank, how many lines were dropped so far, for each rank whose dropped output lay
    after the position asked for (a reader says so once, counting from what it was told)."""
    closed: bool = False
    """Whether the journal was closed (its job ended) and this page reaches its end: a
    reader has everything."""


@dataclass
class _Rank:
    entries: deque[Entry] = field(default_factory=deque)
    size: int = 0
    dropped_lines: int = 0
    dropped_through: int = 0
    """The position of the newest entry dropped (0: none)."""


class Journal:
    """Every rank's output of one job, each rank's bounded by `bound` bytes."""

    def __init__(self, ranks: int, bound: int = BOUND_BYTES) -> None:
        """An empty journal for `ranks` ranks."""
        if bound <= 0:
            raise ValueError(f"a journal's bound must be positive, not {bound}")
        self.bound = bound
        self._ranks = [_Rank() for _ in range(ranks)]
        self._position = 0
        self._closed = False
        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)

    @property
    def position(self) -> int:
        """The position of the newest entry (0: none yet)."""
        return self._position

    def write(self, rank: int, chunks: Iterable[OutputChunk], now: float | None = None) -> None:
        """Take in `rank`'s `chunks` (as `Console.write` does); its oldest past the bound go."""
        at = time.time() if now is None else now
        with self._lock:
            kept = self._ranks[rank]
            for chunk in chunks:
                self._position += 1
                kept.entries.append(Entry(self._position, rank, chunk, at))
                kept.size += len(chunk.data)
                while kept.size > self.bound and len(kept.entries) > 1:
                    old = kept.entries.popleft()
                    kept.size -= len(old.chunk.data)
                    kept.dropped_lines += old.chunk.data.count(b"\n")
                    kept.dropped_through = old.position
            self._grown.notify_all()

    def close(self) -> None:
        """No more output comes (the job ended): readers waiting return at once."""
        with self._lock:
            self._closed = True
            self._grown.notify_all()

    def read(
        self, after: int = 0, limit: int = 10_000, wait_s: float = 0.0, settle_s: float = 0.0
    ) -> Page:
        """Up to `limit` entries after position `after`, in arrival order; waits up to
        `wait_s` for one if there is none yet (and the journal is open), and then up to
        `settle_s` more (within `wait_s`) for it to close: a job that ends at once then
        comes in one page."""
        with self._lock:
            if wait_s > 0:
                end = time.monotonic() + wait_s
                self._grown.wait_for(
                    lambda: self._position > after or self._closed, timeout=wait_s
                )
                settle_s = min(settle_s, end - time.monotonic())
                if settle_s > 0:
                    self._grown.wait_for(lambda: self._closed, timeout=settle_s)
            entries = tuple(_take(self._after(after), limit))
            dropped = {
                rank: kept.dropped_lines
                for rank, kept in enumerate(self._ranks)
                if kept.dropped_through > after
            }
            end = entries[-1].position if entries else after
            closed = self._closed and end >= self._position
        return Page(entries, end, dropped, closed)

    def newest(self, lines: int) -> int:
        """The position to read after to get (at least) the newest `lines` lines of output."""
        with self._lock:
            newest = heapq.merge(
                *(reversed(kept.entries) for kept in self._ranks),
                key=lambda entry: entry.position,
                reverse=True,
            )
            seen = 0
            for entry in newest:
                seen += entry.chunk.data.count(b"\n")
                if seen >= lines:
                    return entry.position - 1
        return 0

    def _after(self, after: int) -> Iterator[Entry]:
        """Every kept entry after `after`, merged across ranks in arrival order."""
        return heapq.merge(
            *(_tail(kept.entries, after) for kept in self._ranks),
            key=lambda entry: entry.position,
        )


def _tail(entries: deque[Entry], after: int) -> Iterator[Entry]:
    """The entries of one rank after position `after` (its newest are at the right)."""
    if not entries or entries[-1].position <= after:
        return iter(())
    if entries[0].position > after:
        return iter(entries)
    low, high = 0, len(entries) - 1  # the first entry after `after`
    while low < high:
        middle = (low + high) // 2
        if entries[middle].position <= after:
            low = middle + 1
        else:
            high = middle
    return (entries[i] for i in range(low, len(entries)))


def _take(entries: Iterator[Entry], limit: int) -> Iterator[Entry]:
    for count, entry in enumerate(entries):
        if count >= limit:
            return
        yield entry
