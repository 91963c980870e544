"""The TCP connections a failed call left open, shut so that its peers fail at once.

After a collective fails (a peer was lost), torch's gloo process group keeps its
connections to the other ranks open, even once destroyed: a live peer that waits on this
rank in a collective then waits out gloo's timeout (30 minutes by default), and is
replaced as stuck instead of kept. Shutting the connections this rank's call opened and
left open makes every such peer's collective fail in moments, and each peer then does the
same: the failure reaches every rank of the group. Ours (the snapshot keeper's) are kept.
A client the function opened and left open (say, to a tracking server) is shut too: it
connects again when used, as after any dropped connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Collection, Iterator

_FDS = "/proc/self/fd"
_servers: set[int] = set()
"""The ports this process listened on before its first call (Ray's servers)."""


def note_servers() -> None:
    """Note the ports this process listens on now (once, as the rank's actor starts)."""
    for sock in _sockets(None):
        with contextlib.suppress(OSError), sock:
            if _listening(sock):
                _servers.add(sock.getsockname()[1])


def mark() -> frozenset[str]:
    """The descriptors open now (cheap: their numbers only), to compare with later."""
    try:
        return frozenset(os.listdir(_FDS))
    except OSError:
        return frozenset()


def shut_since(before: frozenset[str], keep_ports: Collection[int] = ()) -> int:
    """Shut the TCP connections opened since `before` and still open, except those on
    `keep_ports` (either end) and those to this process's first servers; how many."""
    kept = _servers | set(keep_ports)
    shut = 0
    for sock in _sockets(before):
        with contextlib.suppress(OSError), sock:
            if _listening(sock):
                continue  # no peer waits on a listener
            if sock.getsockname()[1] in kept or sock.getpeername()[1] in kept:
                continue
            sock.shutdown(socket.SHUT_RDWR)  # the connection itself, for every holder
            shut += 1
    return shut


def _sockets(before: frozenset[str] | None) -> Iterator[socket.socket]:
    """Copies (new descriptors) of this process's TCP sockets not among `before`."""
    try:
        names = os.listdir(_FDS)
    except OSError:
        return
    for name in names:
        if before is not None and name in before:
            continue
        with contextlib.suppress(OSError, ValueError):
            if not os.readlink(f"{_FDS}/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                yield sock
            else:
                sock.close()


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
