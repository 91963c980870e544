"""Driver side of rank output: prefixes, line assembly, the console."""

from __future__ import annotations

import codecs
import sys
from collections.abc import Iterable
from typing import TextIO

from workers.protocol import OutputChunk

_COLOURS = (36, 32, 33, 35, 34, 91, 92, 93, 94, 95, 96)
# Markers Ray's worker writes to its own stdout/stderr for its log files.
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")


class Console:
    """Writes each rank's output to the driver's stdout/stderr, one prefixed line at a time."""

    def __init__(self, name: str, num_ranks: int) -> None:
        """`name` is the job name shown in every prefix."""
        self.name = name
        self._partial: dict[tuple[int, str], str] = {}
        self._decoders: dict[tuple[int, str], codecs.IncrementalDecoder] = {}
        self.printed = [0] * num_ranks
        """Per rank, the seq of the last chunk written out."""

    def write(self, rank: int, chunks: Iterable[OutputChunk]) -> None:
        """Show complete lines of `chunks` now; keep a trailing partial line for later."""
        for chunk in chunks:
            key = (rank, chunk.stream)
            decoder = self._decoders.setdefault(key, _decoder())
            text = self._partial.pop(key, "") + decoder.decode(chunk.data)
            *lines, rest = text.split("\n")
            if lines:
                self._emit(rank, chunk.stream, lines)
            if rest:
                self._partial[key] = rest
            self.printed[rank] = max(self.printed[rank], chunk.seq)

    def flush(self) -> None:
        """Write out every partial line (the end of a call)."""
        for (rank, stream), rest in sorted(self._partial.items()):
            self._emit(rank, stream, [rest])
        self._partial.clear()

    def _emit(self, rank: int, stream: str, lines: list[str]) -> None:
        lines = [line for line in lines if not line.startswith(_RAY_MARKERS)]
        if not lines:
            return
        out: TextIO = sys.stdout if stream == "stdout" else sys.stderr
        prefix = f"[{self.name} r{rank}]"
        if _is_tty(out):
            prefix = f"\x1b[{_COLOURS[rank % len(_COLOURS)]}m{prefix}\x1b[0m"
        out.write("".join(f"{prefix} {line.rstrip(chr(13))}\n" for line in lines))
        out.flush()


def _decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
