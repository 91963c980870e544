"""Before Ray's client is let near a given address: does a Ray server answer there, at once?

Ray's own client retries a dead or foreign address for minutes, deaf to Ctrl-C and
SIGTERM, and may then end the process. This asks within seconds, and says what it found.
"""

from __future__ import annotations

import os
import socket
import time

from orchestrator.errors import ClusterUnreachableError

REACH_TIMEOUT_S = 5.0
"""How long a given address may take to answer before the call fails (Ray retries for minutes)."""
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, or its
client server for ray://) answers with a SETTINGS frame of its own."""


def check_reachable(address: str, given_as: str) -> None:
    """Raise ClusterUnreachableError, naming `address`, unless a Ray server answers there.

    Ray itself retries a dead address for minutes, deaf to Ctrl-C and SIGTERM, and may
    then end the process. Addresses without a port ("auto", "local") are Ray's to read.
    """
    scheme, _, host_port = address.rpartition("://")
    host, colon, port = host_port.rpartition(":")
    if not colon or not port.isdigit():
        return
    host = host.strip("[]")
    where = f"no Ray cluster at {given_as}={address!r}"
    local = "give no address to run on this machine"
    fix = (
        "check that Ray runs there (`ray start --head` prints the address to give) and that "
        f"this machine can reach it, or {local}"
    )
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS server waits for a TLS hello: the open port is all we ask
            sock.sendall(_H2_PREFACE)
            reply = sock.recv(9)
            answers = len(reply) == 9 and reply[3] == 4  # SETTINGS
            answers = answers and _answers_rpc(sock, host_port, int.from_bytes(reply[:3], "big"))
    except TimeoutError:
        tried = f"{host}:{port} did not answer within {REACH_TIMEOUT_S:g} s"
        raise ClusterUnreachableError(f"{where}: {tried}; {fix}") from None
    except OSError as exc:
        tried = f"connecting to {host}:{port} failed ({exc.strerror or exc})"
        raise ClusterUnreachableError(f"{where}: {tried}; {fix}") from None
    if not answers:
        kind = "Ray Client server (ray://)" if scheme else "GCS (`ray start --head --port`)"
        raise ClusterUnreachableError(
            f"{where}: {host}:{port} accepts connections but does not answer as a Ray {kind} "
            f"would; give the address of the cluster's head, or {local}"
        )


def _answers_rpc(sock: socket.socket, authority: str, skip: int) -> bool:
    """Whether the HTTP/2 server on `sock` answers a gRPC call within REACH_TIMEOUT_S.

    Any answer counts, an error status included (the method is Ray's GCS's; a Ray Client
    server says it has none, a GCS with token auth may refuse us): silence does not. A
    server that only greets would otherwise hold Ray's connect for minutes, deaf to
    signals. One call by hand (Ray ships no gRPC for Python): HEADERS, then an empty
    message, on stream 1. `skip`: bytes of the server's first frame still unread.
    """

    def literal(name: bytes, value: bytes) -> bytes:  # HPACK, not indexed, new name
        return bytes([0, len(name)]) + name + bytes([len(value)]) + value

    path = b"/ray.rpc.NodeInfoGcsService/GetClusterId"
    block = (
        b"\x83\x86"  # :method POST, :scheme http (HPACK's static table)
        + b"\x04" + bytes([len(path)]) + path
        + b"\x01" + bytes([len(authority)]) + authority.encode()
        + literal(b"content-type", b"application/grpc")
        + literal(b"te", b"trailers")
    )
    stream = (1).to_bytes(4, "big")
    sock.sendall(
        bytes([0, 0, 0, 4, 1]) + b"\0\0\0\0"  # SETTINGS ACK
        + len(block).to_bytes(3, "big") + bytes([1, 4]) + stream + block  # HEADERS
        + (5).to_bytes(3, "big") + bytes([0, 1]) + stream + b"\0\0\0\0\0"  # DATA, END_STREAM
    )
    deadline = time.monotonic() + REACH_TIMEOUT_S
    buffer = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:
            return False
        if not chunk:
            return False
        buffer += chunk
        dropped = min(skip, len(buffer))
        buffer, skip = buffer[dropped:], skip - dropped
        while len(buffer) >= 9:
            size, kind, number = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[5:9]
            if kind in (1, 3) and int.from_bytes(number, "big") & 0x7FFFFFFF == 1:
                return True  # HEADERS (an answer) or RST_STREAM (a refusal) for our call
            if kind == 7:  # GOAWAY: it speaks HTTP/2 and hung up on us, as a server does
                return True
            buffer = buffer[9 + size :]
    return False
