"""File-descriptor-level capture of a rank's stdout and stderr, drained by the driver."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

from orchestrator_workers.private import UnsafeFolderError
from orchestrator_workers.protocol import EXIT_STREAM, RAY_MARKERS, STATE_STREAM, OutputChunk
from orchestrator_workers.tail import STREAMS, frame, keeper_command, tail_path

_READ = 1 << 16
_SWEEP_LIMIT = 1 << 20  # bytes per pipe per sweep, so a flood cannot starve the other
_BUFFER_LIMIT = 64 << 20  # undrained bytes kept; older ones are dropped with a notice
_EXIT_GRACE_S = 1.0  # how long os._exit waits for the driver to take the last output
_SYNC_LIMIT_S = 5.0  # how long sync reads a pipe that is never dry
_GATHER_BYTES = 1 << 20  # a drain gathering output returns once this much waits


_active: Capture | None = None


def tell_driver(state: str) -> None:
    """Say, after the output so far, what this rank waits on beyond its work; '' when done."""
    if _active is not None:
        _active.sync()
        _active._append(STATE_STREAM, state.encode())


_fork = threading.local()
"""Per forking thread: whether SIGTERM was blocked in it before the fork (see _hold_sigterm)."""


def _hold_sigterm() -> None:
    """Before a fork: block SIGTERM in the forking thread, so that the child holds one sent
    to it before it has dropped Ray's handler, instead of losing it.

    Until its at-fork hook runs, a child has the rank's Python-level SIGTERM handler, which
    a forked child never runs: a SIGTERM that comes then (a pool terminated at once, as
    `with Pool() as p: p.map(...)` does when map raises) was swallowed, and the child lived
    on while its parent waited for it. The rank's other threads still take SIGTERMs sent to
    the rank meanwhile.
    """
    try:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    except (OSError, ValueError):
        return
    _fork.was_blocked = signal.SIGTERM in held


def _release_sigterm(unknown_blocked: bool = True) -> None:
    """After a fork, in parent and child: unblock SIGTERM again unless it was blocked before
    (`unknown_blocked`: whether to assume so when `_hold_sigterm` did not say)."""
    if getattr(_fork, "was_blocked", unknown_blocked):
        return
    _fork.was_blocked = True
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class Capture:
    """Replaces fds 1 and 2 with pipes; a thread turns what arrives into numbered chunks.

    Everything written to the fds is caught: print, logging, C libraries (gloo, NCCL)
    and child processes alike.
    """

    def __init__(self) -> None:
        """Redirect fds 1 and 2 now and start the reading thread."""
        global _active  # noqa: PLW0603 - one capture per rank process
        _active = self
        self._cond = threading.Condition()
        self._chunks: list[OutputChunk] = []
        self._buffered = 0
        self._seq = 0
        self._reading = threading.Lock()  # one reader of the pipes at a time: seqs in order
        self._syncs = 0  # how many syncs there were: a drain gathering output stops at one
        self._gathering = 0  # drains gathering now: a sync wakes no thread but theirs
        self._synced_seq = 0  # the last chunk's seq at the last sync: all before it is in
        self._pipes: dict[int, str] = {}
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.dup2(write_end, fd)
            os.close(write_end)
            self._pipes[read_end] = stream
        self._tee = self._lifeline = -1
        sys.stdout, sys.stderr = _line_buffered(sys.stdout), _line_buffered(sys.stderr)
        threading.Thread(target=self._pump, name="output-capture", daemon=True).start()
        self._hook_exit()
        self._keep_leftovers()
        faulthandler.enable(all_threads=True)  # a segfault's Python stack goes to stderr

    def _keep_leftovers(self) -> None:
        """Start the process that saves what this rank wrote but nobody read, if it dies."""
        lifeline, self._lifeline = os.pipe()
        tee, self._tee = os.pipe()
        os.set_blocking(self._tee, False)  # the copy is best effort: never block the rank
        out_fd, err_fd = self._pipes
        self.tail = ""
        """Where the keeper leaves this rank's last output if it dies; '' without a keeper."""
        self._keeper: subprocess.Popen[bytes] | None = None
        try:
            path = str(tail_path(os.getpid()))  # refused where the folder is not ours
            argv, folder = keeper_command(path, (out_fd, err_fd, tee, lifeline))
            self._keeper = subprocess.Popen(
                argv,
                cwd=folder,
                pass_fds=(out_fd, err_fd, tee, lifeline),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.tail = path
        except OSError as exc:  # without it, a crash loses its last few lines
            self._keeper = None
            os.close(self._tee)
            self._tee = -1
            if isinstance(exc, UnsafeFolderError):
                print(
                    f"[orchestrator] a crash's last lines will not be kept: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
        os.close(lifeline)
        os.close(tee)

    def _hook_exit(self) -> None:
        """Make os._exit hand the last lines to the driver first: they explain the exit.

        Only in the rank's own process: a forked child (a data loader worker, a
        multiprocessing.Process) inherits the hook but not the thread it waits for.
        """
        real_exit = os._exit
        owner = os.getpid()

        def _exit(status: int) -> NoReturn:
            if os.getpid() == owner:
                with contextlib.suppress(Exception):
                    self.sync()
                    self._append(EXIT_STREAM, str(status).encode())
                    deadline = time.monotonic() + _EXIT_GRACE_S
                    with self._cond:
                        self._cond.wait_for(lambda: not self._chunks, timeout=_EXIT_GRACE_S)
                    # The driver's request has taken the chunks; let its reply leave.
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            real_exit(status)

        os._exit = _exit
        os.register_at_fork(
            before=_hold_sigterm,
            after_in_parent=_release_sigterm,
            after_in_child=self._after_fork_in_child,
        )

    def _after_fork_in_child(self) -> None:
        """A forked child writes to fds 1 and 2 like its rank, and inherits nothing else of ours.

        It keeps no end of the capture's private pipes (the keeper's lifeline among
        them: the keeper must learn of the rank's death when the rank dies, not when
        its last data loader worker does), and SIGTERM kills it as it would kill a
        child of a torchrun worker, instead of running Ray's handler for the actor.
        """
        for fd in (*self._pipes, self._tee, self._lifeline):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _release_sigterm(unknown_blocked=False)  # a SIGTERM that came meanwhile kills it now

    def drain(self, timeout: float, gather: float = 0.0) -> list[OutputChunk]:
        """Chunks not yet drained, waiting up to `timeout` s for the first one.

        Then up to `gather` s more while more come, so that a rank printing a line per
        step costs the driver a request per `gather`, not per line; a sync (the call's
        end, a debugger's notice), an exit or `_GATHER_BYTES` waiting end it at once.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._chunks, timeout)
            # Gather only output that came since the last sync (a sync that came first, as
            # this drain woke, would otherwise leave it waiting its whole `gather`).
            if self._chunks and gather > 0 and self._chunks[-1].seq > self._synced_seq:
                synced = self._syncs
                self._gathering += 1
                try:
                    self._cond.wait_for(
                        lambda: self._syncs != synced or self._buffered >= _GATHER_BYTES, gather
                    )
                finally:
                    self._gathering -= 1
            chunks, self._chunks, self._buffered = self._chunks, [], 0
            self._cond.notify_all()  # os._exit may be waiting for this
        return chunks

    def sync(self) -> int:
        """Flush Python's buffers, read the pipes dry; the last chunk's seq.

        In the calling thread (a handoff to the reading thread can take milliseconds on
        a busy node); a writer that never stops (a child flooding) gets 5 s.
        """
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        deadline = time.monotonic() + _SYNC_LIMIT_S
        with self._reading:
            while not self._sweep_all() and time.monotonic() < deadline:
                pass
        with self._cond:
            self._syncs += 1
            self._synced_seq = self._seq
            if self._gathering:  # it returns what it has; a drain waiting for a first
                self._cond.notify_all()  # chunk is not woken for nothing (a GIL handoff)
            return self._seq

    def _pump(self) -> None:
        watched = list(self._pipes)
        while True:
            select.select(watched, [], [])
            with self._reading:
                self._sweep_all()

    def _sweep_all(self) -> bool:
        """Read what both pipes hold now (the caller holds `_reading`); True if dry."""
        return all([self._sweep(fd, stream) for fd, stream in self._pipes.items()])

    def _sweep(self, fd: int, stream: str) -> bool:
        """Read what `fd` holds now; True if it ran dry."""
        taken = 0
        while taken < _SWEEP_LIMIT:
            try:
                data = os.read(fd, _READ)
            except BlockingIOError:
                return True
            if not data:
                return True
            taken += len(data)
            if not _only_ray_markers(data):  # Ray's per-task markers must not wake the driver
                self._append(stream, data)
        return False

    def _append(self, stream: str, data: bytes) -> None:
        with self._cond:
            self._seq += 1
            if stream not in STREAMS:  # an exit status or a state: no gathering after it
                self._syncs += 1
                self._synced_seq = self._seq
            self._chunks.append(OutputChunk(self._seq, stream, data))
            if self._tee >= 0 and stream in STREAMS:
                with contextlib.suppress(OSError):  # full: the keeper lags, skip the copy
                    os.write(self._tee, frame(self._seq, stream, data))
            self._buffered += len(data)
            while self._buffered > _BUFFER_LIMIT and len(self._chunks) > 1:
                dropped = self._chunks.pop(0)
                self._buffered -= len(dropped.data)
                notice = f"[{len(dropped.data)} bytes of output dropped: not drained]\n"
                self._chunks[0] = OutputChunk(
                    self._chunks[0].seq,
                    self._chunks[0].stream,
                    notice.encode() + self._chunks[0].data,
                )
            self._cond.notify_all()


def _line_buffered(console: Any) -> Any:
    """`console`, writing each line in one piece as a terminal would (a print's line at
    once, a partial line at a flush).

    Ray's workers wrap it in a writer that flushes after every write: a print's text and
    its newline reached the pipe as two writes, the reading thread woke between them, and
    a rank killed right after a print lost the line's text (read, not yet copied to its
    keeper), its newline alone shown as its last words.
    """
    if type(console).__name__ == "Unbuffered" and hasattr(console, "stream"):
        console = console.stream  # ray._private.utils.Unbuffered
    reconfigure = getattr(console, "reconfigure", None)  # a TextIOWrapper's, or alike
    if callable(reconfigure):
        with contextlib.suppress(ValueError):
            reconfigure(line_buffering=True, write_through=False)
    return console


def _only_ray_markers(data: bytes) -> bool:
    lines = [line for line in data.split(b"\n") if line]
    return bool(lines) and all(line.startswith(RAY_MARKERS) for line in lines)
