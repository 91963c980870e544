"""Rank 0's side of a call's rendezvous store: a port held between calls, a server during one.

Between calls the next call's port is only reserved: bound on the node's IP, not
listening, so a connection there is refused. As a call starts the socket listens, and
torch's TCPStore takes it over when the first rank connects: a call that never
rendezvous makes no store (nor imports torch). The kernel queues early connections
meanwhile. The store closes when the driver says every rank of the call is done.

Made at once (where torch was loaded), a store per call cost a loop of quick calls 5 s
every 25 to 50 calls: torch 2.14's TCPStore client (the server's own among them) waits
5 s to connect once some 25 were made in one process within seconds (`connect` in
torch's log: found on this project's 2-core test machine; plain sockets do not).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from typing import Any

from orchestrator_workers import _compat


def reserve_port(host: str) -> socket.socket:
    """A TCP socket bound to a free port of `host`, not yet listening.

    Without SO_REUSEADDR: Linux lets any user bind a port that a socket holds with it
    and listen there first; held without it, nobody else can bind the port at all.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.set_inheritable(False)
    sock.bind((host, 0))
    return sock


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port` now, bound and listening in one step.

    For a given port that this process no longer holds (SO_REUSEADDR: an earlier
    store's connections may still be in TIME_WAIT there); listening at once leaves no
    time in which a socket of another user could listen first.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.set_inheritable(False)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class StoreKeeper:
    """Rank 0's rendezvous stores across calls: the next call's port reserved, the
    running call's store served, each closed when its time comes (see the module)."""

    def __init__(self, host: str) -> None:
        """Keep stores on `host` (the node's IP); none yet."""
        self._host = host
        self._store: StoreServer | None = None
        """The running call's store."""
        self._reserved: socket.socket | None = None
        """The next call's store port, bound on `host` but not listening."""
        self._lock = threading.Lock()

    @property
    def made(self) -> bool:
        """Whether the running call's store was made (a rank connected to it)."""
        store = self._store
        return store is not None and store.made

    @property
    def port(self) -> int | None:
        """The running call's store port (None: none served)."""
        store = self._store
        return None if store is None else store.port

    def reserve(self) -> int:
        """Reserve a port for the next call's store; the running call's stays open."""
        with self._lock:
            if self._reserved is not None:
                self._reserved.close()
            self._reserved = reserve_port(self._host)
            return int(self._reserved.getsockname()[1])

    def serve(self, port: int) -> None:
        """As a call starts: serve its store on the reserved `port` (else bind `port` and
        listen there in one step)."""
        self.close()  # an earlier call's, if the driver's word has not come yet
        with self._lock:
            reserved, self._reserved = self._reserved, None
            if reserved is None or reserved.getsockname()[1] != port:
                if reserved is not None:
                    reserved.close()
                reserved = listen_on(self._host, port)
            self._store = StoreServer(reserved)

    def close(self, port: int | None = None) -> None:
        """Close the running call's store (`port`: only if it is that call's)."""
        with self._lock:
            store = self._store
            if store is None or (port is not None and store.port != port):
                return
            self._store = None
        store.close()


class StoreServer:
    """One call's rendezvous store, serving on a reserved socket (see the module)."""

    def __init__(self, sock: socket.socket) -> None:
        """Listen on `sock` now; make torch's store on the first connection."""
        sock.listen(128)
        self.port = int(sock.getsockname()[1])
        self._sock: socket.socket | None = sock
        self._store: Any = None
        self._closed = False
        self._lock = threading.Lock()
        _watcher.watch(self)

    @property
    def made(self) -> bool:
        """Whether torch's store was made (a rank connected, or torch was loaded)."""
        with self._lock:
            return self._store is not None

    def close(self) -> None:
        """Stop serving: close torch's store, or the socket it never took."""
        with self._lock:
            self._closed = True
            self._store = None
            sock, self._sock = self._sock, None
        _watcher.forget(self)  # before the socket closes: its fd number may be reused
        if sock is not None:
            sock.close()

    def _make(self) -> None:
        with self._lock:
            if self._closed or self._store is not None or self._sock is None:
                return
            sock, self._sock = self._sock, None
            self._store = _compat.serve_store(sock)  # it takes the socket over


class _Watcher:
    """One thread per rank process that makes its store when the first rank connects.

    Started on first need and kept: a call costs no thread start (which, on a busy node,
    can take milliseconds before the new thread runs). A rank process serves one store
    at a time (the actor closes a call's before the next call's opens).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: StoreServer | None = None
        self._wake_r = self._wake_w = -1

    def watch(self, server: StoreServer) -> None:
        """Make `server`'s store as soon as a connection is waiting on its socket."""
        with self._lock:
            self._server = server
            if self._wake_w < 0:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                threading.Thread(target=self._run, name="store watch", daemon=True).start()
        os.write(self._wake_w, b"x")

    def forget(self, server: StoreServer) -> None:
        """Stop watching `server` (it is closing); the thread selects anew without it."""
        with self._lock:
            if self._server is server:
                self._server = None
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                server = self._server
                sock = server._sock if server is not None else None
                fd = sock.fileno() if sock is not None else -1
            try:
                ready, _, _ = select.select([self._wake_r] + ([fd] if fd >= 0 else []), [], [])
            except (OSError, ValueError):  # its socket closed meanwhile: look again
                continue
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            with self._lock:
                if fd < 0 or fd not in ready or self._server is not server:
                    continue
                self._server = None
            assert server is not None
            server._make()


_watcher = _Watcher()
