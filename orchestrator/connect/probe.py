"""Before Ray's client is let near a given address: does a Ray server answer there, at once?

Ray's own client retries a dead or foreign address for minutes, deaf to Ctrl-C and
SIGTERM, and may then end the process. This asks within seconds, and says what it found.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING

from orchestrator.connect import tokens
from orchestrator.errors import ClusterUnreachableError

if TYPE_CHECKING:
    import hpack

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
    why = problem(address)
    if why is None:
        return
    local = "give no address to run on this machine"
    if why.startswith(REFUSED):
        raise ClusterUnreachableError(f"the Ray cluster at {given_as}={address!r} {why}")
    if "does not answer as" in why:
        fix = f"give the address of the cluster's head, or {local}"
    else:
        fix = (
            "check that Ray runs there (`ray start --head` prints the address to give) and "
            f"that this machine can reach it, or {local}"
        )
    raise ClusterUnreachableError(f"no Ray cluster at {given_as}={address!r}: {why}; {fix}")


def problem(address: str) -> str | None:
    """Why no Ray server answers at `address`, asked within seconds; None where one does.

    Where it refuses a driver without a token, this user's token at hand (Ray's token mode
    off) is sent from then on, and asked with: Ray's driver would retry for 20 s, then fail.
    """
    why = _answer(address)
    if why == _NO_TOKEN and tokens.send_token_at_hand():
        why = _answer(address)
        if why is not None:
            tokens.withdraw_token()
    return why


def _answer(address: str) -> str | None:
    scheme, _, host_port = address.rpartition("://")
    host, colon, port = host_port.rpartition(":")
    if not colon or not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None  # a TLS server waits for a TLS hello: the open port is all we ask
            sock.sendall(_H2_PREFACE)
            reply = sock.recv(9)
            answer: str | None = "no HTTP/2 greeting"
            if len(reply) == 9 and reply[3] == 4:  # SETTINGS
                skip = int.from_bytes(reply[:3], "big")
                answer = _rpc_answer(sock, host_port, skip, client=bool(scheme))
    except TimeoutError:
        return f"{host}:{port} did not answer within {REACH_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"connecting to {host}:{port} failed ({exc.strerror or exc})"
    if answer is None or answer.startswith(REFUSED):
        return answer
    kind = "Ray Client server (ray://)" if scheme else "GCS (`ray start --head --port`)"
    return f"{host}:{port} accepts connections but does not answer as a Ray {kind} would ({answer})"


_GCS_CALL = b"/ray.rpc.NodeInfoGcsService/GetClusterId"
_RAY_CLIENT_CALL = b"/ray.rpc.RayletDriver/ClusterInfo"
"""A method each server has, so that one with token authentication checks the token."""
_PING = b"\x08\x06"
"""ClusterInfoRequest(type=PING), which Ray Client's server answers itself (protobuf)."""


def _rpc_answer(sock: socket.socket, authority: str, skip: int, *, client: bool) -> str | None:
    """None if the HTTP/2 server on `sock` answers a gRPC call within REACH_TIMEOUT_S; else
    what it did instead.

    A gRPC answer is HTTP/2 status 200 with content-type application/grpc, whatever its
    gRPC status, but for a refusal of this driver's token (the method is one the server
    has, so that it checks the token: the GCS's, or the Ray Client server's ping). Any
    other HTTP/2 server (a 404, a reset, silence) would hold Ray's connect for minutes,
    deaf to signals. One call by hand (Ray ships no gRPC for Python): HEADERS, then the
    message, on stream 1. `skip`: bytes of the server's first frame still unread;
    `client`: the server is Ray Client's (`ray://`).
    """
    import hpack  # only here: decoding the answer's headers (Huffman-coded, indexed)

    from orchestrator import _ray_compat

    token = _ray_compat.auth_headers()
    path, body = (_RAY_CLIENT_CALL, _PING) if client else (_GCS_CALL, b"")
    message = b"\0" + len(body).to_bytes(4, "big") + body  # gRPC: not compressed, length
    block = _request_headers(path, authority, token)
    stream = (1).to_bytes(4, "big")
    sock.sendall(
        bytes([0, 0, 0, 4, 1])
        + b"\0\0\0\0"  # SETTINGS ACK
        + len(block).to_bytes(3, "big")
        + bytes([1, 4])
        + stream
        + block  # HEADERS
        + len(message).to_bytes(3, "big")
        + bytes([0, 1])
        + stream
        + message  # DATA, END_STREAM
    )
    deadline = time.monotonic() + REACH_TIMEOUT_S
    buffer = headers = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:
            return "no answer to a gRPC call"
        if not chunk:
            return "it hung up on a gRPC call"
        buffer += chunk
        dropped = min(skip, len(buffer))
        buffer, skip = buffer[dropped:], skip - dropped
        while len(buffer) >= 9 and len(buffer) >= 9 + (size := int.from_bytes(buffer[:3], "big")):
            kind, flags, number = buffer[3], buffer[4], buffer[5:9]
            payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
            ours = int.from_bytes(number, "big") & 0x7FFFFFFF == 1
            if kind == 7:  # GOAWAY
                return "it hung up on a gRPC call (GOAWAY)"
            if not ours:
                continue
            if kind == 3:  # RST_STREAM
                return "it reset a gRPC call"
            if kind == 1:  # HEADERS: [pad length] [priority] block [padding]
                pad = payload[0] if flags & 0x8 else 0
                payload = payload[(1 if flags & 0x8 else 0) + (5 if flags & 0x20 else 0) :]
                headers += payload[: len(payload) - pad]
            elif kind == 9:  # CONTINUATION
                headers += payload
            if kind in (1, 9) and flags & 0x4:  # END_HEADERS
                decoder = hpack.Decoder()
                return _grpc_headers(decoder, headers, sent_token=bool(token))
    return "no answer to a gRPC call"


REFUSED = "refused"
"""How the answer of a server that refused this driver's token (or its lack of one) starts."""
_UNAUTHENTICATED = "16"
"""gRPC's status code for a call without valid credentials."""


def _request_headers(path: bytes, authority: str, token: dict[str, str]) -> bytes:
    """The gRPC call's HEADERS block (HPACK), with Ray's token headers where it has some."""
    import hpack

    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path.decode()),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *((name.lower(), value) for name, value in token.items()),
    ]
    return bytes(hpack.Encoder().encode(fields))


_NO_TOKEN = (
    f"{REFUSED} a driver without its token (Ray's token authentication is on there), and "
    "this user has none at hand: put the cluster's token (`ray get-auth-token` on its head "
    "prints it) in ~/.ray/auth_token, in RAY_AUTH_TOKEN, or in the file RAY_AUTH_TOKEN_PATH "
    "names"
)
"""What a server that refused a call without a token said (the token at hand is sent next)."""


def _grpc_headers(decoder: hpack.Decoder, block: bytes, *, sent_token: bool) -> str | None:
    """None if the header `block` is a gRPC answer's; else what it says instead (starting
    with REFUSED where the answer refuses the token sent, or the lack of one)."""
    try:
        fields = {str(name): str(value) for name, value in decoder.decode(block, raw=False)}
    except Exception:  # noqa: BLE001 - hpack's errors: not an answer we can read
        return "headers that are not HTTP/2's"
    status, kind = fields.get(":status", "?"), fields.get("content-type", "none")
    if status == "200" and kind.startswith("application/grpc"):
        if fields.get("grpc-status") != _UNAUTHENTICATED:
            return None
        if not sent_token:
            return _NO_TOKEN
        return (
            f"{REFUSED} this driver's Ray token ({tokens.where_from()}): give the cluster's "
            "token (the one its head was started with: `ray get-auth-token` there prints "
            "it) in RAY_AUTH_TOKEN, in the file RAY_AUTH_TOKEN_PATH names, or in "
            "~/.ray/auth_token"
        )
    return f"it answered a gRPC call with HTTP status {status}, content-type {kind}"
