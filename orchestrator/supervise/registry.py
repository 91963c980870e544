"""Where the cluster keeps its detached jobs' records: any process that reaches it finds them.

One record per job in Ray's internal key-value store (namespace "orchestrator"), under
`jobs/<id>`: what `list_jobs` shows and what `get_job` needs to reach the job's supervisor.
Whoever holds the cluster's token may read and change it, as they may use the cluster.
"""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import json
import platform
import secrets
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass

from orchestrator import _ray_compat
from orchestrator.connect import rankside
from orchestrator.errors import ConfigError
from orchestrator.options import Options

PREFIX = "jobs/"
POOLS = "pools/"


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
    return f"supervisor-{name}-{secrets.token_hex(3)}"


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


def keep(record: JobRecord) -> None:
    """Record `record` in the cluster (as JSON: reading a record runs no code)."""
    _ray_compat.kv_put(PREFIX + record.id, json.dumps(dataclasses.asdict(record)).encode())


def _parse(value: bytes) -> JobRecord | None:
    """The record in `value`; None for one this version cannot read."""
    try:
        fields = json.loads(value)
        console = fields.pop("console")
        ranks = console["log_ranks"]
        console["log_ranks"] = None if ranks is None else tuple(ranks)
        return JobRecord(**fields, console=ConsoleOptions(**console))
    except (ValueError, TypeError, KeyError):
        return None


def forget(job_id: str) -> None:
    """Remove the record of `job_id`."""
    _ray_compat.kv_delete(PREFIX + job_id)


def records() -> list[JobRecord]:
    """Every detached job's record, oldest first."""
    found = []
    for key in _ray_compat.kv_keys(PREFIX):
        value = _ray_compat.kv_get(key)
        record = _parse(value) if value is not None else None
        if record is not None:
            found.append(record)
    return sorted(found, key=lambda r: r.started)


def find(id_or_name: str) -> JobRecord:
    """The record of job `id_or_name`, or of the newest job of that name; ConfigError naming
    the jobs there are when there is none."""
    value = _ray_compat.kv_get(PREFIX + id_or_name)
    record = _parse(value) if value is not None else None
    if record is not None:
        return record
    named = [r for r in records() if r.name == id_or_name]
    if named:
        return named[-1]
    known = ", ".join(r.id for r in records()[-10:]) or "none"
    raise ConfigError(
        f"no detached job {id_or_name!r} in this cluster; the newest there are: {known} "
        "(`orchestrator jobs` lists them)"
    )


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
    text = json.dumps(asked, sort_keys=True, default=repr)
    return POOLS + hashlib.sha256(text.encode()).hexdigest()[:16]


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
