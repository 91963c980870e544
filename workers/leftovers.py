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

NCCL's equivalent: a rank whose NCCL collective waits on a lost peer has its
communicators aborted (`abort_nccl`), so that its wait fails now rather than at NCCL's
timeout. Written for GPUs; not tested here (no GPUs, and one GPU cannot hold two NCCL
ranks).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
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


def abort_nccl() -> bool:
    """Abort every NCCL communicator of this process's process groups (the default one
    NCCL's), so that a collective waiting on a lost peer fails now; True where it did.
    Never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    if "nccl" not in str(dist.get_backend()).lower():
        return False
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):  # already destroyed meanwhile: nothing to abort
        _abort_process_group()
        return True
    return False


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
