"""A detached function's warm calls, started on the ranks by the driver itself while the
supervisor watches (issue 36's "direct mode").

A detached call sent through the supervisor costs two more Ray trips and the supervisor's
work on the call's path. So where a driver waits for a small call's result, it starts the
call on rank 0 itself, as a live call does, and takes the outcomes from rank 0's hand; the
supervisor is told first (a `DirectCall`, with everything it needs to run the job itself)
and watches:

- The supervisor lends the pool by a token held in rank 0's hand (`handoff.Hand`): a
  driver's start must carry it, and uses it up, lending the token the driver chose for its
  next call. Before the supervisor starts anything itself it takes the token back
  (`revoke`), learning at once whether a driver's call took it; a call that did runs (is
  watched) first. So a driver's call never replaces another, nor runs beside one.
- The driver tells the supervisor how the call went (a `Settled`): quiet and successful,
  with its results (the supervisor keeps them, as for any detached job); or anything else
  (refused, or a rank printed or failed, or it runs long), and the supervisor looks at the
  hand: a call that ran is taken over (its outcomes collected as a second reader of the
  hand, its output as any call's), one that did not is run by the supervisor; the driver
  follows the job. A driver that says nothing within ADOPT_AFTER_S (killed, or its
  network lost) leaves the supervisor to look likewise.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import ray
from ray.exceptions import GetTimeoutError, RayError

from orchestrator.pool import Pool
from orchestrator_workers.protocol import (
    CallSpec,
    Collected,
    Lease,
    RankResult,
    Used,
    unwire,
    wire,
)

ADOPT_AFTER_S = 2.0
"""How long the supervisor waits for the driver's word on its call before it looks itself."""
NOTICE_WAIT_S = 5.0
"""How long the supervisor waits for the notice of a call that took the lease (sent before
the call by its driver) before it treats the call as an orphan."""
DIRECT_WAIT_S = 0.05
"""How long a driver waits for a call it made itself before it follows the job instead (a
call that prints shows its first lines that late)."""
READER = "driver"
"""The driver's name as a reader of a call's outcomes at rank 0's hand."""


@dataclass(frozen=True)
class DirectCall:
    """A call the driver starts on the ranks itself, as it tells the supervisor first."""

    call_id: bytes
    """Its share key, encoded (the hand's call id)."""
    secret: bytes = field(repr=False)
    """The job's secret (its ranks' snapshots); never shown, as the tokens."""
    token: bytes = field(repr=False)
    """The lease token its start carries."""
    lend: bytes = field(repr=False)
    """The token its start lends for the driver's next call."""
    port: int
    """Its rendezvous store's port."""


@dataclass(frozen=True)
class Settled:
    """The driver's word on its call: where it succeeded quietly, each rank's outcome as
    the rank pickled it (by rank: the supervisor reads them as it reads those it collects)
    and the next call's store port; else the supervisor looks at the hand now (the call
    was refused, or printed, failed or runs on: it is taken over)."""

    outcomes: list[bytes] | None = None
    next_port: int | None = None


@dataclass(frozen=True)
class Loan:
    """The pool lent to a driver for its next call: the token rank 0's hand holds, the
    store port, and (where the driver lacks them) rank 0's actor and its node's peers."""

    pool: str
    token: bytes = field(repr=False)
    """Never shown, as `peers` (their doors' keys)."""
    port: int
    gpus: bool
    rank0: Any = None
    peers: bytes = field(default=b"", repr=False)


def can_lend(pool: Pool | None) -> bool:
    """Whether a driver may start calls on `pool` itself: rank 0 alone starts them."""
    return pool is not None and pool.handoff and (len(pool.nodes) == 1 or bool(pool.others))


def pool_id(pool: Pool) -> str:
    """The pool's identity for a lease: its rank 0's door (a random name, one per actor)."""
    return pool.infos[0].door


def new_token() -> bytes:
    """A lease token."""
    return secrets.token_bytes(16)


class Leases:
    """The supervisor's side: the token rank 0's hand holds, and its drivers' words."""

    def __init__(self) -> None:
        """No token lent yet."""
        self.outstanding: bytes | None = None
        """The token the hand holds (lent by the last start), as far as this side knows."""
        self.pool: Pool | None = None
        """The pool whose rank 0 holds it."""
        self._said: dict[bytes, Settled] = {}
        self._taken: dict[bytes, None] = {}
        """Calls a revoke found holding the ranks (the newest 64)."""
        self._cond = threading.Condition()

    def say(self, call_id: bytes, settled: Settled) -> None:
        """The driver's word on its call `call_id`."""
        with self._cond:
            self._said[call_id] = settled
            while len(self._said) > 64:  # words on calls never noticed (their jobs refused)
                del self._said[next(iter(self._said))]
            self._cond.notify_all()

    def word(self, call_id: bytes, wait_s: float) -> Settled | None:
        """The driver's word on `call_id`, waiting up to `wait_s` for it (taken: once)."""
        with self._cond:
            self._cond.wait_for(lambda: call_id in self._said, wait_s)
            return self._said.pop(call_id, None)

    def revoke(self, pool: Pool, token: bytes | None = None) -> Used | None:
        """Take back `token` (default: the outstanding one) at rank 0's hand: None where no
        driver's call took it (or rank 0 is gone: no call can take it); else that call's id
        and the token it lent, which is outstanding now."""
        token = token if token is not None else self.outstanding
        if token is None:
            return None
        try:
            used = ray.get(pool.actors[0].revoke.remote(token), timeout=NOTICE_WAIT_S)
        except (RayError, GetTimeoutError):  # the attempt finds out what became of rank 0
            used = None
        if used is not None:
            self._taken[used.call_id] = None
            while len(self._taken) > 64:
                del self._taken[next(iter(self._taken))]
        if token == self.outstanding:
            self.outstanding = None if used is None else used.lend
        return used

    def took(self, call_id: bytes) -> bool:
        """Whether a revoke found that call `call_id` took its token (it runs)."""
        return call_id in self._taken

    def clear(self, pool: Pool) -> None:
        """Take every token back before the runner starts a call itself, waiting for any
        call that took one and was never told of (see `orphan`)."""
        while (used := self.revoke(pool)) is not None:
            self.orphan(pool, used.call_id)

    def orphan(self, pool: Pool, call_id: bytes) -> None:
        """Wait for call `call_id`, whose driver never told of it (it died between its
        notice and its start, and the notice was lost), to end on the ranks. Its output
        goes to the next job's journal."""
        with contextlib.suppress(RayError):
            while True:
                got = ray.get(pool.actors[0].collect.remote(call_id, "orphan"))
                collected: Collected = pickle.loads(got)  # noqa: S301 - our rank's
                if not collected.running:
                    return


def take_queued(cond: threading.Condition, queue: deque[Any], call_id: bytes, wait_s: float) -> Any:
    """The entry of driver's call `call_id` in a runner's `queue` (guarded by `cond`, which
    is notified as entries come), taken out; None where it did not come within `wait_s`."""

    def find() -> Any:
        calls = (e for e in queue if e.driver_call and e.driver_call.call_id == call_id)
        return next(calls, None)

    with cond:
        found = cond.wait_for(find, wait_s)
        if found is not None:
            queue.remove(found)
        return found


def next_entry(
    leases: Leases,
    pool: Pool | None,
    own: DirectCall | None,
    cond: threading.Condition,
    queue: deque[Any],
) -> Any | None:
    """Before the runner starts a job on `pool` (`own`: the driver's call the job is, if
    any): None, go on; or the entry of a driver's call that holds the ranks now, taken
    from the runner's `queue` (see `take_queued`), to run first."""
    while pool is not None and leases.outstanding is not None:
        if own is not None and own.token == leases.outstanding:
            return None  # its driver's word decides (see `before_attempt`)
        used = leases.revoke(pool)
        if used is None:
            return None
        entry = take_queued(cond, queue, used.call_id, NOTICE_WAIT_S)
        if entry is not None:
            return entry
        leases.orphan(pool, used.call_id)
    return None


def before_attempt(
    leases: Leases,
    pool: Pool,
    mine: DirectCall | None,
    lend: bytes | None,
    stop: threading.Event,
) -> tuple[str, list[Any] | None, bytes | None]:
    """How the runner's attempt on `pool` goes, where `mine` is a driver's call (its first
    attempt): ("values", its results, None): it succeeded quietly; ("adopt", None, None):
    it runs on the ranks, and the runner watches it as its own; ("own", None, the token its
    start lends): the runner starts the call itself, every token taken back first (`lend`:
    what the job's driver is to be lent)."""
    if leases.pool is not pool:  # a new pool's rank 0 holds no token
        leases.pool, leases.outstanding = pool, None
    if mine is not None and (leases.took(mine.call_id) or mine.token == leases.outstanding):
        word = None
        deadline = time.monotonic() + ADOPT_AFTER_S
        while word is None and not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            word = leases.word(mine.call_id, min(left, 0.1))
        values = _values(word.outcomes) if word is not None and word.outcomes else None
        if word is not None and values is not None:
            leases.outstanding = mine.lend
            pool.use_store(word.next_port, close=False)  # its driver closed the last one
            return "values", values, None
        ran = leases.took(mine.call_id)
        if not ran and not stop.is_set():  # refused, or running on, or its driver is gone
            used = leases.revoke(pool, mine.token)
            ran = used is not None and used.call_id == mine.call_id
            if used is not None and not ran:
                leases.orphan(pool, used.call_id)
        if ran:
            leases.outstanding = mine.lend
            pool.store_port = mine.port
            return "adopt", None, None
    leases.clear(pool)
    leases.outstanding = lend if can_lend(pool) else None
    return "own", None, leases.outstanding


class Holder:
    """The driver's side: the loan for its next call, if it holds one, and the call."""

    def __init__(self) -> None:
        """No lease yet: the first answer of the supervisor brings one."""
        self._lock = threading.Lock()
        self._loan: Loan | None = None
        self._pool = ""
        self._rank0: Any = None
        self._peers = b""

    def known(self) -> str:
        """The pool whose rank 0 and peers this driver has ("" for none)."""
        return self._pool

    def holds(self) -> bool:
        """Whether it holds a loan for the next call."""
        return self._loan is not None

    def keep(self, loan: Loan | None) -> None:
        """Hold `loan` for the next call (None: hold none)."""
        with self._lock:
            if loan is not None and loan.rank0 is not None:
                self._pool, self._rank0, self._peers = loan.pool, loan.rank0, loan.peers
            self._loan = loan if loan is not None and loan.pool == self._pool else None

    def take(self) -> Loan | None:
        """The loan held, now no longer held (one call uses it)."""
        with self._lock:
            loan, self._loan = self._loan, None
            return loan

    def call(
        self, handle: Any, told: tuple[Any, ...], shipped: Any, options: Any, *,
        loan: Loan, wait_s: float,
    ) -> list[Any] | None:
        """Tell the supervisor (`handle`) of the call (`told`: its record and the rest of
        `notice`'s), start it on the ranks, and wait up to `wait_s` for it: its results
        where it succeeded quietly; None where the supervisor has it now (follow the job)."""
        call_id = uuid.uuid4().hex[:16]
        secret, lend = os.urandom(32), new_token()
        mine = DirectCall(call_id.encode(), secret, loan.token, lend, loan.port)
        noticed = handle.notice.remote(wire((*told, mine)))
        spec = CallSpec(
            master_port=loan.port,
            restart_count=0,
            max_restarts=options.max_restarts,
            share_key=call_id,
            uses_torch=shipped.uses_torch or loan.gpus,
            watched=options.stall_after is not None,
            job_secret=secret,
        )
        run = self._rank0.run_node.remote(
            mine.call_id, pickle.dumps(spec, pickle.HIGHEST_PROTOCOL), shipped.data,
            self._peers, None, lease=Lease(loan.token, lend), reader=READER,
        )
        quiet = None
        try:
            if ray.wait([run], timeout=wait_s)[0]:
                quiet = _quiet(ray.get(run), options.num_replicas)
        except RayError:
            pass  # rank 0 is gone: the supervisor finds out, and says so
        finally:
            if quiet is None:  # the supervisor looks at the hand now
                handle.settle.remote(mine.call_id, wire(Settled()))
        if quiet is None:
            with contextlib.suppress(GetTimeoutError):  # slow to answer: followed all the same
                refused = unwire(ray.get(noticed, timeout=NOTICE_WAIT_S * 4))
                if refused is not None:
                    raise refused
            return None
        results, raw = quiet
        if results[0].store_open:
            self._rank0.close_store.remote(loan.port)
        next_port = results[0].next_master_port
        handle.settle.remote(mine.call_id, wire(Settled(raw, next_port)))
        self.keep(Loan(loan.pool, lend, next_port or loan.port, loan.gpus))
        return [result.value for result in results]


def _values(outcomes: list[bytes]) -> list[Any] | None:
    """The values in the ranks' pickled outcomes; None where one cannot be read here (the
    supervisor then collects them as for its own call, and fails the job as it would)."""
    try:
        return [cloudpickle.loads(raw).value for raw in outcomes]
    except Exception:  # noqa: BLE001 - said by the call that collects them
        return None


def _quiet(data: bytes, ranks: int) -> tuple[list[RankResult], list[bytes]] | None:
    """A call's outcomes from rank 0's hand, where each of its `ranks` succeeded and printed
    nothing: its results by rank, and the same as the ranks pickled them."""
    got: Collected | None = pickle.loads(data)  # noqa: S301 - our rank's
    if got is None or got.running or got.failed or len(got.outcomes) != ranks:
        return None  # refused, running, failed
    results: list[tuple[RankResult, bytes]] = []
    for _, raw in got.outcomes:
        if raw is None:
            return None  # large (its rank keeps it), or lost: the supervisor has it
        try:
            outcome = cloudpickle.loads(raw)
        except Exception:  # noqa: BLE001 - the supervisor's follower says it as its own
            return None
        if not isinstance(outcome, RankResult) or outcome.output_seq:
            return None  # failed or printed: the supervisor has it
        results.append((outcome, raw))
    results.sort(key=lambda pair: pair[0].rank)
    return [result for result, _ in results], [raw for _, raw in results]
