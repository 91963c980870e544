"""A call's hand-off: each node's first rank passes it to the ranks of its node; on many
nodes, the job's first rank passes it to the other nodes' first ranks.

The driver sends one Ray task per node (from TREE_NODES nodes: one per call, to rank 0),
not one per rank. An actor task costs Ray about 2 ms of CPU, shared between the caller
and the actor; a rank handed its call over a local socket costs a few tens of
microseconds. So a warm call costs the driver and the cluster one Ray task per node.

Each rank listens on a Unix socket of its own (its `Door`). Its node's first rank (the
`Hand`) connects to every door of the node, its own included, sends each rank the call,
and gathers the outcomes; the job's first rank also calls every other node's hand (a
Ray task each) and gathers theirs. The sockets are abstract (no file to plant or remove),
so every process in the node's network namespace can reach them, whoever's and in whichever
container. So a door serves only a peer that first sends its secret (`Door.key`, 32
random bytes that the rank made and that reached its hand only through Ray, with Ray's
token), compared in constant time before a byte is unpickled; a peer that sends nothing
is dropped after KEY_WAIT_S, and neither it nor a flood of them holds the door (see
greeters). The hand, in turn, checks with SO_PEERCRED that the door it reached is held by
the rank's own process (its pid and uid). Nothing else on the node can send a rank code or
read a call's arguments, even by taking a dead rank's socket name.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import pickle
import secrets
import select
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray

from orchestrator_workers.greeters import BACKLOG, Greeters, Greeting
from orchestrator_workers.protocol import (
    NO_LEASE,
    Collected,
    Lease,
    Outcomes,
    Peer,
    RemoteNode,
    Used,
)
from orchestrator_workers.sockets import KEY_BYTES, KEY_WAIT_S, credentials, receive, send

SWITCH = "ORCHESTRATOR_HANDOFF"
"""Set to 0 in the driver's environment to send every rank its own Ray task instead."""
TREE = "ORCHESTRATOR_HANDOFF_TREE"
"""From how many nodes the driver sends a call to rank 0 alone (which calls the other
nodes' first ranks), rather than to each node's first rank: TREE_NODES unless set."""
TREE_NODES = 8
"""Below this, the extra hop through rank 0 costs a call more time than the driver's
Ray tasks to each node: at 16 ranks on 2 nodes, 33 ms against 22 (Ray's own: 26); from
8 nodes the driver's CPU per call is 4.9 ms through rank 0 (Ray's: 57)."""
_SLICE_S = 0.5
"""How often a hand waiting for outcomes checks that its call is still the current one."""
_KEPT_CALLS = 2
"""Ended calls whose outcomes a hand keeps for a reader that has not taken them all (a
detached job's supervisor, behind the driver that made the call: see supervise.direct)."""
_KEPT_TOKENS = 16
"""Lease tokens whose use a hand remembers, for the supervisor's `revoke`."""
_LARGE = 1 << 20
"""An outcome over this size stays with its rank until the driver asks for it: the
first rank would hold every large one of its node in memory, then copy them again."""

Serve = Callable[[bytes, bytes, bytes], tuple[bool, bytes]]
"""Runs a call: (pickled RankSpec, pickled CallSpec, payload) -> (failed, outcome)."""


@dataclass
class _Ended:
    """A call another one replaced: its outcomes, for readers that have not taken all."""

    done: Outcomes
    failing: bool
    taken: dict[str, int]


class Door:
    """A rank's socket for its node's hand: calls in, outcomes out, one call at a time."""

    def __init__(self, serve: Serve) -> None:
        """Listen now, and `serve` each call that comes, in a thread of its own."""
        self._serve = serve
        self._last: tuple[bytes, bytes] = (b"", b"")
        """The last call's id and outcome, for `outcome` (a hand that died cannot ask)."""
        self._done = threading.Condition()
        self._serving = threading.Lock()
        """One link is served at a time (a replaced hand's link closes with its process)."""
        self.key = secrets.token_bytes(KEY_BYTES)
        """What a peer must send first to be served; only the driver and the hand see it."""
        self.name = ""
        """The abstract socket's name; "" where none could be opened (no hand-off)."""
        self.greeters: Greeters | None = None
        """The connections that have not sent the key yet (None: no socket)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"orchestrator-{secrets.token_hex(12)}"
        try:
            listener.bind(f"\0{name}")
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            return
        self.name = name
        self.greeters = Greeters(
            listener,
            self._greeting,
            self._link,
            wait_s=lambda: KEY_WAIT_S,
            name="door",
            link_name="rank",  # a small call runs in it: the rank's function thread
        )

    def __repr__(self) -> str:
        """Never the key."""
        return f"Door({self.name!r})"

    def outcome(self, call_id: bytes) -> bytes:
        """The outcome of call `call_id`, once this rank has one; asked once (it is let go)."""
        with self._done:
            self._done.wait_for(lambda: self._last[0] == call_id)
            outcome, self._last = self._last[1], (call_id, b"")
            return outcome

    def _greeting(self, _conn: socket.socket) -> Greeting:
        """A link is served once its first bytes are the key (within KEY_WAIT_S in all)."""
        key = yield KEY_BYTES
        return True if hmac.compare_digest(key, self.key) else None

    def _link(self, conn: socket.socket, _proven: object) -> None:
        """Serve a link that sent the key, once no other link is served."""
        with conn, contextlib.suppress(Exception):  # that link ends; the door stays open
            conn.settimeout(None)
            with self._serving:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        while (frame := receive(conn, 4)) is not None:
            call_id, spec, call, payload = frame
            failed, outcome = self._serve(spec, call, payload)
            with self._done:
                self._last = (call_id, outcome)
                self._done.notify_all()
            sent = b"" if len(outcome) > _LARGE else outcome  # b"": ask me for it
            send(conn, [call_id, b"\1" if failed else b"\0", sent])


class Hand:
    """A node's first rank's side: a link to each rank's door, and the current call.

    A call's outcomes are kept until the next call but one (where it was leased), each
    reader (the driver, a detached job's supervisor) taking its own way through them.
    """

    def __init__(self) -> None:
        """No links yet: each is made at the first call that needs it."""
        self._links: dict[int, tuple[str, socket.socket]] = {}
        self._lock = threading.Lock()
        self._call = b""
        self._pending: dict[int, socket.socket] = {}
        self._away: set[int] = set()
        """Ranks of other nodes whose outcomes their hands have not brought yet."""
        self._done: Outcomes = []
        self._taken: dict[str, int] = {}
        """How many of `_done` each reader took."""
        self._failing = False
        self._kept = False
        """Whether the call is kept once replaced (it was leased)."""
        self._ended: dict[bytes, _Ended] = {}
        self._lease: bytes | None = None
        """The token a driver's start must carry now; None: no driver may start a call."""
        self._used: dict[bytes, Used] = {}
        """Tokens used up, each with the call that used it."""
        self._wake, self._woken = socket.socketpair()
        """Written when another node's outcomes came: a collect waiting on the links wakes."""
        self._wake.setblocking(False)

    def start(
        self,
        call_id: bytes,
        peers: Sequence[Peer],
        call: bytes,
        payload: bytes,
        nodes: Sequence[RemoteNode] = (),
        *,
        lease: Lease = NO_LEASE,
    ) -> bool:
        """Send call `call_id` to each of `peers` (a rank it cannot reach is done, lost),
        and to the hand of each of `nodes`, which gathers its own node's; False (nothing
        sent) where `lease`'s token is not the one lent, or a call still runs here."""
        token, lend = lease.token, lease.lend
        with self._lock:
            if token is not None:
                if token != self._lease or self._pending or self._away:
                    return False
                self._used[token] = Used(call_id, lend)
                while len(self._used) > _KEPT_TOKENS:
                    del self._used[next(iter(self._used))]
            self._lease = lend
            if self._kept:
                self._ended[self._call] = _Ended(self._done, self._failing, self._taken)
                while len(self._ended) > _KEPT_CALLS:
                    del self._ended[next(iter(self._ended))]
            self._call, self._pending, self._done, self._failing = call_id, {}, [], False
            self._taken, self._kept = {}, lease != NO_LEASE
            self._away = {rank for node in nodes for rank in node.ranks}
            for peer in peers:  # first: rank 0 serves the rendezvous store the others reach
                try:
                    link = self._link(peer)
                    send(link, [call_id, peer.spec, call, payload])
                except OSError:
                    self._lose(peer.rank)
                else:
                    self._pending[peer.rank] = link
            if nodes:
                args = (call_id, call, payload)
                threading.Thread(target=self._follow, args=(*args, nodes), daemon=True).start()
        return True

    def revoke(self, token: bytes) -> Used | None:
        """Take back lease `token`: None where no driver's start used it (none can now);
        else the call that used it, and the token lent next."""
        with self._lock:
            if self._lease == token:
                self._lease = None
                return None
            return self._used.get(token)

    def collect(self, call_id: bytes, reader: str = "") -> Collected:
        """The outcomes `reader` has not collected yet: once all are done, or at once after
        a failure or a lost rank (the driver must hear of it now).

        A call that another one replaced gets what was kept of it (nothing if unleased).
        """
        while True:
            with self._lock:
                if self._call != call_id:
                    ended = self._ended.get(call_id)
                    if ended is None:
                        return Collected([], (), False)
                    at, ended.taken[reader] = ended.taken.get(reader, 0), len(ended.done)
                    return Collected(ended.done[at:], (), ended.failing)
                at = self._taken.get(reader, 0)
                if (len(self._done) > at and self._failing) or not (self._pending or self._away):
                    self._taken[reader] = len(self._done)
                    running = (*self._pending, *sorted(self._away))
                    return Collected(self._done[at:], running, self._failing)
                links = [*self._pending.values(), self._woken]
            try:
                ready, _, _ = select.select(links, [], [], _SLICE_S)
            except (OSError, ValueError):  # a link closed meanwhile (a rank lost): look again
                continue
            with self._lock:
                for link in ready:
                    if link is self._woken:
                        self._woken.recv(4096)
                    else:
                        self._read(link)

    def _follow(
        self, call_id: bytes, call: bytes, payload: bytes, nodes: Sequence[RemoteNode]
    ) -> None:
        """Call each of `nodes`' hands, and take in what they bring, until all came or
        another call replaced this one. A hand that is gone loses its node's ranks: the
        driver then asks each rank's actor, and Ray says which one died."""
        try:
            self._gather(call_id, call, payload, nodes)
        except Exception:  # noqa: BLE001 - Ray failed us: the driver asks each rank left
            with self._lock:
                if self._call == call_id and self._away:
                    self._done.extend((rank, None) for rank in sorted(self._away))
                    self._away, self._failing = set(), True
            self._wake_up()

    def _wake_up(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake is owed already
            self._wake.send(b"\0")

    def _gather(
        self, call_id: bytes, call: bytes, payload: bytes, nodes: Sequence[RemoteNode]
    ) -> None:
        waiting = {
            node.actor.run_node.remote(call_id, call, payload, node.peers, ()): node
            for node in nodes
        }
        owed = {ref: node.ranks for ref, node in waiting.items()}
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=_SLICE_S)
            for ref in ready:
                node, ranks = waiting.pop(ref), owed.pop(ref)
                try:
                    got: Collected = pickle.loads(ray.get(ref))  # noqa: S301 - our rank's
                except Exception:  # noqa: BLE001 - its hand is gone (or broke): ask each rank
                    got = Collected([], (), True)
                came = {rank for rank, _ in got.outcomes} | set(got.running)
                done = [*got.outcomes, *((rank, None) for rank in ranks if rank not in came)]
                with self._lock:
                    if self._call != call_id:
                        return
                    self._done.extend(done)
                    self._away -= {rank for rank, _ in done}
                    self._failing = self._failing or got.failed or len(came) < len(ranks)
                self._wake_up()
                if got.running:
                    rest = node.actor.collect.remote(call_id)
                    waiting[rest], owed[rest] = node, got.running
            with self._lock:
                if self._call != call_id:
                    return

    def _read(self, link: socket.socket) -> None:
        """Take one reply from `link` (lock held); a closed link loses its rank."""
        rank = next((r for r, s in self._pending.items() if s is link), None)
        if rank is None:  # another thread took it meanwhile
            return
        try:
            frame = receive(link, 3)
        except OSError:
            frame = None
        if frame is None:
            del self._pending[rank]
            self._lose(rank)
            return
        call_id, failed, outcome = frame
        if call_id == self._call:  # else a reply to a call that ended without it
            del self._pending[rank]
            self._done.append((rank, outcome or None))
            self._failing = self._failing or failed == b"\1"

    def _lose(self, rank: int) -> None:
        link = self._links.pop(rank, None)
        if link is not None:
            link[1].close()
        self._done.append((rank, None))
        self._failing = True

    def _link(self, peer: Peer) -> socket.socket:
        """The link to `peer`'s door, made now where there is none to this door."""
        have = self._links.get(peer.rank)
        if have is not None and have[0] == peer.door:
            return have[1]
        if have is not None:
            have[1].close()
            del self._links[peer.rank]
        # The same process under another number (a shrink renumbers): its door serves one
        # link at a time, so a second one to it would wait for ever.
        renumbered = next((r for r, (door, _) in self._links.items() if door == peer.door), None)
        if renumbered is not None:
            self._links[peer.rank] = self._links.pop(renumbered)
            return self._links[peer.rank][1]
        link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            link.connect(f"\0{peer.door}")
            pid, uid, _ = credentials(link)
            if (pid, uid) != (peer.pid, os.getuid()):
                raise OSError(f"rank {peer.rank}'s door is held by pid {pid}, uid {uid}")
            link.sendall(peer.key)
        except OSError:
            link.close()
            raise
        self._links[peer.rank] = (peer.door, link)
        return link


def pack_peers(peers: Sequence[Peer]) -> bytes:
    """A node's peers as the driver sends them with every call, pickled once per pool."""
    return pickle.dumps(tuple(peers), pickle.HIGHEST_PROTOCOL)
