"""In-memory snapshots of a rank's training state, for recovery at the same step: the
rank-side API, importable in a rank without the driver's machinery (see
orchestrator_workers.snapshot, and orchestrator_workers.dcp for `writer` and `reader`,
loaded on first use: they import torch.distributed.checkpoint)."""

from typing import TYPE_CHECKING, Any

from orchestrator_workers.errors import SnapshotError, SnapshotMemoryError
from orchestrator_workers.snapshot import Restored, restore, save

if TYPE_CHECKING:
    from orchestrator_workers.dcp import Reader, Writer, reader, writer

__all__ = [
    "Reader",
    "Restored",
    "SnapshotError",
    "SnapshotMemoryError",
    "Writer",
    "reader",
    "restore",
    "save",
    "writer",
]

_DCP = frozenset({"Reader", "Writer", "reader", "writer"})


def __getattr__(name: str) -> Any:
    """The torch.distributed.checkpoint pair, imported on first use."""
    if name in _DCP:
        from orchestrator_workers import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'orchestrator.snapshot' has no attribute {name!r}")
