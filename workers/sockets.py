"""Frames over a Unix socket, and who holds its other end (see handoff)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

KEY_BYTES = 32
"""The size of a door's secret."""
KEY_WAIT_S = 1.0
"""How long a door waits for a new connection's secret before it hangs up."""
_CRED = struct.Struct("3i")
"""struct ucred: pid, uid, gid."""
_JOIN_BYTES = 1 << 20
"""Frames up to this size are sent in one write; larger parts one by one (no copy)."""


def credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of the process at the other end of a Unix socket."""
    found = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(found)
    return pid, uid, gid


def send(sock: socket.socket, parts: Sequence[bytes]) -> None:
    """Write one frame: the parts' sizes, then the parts."""
    header = struct.pack(f"<{len(parts)}Q", *(len(part) for part in parts))
    if sum(len(part) for part in parts) <= _JOIN_BYTES:
        sock.sendall(b"".join([header, *parts]))
        return
    sock.sendall(header)
    for part in parts:
        sock.sendall(part)


def receive(sock: socket.socket, count: int) -> list[bytes] | None:
    """Read one frame of `count` parts; None where the other end closed before one began."""
    header = _exactly(sock, 8 * count)
    if header is None:
        return None
    parts = []
    for size in struct.unpack(f"<{count}Q", header):
        part = _exactly(sock, size)
        if part is None:
            raise ConnectionResetError("the other end closed in the middle of a frame")
        parts.append(part)
    return parts


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 22))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
