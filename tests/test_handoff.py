"""A node's hand-off (orchestrator_workers.handoff), on real sockets in this process: when
the first rank reports its node's outcomes, and what it does with late or lost ones."""

from __future__ import annotations

import os
import threading

from orchestrator_workers import handoff
from orchestrator_workers.protocol import Collected, Lease, Peer, Used


class Rank:
    """A door whose calls wait for `release`, then fail or not as the payload says."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.release = threading.Event()
        self.calls = 0
        self.door = handoff.Door(self._serve)

    def _serve(self, spec: bytes, call: bytes, payload: bytes) -> tuple[bool, bytes]:
        self.calls += 1
        self.release.wait(30)
        return payload == b"fail", b"r%d:%s" % (self.rank, payload)

    def peer(self) -> Peer:
        door = self.door
        return Peer(rank=self.rank, door=door.name, pid=os.getpid(), spec=b"", key=door.key)


def test_a_failure_is_reported_at_once_and_the_others_when_done() -> None:
    a, b = Rank(2), Rank(3)
    hand = handoff.Hand()
    hand.start(b"c2", [a.peer(), b.peer()], b"", b"fail")
    a.release.set()  # rank 3 still runs: the failure comes first, alone
    assert hand.collect(b"c2") == Collected([(2, b"r2:fail")], (3,), True)
    b.release.set()
    assert hand.collect(b"c2") == Collected([(3, b"r3:fail")], (), True)


def test_successes_come_together_once_all_are_done() -> None:
    a, b = Rank(0), Rank(1)
    hand = handoff.Hand()
    hand.start(b"c1", [a.peer(), b.peer()], b"", b"ok")
    a.release.set()
    found: list[object] = []
    collecting = threading.Thread(target=lambda: found.append(hand.collect(b"c1")))
    collecting.start()
    collecting.join(1.0)
    assert collecting.is_alive() and not found  # rank 1 still runs
    b.release.set()
    collecting.join(10)
    assert found == [Collected([(0, b"r0:ok"), (1, b"r1:ok")], (), False)]


def test_a_call_replaced_by_the_next_gets_nothing_and_late_replies_are_dropped() -> None:
    """A call that failed elsewhere leaves a rank running; its late reply must not pass
    for the next call's."""
    stuck, other = Rank(0), Rank(1)
    hand = handoff.Hand()
    hand.start(b"old", [stuck.peer(), other.peer()], b"", b"first")
    old: list[object] = []
    collecting = threading.Thread(target=lambda: old.append(hand.collect(b"old")))
    collecting.start()
    hand.start(b"new", [other.peer()], b"", b"second")
    collecting.join(5)
    assert old == [Collected([], (), False)]
    other.release.set()  # it answers the old call first, then the new one
    assert hand.collect(b"new") == Collected([(1, b"r1:second")], (), False)
    assert other.calls == 2
    stuck.release.set()


def test_a_rank_that_cannot_be_reached_is_lost_and_its_outcome_can_be_asked_for() -> None:
    alive = Rank(0)
    hand = handoff.Hand()
    gone = Peer(rank=1, door="orchestrator-nobody-listens-here", pid=os.getpid(), spec=b"")
    alive.release.set()
    hand.start(b"c1", [alive.peer(), gone], b"", b"ok")
    collected = hand.collect(b"c1")
    assert collected.failed
    assert (1, None) in collected.outcomes  # lost: the driver asks its actor (Ray says it is gone)
    assert alive.door.outcome(b"c1") == b"r0:ok"  # what a rank keeps, for that question


def test_a_lease_is_taken_once_and_a_revoke_says_which_call_took_it() -> None:
    """A detached job's lease (see supervise.direct): a driver's start must carry the token
    the hand holds, uses it up and lends the next; the supervisor's revoke learns which
    call took a token, or takes it back so that no start can."""
    a = Rank(0)
    a.release.set()
    hand = handoff.Hand()
    # The supervisor's start lends the first token; a driver's carries it and lends the next.
    assert hand.start(b"c1", [a.peer()], b"", b"ok", lease=Lease(None, b"t1"))
    assert hand.collect(b"c1") == Collected([(0, b"r0:ok")], (), False)
    assert not hand.start(b"x", [a.peer()], b"", b"ok", lease=Lease(b"forged", b"t9"))
    assert hand.start(b"c2", [a.peer()], b"", b"ok", lease=Lease(b"t1", b"t2"))
    assert hand.collect(b"c2", "driver") == Collected([(0, b"r0:ok")], (), False)
    used_up = Lease(b"t1", b"t3")
    assert not hand.start(b"c3", [a.peer()], b"", b"ok", lease=used_up)
    assert hand.revoke(b"t1") == Used(b"c2", b"t2")
    assert hand.revoke(b"t2") is None  # still lent: taken back now
    assert not hand.start(b"c4", [a.peer()], b"", b"ok", lease=Lease(b"t2", b"t4"))
    assert a.calls == 2


def test_a_leased_call_s_outcomes_reach_each_reader_and_outlive_the_next_call() -> None:
    """The driver and the supervisor each collect every outcome of a leased call, the
    supervisor even after the driver started its next call."""
    a, b = Rank(0), Rank(1)
    a.release.set()
    hand = handoff.Hand()
    assert hand.start(b"c1", [a.peer(), b.peer()], b"", b"fail", lease=Lease(None, b"t1"))
    assert hand.collect(b"c1", "driver") == Collected([(0, b"r0:fail")], (1,), True)
    b.release.set()
    assert hand.collect(b"c1", "driver") == Collected([(1, b"r1:fail")], (), True)
    assert hand.collect(b"c1") == Collected([(0, b"r0:fail"), (1, b"r1:fail")], (), True)
    assert hand.start(b"c2", [a.peer(), b.peer()], b"", b"ok", lease=Lease(b"t1", b"t2"))
    both = [(0, b"r0:ok"), (1, b"r1:ok")]
    collected = hand.collect(b"c2", "driver")
    assert (sorted(collected.outcomes), collected.running, collected.failed) == (both, (), False)
    assert hand.start(b"c3", [a.peer()], b"", b"ok", lease=Lease(b"t2", b"t3"))
    collected = hand.collect(b"c2")  # kept for the supervisor
    assert (sorted(collected.outcomes), collected.running, collected.failed) == (both, (), False)
    assert hand.collect(b"c2") == Collected([], (), False)  # taken
