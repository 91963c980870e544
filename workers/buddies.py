"""The channel that carries in-memory snapshots between ranks (see snapshot): each rank
keeps its wards' copies in its own process and hands them back.

A rank listens on its node's IP, on a TCP port the OS picks, once it first saves or
restores. Every connection starts with a mutual challenge: both sides send a fresh nonce
and prove, with an HMAC-SHA256 over both nonces keyed by the job's secret, that they hold
it. The driver makes that secret for each job and sends it to the ranks through Ray with
the call (as the doors' secrets travel, see handoff); it never appears in the
environment, a repr or a log. So a process without it can neither store a copy nor get
one, and a listener that is not a rank of this job learns nothing from a rank that
connects to it. Connections prove themselves side by side, in the listener's one thread
(see greeters): one that has not within HANDSHAKE_S in all is closed, and a flood of them is
bounded, so none holds the listener. Nothing received is unpickled here: a copy's bytes are
kept as they came and handed back to the rank they belong to.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from orchestrator_workers.greeters import BACKLOG, Greeters, Greeting

HANDSHAKE_S = 10.0
"""How long a connection may take, in all, to prove it holds the job's secret (read at each
accept). 1 s broke snapshots off on a 2-core node busy copying 1 GB per rank."""
IO_S = 120.0
"""The longest pause between two reads or writes of a copy's bytes."""
_CONNECT_TRIES = 3
"""Connections tried where the keeper hangs up before the proof."""
_RETRY_S = 0.05
"""The pause before the second try (twice that before the third)."""
_MAGIC = b"orchestrator-snapshot-1\n"
_NONCE = 16
_PUT, _GET = b"P", b"G"
_KEPT, _NONE = b"K", b"N"
_REQUEST = struct.Struct("!cIqQQ")  # op, ward, step, header bytes, body bytes
_SIZES = struct.Struct("!QQ")


@dataclass
class Copy:
    """One rank's snapshot as bytes: its header (opaque here) and its tensors' bytes."""

    step: int
    header: bytes
    body: bytearray = field(repr=False)


class ChannelError(ConnectionError):
    """A peer could not be reached, did not prove it holds the job's secret, or broke off."""


class Keeper:
    """This rank's listener and the wards' copies it keeps, by ward and step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key = b""
        self._held: dict[int, dict[int, Copy]] = {}
        self.greeters: Greeters | None = None
        """The listener's connections not proven yet (None: not listening)."""
        self.address: tuple[str, int] = ("", 0)

    def serve(self, host: str, key: bytes) -> tuple[str, int]:
        """Listen on `host` (once per process) for the job whose secret is `key`; a new
        job's key drops every copy kept for another. Returns the address peers reach."""
        with self._lock:
            if key != self._key:
                self._held.clear()
                self._key = key
            if self.greeters is None:
                listener = socket.create_server((host, 0), backlog=BACKLOG)
                self.address = (host, listener.getsockname()[1])
                self.greeters = Greeters(
                    listener,
                    self._greeting,
                    self._serve_one,
                    wait_s=lambda: HANDSHAKE_S,
                    name="snapshot-keeper",
                )
            return self.address

    def holdings(self) -> dict[int, list[int]]:
        """The steps of the copies kept, by ward."""
        with self._lock:
            return {ward: sorted(copies) for ward, copies in self._held.items() if copies}

    def settle(self, step: int) -> None:
        """Keep only the copies of `step` (every rank has delivered it, or it was restored)."""
        with self._lock:
            for ward in list(self._held):
                kept = {s: c for s, c in self._held[ward].items() if s == step}
                if kept:
                    self._held[ward] = kept
                else:
                    del self._held[ward]

    def take(self, ward: int, step: int) -> Copy | None:
        """The copy kept for `ward` at `step`, if any (it stays kept)."""
        with self._lock:
            return self._held.get(ward, {}).get(step)

    def forget(self) -> None:
        """Drop every copy kept."""
        with self._lock:
            self._held.clear()

    def close_in_child(self) -> None:
        """In a forked child: the listening socket is the parent's, not the child's."""
        if self.greeters is not None:
            with contextlib.suppress(OSError):
                self.greeters.close()
            self.greeters = None
        self._held = {}
        self._lock = threading.Lock()

    def _greeting(self, conn: socket.socket) -> Greeting:
        """The keeper's side of the mutual challenge: the job's key once the peer proved it
        holds it, as this side did; None if not."""
        with self._lock:
            key = self._key
        hello = yield len(_MAGIC) + _NONCE
        if not key or hello[: len(_MAGIC)] != _MAGIC:
            return None
        theirs, mine = hello[len(_MAGIC) :], os.urandom(_NONCE)
        conn.sendall(mine + _mac(key, b"keeper", theirs, mine))
        proof = yield 32
        return key if hmac.compare_digest(proof, _mac(key, b"saver", theirs, mine)) else None

    def _serve_one(self, conn: socket.socket, key: object) -> None:
        with conn:
            try:
                _no_delay(conn)
                conn.settimeout(IO_S)
                op, ward, step, header_len, body_len = _REQUEST.unpack(_read(conn, _REQUEST.size))
                if op == _PUT:
                    header = bytes(_read(conn, header_len))
                    body = _read(conn, body_len)
                    with self._lock:
                        if self._key != key:
                            return  # another job's now
                        self._held.setdefault(ward, {})[step] = Copy(step, header, body)
                    conn.sendall(_KEPT)
                elif op == _GET:
                    copy = self.take(ward, step)
                    if copy is None:
                        conn.sendall(_NONE)
                        return
                    body_view = memoryview(copy.body)
                    conn.sendall(_KEPT + _SIZES.pack(len(copy.header), body_view.nbytes))
                    conn.sendall(copy.header)
                    conn.sendall(body_view)
            except (OSError, struct.error):
                return  # a peer that broke off, or never proved itself: nothing kept


def put(
    address: tuple[str, int],
    key: bytes,
    *,
    ward: int,
    step: int,
    header: bytes,
    body: Iterable[memoryview],
    body_len: int,
    pause: threading.Event | None = None,
) -> None:
    """Give the rank at `address` ward `ward`'s copy of `step`: `body` is the tensors'
    bytes in order, `body_len` bytes in all. Returns once it is kept there.

    `pause` (a test hook, see snapshot): set once half the body is sent, then never returns.
    """
    with _connect(address, key) as conn:
        conn.sendall(_REQUEST.pack(_PUT, ward, step, len(header), body_len))
        conn.sendall(header)
        sent = 0
        for chunk in body:
            conn.sendall(chunk)
            sent += chunk.nbytes
            if pause is not None and sent >= body_len // 2:
                pause.set()
                threading.Event().wait()
        if conn.recv(1) != _KEPT:
            raise ChannelError(f"the rank at {_where(address)} did not keep the copy")


def get(address: tuple[str, int], key: bytes, ward: int, step: int) -> Copy:
    """Ward `ward`'s copy of `step`, from the rank at `address` that keeps it."""
    with _connect(address, key) as conn:
        conn.sendall(_REQUEST.pack(_GET, ward, step, 0, 0))
        if _read(conn, 1) != _KEPT:
            raise ChannelError(f"the rank at {_where(address)} no longer keeps that copy")
        header_len, body_len = _SIZES.unpack(_read(conn, _SIZES.size))
        header = bytes(_read(conn, header_len))
        return Copy(step, header, _read(conn, body_len))


def _connect(address: tuple[str, int], key: bytes) -> socket.socket:
    """A connection to the keeper at `address`, both sides proven; tried again where the
    keeper hung up before the proof (a flood of other connections crowded this one out
    before its first bytes were read: see greeters)."""
    for attempt in range(1, _CONNECT_TRIES + 1):
        try:
            conn = socket.create_connection(address, timeout=10)
        except OSError as exc:
            raise ChannelError(f"could not reach the rank at {_where(address)}: {exc}") from None
        try:
            _no_delay(conn)
            conn.settimeout(HANDSHAKE_S * 3)
            proven = _prove(conn, key)
        except ConnectionError as exc:
            conn.close()
            if attempt == _CONNECT_TRIES:
                raise ChannelError(
                    f"the rank at {_where(address)} hung up before the proof, {attempt} "
                    f"times ({exc})"
                ) from None
            time.sleep(_RETRY_S * attempt)
            continue
        except BaseException:
            conn.close()
            raise
        if not proven:
            conn.close()
            raise ChannelError(
                f"the listener at {_where(address)} did not prove it holds this job's "
                "secret: it is not a rank of this job"
            )
        conn.settimeout(IO_S)
        return conn
    raise AssertionError("unreachable")


def _prove(conn: socket.socket, key: bytes) -> bool:
    """The saver's side of the mutual challenge (the keeper's is `Keeper._greeting`): True
    once the keeper proved it holds `key`, as this side did."""
    mine = os.urandom(_NONCE)
    conn.sendall(_MAGIC + mine)
    answer = _read(conn, _NONCE + 32)
    theirs = bytes(answer[:_NONCE])
    if not hmac.compare_digest(bytes(answer[_NONCE:]), _mac(key, b"keeper", mine, theirs)):
        return False
    conn.sendall(_mac(key, b"saver", mine, theirs))
    return True


def _no_delay(conn: socket.socket) -> None:
    """Each small write (a proof, a request, an answer) sent at once: with Nagle's
    algorithm, the second of two waited for the peer's delayed ACK, 40 ms a save."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _mac(key: bytes, role: bytes, saver_nonce: bytes, keeper_nonce: bytes) -> bytes:
    return hmac.new(key, role + saver_nonce + keeper_nonce, hashlib.sha256).digest()


def _read(conn: socket.socket, n: int) -> bytearray:
    """Exactly `n` bytes (an OSError if the peer closes first)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        count = conn.recv_into(view[got:], min(n - got, 1 << 22))
        if not count:
            raise ConnectionResetError("the peer closed the connection")
        got += count
    return buf


def _where(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


keeper = Keeper()
"""This process's keeper (a rank's; created listening on first use)."""
os.register_at_fork(after_in_child=keeper.close_in_child)
