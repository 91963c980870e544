"""A call that stopped moving: which ranks are where, the odd ones out first.

Each rank looks at its own function thread five times a second (see
`orchestrator_workers.sampler`); `Watch` reads those looks one rank per node, every few
seconds once a call has run a while. A rank makes progress while its stack changes, its
last collective moves on, or it writes output; a rank at a breakpoint is left out. Once
ranks have made none for `stall_after` seconds, `StallReport` says who is where and for
how long, facts only:

    [train] no progress for 0:45: rank 5 is at loader.py:88 in __getitem__;
    127 ranks (r0-4,6-127) wait in all_reduce at train.py:42
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayError

from orchestrator.diagnose.straggle import Shares
from orchestrator.show.text import clock, rank_label
from orchestrator.waits import whole_ms
from orchestrator_workers.places import UNSEEN, Frame, Place, place_of
from orchestrator_workers.protocol import unwire
from orchestrator_workers.where import Where

if TYPE_CHECKING:
    from orchestrator.observe.series import Series
    from orchestrator.pool import Pool

READ_EVERY_S = 1.0
"""While a watched call runs, how often each node's records are read: where its ranks
are, and their figures (each rank writes its record once a second, and within 0.2 s of a
step)."""
FIRST_READ_S = 1.0
"""A call shorter than this (or than half its `stall_after`) is never read."""
LAST_READ_S = 1.0
"""Once a call whose ranks step or report returned: how long their last records may take."""
ANSWER_S = 10.0
"""A rank that has not looked at its stack for this long does not answer: a C call
holding the GIL, a stopped process."""
READER_S = 5.0
"""A node's reader that has not answered in this long is passed over: the node is read
through another of its ranks (a reading takes milliseconds)."""
BUSY = 0.5
"""A rank using this share of a core at one place is said to be on CPU (it computes)."""


def format_stack(frames: Sequence[Frame]) -> str:
    """A stack as a traceback shows it, innermost call last."""
    if not frames:
        return "  (no Python frame: the function's thread is in native code)"
    lines = []
    for f in frames:
        lines.append(f'  File "{f.file}", line {f.line}, in {f.function}')
        if f.code:
            lines.append(f"    {f.code}")
    return "\n".join(lines)


@dataclass(frozen=True)
class PlaceGroup:
    """Ranks at one place, all making progress or all not."""

    ranks: tuple[int, ...]
    place: Place
    moving: bool
    answers: bool
    since_s: float
    """Without progress this long (the least among them); for ranks that do not
    answer, how long since they last looked."""
    stack: str
    """The first rank's stack."""
    collective: str = ""
    """The first rank's last collective in torch's flight recorder, if it was read."""
    cpu: float = 0.0
    """The most CPU (share of a core) any of them used between its last two looks."""

    def who(self) -> str:
        """'rank 5', '127 ranks (r0-4,6-127)'."""
        return _who(self.ranks)

    def sentence(self) -> str:
        """'rank 5 is at loader.py:88 in __getitem__', '4 ranks (r0-3) wait in barrier at ...'."""
        one = len(self.ranks) == 1
        last = f"; last collective: {self.collective}" if self.collective else ""
        if not self.answers:
            verb = "does" if one else "do"
            seen = f"; last seen {self.place}" if self.place.line else ""
            return (
                f"{self.who()} {verb} not answer (no look at its stack for "
                f"{clock(self.since_s)}{seen}{last})"
            )
        verbs = ("waits", "wait") if self.place.collective else ("is", "are")
        verb = verbs[0] if one else verbs[1]
        note = f" (last collective: {self.collective})" if self.collective else ""
        busy = f", on CPU {self.cpu:.0%}" if self.cpu >= BUSY else ""
        return f"{self.who()} {verb} {self.place}{busy}{note}"


@dataclass(frozen=True)
class StallReport:
    """Ranks without progress for a while: who is where, the odd ones out first."""

    name: str
    since_s: float
    """How long the ranks without progress have had none (the least among them)."""
    groups: tuple[PlaceGroup, ...]
    """The ranks without progress, fewest first; then those that moved lately."""
    returned: tuple[int, ...] = ()
    """Ranks whose function has returned while these run."""
    unread: tuple[int, ...] = ()
    """Running ranks not read yet (or not lately): nothing is said of where they are."""
    outside: tuple[int, ...] = ()
    """Ranks whose call runs but whose function does not (yet, or any more)."""

    @property
    def stalled(self) -> bool:
        """Whether no running rank makes progress (else some wait while others move)."""
        return not any(g.moving for g in self.groups)

    def line(self) -> str:
        """One line: the status line's and the table's."""
        still = [g for g in self.groups if not g.moving]
        moving = [g for g in self.groups if g.moving]
        text = "; ".join(g.sentence() for g in still)
        if moving:
            count = sum(len(g.ranks) for g in still)
            head = f"{count} rank{'s' if count > 1 else ''} without progress for "
            lately = clock(math.ceil(max(1.0, *(g.since_s for g in moving))))
            text = f"{head}{clock(self.since_s)}: {text}; moved within the last {lately}: "
            text += "; ".join(g.sentence() for g in moving)
        else:
            text = f"no progress for {clock(self.since_s)}: {text}"
        collectives = {g.place.calls for g in self.groups if g.place.collective and g.answers}
        if len(collectives) > 1:
            text += "; the ranks are in different collectives"
        if self.returned:
            verb = "has" if len(self.returned) == 1 else "have"
            text += f"; {_who(self.returned)} {verb} returned"
        if self.outside:
            verb = "is" if len(self.outside) == 1 else "are"
            text += f"; {_who(self.outside)} {verb} not in the function (starting it, or returning)"
        if self.unread:
            text += f"; {_who(self.unread)} not read lately"
        elif (
            not self.returned
            and not self.outside
            and len(still) == 1
            and not moving
            and still[0].place.collective
        ):
            text += (
                "; no rank of the job is elsewhere: what they wait for is outside the "
                "job's ranks (the network, or a process outside the job)"
            )
        return f"[{self.name}] {text}"

    def places(self) -> str:
        """Who is where now, odd ones first, without judging progress ('orchestrator stacks')."""
        parts = []
        for g in self.groups:
            text = g.sentence()
            parts.append(text if not g.answers else f"{text}, for {clock(g.since_s)}")
        if self.outside:
            verb = "is" if len(self.outside) == 1 else "are"
            parts.append(f"{_who(self.outside)} {verb} not in the function")
        return f"[{self.name}] where the functions are: " + "; ".join(parts)

    def __str__(self) -> str:
        """The line, then each group's first rank's stack."""
        parts = [self.line()]
        for g in self.groups:
            whose = "" if len(g.ranks) == 1 else f": rank {g.ranks[0]}'s stack"
            parts += ["", f"--- {g.who()}{whose} ---", g.stack]
        return "\n".join(parts)


def report(
    name: str,
    now: float,
    where: dict[int, tuple[Where, float]],
    running: Collection[int],
    last_output: Sequence[float],
    *,
    after_s: float,
    returned: Collection[int] = (),
    mute: Collection[int] = (),
) -> StallReport | None:
    """The report on `running` ranks at `now` (monotonic), if any has made no progress
    for `after_s`; else None.

    `where`: each rank's last reading, with when it was read; `last_output`: when each
    rank last wrote; `mute`: ranks that did not answer the request to read their node.
    """
    seen: dict[tuple[Place, bool], list[tuple[int, float, Where | None]]] = {}
    unread, outside = [], []
    for rank in sorted(running):
        found = where.get(rank)
        quiet = now - last_output[rank]
        if found is None:
            if rank not in mute:
                unread.append(rank)  # nothing to say about it
                continue
            entry, place, answers, still = None, UNSEEN, False, quiet
        else:
            entry, read_at = found
            late = now - read_at
            if not entry.running:  # setting up its call, or its run's end is on its way
                outside.append(rank)
                continue
            if late > ANSWER_S + 5.0 and rank not in mute:  # its node was not read again
                unread.append(rank)
                continue
            # Since the reading its stack is taken to be the same; whether it answers is
            # what its own record said then (a node not read again says nothing of it).
            age = entry.age_s if entry.age_s is not None else quiet
            answers = age < ANSWER_S and rank not in mute
            place = place_of(entry.frames)
            still = entry.still_s + late if answers else age + late
        seen.setdefault((place, answers), []).append((rank, min(still, quiet), entry))
    # Ranks at one place are one group, without progress if any of them has made none
    # for `after_s`: peers that reached a stuck collective a moment later are no different.
    if all(since < after_s for members in seen.values() for _, since, _ in members):
        return None
    groups = []
    for (place, answers), members in seen.items():
        first = members[0][2]
        groups.append(
            PlaceGroup(
                ranks=tuple(rank for rank, _, _ in members),
                place=place,
                moving=all(since < after_s for _, since, _ in members),
                answers=answers,
                since_s=min(since for _, since, _ in members),
                stack=_stack(first, answers),
                collective=first.collective if first is not None else "",
                cpu=max((w.cpu for _, _, w in members if w is not None), default=0.0),
            )
        )
    groups.sort(key=lambda g: (g.moving, len(g.ranks), g.ranks[0]))
    since_s = min(g.since_s for g in groups if not g.moving)
    return StallReport(
        name, since_s, tuple(groups), tuple(sorted(returned)), tuple(unread), tuple(outside)
    )


class Watch:
    """Reads where a call's ranks are, where their time went and their figures, one rank
    per node, every READ_EVERY_S once the call has run FIRST_READ_S (or `after_s / 2`)."""

    def __init__(
        self, pool: Pool, started: float, after_s: float, *, series: Series, key: str
    ) -> None:
        """A watch over `pool`'s ranks for call `key` started at `started` (monotonic);
        each new reading goes into the job's `series`."""
        self.pool = pool
        self.after_s = after_s
        self.series = series
        self.key = key
        self.every = READ_EVERY_S
        self.next_read = started + min(after_s / 2, FIRST_READ_S)
        self.nodes = {node: reach.ranks for node, reach in pool.routes.nodes.items()}
        self.where: dict[int, tuple[Where, float]] = {}
        self.pending: dict[ray.ObjectRef, tuple[str, int, float]] = {}
        """Readings asked for: node, the rank asked, when."""
        self.mute: set[int] = set()
        """Ranks that have not answered a request to read their node within ANSWER_S."""
        self.shares = Shares()
        """Where each rank's time went, for the slow ones (see orchestrator.straggle)."""
        self.readings = 0
        """How many node readings came back: what is judged changes only with them."""

    def last_reading(self, wait_s: float = LAST_READ_S) -> None:
        """Once the call's ranks returned, where they were seen to step or report: read
        each node once more (their last steps and reports), within `wait_s`."""
        if not self.readings or not self.series.stepping:
            return
        self.next_read = 0.0
        self.tick(time.monotonic())
        until = time.monotonic() + wait_s
        while self.pending and (left := until - time.monotonic()) > 0:
            ray.wait(list(self.pending), num_returns=len(self.pending), timeout=whole_ms(left))
            self.tick(time.monotonic())

    def tick(self, now: float) -> float:
        """Take the readings that came back, ask for the next if due; when to tick next."""
        if self.pending:
            refs = list(self.pending)
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                _, rank, _ = self.pending.pop(ref)
                self.mute.discard(rank)
                try:
                    readings: list[Where] = unwire(ray.get(ref))
                except RayError:  # the rank's actor died: its run says how
                    continue
                self.readings += 1
                for entry in readings:
                    kept = self.where.get(entry.rank)
                    if newer(entry, kept[0] if kept is not None else None):
                        self.where[entry.rank] = (entry, now)
                        self.shares.add(entry, now)
                        self.series.add(entry.rank, self.pool.infos[entry.rank], entry, self.key)
            for _, rank, sent in self.pending.values():
                if now - sent >= min(READER_S, ANSWER_S):
                    self.mute.add(rank)
        if now < self.next_read:
            return self.next_read
        self.next_read = now + self.every
        for node, ranks in self.nodes.items():
            asked = [rank for n, rank, _ in self.pending.values() if n == node]
            if any(rank not in self.mute for rank in asked):
                continue  # a reading is on its way
            # A node whose reader does not answer is read through another of its ranks.
            reader = next((r for r in ranks if r not in self.mute and r not in asked), None)
            if reader is not None:
                pids = {r: self.pool.infos[r].pid for r in ranks}
                self.pending[self.pool.actors[reader].where.remote(pids)] = (node, reader, now)
        return self.next_read


def newer(entry: Where, kept: Where | None) -> bool:
    """Whether `entry` is a later reading of its rank than `kept`: by when the rank last
    looked (on its node's monotonic clock: a step of its wall clock changes nothing),
    then by when it was read (the same look, read later, is
    older by then). Two readers of one node (one passed over, then answering late) may
    bring readings out of order; a rank that stopped looking is read the same each time."""
    if kept is None:
        return True
    return (entry.sampled, entry.age_s or 0.0) >= (kept.sampled, kept.age_s or 0.0)


def _who(ranks: Sequence[int]) -> str:
    """'rank 5', '127 ranks (r0-4,6-127)'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"{len(ranks)} ranks (r{rank_label(ranks)})"


def _stack(where: Where | None, answers: bool) -> str:
    if where is None:
        return "  (never read: its node's reader does not answer)"
    if not where.frames and not answers:
        return "  (never seen: it has not looked at its stack since the call began)"
    return format_stack(where.frames)
