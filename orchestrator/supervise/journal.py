"""A job's output journal: every rank's chunks as they were taken in, with their arrival
times, bounded per rank, and read from any position by any number of readers.

A detached job's supervisor keeps one (issue 36): the driver that follows the job, or one
that gets it back later, reads pages of it and feeds them to its own `Console` at their
arrival times, so what it shows is folded as the live console folds. The journal holds
chunks, not lines: a line split across chunks is whole again on the reader's side, and
`orchestrator logs` can copy the bytes in bulk.

The bound is on what a rank's entries cost the supervisor's memory, not on their bytes
alone: an entry costs ENTRY_BYTES besides its output, so a rank that writes a byte at a
time cannot hold the head node's memory at many times the bound; and a rank's chunks that
come close together are kept as one entry (MERGE_S), so that such output is kept in bulk.
Past the bound, a rank's oldest entries are dropped first; a reader told of them learns how
many lines it will never see (`Page.dropped`).
"""

from __future__ import annotations

import heapq
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from orchestrator_workers.protocol import OutputChunk

BOUND_BYTES = 16 << 20
"""The default bound of what each rank's output costs in the journal: 16 MiB of the
supervisor's memory, its bytes and ENTRY_BYTES per entry (about 55,000 lines of 80
characters written one at a time, 200,000 where they come quickly); older output is
dropped first."""
ENTRY_BYTES = 224
"""What an entry costs besides its output, counted in the bound: its Entry, its numbers,
its bytes object's header and its place in the deque (209 bytes measured with tracemalloc,
Python 3.11; tests/test_journal.py checks it)."""
MERGE_S = 0.05
"""A chunk that comes within this long of the first one of its rank's newest entry, on the
same stream, joins that entry while no reader was given its position (and it stays within
MERGE_BYTES): a rank writing a byte at a time makes an entry per MERGE_S, not per byte. A
reader replays the entry at its first chunk's time: its later bytes that much early at most."""
MERGE_BYTES = 4096
"""The most output an entry holds by merging chunks."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One rank's output on one stream (a chunk, or chunks that came close together: see
    MERGE_S), where it is in the journal, and when it came."""

    position: int
    """Its place in the journal: increasing across all ranks, in arrival order."""
    rank: int
    stream: str
    data: bytes
    seq: int
    """Its last chunk's seq."""
    at: float
    """When its first chunk was taken in (time.time() on the journal's machine)."""

    @property
    def chunk(self) -> OutputChunk:
        """Its output as one chunk, as a Console takes it in."""
        return OutputChunk(self.seq, self.stream, self.data)


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
    """What its entries cost: their output, and ENTRY_BYTES each."""
    dropped_lines: int = 0
    dropped_through: int = 0
    """The position of the newest entry dropped (0: none)."""


class Journal:
    """Every rank's output of one job, what each rank's costs bounded by `bound` bytes."""

    def __init__(self, ranks: int, bound: int = BOUND_BYTES) -> None:
        """An empty journal for `ranks` ranks."""
        if bound <= 0:
            raise ValueError(f"a journal's bound must be positive, not {bound}")
        self.bound = bound
        self._ranks = [_Rank() for _ in range(ranks)]
        self._position = 0
        self._handed = 0
        """The newest position given to a reader: no chunk joins an entry up to it."""
        self._closed = False
        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)

    @property
    def position(self) -> int:
        """The position of the newest entry (0: none yet), to read after."""
        with self._lock:
            self._handed = self._position
            return self._position

    def write(self, rank: int, chunks: Iterable[OutputChunk], now: float | None = None) -> None:
        """Take in `rank`'s `chunks` (as `Console.write` does); its oldest past the bound go."""
        at = time.time() if now is None else now
        with self._lock:
            kept = self._ranks[rank]
            for chunk in chunks:
                last = kept.entries[-1] if kept.entries else None
                if last is not None and self._joins(last, chunk, at):
                    data = last.data + chunk.data
                    kept.entries[-1] = Entry(
                        last.position, rank, last.stream, data, chunk.seq, last.at
                    )
                    kept.size += len(chunk.data)
                else:
                    self._position += 1
                    stream = sys.intern(chunk.stream)  # not a copy per entry
                    kept.entries.append(
                        Entry(self._position, rank, stream, chunk.data, chunk.seq, at)
                    )
                    kept.size += len(chunk.data) + ENTRY_BYTES
                while kept.size > self.bound and len(kept.entries) > 1:
                    old = kept.entries.popleft()
                    kept.size -= len(old.data) + ENTRY_BYTES
                    kept.dropped_lines += old.data.count(b"\n")
                    kept.dropped_through = old.position
            self._grown.notify_all()

    def _joins(self, last: Entry, chunk: OutputChunk, at: float) -> bool:
        """Whether `chunk`, taken in at `at`, joins its rank's newest entry `last`."""
        return (
            last.position > self._handed  # no reader was given its position, or a later one
            and last.stream == chunk.stream
            and at - last.at < MERGE_S
            and len(last.data) + len(chunk.data) <= MERGE_BYTES
        )

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
                self._grown.wait_for(lambda: self._position > after or self._closed, timeout=wait_s)
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
            self._handed = max(self._handed, end)
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
                seen += entry.data.count(b"\n")
                if seen >= lines:
                    self._handed = max(self._handed, entry.position - 1)
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
