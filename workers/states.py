"""The states a job and its ranks go through, as the public API spells them."""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    """A job's state, or a rank's; equal to its string ("running"), as the public API shows it."""

    QUEUED = "queued"
    """Behind the function's previous call."""
    PENDING = "pending"
    """Waiting for resources (placement)."""
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"
    """A rank stopped because another rank failed or the job was cancelled."""

    def __str__(self) -> str:
        """The plain word, as in "train: running"."""
        return self.value
