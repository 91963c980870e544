"""What a node has: Python, Ray, torch, cloudpickle, and our rank side at which content.

`read` runs on the node as a Ray task before anything of ours is there, so this module
imports nothing but the standard library, and Ray ships it by value (see
`rankside.check_nodes`). `content_id` is the same on both sides: the driver compares its
own rank side's with what a node has installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform

RANK_SIDE = "orchestrator_workers"


def content_id(folder: str) -> str:
    """The rank side's content in `folder`: every .py file's name and bytes."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as source:
                digest.update(name.encode() + b"\0" + source.read())
    return digest.hexdigest()[:16]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def read() -> dict[str, str | None]:
    """This process's Python and versions, and its rank side's content id (None where it
    has none), read without importing any of them."""
    spec = importlib.util.find_spec(RANK_SIDE)
    folder = list(spec.submodule_search_locations or []) if spec is not None else []
    return {
        "python": platform.python_version(),
        "ray": _version("ray"),
        "torch": _version("torch"),
        "cloudpickle": _version("cloudpickle"),
        "rank_side": content_id(folder[0]) if len(folder) == 1 else None,
    }
