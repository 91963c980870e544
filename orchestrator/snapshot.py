"""In-memory snapshots of a rank's training state, for recovery at the same step: the
rank-side API, importable in a rank without the driver's machinery (see
orchestrator_workers.snapshot)."""

from orchestrator_workers.snapshot import Restored, SnapshotError, restore, save

__all__ = ["Restored", "SnapshotError", "restore", "save"]
