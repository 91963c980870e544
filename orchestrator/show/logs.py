"""Driver side of rank output: line assembly, progress bars, prefixes, console, log files."""

from __future__ import annotations

import codecs
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from orchestrator.logfiles import log_name, make_call_folder, open_log
from orchestrator.options import DEFAULT_PREFIX
from orchestrator.show import messages
from orchestrator.show.fold import Folded, Folder, fold_by_default
from orchestrator.show.text import rank_label
from orchestrator_workers.protocol import RAY_MARKERS, OutputChunk

PARTIAL_DELAY_S = 0.2
"""A line without its newline yet is shown after this long (a prompt, a progress bar)."""
PROGRESS_INTERVAL_S = 1.0
"""A progress bar redrawn with carriage returns is shown at most this often."""

SHOWN_KEPT = 2000
"""The newest shown lines a console keeps for a page to read (see `Console.shown`)."""

_COLOURS = (36, 32, 33, 35, 34, 91, 92, 93, 94, 95, 96)
_RAY_MARKERS = tuple(marker.decode() for marker in RAY_MARKERS)


class Journaling(Protocol):
    """Where a console also records every chunk it takes in (supervise.journal.Journal)."""

    def write(self, rank: int, chunks: Iterable[OutputChunk]) -> None:
        """Record `rank`'s `chunks`, taken in now."""


@dataclass
class _Stream:
    """One rank's stdout or stderr: bytes in, whole lines out."""

    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    pending: str = ""
    """Text after the last newline, cut to its last carriage-return segment."""
    due: float | None = None
    """When `pending` is to be shown even without its newline."""
    shown: str = ""
    """The pending text last shown, so an unchanged bar is not shown twice."""


class Console:
    """Writes each rank's lines to the driver's stdout/stderr with a prefix, and to files."""

    def __init__(
        self,
        name: str,
        num_ranks: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        show: Collection[int] | None = None,
        log_dir: Path | None = None,
        sink: Callable[[str, str], None] | None = None,
        fold: bool | None = None,
        journal: Journaling | None = None,
    ) -> None:
        """`show`: ranks whose lines go to the console (all when None); files get all.

        `log_dir`: where rank-N.log files go (made on first use); `sink(stream, text)`:
        where shown lines go instead of stdout/stderr (a notebook cell). `fold`: show
        lines many ranks write alike once (orchestrator.fold); None: by how many are shown.
        `journal`: also records every chunk as it comes (a detached job's supervisor).
        """
        self.name = name
        self.journal = journal
        self.prefix = prefix
        self.show = None if show is None else frozenset(show)
        self.num_ranks = num_ranks
        self.last_lines = [""] * num_ranks
        """Per rank, the last line it wrote (shown or not)."""
        self.last_output = time.monotonic()
        """When a rank last wrote anything (time.monotonic())."""
        self.last_times = [self.last_output] * num_ranks
        """Per rank, when it last wrote anything (from the call's start)."""
        self._streams: dict[tuple[int, str], _Stream] = {}
        self._files: dict[int, TextIO] = {}
        self._prefixes: dict[tuple[tuple[int, ...], bool], str] = {}
        self.sink = sink
        self.log_dir = log_dir
        shown = range(num_ranks) if show is None else sorted(set(show) & set(range(num_ranks)))
        folding = fold_by_default(len(shown)) if fold is None else fold
        self.folder = Folder(shown) if folding else None
        """Folds the shown lines before they are written; None: each line as it comes."""
        self.shown: deque[tuple[int, str, str]] = deque(maxlen=SHOWN_KEPT)
        """The newest lines shown, folded as shown, each (its number, stream, line with its
        prefix, uncoloured): what a page reads of the live output."""
        self.shown_count = 0

    def close_logs(self) -> None:
        """Show the folded lines still pending, then flush and close the log files."""
        if self.folder is not None:
            self._show(self.folder.flush())
        for file in self._files.values():
            file.close()
        self._files = {}

    def write(self, rank: int, chunks: Iterable[OutputChunk], now: float | None = None) -> None:
        """Take in `chunks`: complete lines are shown at once, a partial line later."""
        now = time.monotonic() if now is None else now
        if self.journal is not None:
            chunks = list(chunks)
            self.journal.write(rank, chunks)
        for chunk in chunks:
            if chunk.data:  # a progress bar's \r counts too
                self.last_output = self.last_times[rank] = now
            key = (rank, chunk.stream)
            state = self._streams.setdefault(key, _Stream())
            text = state.pending + state.decoder.decode(chunk.data)
            *lines, rest = text.split("\n")
            if lines:
                rendered = [line for line in map(_rendered, lines) if not _ray_marker(line)]
                self._log(rank, rendered)
                if rendered and state.shown and rendered[0].startswith(state.shown):
                    # Its start was shown already (a line cut short): show only the rest.
                    rendered[0] = rendered[0][len(state.shown) :]
                    rendered = rendered if rendered[0] else rendered[1:]
                self._emit(rank, chunk.stream, rendered, now)
                state.shown = ""
                state.due = None
            state.pending = rest[rest.rfind("\r", 0, len(rest.rstrip("\r"))) + 1 :]
            if state.pending and state.due is None:
                state.due = now + PARTIAL_DELAY_S

    def tick(self, now: float | None = None) -> float | None:
        """Show partial lines and folds that are due; return when the next one will be."""
        now = time.monotonic() if now is None else now
        upcoming = None
        for (rank, stream), state in sorted(self._streams.items()):
            if state.due is None:
                continue
            if state.due <= now:
                text = _partial(state.pending)
                if text and text != state.shown:
                    self._emit(rank, stream, [text], now)
                    state.shown = text
                state.due = now + PROGRESS_INTERVAL_S
            upcoming = state.due if upcoming is None else min(upcoming, state.due)
        if self.folder is not None:
            self._show(self.folder.tick(now))
            due = self.folder.due
            upcoming = due if upcoming is None or due is None else min(upcoming, due)
        return upcoming

    def flush(self) -> None:
        """Show every partial line and fold not yet shown (the end of a call); flush the files."""
        now = time.monotonic()
        for (rank, stream), state in sorted(self._streams.items()):
            text = _partial(state.pending)
            if text:
                self._log(rank, [text])
            if text and text != state.shown:
                self._emit(rank, stream, [text], now)
            state.pending, state.shown, state.due = "", "", None
        if self.folder is not None:
            self._show(self.folder.flush())
        for file in self._files.values():
            file.flush()

    def mark_files(self, line: str) -> None:
        """Write `line` into every rank's log file (e.g. where a restarted attempt begins)."""
        if self.log_dir is None:
            return
        for rank in range(self.num_ranks):
            self._file(rank).write(f"{line}\n")

    def flush_files(self) -> None:
        """Flush the log files (so a reader sees every complete line so far)."""
        for file in list(self._files.values()):
            file.flush()

    def _prefix(self, ranks: tuple[int, ...], colour: bool) -> str:
        """The prefix of a line from `ranks`, with the space after it ("" for none)."""
        cached = self._prefixes.get((ranks, colour))
        if cached is not None:
            return cached
        rank = ranks[0] if len(ranks) == 1 else _RankList(rank_label(ranks))
        prefix = self.prefix.format(name=self.name, rank=rank)
        if prefix and colour:
            prefix = f"\x1b[{_COLOURS[ranks[0] % len(_COLOURS)]}m{prefix}\x1b[0m"
        prefix = f"{prefix} " if prefix else ""
        if len(ranks) == 1:  # a fold's rank sets are too many to keep
            self._prefixes[(ranks, colour)] = prefix
        return prefix

    def _file(self, rank: int) -> TextIO:
        if rank not in self._files:
            assert self.log_dir is not None
            if not self._files:  # the first file of this attempt: its folder first
                make_call_folder(self.log_dir)
            fd = open_log(self.log_dir / log_name(rank))
            self._files[rank] = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - closed by close_logs
        return self._files[rank]

    def _log(self, rank: int, lines: list[str]) -> None:
        """Write `rank`'s whole `lines` into its log file (a line cut short goes in whole,
        once, when it ends)."""
        if self.log_dir is not None and lines:
            self._file(rank).write("".join(f"{line}\n" for line in lines))

    def _emit(self, rank: int, stream: str, lines: list[str], now: float) -> None:
        """Show `rank`'s `lines` at once, or hand them to the folder."""
        if not lines:
            return
        self.last_lines[rank] = lines[-1]
        self.last_times[rank] = now
        if self.show is not None and rank not in self.show:
            return
        if self.folder is None:
            self._show([Folded((rank,), stream, line) for line in lines])
            return
        shown: list[Folded] = []
        for line in lines:
            shown += self.folder.add(rank, stream, line, now)
        self._show(shown)

    def _show(self, lines: list[Folded]) -> None:
        """Write `lines` with their ranks' prefix, a run of one stream at a time."""
        start = 0
        for end in range(1, len(lines) + 1):
            if end == len(lines) or lines[end].stream != lines[start].stream:
                self._write(lines[start].stream, lines[start:end])
                start = end

    def _write(self, stream: str, lines: list[Folded]) -> None:
        out: TextIO = sys.stdout if stream == "stdout" else sys.stderr
        colour = self.sink is None and _is_tty(out)
        text = "".join(f"{self._prefix(line.ranks, colour)}{line.text}\n" for line in lines)
        for line in lines:
            self.shown_count += 1
            self.shown.append(
                (self.shown_count, stream, f"{self._prefix(line.ranks, False)}{line.text}")
            )
        if self.sink is not None:
            self.sink(stream, text)
            return
        messages.clear_in_place()  # a status line, if one is drawn
        out.write(text)
        out.flush()


class _RankList(str):
    """Ranks as "0-63,65-127" in a prefix; a number's format ({rank:03d}) leaves it as is."""

    __slots__ = ()

    def __format__(self, spec: str) -> str:
        """`spec` applied where it applies to text."""
        try:
            return format(str(self), spec)
        except ValueError:
            return str(self)


class Bulk:
    """Each rank's chunks made whole lines with their prefixes, without folding or timing:
    `orchestrator logs` prints everything kept at once (a pipe takes 100,000 lines in
    well under a second)."""

    def __init__(self, name: str, prefix: str) -> None:
        """Lines of job `name`, prefixed as `prefix` (with {name} and {rank}) says."""
        self.name = name
        self.prefix = prefix
        self._prefixes: dict[int, str] = {}
        self._pending: dict[tuple[int, str], str] = {}

    def lines(self, rank: int, chunk: OutputChunk) -> list[str]:
        """The whole lines `chunk` completes, each prefixed and ending in a newline."""
        key = (rank, chunk.stream)
        text = self._pending.pop(key, "") + chunk.data.decode(errors="replace")
        *whole, rest = text.split("\n")
        if rest:
            self._pending[key] = rest
        prefix = self._prefix(rank)
        return [f"{prefix}{line}\n" for line in map(_rendered, whole) if not _ray_marker(line)]

    def rest(self) -> list[tuple[str, str]]:
        """(stream, line) for each line never ended, in rank order."""
        found = []
        for (rank, stream), text in sorted(self._pending.items()):
            line = _partial(text)
            if line:
                found.append((stream, f"{self._prefix(rank)}{line}\n"))
        self._pending.clear()
        return found

    def _prefix(self, rank: int) -> str:
        cached = self._prefixes.get(rank)
        if cached is None:
            cached = self.prefix.format(name=self.name, rank=rank)
            cached = self._prefixes[rank] = f"{cached} " if cached else ""
        return cached


def _ray_marker(line: str) -> bool:
    """Whether `line` is one of Ray's own markers (kept out of the console and the files)."""
    return line.startswith(_RAY_MARKERS)


def _partial(pending: str) -> str:
    """What is shown of a line not ended yet ("" for none, or for one of Ray's markers)."""
    text = _rendered(pending)
    return "" if _ray_marker(text) else text


def _rendered(line: str) -> str:
    """What a terminal would show for `line`: its last carriage-return segment."""
    line = line.rstrip("\r")
    return line[line.rfind("\r") + 1 :]


def _is_tty(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
