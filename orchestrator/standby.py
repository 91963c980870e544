"""Warm spares a pool keeps on each of its nodes: a failed rank is replaced without a cold start.

A spare is a rank's actor started ahead of need in one of the pool's bundles (so on that
node, and gone with the placement group), holding no resources of its own: Ray's worker
started, our rank side loaded and torch imported where the pool's ranks preload it. When
a rank fails on a node that lives, the pool makes that node's ready spare the rank instead
of starting a process that must first import torch; a spare taken is made again a few
seconds later (the recovery has the CPU first), so a second failure finds one too. A
spare on a lost node is gone with it; the bundle Ray places again gets new ones.

What a spare costs: one more process a node, about 250 MB of host memory with torch
imported (CUDA is not initialised: no GPU memory) and, once, its start (a few seconds of
one core). It reserves nothing in Ray: a GPU rank's spare takes the GPU its failed rank
had (the pool keeps each rank's GPUs on its node, whoever serves the rank).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import ray

from orchestrator_workers.protocol import NodeInfo, unwire

ANSWER_S = 5.0
"""How long a spare about to be taken has to answer (it is idle: in moments)."""
START_AFTER_S = 3.0
"""Spares start this long after the pool's ranks (or after one was taken): the ranks'
start and a recovery come first."""


class _Spare:
    """One spare actor and its `info` answer (ready once torch is imported)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.ready = actor.info.remote()

    def answer(self) -> tuple[bool, NodeInfo | None]:
        """(whether it answered, where it runs): (False, None) while it starts, (True,
        None) where it died."""
        done, _ = ray.wait([self.ready], timeout=0)
        if not done:
            return False, None
        try:
            return True, unwire(ray.get(done[0]))
        except ray.exceptions.RayError:
            return True, None


class Standby:
    """One pool's spares, `per_node` in each of its bundles (see the module)."""

    def __init__(self, make: Callable[[int, int], Any]) -> None:
        """None kept yet; `make(bundle, serial)` starts a spare actor in `bundle` (see Pool)."""
        self.per_node = 0
        self._make = make
        self._spares: dict[int, list[_Spare]] = {}
        self._serial = 0
        self._closed = False
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        """Held by the one start running (timers may overlap): none starts twice the same."""
        self._timers: list[threading.Timer] = []

    def fill(self, bundles: Iterable[int], after: float = START_AFTER_S) -> None:
        """Start the spares missing in `bundles`, `after` seconds from now."""
        if self.per_node <= 0:
            return
        timer = threading.Timer(after, self._start, args=(sorted(set(bundles)),))
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    def take(self, bundle: int) -> tuple[Any, NodeInfo] | None:
        """A ready spare of `bundle` that answers now, no longer kept (its actor and where
        it runs); None where none is. Spares found dead are dropped."""
        with self._lock:
            kept = self._spares.get(bundle, [])
            answers = [(spare, *spare.answer()) for spare in kept]
            kept[:] = [spare for spare, answered, _ in answers if not answered]
        ready = [(spare, info) for spare, _, info in answers if info is not None]
        for n, (spare, info) in enumerate(ready):  # ready once, dead since? (memory monitor)
            if _answers(spare.actor):
                with self._lock:  # those not tried go back
                    kept.extend(s for s, _ in ready[n + 1 :])
                return spare.actor, info
            ray.kill(spare.actor, no_restart=True)  # dead, or too slow to count on
        return None

    def forget(self, bundles: Iterable[int]) -> None:
        """Drop the spares of `bundles` (their node was lost: they are gone with it), and
        the starts not yet made (a bundle being placed again has no node yet)."""
        with self._lock:
            timers, self._timers = self._timers, []
            lost = [spare for bundle in bundles for spare in self._spares.pop(bundle, [])]
        for timer in timers:
            timer.cancel()
        for spare in lost:
            ray.kill(spare.actor, no_restart=True)

    def pids(self) -> dict[int, list[int]]:
        """The process ids of the ready spares, by bundle."""
        with self._lock:
            spares = {bundle: list(kept) for bundle, kept in self._spares.items()}
        found = {b: [i.pid for s in kept if (i := s.answer()[1])] for b, kept in spares.items()}
        return {bundle: pids for bundle, pids in found.items() if pids}

    def close(self, *, kill: bool = True) -> None:
        """Start none again, and kill every spare (`kill=False`: their session is gone,
        and they with it); safe twice."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, []
            spares = [spare for kept in self._spares.values() for spare in kept]
            self._spares.clear()
        for timer in timers:
            timer.cancel()
        for spare in spares if kill else ():
            ray.kill(spare.actor, no_restart=True)

    def _start(self, bundles: list[int]) -> None:
        with self._starting:
            self._start_missing(bundles)

    def _start_missing(self, bundles: list[int]) -> None:
        with self._lock:
            missing = [
                bundle
                for bundle in bundles
                for _ in range(self.per_node - len(self._spares.get(bundle, [])))
            ]
        made = []
        for bundle in missing:  # outside the lock: a start may wait for Ray
            with self._lock:
                if self._closed:
                    break
                self._serial += 1
                serial = self._serial
            made.append((bundle, _Spare(self._make(bundle, serial))))
        with self._lock:
            late = made if self._closed else []
            for bundle, spare in made if not self._closed else ():
                self._spares.setdefault(bundle, []).append(spare)
        for _, spare in late:  # closed meanwhile: none outlives the pool
            ray.kill(spare.actor, no_restart=True)


def _answers(actor: Any) -> bool:
    """Whether `actor` answers within ANSWER_S (a spare ready once may have died since)."""
    try:
        ray.get(actor.serving.remote(), timeout=ANSWER_S)
    except (ray.exceptions.RayError, TimeoutError):
        return False
    return True
