"""The connections a failed call's process group left open, shut so that ranks waiting
on them in a collective fail at once and are kept.

After a collective fails (a peer was lost), torch's gloo process group keeps its
connections to the other ranks open, even once destroyed: a live rank that waits on one
of them in a collective then waits out gloo's timeout (30 minutes by default), and is
replaced as stuck instead of kept. Each connection between two ranks was accepted by one
of them, on a listener its process group opened during the call; when every rank shuts
the connections it accepted there (a rank whose call failed does it at once, the driver
asks the ranks still running), every connection between them is shut and every
collective fails in moments. Never touched: Ray's listeners (those this process had
before its first call), the snapshot keeper's and the rendezvous store's. A server the
function itself started and left running loses its connections too.
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
    for sock in _sockets():
        with contextlib.suppress(OSError), sock:
            if _listening(sock):
                _servers.add(sock.getsockname()[1])


def shut_accepted(keep_ports: Collection[int] = ()) -> int:
    """Shut the connections accepted on listeners opened since the actor started, other
    than `keep_ports`'; returns how many."""
    sockets = list(_sockets())
    try:
        listeners = set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                if _listening(sock):
                    listeners.add(sock.getsockname()[1])
        listeners -= _servers | set(keep_ports)
        shut = 0
        for sock in sockets:
            with contextlib.suppress(OSError):
                if not _listening(sock) and sock.getsockname()[1] in listeners:
                    sock.shutdown(socket.SHUT_RDWR)  # the connection, for every holder
                    shut += 1
        return shut
    finally:
        for sock in sockets:
            sock.close()  # our copy of the descriptor only


def _sockets() -> Iterator[socket.socket]:
    """Copies (new descriptors) of this process's TCP sockets."""
    try:
        names = os.listdir(_FDS)
    except OSError:
        return
    for name in names:
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
