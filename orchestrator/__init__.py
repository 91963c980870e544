"""Run one PyTorch training function as a multi-node torch.distributed job on Ray."""

from orchestrator.distribute import DistributedFunction, distribute
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
)
from orchestrator.job import Job, JobStatus, RankStatus
from orchestrator.options import CallOptions, default_log_dir
from orchestrator_workers.protocol import RankFailure
from orchestrator_workers.states import State

__all__ = [
    "BusyError",
    "CallOptions",
    "ClusterMismatchError",
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
    "RankFailure",
    "RankStatus",
    "StallError",
    "State",
    "default_log_dir",
    "distribute",
]
