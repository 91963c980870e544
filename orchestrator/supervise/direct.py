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
  follows the job. A driver that says nothing within `lending.ADOPT_AFTER_S` (killed, or
  its network lost) leaves the supervisor to look likewise.

This module holds the driver's side (`Holder`) and what the two sides tell each other;
the supervisor's side is `supervise.lending`, the hook of its runner.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import ray
from ray.exceptions import GetTimeoutError, RayError

from orchestrator.dispatch import call_spec
from orchestrator.hook import Started
from orchestrator.options import Options
from orchestrator.shipping import Shipment
from orchestrator_workers.protocol import Collected, Lease, RankResult, unwire, wire

NOTICE_WAIT_S = 5.0
"""How long the supervisor waits for the notice of a call that took the lease (sent before
the call by its driver) before it treats the call as an orphan."""
DIRECT_WAIT_S = 0.05
"""How long a driver waits for a call it made itself before it follows the job instead (a
call that prints shows its first lines that late)."""
READER = "driver"
"""The driver's name as a reader of a call's outcomes at rank 0's hand."""


@dataclass(frozen=True)
class DirectCall(Started):
    """A call the driver starts on the ranks itself, as it tells the supervisor first: a
    call started by another process, as the supervisor's runner sees it, with the tokens
    its start carries and lends (never shown)."""

    token: bytes = field(repr=False)
    """The lease token its start carries."""
    lend: bytes = field(repr=False)
    """The token its start lends for the driver's next call."""


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


def new_token() -> bytes:
    """A lease token."""
    return secrets.token_bytes(16)


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
        self,
        handle: Any,
        told: tuple[Any, ...],
        shipped: Shipment,
        options: Options,
        *,
        loan: Loan,
        wait_s: float,
    ) -> list[Any] | None:
        """Tell the supervisor (`handle`) of the call (`told`: its record and the rest of
        `notice`'s), start it on the ranks, and wait up to `wait_s` for it: its results
        where it succeeded quietly; None where the supervisor has it now (follow the job)."""
        call_id = uuid.uuid4().hex[:16]
        secret, lend = os.urandom(32), new_token()
        mine = DirectCall(call_id.encode(), secret, loan.port, token=loan.token, lend=lend)
        noticed = handle.notice.remote(wire((*told, mine)))
        spec = call_spec(
            options, shipped, gpus=loan.gpus, port=loan.port, share_key=call_id, job_secret=secret
        )
        lease = Lease(loan.token, lend)
        run = self._rank0.run_node.remote(
            mine.call_id, spec, shipped.data, self._peers, None, lease=lease, reader=READER
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
