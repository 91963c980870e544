"""One rank's link with the driver, as long as its actor lives: its output and its stacks.

A rank numbers its output chunks across calls, and an output request may outlive the
call that made it (it returns with what the rank prints next). So what the driver has
taken in, and the request in flight, belong to the rank's actor, not to one call: the
pool keeps one `RankChannel` per rank and starts a new one when it replaces the actor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from orchestrator.show.fold import FOLD_FROM_RANKS
from orchestrator_workers.protocol import OutputChunk

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
        chunks: list[OutputChunk] = ray.get(ref)
        if chunks:  # the pseudo-streams' chunks count as taken in too
            self.shown = max(self.shown, chunks[-1].seq)
        return chunks


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
