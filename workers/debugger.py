"""pdb for one rank over a TCP socket, for whoever holds its one-time secret.

The rank listens on its node's IP and says how to attach in its own output, which only
the driver's user sees (the console, and log files readable by that user alone). A
client must send the secret (128 random bits) as its first line before one byte of pdb
is sent; any other connection is closed and changes nothing: the rank keeps waiting.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import pdb
import secrets
import socket
import sys
from types import FrameType, TracebackType

from orchestrator_workers import capture

TOKEN_VAR = "ORCHESTRATOR_DEBUG_TOKEN"  # noqa: S105 - a variable's name, not a secret
"""Where `orchestrator attach` reads the secret (not its argv: `ps` shows that to all)."""
ATTACH_HINT = f"{TOKEN_VAR}={{token}} python -m orchestrator attach {{host}}:{{port}}"
WAITING, ATTACHED = "waiting for a debugger", "in a debugger"
"""A rank's states while it stops at a breakpoint (job.status() shows them)."""
_HELLO_TIMEOUT_S = 10.0
"""How long a client may take to send the secret before it is hung up on."""


class RemotePdb(pdb.Pdb):
    """A pdb session served on `host`, port chosen by the OS; blocks until someone attaches."""

    def __init__(self, host: str) -> None:
        """Listen now, tell the driver (through this rank's output) how to attach, and wait."""
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        token = secrets.token_hex(16)
        rank = os.environ.get("RANK", "?")
        hint = ATTACH_HINT.format(token=token, host=host, port=port)
        print(
            f"rank {rank} is waiting for a debugger: {hint}"
            f"  (or: (echo {token}; cat) | nc {host} {port})",
            file=sys.__stderr__,
            flush=True,
        )
        capture.tell_driver(WAITING)
        conn = _accept_with(self._listener, token)
        self._listener.close()  # one session per stop: the secret is spent
        capture.tell_driver(ATTACHED)
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
        capture.tell_driver("")

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


def _accept_with(listener: socket.socket, token: str) -> socket.socket:
    """The first connection whose first line is `token`; others are closed unanswered."""
    wanted = token.encode()
    while True:
        conn, _ = listener.accept()
        conn.settimeout(_HELLO_TIMEOUT_S)
        hello = b""
        with contextlib.suppress(OSError):  # a timeout or a reset: not our client
            while b"\n" not in hello and len(hello) < 256:
                chunk = conn.recv(256)
                if not chunk:
                    break
                hello += chunk
        given = hello.split(b"\n", 1)[0].strip()
        if hmac.compare_digest(given, wanted):
            conn.settimeout(None)
            return conn
        with contextlib.suppress(OSError):
            conn.close()


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
