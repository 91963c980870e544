"""Where the cluster keeps its detached functions' supervisors: any process that reaches it
finds them, and through them their jobs.

One record per supervisor in Ray's internal key-value store (namespace "orchestrator"),
under `supervisors/<actor name>`, written once when it starts; each supervisor keeps its
own jobs' records (`JobRecord`) and answers for them (`Supervisor.find`, `.jobs`), so a
call records nothing here and `list_jobs` asks each supervisor once for its jobs, however
many it keeps. A warm pool is recorded under `pools/<key>` for a later driver that asks for the
same. Whoever holds the cluster's token may read and change these, as they may use the
cluster.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import platform
import secrets
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass

import cloudpickle

from orchestrator import _ray_compat
from orchestrator.connect import rankside
from orchestrator.options import Options
from orchestrator_workers.protocol import SUPERVISOR_PREFIX

SUPERVISORS = "supervisors/"
POOLS = "pools/"
EARLIER_JOBS = "jobs/"
"""Where versions before 2026-12 recorded each job (read only, see `earlier_record`)."""


@dataclass(frozen=True)
class ConsoleOptions:
    """How a follower shows the job's output: as its driver asked."""

    log_prefix: str
    log_ranks: Collection[int] | None
    fold_output: bool | None


@dataclass(frozen=True)
class JobRecord:
    """A detached job, as the cluster records it."""

    id: str
    """The job's name and a short random part, e.g. "train-3f9a1c"."""
    name: str
    supervisor: str
    """The name of its supervisor's actor (namespace "orchestrator")."""
    ranks: int
    started: float
    """When it was submitted (time.time())."""
    user: str
    """Who submitted it, and from where: "alice@laptop"."""
    code: str
    """The content id of the product's code that submitted it (`rankside.both_content()`)."""
    console: ConsoleOptions


def supervisor_name(name: str) -> str:
    """A fresh, unique name for the supervisor of detached function `name`."""
    return f"{SUPERVISOR_PREFIX}{name}-{secrets.token_hex(3)}"


def new_record(name: str, options: Options, supervisor: str) -> JobRecord:
    """A record for a new job of `name`, run as `options` say by `supervisor`."""
    return JobRecord(
        id=f"{name}-{secrets.token_hex(3)}",
        name=name,
        supervisor=supervisor,
        ranks=options.num_replicas,
        started=time.time(),
        user=f"{getpass.getuser()}@{socket.gethostname()}",
        code=rankside.both_content(),
        console=ConsoleOptions(options.log_prefix, options.log_ranks, options.fold_output),
    )


def keep_supervisor(actor_name: str, name: str) -> None:
    """Record that supervisor `actor_name` (of detached function `name`) runs (as JSON:
    reading a record runs no code)."""
    value = json.dumps({"name": name, "started": time.time()}).encode()
    _ray_compat.kv_put(SUPERVISORS + actor_name, value)


def forget_supervisor(actor_name: str) -> None:
    """Remove the record of supervisor `actor_name` (it ends, or it was lost)."""
    _ray_compat.kv_delete(SUPERVISORS + actor_name)


def supervisors() -> list[tuple[str, str, float]]:
    """(actor name, function name, when it started) of every supervisor recorded, oldest
    first."""
    found = []
    for key in _ray_compat.kv_keys(SUPERVISORS):
        try:
            fields = json.loads(_ray_compat.kv_get(key) or b"")
            found.append((key[len(SUPERVISORS):], str(fields["name"]), float(fields["started"])))
        except (ValueError, TypeError, KeyError):
            continue  # gone meanwhile, or written by a version that this one cannot read
    return sorted(found, key=lambda found: found[2])


def earlier_record(job_id: str) -> JobRecord | None:
    """The record of `job_id` as versions before 2026-12 kept it (one JSON key per job,
    `jobs/<id>`), so that a job they started is still found; None where there is none."""
    value = _ray_compat.kv_get(EARLIER_JOBS + job_id)
    try:
        fields = json.loads(value or b"")
        console = fields.pop("console")
        ranks = console["log_ranks"]
        console["log_ranks"] = None if ranks is None else tuple(ranks)
        return JobRecord(**fields, console=ConsoleOptions(**console))
    except (ValueError, TypeError, KeyError):
        return None


def function_of(job_id: str) -> str:
    """The function name in job id `job_id` (its name, a dash and a short random part)."""
    return job_id.rsplit("-", 1)[0]


def pool_key(options: Options) -> str:
    """What a warm pool is, as a key: a later driver gets the pool only where it asks for
    the same name, layout, resources, environment, post-mortem, Python and code."""
    asked = {
        "name": options.job_name,
        "num_replicas": options.num_replicas,
        "replicas_per_node": options.replicas_per_node,
        "gpus_per_replica": options.gpus_per_replica,
        "cpus_per_replica": options.cpus_per_replica,
        "resources_per_replica": dict(options.resources_per_replica or {}),
        "env": dict(options.env or {}),
        "runtime_env": options.runtime_env,
        "post_mortem": options.post_mortem,
        "python": platform.python_version(),
        "code": rankside.both_content(),
    }
    text = json.dumps(asked, sort_keys=True, default=_as_key)
    return POOLS + hashlib.sha256(text.encode()).hexdigest()[:16]


def _as_key(value: object) -> str:
    """A value json cannot write, as the same text in every driver: a function (a setup
    hook) by its pickle, as the ranks get it, not by its address in this process."""
    if callable(value):
        return hashlib.sha256(cloudpickle.dumps(value)).hexdigest()
    return repr(value)


def pool_supervisor(key: str) -> str | None:
    """The name of the supervisor that keeps the warm pool `key`, if one was recorded."""
    value = _ray_compat.kv_get(key)
    return value.decode() if value else None


def keep_pool(key: str, supervisor: str) -> None:
    """Record that `supervisor` keeps the warm pool `key`."""
    _ray_compat.kv_put(key, supervisor.encode())


def forget_pool(key: str, supervisor: str) -> None:
    """Remove the record of pool `key`, if it is still `supervisor`'s."""
    if pool_supervisor(key) == supervisor:
        _ray_compat.kv_delete(key)


def pools() -> list[tuple[str, str]]:
    """(key, supervisor name) of every warm pool recorded."""
    found = []
    for key in _ray_compat.kv_keys(POOLS):
        name = pool_supervisor(key)
        if name:
            found.append((key, name))
    return found
