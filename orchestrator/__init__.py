"""Run one PyTorch training function as a multi-node torch.distributed job on Ray.

Names are imported on first use, so a rank that imports `orchestrator.snapshot` loads
none of the driver's machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.errors import (
        BusyError,
        ClusterMismatchError,
        ClusterUnreachableError,
        ConfigError,
        DistributedError,
        JobTimeoutError,
        OrchestratorError,
        PlacementError,
        PlacementTimeoutError,
        StallError,
        SupervisorLostError,
    )
    from orchestrator.function import DistributedFunction, distribute
    from orchestrator.job import Job
    from orchestrator.jobstatus import JobStatus, RankStatus
    from orchestrator.options import CallOptions, default_log_dir
    from orchestrator.supervise.catalog import JobInfo, get_job, list_jobs
    from orchestrator.supervise.follow import FollowedJob
    from orchestrator_workers.progress import report
    from orchestrator_workers.protocol import RankFailure
    from orchestrator_workers.states import State

_WHERE = {
    "orchestrator.function": ("DistributedFunction", "distribute"),
    "orchestrator.errors": (
        "BusyError",
        "ClusterMismatchError",
        "ClusterUnreachableError",
        "ConfigError",
        "DistributedError",
        "JobTimeoutError",
        "OrchestratorError",
        "PlacementError",
        "PlacementTimeoutError",
        "StallError",
        "SupervisorLostError",
    ),
    "orchestrator.job": ("Job",),
    "orchestrator.jobstatus": ("JobStatus", "RankStatus"),
    "orchestrator.options": ("CallOptions", "default_log_dir"),
    "orchestrator.supervise.catalog": ("JobInfo", "get_job", "list_jobs"),
    "orchestrator.supervise.follow": ("FollowedJob",),
    "orchestrator_workers.progress": ("report",),
    "orchestrator_workers.protocol": ("RankFailure",),
    "orchestrator_workers.states": ("State",),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "BusyError",
    "CallOptions",
    "ClusterMismatchError",
    "ClusterUnreachableError",
    "ConfigError",
    "DistributedError",
    "DistributedFunction",
    "FollowedJob",
    "Job",
    "JobInfo",
    "JobStatus",
    "JobTimeoutError",
    "OrchestratorError",
    "PlacementError",
    "PlacementTimeoutError",
    "RankFailure",
    "RankStatus",
    "StallError",
    "State",
    "SupervisorLostError",
    "default_log_dir",
    "distribute",
    "get_job",
    "list_jobs",
    "report",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept here)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the submodules imported so far."""
    return sorted({*globals(), *__all__})
