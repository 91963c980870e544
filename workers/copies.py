"""Where a rank's snapshot copies go and which step every rank can restore: each rank's
buddy (a rank on another node), the newest step all of them hold, and whether each node has
the memory a save adds there. Pure: what the ranks gathered in, a decision out."""

from __future__ import annotations

import contextlib
from typing import Any

from orchestrator_workers.errors import SnapshotMemoryError


def buddies(nodes: list[str]) -> list[int]:
    """For each rank, the rank that keeps its copy: counting on from one node's worth of
    ranks, the first on another node (on one node, the next rank; alone, itself)."""
    world = len(nodes)
    per_node = nodes.count(nodes[0])
    out = []
    for rank in range(world):
        others = [(rank + per_node + k) % world for k in range(world)]
        away = [r for r in others if nodes[r] != nodes[rank]]
        out.append(away[0] if away else (rank + 1) % world)
    return out


def agree(ranks: list[Any]) -> tuple[int | None, list[int]]:
    """The newest step every rank can restore (its own copy, or one another rank keeps
    for it), and the ranks with nothing of it; (None, those ranks) where there is none."""
    world = len(ranks)
    steps: list[set[int]] = [set() if own is None else {own} for _, _, own, _, _ in ranks]
    rank_of = {identity: rank for rank, (*_, identity) in enumerate(ranks)}
    for _, _, _, held, _ in ranks:  # once over every keeper's holdings, not once per rank
        for ward, kept in held.items():
            if ward in rank_of:  # a lost rank's copies serve nobody now (a shrink)
                steps[rank_of[ward]].update(kept)
    common = set.intersection(*steps) if steps else set()
    if common:
        return max(common), []
    newest = max((max(s) for s in steps if s), default=None)
    return None, [r for r in range(world) if newest is None or newest not in steps[r]]


def available_memory() -> int:
    """Bytes this node can still give: MemAvailable, or less under a cgroup's limit."""
    available = 1 << 62
    cgroup = "/sys/fs/cgroup/memory"
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as info:
        line = next(line for line in info if line.startswith("MemAvailable:"))
        available = int(line.split()[1]) * 1024
    with (
        contextlib.suppress(OSError, ValueError),
        open(f"{cgroup}.max") as limit,
        open(f"{cgroup}.current") as used,
    ):
        text = limit.read().strip()
        if text != "max":
            available = min(available, int(text) - int(used.read()))
    return available


def check_room(ranks: list[Any], step: int) -> None:
    """Raise on every rank alike if some node cannot hold what this snapshot adds there:
    each rank's ward's new copy (the previous one is kept until every rank has the new)
    and a rank's own copy where it is new or grew."""
    nodes: dict[str, tuple[int, int, list[int]]] = {}
    wards = {buddy: ward for ward, buddy in enumerate(buddies([r[0] for r in ranks]))}
    for rank, (where, _, _, _, grown, available) in enumerate(ranks):
        ward = wards.get(rank)
        incoming = ranks[ward][3] if ward is not None and ward != rank else 0
        need, _, members = nodes.get(where, (0, available, []))
        nodes[where] = (need + grown + incoming, available, [*members, rank])
    short = [(w, n, a, m) for w, (n, a, m) in nodes.items() if n > a]
    if not short:
        return
    _, need, available, members = short[0]
    raise SnapshotMemoryError(step, members, need, available)
