"""One rank's link with the driver, as long as its actor lives: its output and its stacks.

A rank numbers its output chunks across calls, and an output request may outlive the
call that made it (it returns with what the rank prints next). So what the driver has
taken in, and the request in flight, belong to the rank's actor, not to one call: the
pool keeps one `RankChannel` per rank and starts a new one when it replaces the actor.
A call's `CallOutput` makes the ranks' requests, takes in what they bring, and shows it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from orchestrator import crash
from orchestrator.options import FOLD_FROM_RANKS
from orchestrator_workers.protocol import EXIT_STREAM, STATE_STREAM, NodeInfo, OutputChunk, unwire

if TYPE_CHECKING:
    from orchestrator.show.logs import Console

DRAIN_POLL_S = 30.0
"""How long one output request waits on an idle rank before returning empty."""
DRAIN_GATHER_S = 0.1
"""From `GATHER_FROM_RANKS` ranks: once a rank prints, how long its output request waits
for more before returning, so that a rank printing every step costs the driver ten
requests a second, not one a line. The call's end returns it at once."""
GATHER_FROM_RANKS = FOLD_FROM_RANKS
"""Below this many ranks, each line comes as soon as it is printed (a person reads them
as they come); from it, output is gathered: the console folds it then, and a fold holds
a line for a moment anyway."""
POLL_S = 0.1
"""While ranks print (from `GATHER_FROM_RANKS`), how often their output is taken in."""
STACKS_WAIT_S = 3.0
"""How long to wait for the ranks' stacks before reporting without them."""


@dataclass
class RankChannel:
    """The driver's side of one rank actor's output: the request in flight, what was taken."""

    actor: Any
    drain: ray.ObjectRef | None = None
    """The output request in flight, if any: it brings what the rank prints next."""
    shown: int = 0
    """The seq of the last chunk taken in: a call owes only newer ones."""

    def request(self, gather_s: float) -> ray.ObjectRef:
        """The output request in flight, made now if there is none (one that gathers
        output for `gather_s` once some comes)."""
        if self.drain is None:
            self.drain = self.actor.drain.remote(DRAIN_POLL_S, gather_s)
        return self.drain

    def take(self) -> list[OutputChunk]:
        """What the request in flight brought (it must be ready); RayActorError if the
        rank is gone."""
        ref, self.drain = self.drain, None
        assert ref is not None, "take() without a request"
        chunks: list[OutputChunk] = unwire(ray.get(ref))
        if chunks:  # the pseudo-streams' chunks count as taken in too
            self.shown = max(self.shown, chunks[-1].seq)
        return chunks


class CallOutput:
    """One call's side of its ranks' output: the requests in flight, what they bring
    shown on `console`, and what each rank said of itself (its exit status, a debugger)."""

    def __init__(
        self, channels: Sequence[RankChannel], infos: Sequence[NodeInfo], console: Console
    ) -> None:
        """Output of the ranks whose `channels` these are (by rank), shown on `console`;
        every rank's request to be made. `infos`: where each rank runs (a dead rank's last
        words are read there)."""
        self.channels = channels
        self.infos = infos
        self.console = console
        self.gather_s = gather_s(len(channels))
        """How long each rank's output request gathers output once some comes."""
        self.shown_at = 0.0
        """When output was last taken in (ranks that print are then read every POLL_S)."""
        self.draining: dict[ray.ObjectRef, int] = {}
        """Each live rank's output request in flight: ref -> rank."""
        self._undrained = set(range(len(channels)))
        """Ranks whose output request is to be made (or found, if one is in flight)."""
        self.dead: set[int] = set()
        """Ranks whose actor is gone."""
        self.exit_codes: dict[int, int] = {}
        """Statuses ranks passed to os._exit, as they reported them just before."""
        self.waits_on: dict[int, str] = {}
        """Per rank, what it waits on beyond its work (a debugger), if anything."""

    def request(self) -> None:
        """Make the output requests still to be made (a rank's, once its last came back)."""
        for rank in self._undrained - self.dead:
            self.draining[self.channels[rank].request(self.gather_s)] = rank
        self._undrained.clear()

    def printing(self, now: float) -> bool:
        """Whether ranks print now, where their output is gathered (taken every POLL_S)."""
        return self.gather_s > 0 and now - self.shown_at < POLL_S

    def take(self, ready: list[ray.ObjectRef]) -> None:
        """Show what these ready output requests brought."""
        for ref in ready:
            self._show(self.draining.pop(ref))
        if ready:
            self.shown_at = time.monotonic()

    def owes(self, owed: Mapping[int, int]) -> bool:
        """Whether output up to `owed` (rank -> seq) is still to come from a live rank."""
        channels = self.channels
        return any(channels[r].shown < seq for r, seq in owed.items() if r not in self.dead)

    def last_words(self, rank: int) -> str:
        """Show what dead `rank` wrote in its last instant (saved by its keeper); return it."""
        self.dead.add(rank)
        channel = self.channels[rank]
        chunks = crash.last_words(self.infos[rank], channel.shown)
        self.console.write(rank, chunks)
        channel.shown = max([channel.shown, *(chunk.seq for chunk in chunks)])
        return "".join(chunk.data.decode(errors="replace") for chunk in chunks)

    def _show(self, rank: int) -> None:
        try:
            chunks = self.channels[rank].take()
        except RayActorError:
            self.dead.add(rank)
            return
        self._undrained.add(rank)
        for chunk in chunks:
            if chunk.stream == EXIT_STREAM:
                self.exit_codes[rank] = int(chunk.data)
            elif chunk.stream == STATE_STREAM:
                self.waits_on[rank] = chunk.data.decode()
        shown = [chunk for chunk in chunks if chunk.stream not in (EXIT_STREAM, STATE_STREAM)]
        self.console.write(rank, shown)


def gather_s(ranks: int) -> float:
    """How long an output request of a job of `ranks` ranks gathers output (see
    `GATHER_FROM_RANKS`)."""
    return DRAIN_GATHER_S if ranks >= GATHER_FROM_RANKS else 0.0


def rank_stacks(actors: Mapping[int, Any], wait_s: float = STACKS_WAIT_S) -> dict[int, str]:
    """The current stacks of each rank's actor, by rank, asked of all at once; within
    `wait_s`. A rank that cannot answer says why instead."""
    refs = {actor.stacks.remote(): rank for rank, actor in actors.items()}
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    found = {rank: f"(no answer within {wait_s:g} s)" for rank in refs.values()}
    for ref in done:
        try:
            found[refs[ref]] = ray.get(ref)
        except RayActorError:
            found[refs[ref]] = "(its process is gone)"
        except ray.exceptions.RayError as exc:
            found[refs[ref]] = f"(no answer: {type(exc).__name__})"
    return dict(sorted(found.items()))
