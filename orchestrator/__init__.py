"""Run one PyTorch training function as a multi-node torch.distributed job on Ray."""

from orchestrator.distribute import DistributedFunction, distribute
from orchestrator.errors import (
    BusyError,
    ClusterUnreachableError,
    ConfigError,
    DistributedError,
    JobTimeoutError,
    OrchestratorError,
    PlacementError,
    PlacementTimeoutError,
)
from orchestrator.job import Job, JobStatus, RankStatus

__all__ = [
    "BusyError",
    "ClusterUnreachableError",
    "ConfigError",
    "DistributedError",
    "DistributedFunction",
    "Job",
    "JobStatus",
    "JobTimeoutError",
    "OrchestratorError",
    "PlacementError",
    "PlacementTimeoutError",
    "RankStatus",
    "distribute",
]
