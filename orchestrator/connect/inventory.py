"""What a node has: Python, Ray, torch, cloudpickle, and our rank side at which content.

`read` runs on the node as a Ray task before anything of ours is there, so this module
imports nothing but the standard library and `bootstrap` (standard library only too), and
Ray ships both by value (see `rankside`). `content_id` is the same on both sides: the
driver compares its own rank side's with what a node has installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

from orchestrator.connect.bootstrap import PACKAGE as RANK_SIDE
from orchestrator.connect.bootstrap import content_id


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


DRIVER_SIDE = "orchestrator"
"""The driver's package: a detached job's supervisor runs it in the cluster."""


def _content(package: str) -> str | None:
    """The content id of `package` as this process would import it; None: it has none."""
    spec = importlib.util.find_spec(package)
    folder = list(spec.submodule_search_locations or []) if spec is not None else []
    return content_id(folder[0]) if len(folder) == 1 else None


def read() -> dict[str, str | None]:
    """This process's Python and versions, and the content ids of its rank side and driver
    side (None where it has none), read without importing any of them."""
    return {
        "python": platform.python_version(),
        "ray": _version("ray"),
        "torch": _version("torch"),
        "cloudpickle": _version("cloudpickle"),
        "rank_side": _content(RANK_SIDE),
        "driver_side": _content(DRIVER_SIDE),
    }
