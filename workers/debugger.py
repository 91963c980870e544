"""pdb for one rank over a TCP socket, for whoever holds its one-time secret.

The rank listens on its node's IP and says how to attach in its own output, which only
the driver's user sees (the console, and log files readable by that user alone). A
client must send the secret (128 random bits) as its first line before one byte of pdb
is sent; any other connection is closed and changes nothing: the rank keeps waiting.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import os
import pdb
import secrets
import selectors
import socket
import sys
import time
from types import FrameType, TracebackType
from typing import Any

from orchestrator_workers import capture
from orchestrator_workers.states import State

TOKEN_VAR = "ORCHESTRATOR_DEBUG_TOKEN"  # noqa: S105 - a variable's name, not a secret
"""Where `orchestrator attach` reads the secret (not its argv: `ps` shows that to all)."""
ATTACH_HINT = f"{TOKEN_VAR}={{token}} python -m orchestrator attach {{host}}:{{port}}"
_HELLO_TIMEOUT_S = 10.0
"""How long a client may take to send its whole first line (the secret) before it is hung up on."""
_MAX_GREETING = 64
"""Connections greeting at once; past this the oldest is hung up on."""


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
        capture.tell_driver(State.WAITING)
        conn, already = _accept_with(self._listener, token)
        self._listener.close()  # one session per stop: the secret is spent
        capture.tell_driver(State.ATTACHED)
        self._conn = conn
        reader = io.BufferedReader(_Prefixed(already, conn))  # commands sent with the secret
        self._in = io.TextIOWrapper(reader, encoding="utf-8", errors="replace")
        self._file = conn.makefile("w", buffering=1, encoding="utf-8", errors="replace")
        super().__init__(stdin=self._in, stdout=self._file)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {rank}) "

    def close(self) -> None:
        """Hang up on the attached client."""
        for closable in (self._file, self._in, self._conn, self._listener):
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


def _accept_with(listener: socket.socket, token: str) -> tuple[socket.socket, bytes]:
    """The first connection whose first line is `token`, and what it sent after that line.

    Others are closed unanswered. Connections greet side by side, each with one deadline
    for its whole first line: one that trickles bytes cannot hold the port.
    """
    listener.setblocking(False)
    with _Greeter(listener, token.encode()) as greeter:
        while True:
            found = greeter.step()
            if found is not None:
                return found


class _Greeter:
    """The connections still sending their first line, each with its deadline."""

    def __init__(self, listener: socket.socket, wanted: bytes) -> None:
        self._listener = listener
        self._wanted = wanted
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._greeting: dict[socket.socket, tuple[float, bytes]] = {}

    def __enter__(self) -> _Greeter:
        return self

    def __exit__(self, *_: object) -> None:
        for conn in list(self._greeting):
            self._drop(conn)
        self._selector.close()

    def step(self) -> tuple[socket.socket, bytes] | None:
        """Wait for one event; the client with the secret and its further bytes, if it came."""
        now = time.monotonic()
        for conn in [c for c, (deadline, _) in self._greeting.items() if deadline <= now]:
            self._drop(conn)
        deadlines = [deadline for deadline, _ in self._greeting.values()]
        for key, _ in self._selector.select(max(min(deadlines, default=now + 60) - now, 0)):
            ready = key.fileobj
            if ready is self._listener:
                self._accept()
            elif isinstance(ready, socket.socket) and ready in self._greeting:
                found = self._read(ready)
                if found is not None:
                    return ready, found
        return None

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionAbortedError):
            conn, _ = self._listener.accept()
            conn.setblocking(False)
            self._greeting[conn] = (time.monotonic() + _HELLO_TIMEOUT_S, b"")
            self._selector.register(conn, selectors.EVENT_READ)
            if len(self._greeting) > _MAX_GREETING:
                self._drop(next(iter(self._greeting)))  # the oldest

    def _read(self, conn: socket.socket) -> bytes | None:
        """What `conn` sent after the secret's line once it has sent it; None until then."""
        try:
            chunk = conn.recv(256)
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        deadline, hello = self._greeting[conn]
        hello += chunk
        line, newline, rest = hello.partition(b"\n")
        if newline and hmac.compare_digest(line.strip(), self._wanted):
            self._greeting.pop(conn)
            self._selector.unregister(conn)
            conn.setblocking(True)
            return rest
        if not chunk or newline or len(hello) >= 256:
            self._drop(conn)
        else:
            self._greeting[conn] = (deadline, hello)
        return None

    def _drop(self, conn: socket.socket) -> None:
        self._greeting.pop(conn, None)
        self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()


class _Prefixed(io.RawIOBase):
    """A socket's input, starting with bytes already read from it."""

    def __init__(self, first: bytes, conn: socket.socket) -> None:
        self._first = first
        self._conn = conn

    def readable(self) -> bool:
        """It is read from."""
        return True

    def readinto(self, buffer: Any) -> int:
        """What is left of the first bytes, then what the socket has."""
        if self._first:
            size = min(len(buffer), len(self._first))
            buffer[:size] = self._first[:size]
            self._first = self._first[size:]
            return size
        return self._conn.recv_into(buffer)


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
