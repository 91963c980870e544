"""The Ray names of a pool's actors, in one namespace, so other drivers (`orchestrator
stacks`) find a job's ranks: NAME-POOLID-rRANK, and NAME-POOLID-spareN for warm spares."""

from __future__ import annotations

import re

ACTOR_NAMESPACE = "orchestrator"
"""Ray namespace of every rank's actor, named `actor_name(...)`, so other drivers find them."""
_ACTOR_NAME = re.compile(r"^(?P<job>.+)-(?P<pool>[0-9a-f]{8})-r(?P<rank>\d+)(?:\.\d+)?$")
_SPARE_NAME = re.compile(r"^(?P<job>.+)-(?P<pool>[0-9a-f]{8})-spare\d+$")


def actor_name(job_name: str, pool_id: str, rank: int, attempt: int = 0) -> str:
    """The Ray actor name of `rank` in pool `pool_id` of job `job_name`: NAME-ID-rRANK.

    A rank's actor replaced at restart N is NAME-ID-rRANK.N (names are freed lazily).
    """
    return f"{job_name}-{pool_id}-r{rank}" + (f".{attempt}" if attempt else "")


def spare_name(job_name: str, pool_id: str, serial: int) -> str:
    """The Ray actor name of pool `pool_id`'s warm spare number `serial` (see standby): it
    keeps it when it serves a rank (ask it which: `serving`)."""
    return f"{job_name}-{pool_id}-spare{serial}"


def parse_spare_name(name: str) -> tuple[str, str] | None:
    """(job name, pool id) of one of our spares' names; None for any other name."""
    match = _SPARE_NAME.match(name)
    return None if match is None else (match["job"], match["pool"])


def parse_actor_name(name: str) -> tuple[str, str, int] | None:
    """(job name, pool id, rank) of one of our actors' names; None for any other name."""
    match = _ACTOR_NAME.match(name)
    if match is None:
        return None
    return match["job"], match["pool"], int(match["rank"])
