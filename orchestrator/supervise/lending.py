"""The supervisor's side of a detached function's direct calls (see `supervise.direct`): the
hook of its runner (`Lending`), which lends the pool to drivers and takes it back.

The runner asks it before each job starts on the pool which call must run first (a
driver's that took the token), how each attempt begins (a driver's call that succeeded
quietly has ended already; one that ran is collected; else the runner starts it, lending
the token the job's driver is to be lent), and whether the idle pool may be released
(not while a driver's call holds its ranks).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from typing import Any

import cloudpickle
import ray
from ray.exceptions import GetTimeoutError, RayError

from orchestrator.hook import Begin, Collect, Ended, RunFirst, RunnerHook, Start, Started
from orchestrator.pool import Pool
from orchestrator.supervise.direct import NOTICE_WAIT_S, DirectCall, Settled
from orchestrator_workers.protocol import Collected, Used

ADOPT_AFTER_S = 2.0
"""How long the supervisor waits for the driver's word on its call before it looks itself."""
KEPT = 64
"""Drivers' words, and calls a revoke found holding the ranks, kept (the newest)."""


def pool_id(pool: Pool) -> str:
    """The pool's identity for a loan: its rank 0's door (a random name, one per actor)."""
    return pool.infos[0].door


class Lending(RunnerHook):
    """The token rank 0's hand holds, its drivers' words, and what the runner does then."""

    def __init__(self) -> None:
        """No token lent yet."""
        self.outstanding: bytes | None = None
        """The token the hand holds (lent by the last start), as far as this side knows."""
        self.pool: Pool | None = None
        """The pool whose rank 0 holds it."""
        self._said: dict[bytes, Settled] = {}
        self._taken: dict[bytes, None] = {}
        """Calls a revoke found holding the ranks."""
        self._cond = threading.Condition()

    def say(self, call_id: bytes, settled: Settled) -> None:
        """The driver's word on its call `call_id`."""
        with self._cond:
            self._said[call_id] = settled
            while len(self._said) > KEPT:  # words on calls never noticed (their jobs refused)
                del self._said[next(iter(self._said))]
            self._cond.notify_all()

    def run_first(self, pool: Pool, started: Started | None) -> RunFirst | None:
        """Before a job starts on `pool`: the driver's call that took the token, if one did
        (its job runs first: see `Runner`), unless the job is the driver's call the token
        was lent for (its driver's word decides: see `begin`)."""
        if self.outstanding is None:
            return None
        if isinstance(started, DirectCall) and started.token == self.outstanding:
            return None
        used = self.revoke(pool)
        return None if used is None else RunFirst(used.call_id, NOTICE_WAIT_S)

    def missed(self, pool: Pool, call_id: bytes) -> None:
        """Wait for call `call_id`, whose driver never told of it (it died between its
        notice and its start, and the notice was lost), to end on the ranks. Its output
        goes to the next job's journal."""
        with contextlib.suppress(RayError):
            while True:
                got = ray.get(pool.actors[0].collect.remote(call_id, "orphan"))
                collected: Collected = pickle.loads(got)  # noqa: S301 - our rank's
                if not collected.running:
                    return

    def begin(
        self, pool: Pool, started: Started | None, lend: bytes | None, stop: threading.Event
    ) -> Begin:
        """Where the job is a driver's call (`started`): its results, if it succeeded
        quietly; collect it, if it runs on the ranks. Else every token is taken back, and
        the runner starts the call, lending `lend` where drivers may start calls."""
        if self.pool is not pool:  # a new pool's rank 0 holds no token
            self.pool, self.outstanding = pool, None
        mine = started if isinstance(started, DirectCall) else None
        if mine is not None and (self._took(mine.call_id) or mine.token == self.outstanding):
            word = self._word(mine.call_id, stop)
            values = _values(word.outcomes) if word is not None and word.outcomes else None
            if word is not None and values is not None:
                self.outstanding = mine.lend
                return Ended(values, word.next_port)
            ran = self._took(mine.call_id)
            if not ran and not stop.is_set():  # refused, or running on, or its driver is gone
                used = self.revoke(pool, mine.token)
                ran = used is not None and used.call_id == mine.call_id
                if used is not None and not ran:
                    self.missed(pool, used.call_id)
            if ran:
                self.outstanding = mine.lend
                return Collect(mine)
        while (used := self.revoke(pool)) is not None:  # and any call that took one ends
            self.missed(pool, used.call_id)
        # A driver starts its calls at rank 0 alone.
        self.outstanding = lend if pool.routes.from_rank0 else None
        return Start(self.outstanding)

    def may_release(self, pool: Pool) -> bool:
        """Whether the idle `pool` may go: the token taken back, no driver's call took it
        (one that did holds the ranks: its job comes)."""
        return self.revoke(pool) is None

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
            while len(self._taken) > KEPT:
                del self._taken[next(iter(self._taken))]
        if token == self.outstanding:
            self.outstanding = None if used is None else used.lend
        return used

    def _took(self, call_id: bytes) -> bool:
        """Whether a revoke found that call `call_id` took its token (it runs)."""
        return call_id in self._taken

    def _word(self, call_id: bytes, stop: threading.Event) -> Settled | None:
        """The driver's word on `call_id`, waiting up to ADOPT_AFTER_S for it (taken: once),
        or until `stop` is set."""
        deadline = time.monotonic() + ADOPT_AFTER_S
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            with self._cond:
                if self._cond.wait_for(lambda: call_id in self._said, min(left, 0.1)):
                    return self._said.pop(call_id)
        return None


def _values(outcomes: list[bytes]) -> list[Any] | None:
    """The values in the ranks' pickled outcomes; None where one cannot be read here (the
    supervisor then collects them as for its own call, and fails the job as it would)."""
    try:
        return [cloudpickle.loads(raw).value for raw in outcomes]
    except Exception:  # noqa: BLE001 - said by the call that collects them
        return None
