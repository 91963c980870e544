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
from orchestrator.supervise.detached import JobInfo, get_job, list_jobs
from orchestrator.supervise.follow import FollowedJob, SupervisorLostError
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
]
