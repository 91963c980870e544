"""A job's output journal: chunks kept with their arrival times, bounded per rank, read in
pages from any position, and shown by a reader's Console as the live console shows them."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from orchestrator.show.logs import Console
from orchestrator.supervise.journal import ENTRY_BYTES, MERGE_S, Journal
from orchestrator_workers.protocol import OutputChunk


def _chunks(*texts: str, start: int = 1) -> list[OutputChunk]:
    return [OutputChunk(start + i, "stdout", text.encode()) for i, text in enumerate(texts)]


def test_pages_come_in_arrival_order_across_ranks_from_any_position():
    journal = Journal(ranks=2)
    journal.write(0, _chunks("a0\n"), now=1.0)
    journal.write(1, _chunks("b0\n"), now=2.0)
    journal.write(1, _chunks("b1\n", start=2), now=2.5)
    journal.write(0, _chunks("a1\n", start=2), now=3.0)
    page = journal.read()
    assert [(e.rank, e.chunk.data, e.at) for e in page.entries] == [
        (0, b"a0\n", 1.0),
        (1, b"b0\n", 2.0),
        (1, b"b1\n", 2.5),
        (0, b"a1\n", 3.0),
    ]
    assert page.next == journal.position == 4 and not page.dropped
    later = journal.read(after=2, limit=1)
    assert [e.chunk.data for e in later.entries] == [b"b1\n"] and later.next == 3
    assert journal.read(after=4).entries == () and journal.read(after=4).next == 4


def test_past_the_bound_a_rank_s_oldest_output_goes_and_readers_are_told_how_much():
    journal = Journal(ranks=2, bound=2 * ENTRY_BYTES + 10)  # two entries of a few bytes
    journal.write(1, _chunks("kept\n"))
    for at, chunk in enumerate(_chunks("line 1\n", "line 2\nline 3\n", "line 4\n")):
        journal.write(0, [chunk], now=float(at))  # an entry each: they came apart
    page = journal.read()
    assert [e.chunk.data for e in page.entries if e.rank == 0] == [b"line 4\n"]
    assert [e.chunk.data for e in page.entries if e.rank == 1] == [b"kept\n"]  # its own bound
    assert page.dropped == {0: 3}  # lines 1 to 3
    assert journal.read(after=page.next).dropped == {}  # nothing dropped after what it read
    longer = "a line longer than the bound " * 20 + "\n"
    journal.write(0, _chunks(longer, start=4), now=3.0)  # the newest stays
    assert [e.chunk.data for e in journal.read(after=page.next).entries] == [longer.encode()]
    assert journal.read(after=page.next).dropped == {}  # line 4 went, but was read before
    assert journal.read().dropped == {0: 4}  # a reader from the start never sees 1 to 4
    with pytest.raises(ValueError, match="bound must be positive, not 0"):
        Journal(ranks=1, bound=0)


def test_the_newest_lines_are_found_from_the_end():
    journal = Journal(ranks=2)
    for i in range(100):
        journal.write(i % 2, _chunks(f"line {i}\n", start=i + 1), now=float(i))
    newest = journal.read(after=journal.newest(10)).entries
    assert [e.chunk.data for e in newest] == [f"line {i}\n".encode() for i in range(90, 100)]
    assert journal.newest(1000) == 0  # fewer than asked: all of it


def test_a_reader_waits_for_what_comes_next():
    journal = Journal(ranks=1)
    threading.Timer(0.2, journal.write, (0, _chunks("late\n"))).start()
    started = time.monotonic()
    page = journal.read(after=0, wait_s=10)
    assert [e.chunk.data for e in page.entries] == [b"late\n"]
    assert time.monotonic() - started < 5
    assert journal.read(after=page.next, wait_s=0.05).entries == ()  # nothing more: on time


def test_closing_wakes_a_waiting_reader_whose_page_then_says_it_has_everything():
    journal = Journal(ranks=2)
    journal.write(0, _chunks("a\n"), now=1.0)
    journal.write(0, _chunks("b\n", start=2), now=2.0)
    assert not journal.read(after=0).closed  # open: more may come
    threading.Timer(0.2, journal.close).start()
    started = time.monotonic()
    last = journal.read(after=2, wait_s=10)
    assert last.entries == () and last.closed
    assert time.monotonic() - started < 5
    partial = journal.read(after=0, limit=1)  # closed, but this page stops short of the end
    assert len(partial.entries) == 1 and not partial.closed
    assert journal.read(after=partial.next).closed


def test_a_settling_reader_waits_a_moment_more_for_the_end_once_output_came():
    """A submit's first read: output and a close soon after come in one page; a job that
    goes on is answered once the settle time is up, not after the whole wait."""
    journal = Journal(ranks=1)

    def last_words() -> None:  # in this order, however late the thread runs
        journal.write(0, _chunks("last\n"))
        time.sleep(0.1)
        journal.close()

    threading.Timer(0.05, last_words).start()
    page = journal.read(after=0, wait_s=10, settle_s=5)
    assert [e.chunk.data for e in page.entries] == [b"last\n"] and page.closed
    going_on = Journal(ranks=1)
    going_on.write(0, _chunks("first\n"))
    closer = threading.Timer(3, going_on.close)
    closer.start()
    started = time.monotonic()
    page = going_on.read(after=0, wait_s=10, settle_s=0.2)
    assert [e.chunk.data for e in page.entries] == [b"first\n"]
    assert not page.closed  # answered when the settle time was up, before the close
    assert time.monotonic() - started >= 0.2  # it did wait for the close that long
    closer.cancel()
    unsettled = Journal(ranks=1)
    unsettled.write(0, _chunks("first\n"))
    closer = threading.Timer(3, unsettled.close)
    closer.start()
    assert not unsettled.read(after=0, wait_s=10).closed  # no settle_s: at once, not at the close
    closer.cancel()


def test_replayed_into_a_console_it_shows_what_the_live_console_showed(capsys):
    """A line split across chunks is whole again, and ranks printing alike fold as live."""
    journal = Journal(ranks=8)
    live = Console("train", 8)
    for step in range(3):
        for rank in range(8):
            chunks = _chunks(f"step {step} lo", "ss 0.5\n", start=2 * step + 1)
            journal.write(rank, chunks, now=100.0 + step)
            live.write(rank, chunks, now=100.0 + step)
        live.tick(now=100.5 + step)
    live.flush()
    shown_live = capsys.readouterr().out
    replay = Console("train", 8)
    for entry in journal.read().entries:
        replay.write(entry.rank, [entry.chunk], now=entry.at)
        replay.tick(now=entry.at)
    replay.flush()
    assert capsys.readouterr().out == shown_live
    assert "[train r0-7] step 2 loss 0.5" in shown_live


def test_in_bulk_chunks_become_whole_prefixed_lines_without_ray_s_markers():
    from orchestrator.show.logs import Bulk
    from orchestrator_workers.protocol import RAY_MARKERS

    bulk = Bulk("train", "[{name} r{rank}]")
    marker = RAY_MARKERS[0].decode()
    assert bulk.lines(1, OutputChunk(1, "stdout", b"a line cut ")) == []
    assert bulk.lines(0, OutputChunk(1, "stdout", f"{marker} x\nzero\n".encode())) == [
        "[train r0] zero\n"
    ]
    assert bulk.lines(1, OutputChunk(2, "stdout", b"short\nbar 10%\rbar 90%\n10%\r20%")) == [
        "[train r1] a line cut short\n",
        "[train r1] bar 90%\n",  # what a terminal shows of a progress bar
    ]
    assert bulk.rest() == [("stdout", "[train r1] 20%\n")]


def _retained(journal: Journal, writes: list[tuple[int, bytes, float]]) -> int:
    """The bytes of memory `journal` holds after taking in `writes` (rank, data, at)."""
    tracemalloc.start()  # what is allocated from now on and still held at the end
    try:
        for seq, (rank, data, at) in enumerate(writes, start=1000):
            journal.write(rank, [OutputChunk(seq, "stdout", data)], now=at)
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_one_byte_writes_cost_the_supervisor_no_more_memory_than_the_bound():
    """Issue 55: progress dots a byte at a time cost about 330 bytes each, 20 times the
    bound. Written apart (an entry each, the worst case) the journal's memory stays near the
    bound; written quickly, they are kept as few entries."""
    bound = 16 << 10
    dots = [(0, b"." if i % 10 else b"\n", float(i)) for i in range(6_000)]
    apart = Journal(ranks=1, bound=bound)
    held = _retained(apart, dots)
    assert bound / 2 < held < 1.5 * bound, held  # ENTRY_BYTES is what an entry costs
    kept = apart.read()
    assert 50 < len(kept.entries) < bound // ENTRY_BYTES and kept.dropped[0] > 500
    quick = Journal(ranks=1, bound=bound)
    held = _retained(quick, [(0, data, 1000.0 + i * 1e-4) for i, (_, data, _) in enumerate(dots)])
    assert held < 1.5 * bound, held
    entries = quick.read().entries
    assert len(entries) < 30 and b"".join(e.chunk.data for e in entries) == b"".join(
        data for _, data, _ in dots
    )  # 0.6 s of output in 0.05 s entries: each came in whole


def test_readers_get_every_byte_not_dropped_whatever_was_merged():
    """Chunks merge into an entry only while no reader was given its position: a reader
    that keeps up gets every byte once, one that comes late a tail and how many lines it
    lost, one from `newest` at least the lines it asked for."""
    journal = Journal(ranks=2, bound=16 * ENTRY_BYTES)
    written: dict[int, list[bytes]] = {0: [], 1: []}
    live: dict[int, list[bytes]] = {0: [], 1: []}
    after, positions = 0, []
    for i in range(5_000):
        rank, data = i % 2, b"\n" if i % 7 == 0 else bytes([48 + i % 10])
        journal.write(rank, [OutputChunk(i + 1, "stdout", data)], now=100.0 + i * MERGE_S / 40)
        written[rank].append(data)
        if i % 37 == 0:  # a follower reads a page now and then
            page = journal.read(after)
            assert not page.dropped  # it keeps up: nothing it has not seen is dropped
            for entry in page.entries:
                live[entry.rank].append(entry.chunk.data)
                positions.append(entry.position)
            after = page.next
    page = journal.read(after)
    for entry in page.entries:
        live[entry.rank].append(entry.chunk.data)
        positions.append(entry.position)
    assert positions == sorted(set(positions))  # in order, each entry once
    late = journal.read()
    assert late.dropped  # the bound dropped the oldest
    for rank in (0, 1):
        everything = b"".join(written[rank])
        assert b"".join(live[rank]) == everything  # every byte, once, in order
        tail = b"".join(e.chunk.data for e in late.entries if e.rank == rank)
        assert everything.endswith(tail) and len(tail) > 100
        assert late.dropped[rank] == everything[: len(everything) - len(tail)].count(b"\n")
    newest = journal.read(journal.newest(5)).entries
    assert b"".join(e.chunk.data for e in newest).count(b"\n") >= 5
    assert len(late.entries) < 5_000 / 10  # merged: far fewer entries than chunks
