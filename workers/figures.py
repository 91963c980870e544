"""One rank's figures at one reading: its step, how long the step took, samples per second,
CPU, memory, GPU and what its function reported; numbers, not words.

Read from its record (`where.Where`) by the rank itself for Ray's metrics (`raymetrics`)
and by the driver for the job's numbers over time, its page and its `/metrics`: one
reading of a record, for both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator_workers.where import Where


@dataclass(frozen=True)
class Figures:
    """One rank's figures at one reading (see `from_record`)."""

    at: float
    """When the rank wrote them (wall clock)."""
    step: int
    """Steps its function completed in this call (see orchestrator_workers.progress)."""
    last_step_at: float | None
    """When the newest step ended (None: no step yet)."""
    step_s: float | None
    """How long the newest step took."""
    samples_per_s: float | None
    """From the `samples` it reports (None: it reports none)."""
    cpu: float
    """Cores its whole process used (every thread)."""
    rss_mb: float
    gpu_mb: float | None
    """torch's CUDA memory allocated (None: CUDA is not up)."""
    gpu_busy: int | None
    """Percent of the last sample period its GPU ran a kernel (None: not known)."""
    scalars: Mapping[str, float] = field(default_factory=dict)
    """What its function reported last (`orchestrator.report`)."""

    def use(self) -> str:
        """What the process uses: '1.0 cores, 0.3 GB, GPU 3.1 GB 87% busy'."""
        text = f"{self.cpu:.1f} cores, {self.rss_mb / 1024:.1f} GB"
        if self.gpu_mb is not None:
            text += f", GPU {self.gpu_mb / 1024:.1f} GB"
            text += f" {self.gpu_busy}% busy" if self.gpu_busy is not None else ""
        return text


def from_record(where: Where, at: float, samples_per_s: float | None = None) -> Figures:
    """The figures a rank's record carries (`at`: when it was written, on this clock)."""
    newest = where.recent_steps[-1] if where.recent_steps else None
    return Figures(
        at=at,
        step=where.steps,
        last_step_at=newest[1] if newest is not None else None,
        step_s=newest[2] if newest is not None else None,
        samples_per_s=samples_per_s,
        cpu=where.process_cpu,
        rss_mb=where.rss_mb,
        gpu_mb=where.gpu_mb,
        gpu_busy=where.gpu_busy,
        scalars=dict(where.scalars or {}),
    )
