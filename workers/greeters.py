"""Listeners that serve a connection only once it has proven itself, and that a flood of
connections cannot shut: the snapshot keeper's (see buddies) and each rank's door (see
handoff).

One thread per listener accepts and greets: it reads each new connection's greeting as its
bytes come, with no thread of its own, and hangs up on one that has not finished within
one deadline for the whole greeting (trickling bytes buys nothing). At most `limit`
connections greet at once, and `per_source` from one source (an IP address; on a Unix
socket, a process); past either, the one that got least far in its greeting is hung up on,
the oldest of those first. So a flood of silent or trickling connections costs one thread
and `limit` descriptors, and never keeps out the rightful peer, which sends its part of the
greeting at once and so outlasts them. A proven connection is served in a thread of its own
and no longer counts. Running out of descriptors or memory is waited out, BACKOFF_S at a
time (a proven connection that gets no thread is closed, and accepting waits as well): the
listener stays open, and accepts again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field
from typing import Any

from orchestrator_workers.sockets import credentials

Greeting = Generator[int, bytes, object]
"""A connection's greeting: yields how many bytes it wants next and is sent them (it may
write a short answer in between); returns what the proven connection is served with, or
None to hang up."""
Serve = Callable[[socket.socket, object], None]
"""Serves a proven connection (blocking again) with what its greeting returned."""

LIMIT = 64
"""Connections greeting one listener at once, at most."""
PER_SOURCE = 16
"""Connections from one source greeting one listener at once, at most."""
BACKLOG = socket.SOMAXCONN
"""The listen backlog: a burst waits in the kernel's queue rather than being refused."""
BACKOFF_S = 0.05
"""How long accepting pauses when descriptors, memory or threads ran out."""
_BURST = 16
"""Connections accepted in a row before the greeters' bytes are read again."""
_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
"""What `accept` says once the listener itself was closed."""


@dataclass(eq=False)
class _Greeter:
    """One connection that has not proven itself yet."""

    conn: socket.socket
    source: Hashable
    deadline: float
    greeting: Greeting
    want: int = 0
    got: bytearray = field(default_factory=bytearray)
    steps: int = 0
    """How many of its greeting's reads it has finished: how far it got."""


class Greeters:
    """A listener's accepting thread, and the connections greeting it."""

    def __init__(
        self,
        listener: socket.socket,
        greet: Callable[[socket.socket], Greeting],
        serve: Serve,
        *,
        wait_s: Callable[[], float],
        name: str,
        link_name: str = "",
    ) -> None:
        """Accept on `listener` (listening) in a thread named `name`; greet each connection
        with `greet`, within `wait_s()` seconds of its accept; `serve` the proven ones, each
        in a thread named `link_name` (default: NAME-link)."""
        self.limit = LIMIT
        """Connections greeting at once, at most (tests may lower it)."""
        self.per_source = PER_SOURCE
        """Connections from one source greeting at once, at most (tests may lower it)."""
        self._listener = listener
        self._greet, self._serve, self._wait_s = greet, serve, wait_s
        self._link_name = link_name or f"{name}-link"
        self._by_process = listener.family == socket.AF_UNIX
        self._greeting: dict[socket.socket, _Greeter] = {}
        """Oldest first."""
        self._selector = selectors.DefaultSelector()
        self._wake, self._woken = socket.socketpair()
        self._wake.setblocking(False)
        self._closed = False
        self._paused_until = 0.0
        self._pid = os.getpid()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._woken, selectors.EVENT_READ)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def close(self) -> None:
        """Stop listening and hang up on every greeter; in a forked child (no thread here),
        close this process's copies alone."""
        self._closed = True
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                self._wake.send(b"\0")  # the thread closes them all
            return
        for sock in (self._listener, *self._greeting, self._wake, self._woken):
            sock.close()
        self._greeting = {}
        self._selector.close()  # unregisters nothing: the epoll set is the parent's too

    def _run(self) -> None:
        try:
            while not self._closed:
                try:
                    self._step()
                except Exception:  # noqa: BLE001 - whatever it was, the listener stays open
                    self._pause()
                    time.sleep(BACKOFF_S)
        finally:
            for greeter in list(self._greeting.values()):
                self._drop(greeter)
            self._selector.close()
            for sock in (self._listener, self._wake, self._woken):
                sock.close()

    def _step(self) -> None:
        """Hang up on the greeters out of time, then wait for one round of events."""
        now = time.monotonic()
        for late in [g for g in self._greeting.values() if g.deadline <= now]:
            self._drop(late)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        wakes = [g.deadline for g in self._greeting.values()]
        if self._paused_until:
            wakes.append(self._paused_until)
        timeout = max(min(wakes) - now, 0.0) if wakes else None
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._woken:
                with contextlib.suppress(OSError):
                    self._woken.recv(4096)
            elif key.data.conn in self._greeting:  # not hung up on meanwhile
                self._read(key.data)

    def _accept(self) -> None:
        for _ in range(_BURST):
            try:
                conn, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of descriptors or memory: wait, then accept again
                if exc.errno in _GONE or self._listener.fileno() < 0:
                    self._closed = True
                else:
                    self._pause()
                return
            if not self._admit(conn, address):
                return

    def _admit(self, conn: socket.socket, address: Any) -> bool:
        """Greet `conn`; False where that could not start (the conn is closed)."""
        try:
            conn.setblocking(False)
            source = credentials(conn)[0] if self._by_process else address[0]
            greeting = self._greet(conn)
            greeter = _Greeter(conn, source, time.monotonic() + self._wait_s(), greeting)
            greeter.want = next(greeting)
            self._selector.register(conn, selectors.EVENT_READ, greeter)
        except (OSError, ValueError):
            conn.close()
            self._pause()
            return False
        self._greeting[conn] = greeter
        self._read(greeter)  # what came with the connection: a rightful peer's first bytes
        if conn in self._greeting:
            self._make_room(greeter)
        return True

    def _make_room(self, newcomer: _Greeter) -> None:
        """Past a cap, hang up on the greeter that got least far, the oldest first: as far
        as each got by now (a burst of accepts is read only after it, and a rightful peer's
        first bytes may have come meanwhile)."""
        others = [g for g in self._greeting.values() if g is not newcomer]
        same = [g for g in others if g.source == newcomer.source]
        if len(same) >= self.per_source:
            crowd, cap = same, self.per_source
        elif len(others) >= self.limit:
            crowd, cap = others, self.limit
        else:
            return
        for key, _ in self._selector.select(0):  # one look at what came meanwhile
            greeter = key.data
            if isinstance(greeter, _Greeter) and greeter.conn in self._greeting:
                self._read(greeter)
        left = [g for g in crowd if g.conn in self._greeting]
        if len(left) >= cap:
            self._drop(min(left, key=_progress))

    def _read(self, greeter: _Greeter) -> None:
        """Take what `greeter` sent; once its greeting's step has all it wanted, go on."""
        try:
            chunk = greeter.conn.recv(greeter.want - len(greeter.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(greeter)
            return
        greeter.got += chunk
        if len(greeter.got) < greeter.want:
            return
        got, greeter.got = bytes(greeter.got), bytearray()
        greeter.steps += 1
        try:
            greeter.want = greeter.greeting.send(got)
        except StopIteration as done:
            self._forget(greeter)
            if done.value is None:
                greeter.conn.close()
            else:
                self._hand_over(greeter.conn, done.value)
        except Exception:  # noqa: BLE001 - its answer could not be sent, or it broke off
            self._drop(greeter)

    def _hand_over(self, conn: socket.socket, proven: object) -> None:
        """Serve a proven connection in a thread of its own."""
        try:
            conn.setblocking(True)
            threading.Thread(
                target=self._serve, args=(conn, proven), name=self._link_name, daemon=True
            ).start()
        except (OSError, RuntimeError):  # no thread to be had: that peer fails; wait
            conn.close()
            self._pause()

    def _pause(self) -> None:
        """Accept nothing for BACKOFF_S (the greeters are still read)."""
        if not self._paused_until:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(self._listener)
            self._paused_until = time.monotonic() + BACKOFF_S

    def _forget(self, greeter: _Greeter) -> None:
        del self._greeting[greeter.conn]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(greeter.conn)

    def _drop(self, greeter: _Greeter) -> None:
        self._forget(greeter)
        greeter.greeting.close()
        greeter.conn.close()


def _progress(greeter: _Greeter) -> int:
    return greeter.steps
