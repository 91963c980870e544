"""Run one PyTorch training function as a multi-node torch.distributed job on Ray."""

from orchestrator.distribute import DistributedFunction, distribute
from orchestrator.errors import (
    ConfigError,
    DistributedError,
    JobTimeoutError,
    OrchestratorError,
    PlacementError,
)

__all__ = [
    "ConfigError",
    "DistributedError",
    "DistributedFunction",
    "JobTimeoutError",
    "OrchestratorError",
    "PlacementError",
    "distribute",
]
