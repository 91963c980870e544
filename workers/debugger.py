"""pdb for one rank over a TCP socket, reachable from the driver's machine."""

from __future__ import annotations

import contextlib
import os
import pdb
import socket
import sys
from types import FrameType, TracebackType

ATTACH_HINT = "python -m orchestrator attach {host}:{port}"


class RemotePdb(pdb.Pdb):
    """A pdb session served on `host`, port chosen by the OS; blocks until someone attaches."""

    def __init__(self, host: str) -> None:
        """Listen now and tell the driver (through this rank's output) how to attach."""
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        rank = os.environ.get("RANK", "?")
        print(
            f"rank {rank} is waiting for a debugger: {ATTACH_HINT.format(host=host, port=port)}"
            f"  (or: nc {host} {port})",
            file=sys.__stderr__,
            flush=True,
        )
        conn, _ = self._listener.accept()
        self._conn = conn
        self._file = conn.makefile("rw", buffering=1, encoding="utf-8", errors="replace")
        super().__init__(stdin=self._file, stdout=self._file)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {rank}) "

    def close(self) -> None:
        """Hang up on the attached client."""
        for closable in (self._file, self._conn, self._listener):
            with contextlib.suppress(OSError):
                closable.close()

    def do_continue(self, arg: str) -> bool | None:
        """Continue, and hang up once no breakpoint is left."""
        result = super().do_continue(arg)
        if not self.breaks:
            self.close()
        return result

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        """Quit: the rank raises BdbQuit, which fails the call."""
        result = super().do_quit(arg)
        self.close()
        return result

    do_q = do_exit = do_quit


def _host() -> str:
    return os.environ.get("ORCHESTRATOR_NODE_IP", "127.0.0.1")


def set_trace(*_: object, **__: object) -> None:
    """The rank's `breakpoint()`: stop in the caller's frame and wait for an attach."""
    frame: FrameType | None = sys._getframe().f_back
    RemotePdb(_host()).set_trace(frame)


def post_mortem(tb: TracebackType) -> None:
    """Open the frame where the exception was raised, for an attached debugger."""
    debugger = RemotePdb(_host())
    try:
        debugger.reset()
        debugger.interaction(None, tb)
    finally:
        debugger.close()
