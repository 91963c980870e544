"""The rank side's exceptions that reach a user's code: a snapshot's (re-exported by
`orchestrator.snapshot` and `orchestrator.errors`). The rank side's other exceptions stay
inside it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SnapshotError(RuntimeError):
    """An in-memory snapshot that cannot be saved or restored as asked; the message says
    what to do instead.

    Raised in a rank by `snapshot.save`, `snapshot.restore` and the dcp pair
    (`snapshot.writer`, `snapshot.reader`): called outside a function run by
    `distribute()`, or before `init_process_group()`; a state `save` cannot hold (a sparse
    or sharded tensor: use the dcp pair); a snapshot loaded through the other API than the
    one that saved it, or into another sharding or shape. A node without the memory for
    one raises `SnapshotMemoryError`.
    """


class SnapshotMemoryError(SnapshotError):
    """A node lacks the memory a snapshot needs: raised by `snapshot.save` on every rank
    alike before any copy is made (the previous snapshot is kept). Save less state, run
    fewer ranks per node, or checkpoint to disk instead."""

    def __init__(self, step: int, ranks: Sequence[int], needed: int, available: int) -> None:
        """The error for the snapshot of `step`, whose ranks `ranks` on one node need
        `needed` bytes more there, and `available` bytes are."""
        super().__init__(
            f"the in-memory snapshot of step {step} needs {_gb(needed)} more memory on the "
            f"node of ranks {', '.join(map(str, ranks))} (their own copies, and the copies "
            f"they keep for their buddies, all in process memory), and {_gb(available)} is "
            "available there (MemAvailable, or the container's memory limit): save less "
            "state, run fewer ranks per node, or checkpoint to disk instead"
        )
        self.step = step
        """The step whose snapshot was not taken."""
        self.ranks = tuple(ranks)
        """The ranks on the node that lacks the memory."""
        self.needed = needed
        """The bytes the snapshot adds on that node (copies of its ranks and their wards)."""
        self.available = available
        """The bytes that node can still give (MemAvailable, or its container's limit)."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields (its constructor builds its message)."""
        return (type(self), (self.step, self.ranks, self.needed, self.available))


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
