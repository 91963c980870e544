"""A rank's figures through Ray's own metrics (`ray.util.metrics`): a cluster whose
Prometheus already scrapes Ray gets every rank's step, step time, samples a second, CPU,
memory and GPU with nothing to set up.

Recorded in the rank from its record as the sampler writes it (while a watched call
runs), at most once a second, labelled job, rank, node and pid: the labels of
the page's `/metrics` (orchestrator/observe/exposition.py), which serves the same names.
Ray's metrics agent on each node (started where the node has `ray[default]`) exports them
with Ray's own, each name prefixed `ray_` as Ray prefixes every application metric
(`ray_orchestrator_rank_step`); on a node without one, Ray keeps nothing. A gauge keeps
its last value after a call ends, until the rank's process does. Recording never fails a
rank: where Ray's metrics cannot be made, the rank goes on without them.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from orchestrator_workers.figures import Figures, from_record
from orchestrator_workers.progress import SamplesRate
from orchestrator_workers.where import Where

HELP = {
    "orchestrator_rank_step": (
        "Steps the rank's function completed in this call (optimizer steps, or report(step=))."
    ),
    "orchestrator_rank_step_seconds": "How long the rank's newest step took.",
    "orchestrator_rank_last_step_timestamp_seconds": (
        "When the rank's newest step ended (Unix time)."
    ),
    "orchestrator_rank_samples_per_second": (
        "Samples a second, from the samples the function reports."
    ),
    "orchestrator_rank_cpu_cores": "CPU the rank's process uses, in cores (every thread).",
    "orchestrator_rank_memory_bytes": "The rank's process's resident memory.",
    "orchestrator_rank_gpu_memory_bytes": (
        "CUDA memory torch allocated on the rank's GPU (where CUDA is up)."
    ),
    "orchestrator_rank_gpu_utilization_ratio": (
        "Share of the last sample period the rank's GPU ran a kernel (0 to 1)."
    ),
}
"""The figures a rank records, by metric name: what each says."""
LABELS = ("job", "rank", "node", "pid")
EVERY_S = 1.0
"""Recorded at most this often (Ray's agents push every 10 s by default): a record written
at each look while steps go by costs no more than one a second."""


class RayMetrics:
    """One rank's gauges in Ray's metrics, made at the first record."""

    def __init__(self, node: str) -> None:
        """The node this rank's figures are labelled with; the job's name is its call's
        (a spare serves another job each time), the rank read at each record (a rank can
        be renumbered)."""
        self._job = ""
        self._node = node
        self._pending: Where | None = None
        """The newest record not recorded yet (within a second of the last)."""
        self._gauges: dict[str, Any] | None = None
        self._off = False
        self._samples = SamplesRate()
        self._recorded = -EVERY_S

    def begin(self, job: str) -> None:
        """A call of job `job` begins: its figures are labelled so, its samples count anew."""
        self._job = job
        self._samples.reset()

    def record(self, where: Where) -> None:
        """Set each gauge from the record the rank just wrote (at most once a second: else
        kept for the next, or `flush`); never raises."""
        now = time.monotonic()
        if self._off or now - self._recorded < EVERY_S:
            self._pending = where
            return
        self._recorded, self._pending = now, None
        try:
            gauges = self._gauges if self._gauges is not None else self._made()
            tags = {
                "job": self._job,
                "rank": os.environ.get("RANK", ""),
                "node": self._node,
                "pid": str(os.getpid()),
            }
            for name, value in self._values(where).items():
                if value is not None:
                    gauges[name].set(value, tags)
        except Exception as exc:  # noqa: BLE001 - the rank goes on without Ray's metrics
            self._off = True
            print(
                f"[orchestrator] this rank's figures are not in Ray's metrics: {exc!r}",
                file=sys.stderr,
                flush=True,
            )

    def flush(self) -> None:
        """Record the newest record kept back (a call's end: its last step counts)."""
        pending = self._pending
        if pending is not None:
            self._recorded = -EVERY_S
            self.record(pending)

    def _made(self) -> dict[str, Any]:
        from ray.util.metrics import Gauge  # loaded with Ray in every rank; only here in tests

        self._gauges = {name: Gauge(name, text, LABELS) for name, text in HELP.items()}
        return self._gauges

    def _values(self, where: Where) -> dict[str, float | None]:
        rate = self._samples.of(where.reported_at, where.samples_total)
        return values(from_record(where, time.time(), rate))


def values(figures: Figures) -> dict[str, float | None]:
    """A rank's figures as the metrics of HELP, in base units (None: not known, so no
    sample); the page's `/metrics` serves the same (orchestrator/observe/exposition.py)."""
    gpu_mb, gpu_busy = figures.gpu_mb, figures.gpu_busy
    return {
        "orchestrator_rank_step": (
            float(figures.step) if figures.last_step_at is not None else None
        ),
        "orchestrator_rank_step_seconds": figures.step_s,
        "orchestrator_rank_last_step_timestamp_seconds": figures.last_step_at,
        "orchestrator_rank_samples_per_second": figures.samples_per_s,
        "orchestrator_rank_cpu_cores": figures.cpu,
        "orchestrator_rank_memory_bytes": figures.rss_mb * 2**20,
        "orchestrator_rank_gpu_memory_bytes": gpu_mb * 2**20 if gpu_mb is not None else None,
        "orchestrator_rank_gpu_utilization_ratio": gpu_busy / 100 if gpu_busy is not None else None,
    }
