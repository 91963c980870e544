"""Where the cluster keeps its detached functions' supervisors: any process that reaches it
finds them, and through them their jobs.

One record per supervisor in Ray's internal key-value store (namespace "orchestrator"),
under `supervisors/<actor name>`, written once when it starts; each supervisor publishes
its own jobs' records, with their state, and its warm pool's (`supervise.listing`), so a
call records nothing from its driver. A warm pool is recorded under `pools/<key>` for a
later driver that asks for the same. Whoever holds the cluster's token may read and change
these, as they may use the cluster: every record is JSON, read as data (nothing in it is
unpickled or run), and one that this version cannot read is skipped and named once, with
how to remove it (`orchestrator stop KEY`).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import platform
import re
import secrets
import shlex
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import cloudpickle

from orchestrator import _ray_compat
from orchestrator.connect import local, rankside
from orchestrator.errors import BadRecord
from orchestrator.options import Options
from orchestrator.show import messages
from orchestrator.show.text import printable
from orchestrator_workers.protocol import SUPERVISOR_PREFIX

SUPERVISORS = "supervisors/"
POOLS = "pools/"
EARLIER_JOBS = "jobs/"
"""Where versions before 2026-12 recorded each job (read only, see `earlier_record`)."""
LISTING = "listing/"
"""Where each supervisor publishes its jobs and warm pool (see `supervise.listing`)."""
RECORDS = (SUPERVISORS, POOLS, EARLIER_JOBS, LISTING)
"""Every kind of record here, by its keys' prefix."""
LARGEST = 1 << 20
"""A record longer than this (bytes) is not read: ours are a few hundred."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A detached function's name, as `distribute(name=...)` allows it."""
SUPERVISOR = re.compile(rf"{SUPERVISOR_PREFIX}{NAME.pattern}-[0-9a-f]{{6}}")
"""A supervisor's actor name (`supervisor_name`)."""


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
    """Who submitted it, and from where: "alice@laptop" (what its driver claims: $USER)."""
    code: str
    """The content id of the product's code that submitted it (`rankside.both_content()`)."""
    console: ConsoleOptions

    def as_json(self) -> dict[str, Any]:
        """The record as JSON data (`job_record` reads it back)."""
        console = self.console
        ranks = None if console.log_ranks is None else sorted(console.log_ranks)
        shown = {
            "log_prefix": console.log_prefix,
            "log_ranks": ranks,
            "fold_output": console.fold_output,
        }
        return {
            "id": self.id,
            "name": self.name,
            "supervisor": self.supervisor,
            "ranks": self.ranks,
            "started": self.started,
            "user": self.user,
            "code": self.code,
            "console": shown,
        }


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


def caller_is(user: str) -> bool:
    """Whether `user` ("alice@laptop", as a record claims it) names this process's user."""
    try:
        me = getpass.getuser()
    except (OSError, KeyError):  # no $USER, and no passwd entry
        return False
    return user.rpartition("@")[0] == me


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
    first (one that cannot be read: skipped, and named once)."""
    found = [read(key, _supervisor) for key in _ray_compat.kv_keys(SUPERVISORS)]
    return sorted((each for each in found if each is not None), key=lambda each: each[2])


def _supervisor(key: str, value: bytes) -> tuple[str, str, float]:
    actor_name = key[len(SUPERVISORS) :]
    if not SUPERVISOR.fullmatch(actor_name):
        raise BadRecord("not a supervisor's name")
    fields = parse(value)
    return actor_name, text(fields, "name", NAME), number(fields, "started", 0, 1e11)


def earlier_record(job_id: str) -> JobRecord | None:
    """The record of `job_id` as versions before 2026-12 kept it (one JSON key per job,
    `jobs/<id>`), so that a job they started is still found; None where there is none."""
    return read(EARLIER_JOBS + job_id, _earlier)


def _earlier(_key: str, value: bytes) -> JobRecord:
    return job_record(parse(value))


def job_record(fields: dict[str, Any]) -> JobRecord:
    """The JobRecord in JSON data `fields` (`JobRecord.as_json`); BadRecord where a field
    is missing, of another type, or out of range."""
    name = text(fields, "name", NAME)
    console = fields.get("console")
    if not isinstance(console, dict):
        raise BadRecord("console: not an object")
    shown = console.get("log_ranks")
    if shown is not None and not (
        isinstance(shown, list) and all(type(rank) is int and 0 <= rank < 1 << 20 for rank in shown)
    ):
        raise BadRecord("console.log_ranks: not a list of ranks")
    fold = console.get("fold_output")
    if fold is not None and not isinstance(fold, bool):
        raise BadRecord("console.fold_output: not true, false or null")
    return JobRecord(
        id=text(fields, "id", re.compile(rf"{re.escape(name)}-[0-9a-f]{{6,32}}")),
        name=name,
        supervisor=text(fields, "supervisor", SUPERVISOR),
        ranks=int(number(fields, "ranks", 1, 1 << 20)),
        started=number(fields, "started", 0, 1e11),
        user=text(fields, "user"),
        code=text(fields, "code"),
        console=ConsoleOptions(
            text(console, "log_prefix"), None if shown is None else tuple(shown), fold
        ),
    )


def function_of(job_id: str) -> str:
    """The function name in job id `job_id` (its name, a dash and a short random part)."""
    return job_id.rsplit("-", 1)[0]


def pool_key(options: Options, paths: local.DriverPaths | None = None) -> str:
    """What a warm pool is, as a key: a later driver gets the pool only where it asks for
    the same name, layout, resources, environment, post-mortem, Python and code, from the
    same folders (`paths`, by default this driver's: its ranks run there)."""
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
        "paths": asdict(paths or local.driver_paths()),
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
    """The name of the supervisor that keeps the warm pool `key`, if one was recorded (and
    can be read: else it is named once)."""
    return read(key, _pool)


def _pool(_key: str, value: bytes) -> str:
    return pool_value(value)


def pool_value(value: bytes) -> str:
    """The supervisor's name that a warm pool's record holds; BadRecord if it holds none."""
    try:
        name = value.decode()
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8") from None
    if not SUPERVISOR.fullmatch(name):
        raise BadRecord("not a supervisor's name")
    return name


def keep_pool(key: str, supervisor: str) -> None:
    """Record that `supervisor` keeps the warm pool `key`."""
    _ray_compat.kv_put(key, supervisor.encode())


def forget_pool(key: str, supervisor: str) -> None:
    """Remove the record of pool `key`, if it is still `supervisor`'s."""
    if pool_supervisor(key) == supervisor:
        _ray_compat.kv_delete(key)


# Reading records: JSON data, checked field by field; one that cannot be read, named once.


T = TypeVar("T")


def read(key: str, decode: Callable[[str, bytes], T]) -> T | None:
    """The record under `key`, as `decode` reads it; None where there is none, or where it
    cannot be read (named once: see `bad`)."""
    value = _ray_compat.kv_get(key)
    if value is None:
        return None
    try:
        return decode(key, value)
    except BadRecord as exc:
        bad(key, str(exc))
        return None


def readable(key: str) -> bool:
    """Whether the record under `key` (supervisors/, pools/ or jobs/) can be read, or is
    gone; False for another key."""
    value = _ray_compat.kv_get(key)
    decode = next((read for prefix, read in _KINDS.items() if key.startswith(prefix)), None)
    try:
        return value is None or (decode is not None and decode(key, value) is not None)
    except BadRecord:
        return False


def parse(value: bytes, largest: int = LARGEST) -> dict[str, Any]:
    """`value` as a JSON object; BadRecord where it is not one (longer than `largest`
    bytes, not UTF-8, not JSON, nested too deep)."""
    if len(value) > largest:
        raise BadRecord(f"{len(value)} bytes")
    try:
        fields = json.loads(value.decode())
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise BadRecord(f"not JSON that can be read: {type(exc).__name__}") from None
    if not isinstance(fields, dict):
        raise BadRecord("not a JSON object")
    return fields


def text(fields: dict[str, Any], name: str, pattern: re.Pattern[str] | None = None) -> str:
    """Field `name` of `fields`: a string of at most 256 characters (matching `pattern`)."""
    value = fields.get(name)
    if not isinstance(value, str) or len(value) > 256:
        raise BadRecord(f"{name}: not a string of at most 256 characters")
    if pattern is not None and not pattern.fullmatch(value):
        raise BadRecord(f"{name}: not as this product writes it")
    return value


def number(fields: dict[str, Any], name: str, low: float, high: float) -> float:
    """Field `name` of `fields`: a number from `low` to `high`."""
    value = fields.get(name)  # NaN is no number from low to high, a huge int not either
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRecord(f"{name}: not a number from {low:g} to {high:g}")
    return float(value)


_KINDS: dict[str, Callable[[str, bytes], object]] = {
    SUPERVISORS: _supervisor,
    POOLS: _pool,
    EARLIER_JOBS: _earlier,
}
"""How each kind of record here is read, by its keys' prefix."""


def named_by(key: str) -> list[str]:
    """The keys of the records that `key` names, as it is or as `bad` shows it (escaped)."""
    prefix = next((prefix for prefix in RECORDS if key.startswith(prefix)), None)
    if prefix is None:
        return []
    return [found for found in _ray_compat.kv_keys(prefix) if key in (found, printable(found))]


def remove(key: str) -> None:
    """Remove the record under `key`."""
    _ray_compat.kv_delete(key)


_named: set[str] = set()
"""The keys of the records this process has named as unreadable."""


def bad(key: str, why: str) -> None:
    """Say, once in this process, that the record `key` is skipped: why, and what removes it."""
    if key in _named:
        return
    _named.add(key)
    shown = shlex.quote(printable(key))
    messages.warn(
        f"skipped {shown} in the cluster's key-value store: it cannot be read ({why}), and "
        f"whoever holds the cluster's token may have written it. `orchestrator stop {shown}` "
        "removes it"
    )
