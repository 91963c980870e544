"""A rank that stopped, named in seconds rather than at `stall_after`.

The rule: once every running rank has completed N steps, rank R is *stopped* when all the
other running ranks wait at one place on a collective (in its call, or with torch's flight
recorder saying their last collective is not done: DDP's all-reduce is waited on inside
autograd's backward, NCCL's at the next sync) and R, elsewhere, has for at least
T = max(FLOOR_S, K x the slowest of the last N steps of any rank):

- made no progress: its stack the same (the flight recorder's last collective too, read
  every few seconds while a stack stays put), and no output;
- used no CPU or I/O: its process and its children under a tenth of a core and under
  100 KB/s (see orchestrator_workers.sampler.IDLE_CORES), so a rank that saves a
  checkpoint, evaluates, or waits on its data loader's busy workers is not stopped.

It is named within T and about 2 s (the ranks' records are read once a second, judged
once a second), with the stall report's detail. It never ends a call: `on_stall="raise"`
acts at `stall_after` alone. Before N steps (compilation, warm-up, a loader filling its
workers), `stall_after` alone applies.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.diagnose.stall import PlaceGroup, StallReport
from orchestrator.show.text import clock
from orchestrator_workers.where import Where

K = 5.0
"""How many times its slowest recent step a rank may stay still and quiet."""
N = 10
"""Steps every running rank must have completed, and how many recent steps count."""
FLOOR_S = 10.0
"""However quick the steps, no rank is stopped before this."""


@dataclass(frozen=True)
class Stopped:
    """A rank that stopped while its peers wait for it in a collective."""

    rank: int
    after_s: float
    """The threshold it passed (T)."""
    report: StallReport
    """Who is where: the rank, and its peers in their collective."""

    def line(self) -> str:
        """'[train] rank 3 stopped: no progress, CPU or I/O for 0:12 (...)'."""
        groups = self.report.groups
        rank = next(g for g in groups if g.ranks == (self.rank,))
        peers = next(g for g in groups if g is not rank)
        return (
            f"[{self.report.name}] rank {self.rank} stopped: no progress, CPU or I/O for "
            f"{clock(rank.since_s)} (over {self.after_s:.0f} s, {K:g}x its peers' slowest "
            f"recent step) {rank.place}; {peers.sentence()}"
        )

    def __str__(self) -> str:
        """The line, then the stacks as the stall report shows them."""
        return "\n".join([self.line(), *str(self.report).splitlines()[1:]])


def threshold(
    steps: Mapping[int, tuple[int, Sequence[float]]], running: Collection[int]
) -> float | None:
    """T for `running` ranks, from each one's steps completed and its recent steps'
    lengths; None while any has completed fewer than N."""
    if not running or any(steps.get(rank, (0, ()))[0] < N for rank in running):
        return None
    slowest = max((max(steps[rank][1][-N:], default=0.0) for rank in running), default=0.0)
    return max(FLOOR_S, K * slowest)


def find(
    found: StallReport | None, where: dict[int, tuple[Where, float]], now: float, after_s: float
) -> Stopped | None:
    """The stopped rank in `found`, the stall report on the running ranks at `now`
    (monotonic) with `after_s` for `stall_after`: by the rule above, with T = `after_s`
    (`where`: each rank's last reading, and when it was read); None where there is none."""
    if found is None or found.unread or found.outside or len(found.groups) != 2:
        return None
    alone = [
        g
        for g in found.groups
        if len(g.ranks) == 1 and not g.moving and g.answers and not g.place.collective
    ]
    peers = [g for g in found.groups if g.answers and waits_on_collective(g)]
    if len(alone) != 1 or len(peers) != 1:
        return None  # not one rank elsewhere while the others wait in one collective
    rank = alone[0].ranks[0]
    entry, read_at = where[rank]
    if entry.quiet_s + (now - read_at) < after_s:
        return None  # it computes or moves data: a pause, not a stop
    return Stopped(rank, after_s, found)


def waits_on_collective(group: PlaceGroup) -> bool:
    """Whether `group`'s ranks wait on a collective: at its call, or where their last
    collective in torch's flight recorder is not done."""
    return group.place.collective or group.collective.endswith(", not done")
