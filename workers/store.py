"""Rank 0's side of a call's rendezvous store: a port held between calls, a server during one.

Between calls the next call's port is only reserved: bound on the node's IP, not
listening, so a connection there is refused. As a call starts the socket listens, and
torch's TCPStore takes it over: at once where torch is loaded already, else when the
first rank connects (a job that never rendezvous never imports torch). The kernel
queues early connections meanwhile. The store closes when the driver says every rank of
the call is done.
"""

from __future__ import annotations

import select
import socket
import sys
import threading
from typing import Any

from orchestrator_workers import _compat

_WATCH_S = 0.2
"""How often a store not yet made looks whether its call ended."""


def reserve_port(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: one the OS picks), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.set_inheritable(False)
    sock.bind((host, port))
    return sock


class StoreServer:
    """One call's rendezvous store, serving on a reserved socket (see the module)."""

    def __init__(self, sock: socket.socket) -> None:
        """Listen on `sock` now; make torch's store now or on the first connection."""
        sock.listen(128)
        self.port = int(sock.getsockname()[1])
        self._sock: socket.socket | None = sock
        self._store: Any = None
        self._closed = False
        self._lock = threading.Lock()
        if "torch.distributed" in sys.modules:
            self._make()
        else:
            threading.Thread(target=self._watch, name="store watch", daemon=True).start()

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
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _watch(self) -> None:
        while True:
            with self._lock:
                sock = None if self._closed or self._store is not None else self._sock
            if sock is None:
                return
            try:
                ready, _, _ = select.select([sock], [], [], _WATCH_S)
            except (OSError, ValueError):  # closed meanwhile
                return
            if ready:
                self._make()
                return

    def _make(self) -> None:
        with self._lock:
            if self._closed or self._store is not None or self._sock is None:
                return
            sock, self._sock = self._sock, None
            self._store = _compat.serve_store(sock)  # it takes the socket over
