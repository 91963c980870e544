"""A picture of many ranks that fits on a screen: grouped by state and node, odd ones first.

Up to `SUMMARY_FROM_RANKS` ranks a job's table has a row per rank. From there on it
has a row per group: the ranks that differ from the rest (the root cause, failed,
stopped, waiting for or in a debugger, silent while their peers write) come first,
one row per state and node; the ranks in the usual state share one row last. Each
row's last output is its ranks' last lines folded (`Rank 0..127: Epoch 3`). The
per-rank rows stay one click (the HTML's details) or one call
(`job.table().text(full=True)`) away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrator.show.fold import fold_lines
from orchestrator.show.text import rank_label

SUMMARY_FROM_RANKS = 16
"""From this many ranks a table summarizes: 16 rows still fit a screen, 32 do not."""
SILENT_S = 60.0
"""A running rank that wrote nothing for this long, while most of its peers did, is odd."""


@dataclass(frozen=True)
class StateGroup:
    """Ranks shown as one row: one state (and, for odd ones, one node)."""

    state: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    last_line: str
    """Their last lines, folded where they differ only in numbers."""
    odd: bool
    """They differ from the usual state (or are the root cause, or silent)."""
    root_cause: bool = False

    @property
    def label(self) -> str:
        """r0-63,65-127."""
        return f"r{rank_label(self.ranks)}"

    @property
    def where(self) -> str:
        """Their node, or how many nodes (with the first few)."""
        if len(self.nodes) <= 2:
            return ", ".join(self.nodes)
        return f"{len(self.nodes)} nodes ({self.nodes[0]}, ...)"


@dataclass(frozen=True)
class RankView:
    """What a summary needs of one rank."""

    rank: int
    node: str
    state: str
    last_line: str = ""
    root_cause: bool = False
    silent_s: float | None = None
    """How long it has written nothing, while running; None where not known."""


def group(ranks: Sequence[RankView]) -> list[StateGroup]:
    """`ranks` grouped: the root cause, then the odd ones (fewest first), then the usual."""
    if not ranks:
        return []
    usual = Counter(r.state for r in ranks).most_common(1)[0][0]
    silent = _silent(ranks)
    buckets: dict[tuple[str, bool, bool, str], list[RankView]] = {}
    for r in ranks:
        state = f"{r.state} (silent {r.silent_s:.0f} s)" if r.rank in silent else r.state
        odd = state != usual or r.root_cause
        buckets.setdefault((state, r.root_cause, odd, r.node if odd else ""), []).append(r)
    groups = [
        StateGroup(
            state=state,
            ranks=tuple(r.rank for r in members),
            nodes=tuple(dict.fromkeys(r.node for r in members)),
            last_line=_last_line(members),
            odd=odd,
            root_cause=cause,
        )
        for (state, cause, odd, _), members in buckets.items()
    ]
    groups.sort(key=lambda g: (not g.root_cause, not g.odd, len(g.ranks), g.ranks[0]))
    return groups


def states_line(states: Iterable[tuple[int, str]]) -> str:
    """Ranks by state, the fewest first: "r5 failed, r0-4,6-127 running"."""
    by_state: dict[str, list[int]] = {}
    for rank, state in states:
        by_state.setdefault(state, []).append(rank)
    ordered = sorted(by_state.items(), key=lambda item: (len(item[1]), min(item[1])))
    return ", ".join(f"r{rank_label(ranks)} {state}" for state, ranks in ordered)


def _silent(ranks: Sequence[RankView]) -> set[int]:
    """Running ranks quiet for SILENT_S while most running peers wrote within it."""
    running = [r for r in ranks if r.silent_s is not None]
    quiet = {r.rank for r in running if (r.silent_s or 0.0) >= SILENT_S}
    return quiet if quiet and len(quiet) * 2 < len(running) else set()


def _last_line(members: Sequence[RankView]) -> str:
    lines = {r.rank: r.last_line for r in members if r.last_line}
    if not lines:
        return ""
    folded = fold_lines(lines)
    first = folded[0]
    shown = first.text
    if len(first.ranks) < len(members):
        shown = f"[r{rank_label(first.ranks)}] {shown}"
    others = len(folded) - 1
    return shown + (f" (+{others} other line{'s' if others > 1 else ''})" if others else "")


def group_stacks(stacks: dict[int, str]) -> list[tuple[tuple[int, ...], str]]:
    """Ranks whose stacks read the same, together: the odd ones out (fewest) first."""
    same: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        same.setdefault(stacks[rank], []).append(rank)
    groups = [(tuple(ranks), text) for text, ranks in same.items()]
    return sorted(groups, key=lambda g: (len(g[0]), g[0][0]))


def stacks_title(ranks: Sequence[int]) -> str:
    """'rank 5', or 'ranks 0-4,6-127 (127 ranks, the same stacks)'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {rank_label(ranks)} ({len(ranks)} ranks, the same stacks)"
