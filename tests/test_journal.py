"""A job's output journal: chunks kept with their arrival times, bounded per rank, read in
pages from any position, and shown by a reader's Console as the live console shows them."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.show.logs import Console
from orchestrator.supervise.journal import Journal
from orchestrator_workers.protocol import OutputChunk


def _chunks(*texts: str, start: int = 1) -> list[OutputChunk]:
    return [OutputChunk(start + i, "stdout", text.encode()) for i, text in enumerate(texts)]


def test_pages_come_in_arrival_order_across_ranks_from_any_position():
    journal = Journal(ranks=2)
    journal.write(0, _chunks("a0\n"), now=1.0)
    journal.write(1, _chunks("b0\n", "b1\n"), now=2.0)
    journal.write(0, _chunks("a1\n", start=2), now=3.0)
    page = journal.read()
    assert [(e.rank, e.chunk.data, e.at) for e in page.entries] == [
        (0, b"a0\n", 1.0), (1, b"b0\n", 2.0), (1, b"b1\n", 2.0), (0, b"a1\n", 3.0)
    ]  # fmt: skip
    assert page.next == journal.position == 4 and not page.dropped
    later = journal.read(after=2, limit=1)
    assert [e.chunk.data for e in later.entries] == [b"b1\n"] and later.next == 3
    assert journal.read(after=4).entries == () and journal.read(after=4).next == 4


def test_past_the_bound_a_rank_s_oldest_output_goes_and_readers_are_told_how_much():
    journal = Journal(ranks=2, bound=10)
    journal.write(1, _chunks("kept\n"))
    journal.write(0, _chunks("line 1\n", "line 2\nline 3\n", "line 4\n"))
    page = journal.read()
    assert [e.chunk.data for e in page.entries if e.rank == 0] == [b"line 4\n"]
    assert [e.chunk.data for e in page.entries if e.rank == 1] == [b"kept\n"]  # its own bound
    assert page.dropped == {0: 3}  # lines 1 to 3
    assert journal.read(after=page.next).dropped == {}  # nothing dropped after what it read
    journal.write(0, _chunks("a line longer than the bound\n", start=4))  # the newest stays
    assert [e.chunk.data for e in journal.read(after=page.next).entries] == [
        b"a line longer than the bound\n"
    ]
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
    journal.write(0, _chunks("a\n", "b\n"))
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
    threading.Timer(0.05, journal.write, (0, _chunks("last\n"))).start()
    threading.Timer(0.15, journal.close).start()
    page = journal.read(after=0, wait_s=10, settle_s=5)
    assert [e.chunk.data for e in page.entries] == [b"last\n"] and page.closed
    going_on = Journal(ranks=1)
    going_on.write(0, _chunks("first\n"))
    started = time.monotonic()
    page = going_on.read(after=0, wait_s=10, settle_s=0.2)
    assert [e.chunk.data for e in page.entries] == [b"first\n"] and not page.closed
    assert 0.15 < time.monotonic() - started < 5
    unsettled = Journal(ranks=1)
    unsettled.write(0, _chunks("first\n"))
    started = time.monotonic()
    assert not unsettled.read(after=0, wait_s=10).closed  # no settle_s: at once
    assert time.monotonic() - started < 0.15


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
