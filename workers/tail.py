"""Keeps a copy of a rank's latest output and, once the rank dies, saves it for the driver.

`Capture` starts `python -S -E -c RUN PATH OUT_FD ERR_FD TEE_FD LIFELINE_FD` in this file's folder
(`keeper_command`), RUN running this module as `-m tail` would.
While the rank lives, its capture thread copies every numbered chunk to TEE_FD and this process
keeps the newest ones; the rank holds the lifeline's other end. When the rank dies, this
process also takes what is still unread in the stdout/stderr pipes (OUT_FD, ERR_FD),
writes it all to PATH as JSON, keeps the file a while for the driver, and removes it.
"""

from __future__ import annotations

import collections
import importlib
import os
import select
import struct
import sys
import time

TYPE_CHECKING = False  # typing's import alone would double a keeper's start
if TYPE_CHECKING:  # what saving needs is imported once the rank died
    from collections.abc import Iterable
    from pathlib import Path
    from types import ModuleType

KEEP_S = 10.0
"""How long a dead rank's last output stays on disk for the driver to fetch."""
KEEP_BYTES = 1 << 20
"""How much of the newest output is kept."""
HEADER = struct.Struct(">QBI")
"""A copied chunk: seq, stream (0 stdout, 1 stderr), length; then the bytes."""
STREAMS = ("stdout", "stderr")


def tail_path(pid: int) -> Path:
    """Where the rank with process id `pid` leaves its last output when it dies."""
    return _private().folder() / f"tail-{pid}.json"


_RUN = "import runpy; runpy.run_module('tail', run_name='__main__', alter_sys=True)"
"""`-m tail`, but with the working folder on sys.path as '' (-c's), not as its name: an
import finds the folder the keeper started in, or nothing once it is removed, never one that
another user made under that name (a shipped rank side in a temp dir a cleaner empties)."""


def keeper_command(path: str, fds: tuple[int, int, int, int]) -> tuple[list[str], str]:
    """The command that starts a keeper, and the folder to start it in (this file's, first
    on its sys.path): Python without site or PYTHON* variables, importing only what
    waiting needs (what saving needs comes once the rank died), so that each rank's keeper
    starts in about 20 ms of CPU instead of 40-90."""
    argv = [sys.executable, "-S", "-E", "-c", _RUN, path, *map(str, fds)]
    return argv, os.path.dirname(os.path.abspath(__file__))


def _private() -> ModuleType:
    """orchestrator_workers.private; in a keeper (without site), the same file beside
    this one (its folder is first on sys.path)."""
    try:
        return importlib.import_module("orchestrator_workers.private")
    except ImportError:
        return importlib.import_module("private")


def frame(seq: int, stream: str, data: bytes) -> bytes:
    """One chunk as the capture thread copies it here."""
    return HEADER.pack(seq, STREAMS.index(stream), len(data)) + data


def read_tail(path: str, wait_s: float) -> list[tuple[int, str, str]] | None:
    """The saved chunks at `path` as (seq, stream, text), seq 0 for never-read bytes."""
    import json
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while True:
        try:  # from this user's own folder alone: never another's file, link or FIFO
            saved = json.loads(_private().read_private(Path(path)))
            return [(seq, stream, text) for seq, stream, text in saved]
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)


def main(path: str, out_fd: int, err_fd: int, tee_fd: int, lifeline: int) -> None:
    """Keep the newest chunks until the lifeline closes; then save them and the leftovers."""
    kept: collections.deque[tuple[int, str, bytes]] = collections.deque()
    size = 0
    buffer = b""
    open_fds = [tee_fd, lifeline]
    while lifeline in open_fds:
        ready, _, _ = select.select(open_fds, [], [])
        for fd in ready:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                open_fds.remove(fd)
            elif fd == tee_fd:
                buffer += data
        while len(buffer) >= HEADER.size:
            seq, stream, length = HEADER.unpack_from(buffer)
            if len(buffer) < HEADER.size + length:
                break
            chunk = buffer[HEADER.size : HEADER.size + length]
            buffer = buffer[HEADER.size + length :]
            kept.append((seq, STREAMS[stream], chunk))
            size += length
            while size > KEEP_BYTES and len(kept) > 1:
                size -= len(kept.popleft()[2])
    _save(path, kept, out_fd, err_fd)


def _save(path: str, kept: Iterable[tuple[int, str, bytes]], out_fd: int, err_fd: int) -> None:
    """The rank died: save `kept` and what its pipes still hold, for the driver, a while."""
    import contextlib
    import json
    from pathlib import Path

    saved = [[seq, stream, data.decode("utf-8", errors="replace")] for seq, stream, data in kept]
    for fd, stream in ((out_fd, "stdout"), (err_fd, "stderr")):
        os.set_blocking(fd, False)
        data = b""
        with contextlib.suppress(OSError):
            while block := os.read(fd, 1 << 16):
                data += block
        if data:
            saved.append([0, stream, data.decode("utf-8", errors="replace")])
    target = Path(path)
    _private().write(target, json.dumps(saved))
    _sweep(target.parent)
    time.sleep(KEEP_S)
    _private().remove(target)
    # The dead rank's torchelastic error file (see orchestrator_workers.elastic), read by now.
    pid = target.stem.removeprefix("tail-")
    _private().remove(target.parent / f"torchelastic-error-{pid}.json")


def _sweep(folder: Path) -> None:
    """Remove copies that keepers killed before their time (e.g. with their node) left."""
    old = time.time() - 6 * KEEP_S
    for stale in folder.glob("tail-*.json*"):
        try:
            if stale.lstat().st_mtime < old:
                stale.unlink()
        except OSError:
            pass
    for error_file in folder.glob("torchelastic-error-*.json"):  # of ranks gone without keeper
        pid = error_file.name.removeprefix("torchelastic-error-").removesuffix(".json")
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            error_file.unlink(missing_ok=True)
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    main(sys.argv[1], *(int(fd) for fd in sys.argv[2:6]))
