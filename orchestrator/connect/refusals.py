"""What Ray's refusals to connect mean: a head whose session server died, another Ray or Python."""

from __future__ import annotations

import re

from orchestrator.errors import ClusterMismatchError

_CLIENT_SERVER_DIED = ("Starting Ray client server failed", "in start_specific_server")
"""What the head says when the session's server died at birth: its own words, or the
traceback of its check of the dying process (psutil's ZombieProcess, a race in Ray's own)."""


def server_died(exc: BaseException) -> bool:
    """Whether a Ray Client connect failed because the head's server for it died at birth."""
    return isinstance(exc, ConnectionAbortedError) and any(
        words in str(exc) for words in _CLIENT_SERVER_DIED
    )


_VERSIONS = re.compile(r"Ray: (\S+)\s+Python: (\S+)")


def version_mismatch(refusal: str, address: str) -> ClusterMismatchError | None:
    """Ray's refusal of a driver whose Ray or Python differs from the cluster's, said in one
    line with what to install; None for any other error."""
    found = _VERSIONS.findall(refusal)
    if not refusal.startswith("Version mismatch") or len(found) != 2:
        return None
    (ray_there, py_there), (ray_here, py_here) = found
    differ, fix = [], []
    if py_there != py_here:
        differ.append("Python")
        fix.append(f"a venv made with Python {py_there}")
    if ray_there != ray_here:
        differ.append("Ray")
        fix.append(f"ray=={ray_there}" + (" in it" if fix else ""))
    return ClusterMismatchError(
        f"the Ray cluster at {address} runs Ray {ray_there} on Python {py_there}, this driver "
        f"Ray {ray_here} on Python {py_here}: {' and '.join(differ)} must be the same. Use "
        f"{' with '.join(fix)} here, or start the cluster with this driver's"
    )
