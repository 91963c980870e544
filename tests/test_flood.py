"""Floods against the listeners that greet a connection before they serve it (see
orchestrator_workers.greeters): the snapshot keeper's TCP port, which the network reaches,
and a rank's door, which every process in the node's network namespace reaches. Silent and
trickling connections from another process neither shut them nor slow the rightful peer
much, and cost them no thread; running out of descriptors is waited out."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from orchestrator_workers import buddies, handoff, sockets

KEY = os.urandom(32)
WAIT_S = 1.0
"""The keeper's time to prove oneself here (10 s in a rank)."""
FLOOR_S = 0.5
"""The least bound on a rightful peer's time under a flood: a busy 2-core machine's."""
RATE = 3000
"""The flood's new connections a second."""

FLOOD = """
import collections, resource, socket, sys, time
where, mode, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
if where.startswith("unix:"):
    family, address = socket.AF_UNIX, "\\0" + where[5:]
else:
    family, (host, port) = socket.AF_INET, where[4:].rsplit(":", 1)
    address = (host, int(port))
held, made, start, drip = collections.deque(), 0, time.monotonic(), 0.0
while True:
    conn = socket.socket(family, socket.SOCK_STREAM)
    conn.setblocking(False)
    try:
        conn.connect(address)
    except BlockingIOError:
        pass
    except OSError:
        conn.close()
        continue
    held.append(conn)
    made += 1
    if len(held) > 1000:
        held.popleft().close()
    if made == 500:
        print("flooding", flush=True)
    if mode == "trickle" and time.monotonic() > drip:  # a byte each, every fifth of WAIT_S
        for each in held:
            try:
                each.send(b"x")
            except OSError:
                pass
        drip = time.monotonic() + 0.2
    time.sleep(max(start + made / rate - time.monotonic(), 0))
"""
"""Connects to argv[1] ("tcp:HOST:PORT" or "unix:NAME") RATE times a second, holding the
last 1000 connections open, silent or trickling a byte on each every 0.2 s."""


@pytest.fixture
def keeper(monkeypatch: pytest.MonkeyPatch) -> Iterator[buddies.Keeper]:
    """A keeper in this process, on 127.0.0.1, whose connections have WAIT_S to prove."""
    monkeypatch.setattr(buddies, "HANDSHAKE_S", WAIT_S)
    kept = buddies.Keeper()
    kept.serve("127.0.0.1", KEY)
    yield kept
    kept.close_in_child()  # closes the listener


def _save(address: tuple[str, int]) -> None:
    """A buddy's save, as a rank makes it."""
    body = memoryview(bytes(1 << 10))
    buddies.put(address, KEY, ward=1, step=1, header=b"h", body=[body], body_len=body.nbytes)


def _hand_over(name: str, key: bytes) -> None:
    """A call handed through the door `name` on a new link, as a node's hand does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as link:
        link.settimeout(10)
        link.connect(f"\0{name}")
        link.sendall(key)
        sockets.send(link, [b"call", b"spec", b"", b"args"])
        assert sockets.receive(link, 3) == [b"call", b"\0", b"done: args"]


def _door() -> handoff.Door:
    return handoff.Door(lambda _spec, _call, payload: (False, b"done: " + payload))


@contextlib.contextmanager
def _flood(where: str, mode: str) -> Iterator[None]:
    """Another process floods `where` (see FLOOD) while this block runs."""
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, where, mode, str(RATE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline() == "flooding\n"
        yield
    finally:
        flood.kill()
        flood.wait()


def _timed(work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _trickle(connect: Callable[[], socket.socket], hung_up: list[float]) -> None:
    """Send a byte every fifth of WAIT_S; note when the listener hung up (for 3 WAIT_S)."""
    started = time.monotonic()
    with connect() as conn:
        while time.monotonic() - started < 3 * WAIT_S:
            try:
                conn.send(b"x")
                if select.select([conn], [], [], WAIT_S / 5)[0] and not conn.recv(1):
                    break
            except OSError:
                break
        else:
            return
    hung_up.append(time.monotonic() - started)


def _served_through(
    serve: Callable[[], None], where: str, mode: str, connect: Callable[[], socket.socket]
) -> None:
    """While `where` is flooded, and after: the rightful peer is served within twice its
    quiet time (or FLOOR_S), this process gains no thread and few descriptors, and a
    trickling connection is hung up on once its time to greet is out."""
    quiet = statistics.median(_timed(serve) for _ in range(5))
    bound = max(2 * quiet, FLOOR_S)
    threads, descriptors = threading.active_count(), _descriptors()
    most_threads, most_descriptors, hung_up = 0, 0, []
    trickling = threading.Thread(target=_trickle, args=(connect, hung_up))
    with _flood(where, mode):
        trickling.start()
        during = []
        for _ in range(6):
            during.append(_timed(serve))
            most_threads = max(most_threads, threading.active_count())
            most_descriptors = max(most_descriptors, _descriptors())
            time.sleep(0.1)
        trickling.join()
    after = [_timed(serve) for _ in range(3)]
    assert most_threads <= threads + 3, f"{threads} threads grew to {most_threads}"
    assert most_descriptors <= descriptors + 80, f"{descriptors} fds grew to {most_descriptors}"
    assert max(during) < bound, f"quiet {quiet:.4f} s, flooded {during}"
    assert max(after) < bound, f"quiet {quiet:.4f} s, after the flood {after}"
    assert hung_up and hung_up[0] < 2 * WAIT_S, hung_up


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_flood_neither_shuts_nor_slows_the_keeper(
    keeper: buddies.Keeper, mode: str, processes: None
) -> None:
    host, port = keeper.address
    _served_through(
        lambda: _save(keeper.address),
        f"tcp:{host}:{port}",
        mode,
        lambda: socket.create_connection(keeper.address),
    )


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_flood_neither_shuts_nor_slows_a_door(mode: str, processes: None) -> None:
    door = _door()

    def connect() -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(f"\0{door.name}")
        return conn

    _served_through(lambda: _hand_over(door.name, door.key), f"unix:{door.name}", mode, connect)


RUN_OUT = """
import contextlib, os, resource, sys
from orchestrator_workers import buddies, handoff
buddies.HANDSHAKE_S = 1.0
keeper = buddies.Keeper()
keeper.serve("127.0.0.1", bytes.fromhex(sys.argv[1]))
door = handoff.Door(lambda _spec, _call, payload: (False, b"done: " + payload))
print(keeper.address[1], door.name, door.key.hex(), flush=True)
sys.stdin.readline()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
taken = []
with contextlib.suppress(OSError):
    while True:
        taken.append(os.dup(2))
print("full", flush=True)
sys.stdin.readline()
for fd in taken:
    os.close(fd)
print("free", flush=True)
sys.stdin.readline()
"""
"""A keeper and a door in a process that takes every descriptor it may have, on a line in,
and frees them on the next."""


def test_listeners_out_of_descriptors_serve_again_once_some_are_free(
    monkeypatch: pytest.MonkeyPatch, processes: None
) -> None:
    """EMFILE at accept (or no thread to be had) is waited out: the listener stays open."""
    monkeypatch.setattr(buddies, "HANDSHAKE_S", WAIT_S)  # this side's wait for the keeper
    rank = subprocess.Popen(
        [sys.executable, "-c", RUN_OUT, KEY.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdin is not None and rank.stdout is not None
    waiting: list[socket.socket] = []
    try:
        port, name, key = rank.stdout.readline().split()
        rank.stdin.write("take them all\n")
        rank.stdin.flush()
        assert rank.stdout.readline() == "full\n"
        for _ in range(3):  # accepted into no descriptor: each listener meets EMFILE
            waiting.append(socket.create_connection(("127.0.0.1", int(port))))
            door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.append(door)
            door.connect(f"\0{name}")
        time.sleep(0.5)
        rank.stdin.write("free them\n")
        rank.stdin.flush()
        assert rank.stdout.readline() == "free\n"
        _save(("127.0.0.1", int(port)))
        _hand_over(name, bytes.fromhex(key))
    finally:
        for conn in waiting:
            conn.close()
        rank.kill()
        rank.wait()
