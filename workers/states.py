"""The states a job and its ranks go through, as the public API spells them.

Defined on the rank side, where a rank says it waits for a debugger; the driver re-exports
it as `orchestrator.State`.
"""

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
    WAITING = "waiting for a debugger"
    """A rank stopped at a breakpoint, until `orchestrator attach` reaches it."""
    ATTACHED = "in a debugger"
    """A rank whose pdb a terminal drives."""

    def __str__(self) -> str:
        """The plain word, as in "train: running"."""
        return self.value
