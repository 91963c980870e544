"""The options of a distributed function: one definition, with defaults, docs and checks.

`distribute()` spells the same names and defaults out in its signature, for editors and
type checkers; a test keeps the two identical. Everything else reads `Options`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

from typing_extensions import Unpack

from orchestrator import placement
from orchestrator.errors import ConfigError
from orchestrator.logfiles import unsafe_log_dir
from orchestrator.runtime_env import problems as runtime_env_problems
from orchestrator_workers import private

STALL_AFTER_S = 60.0
"""Default: seconds without progress before a call's report names who is where."""
FOLD_FROM_RANKS = 8
"""Folding is on by default when the console shows this many ranks or more."""
DEFAULT_PREFIX = "[{name} r{rank}]"
"""Default: how each rank's output lines begin."""
RETENTION_S = 7 * 24 * 3600.0
"""Default: seconds a detached job's result and output are kept after it ends (7 days)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Options:
    """How a distributed function is laid out, started and called (distribute()'s keywords)."""

    num_replicas: int
    """How many ranks (the world size)."""
    replicas_per_node: int | None = None
    """None: as many as a node has GPUs; on a CPU-only cluster, all on one node."""
    gpus_per_replica: float | None = None
    """None: 1 when the cluster has GPUs, else 0."""
    cpus_per_replica: float = 1
    """Logical CPUs Ray reserves per rank (more also gives torch more threads)."""
    resources_per_replica: Mapping[str, float] | None = None
    """Other Ray resources per rank, e.g. {"TPU": 1}."""
    name: str | None = None
    """The job's name in output prefixes, actor names and log folders (None: fn's name)."""
    env: Mapping[str, str] | None = None
    """Extra environment variables for every rank; they win over ours."""
    address: str | None = None
    """The Ray cluster: None for RAY_ADDRESS, a `ray start` here, or the embedded default."""
    runtime_env: Mapping[str, Any] | None = None
    """Ray's runtime_env for the ranks' actors (pip, working_dir, env_vars, ...)."""
    log_prefix: str = DEFAULT_PREFIX
    """Format of each console line's prefix, with {name} and {rank}; "" for none."""
    log_ranks: Collection[int] | None = None
    """Ranks shown on the console (None: all); the log files keep every rank."""
    log_dir: str | os.PathLike[str] | bool | None = True
    """True: each call's rank-N.log files under default_log_dir(); a path: there; False: none."""
    fold_output: bool | None = None
    """Show lines many ranks write alike once, as `[train r0-127] ...` (the log files keep
    every line). None: on from 8 ranks shown, where one print per step fills a screen."""
    timeout: float | None = None
    """Seconds a call may run before it is stopped with every rank's stacks."""
    stall_after: float | None = STALL_AFTER_S
    """Seconds ranks may make no progress (same stack, no output) before the status
    line, table and job.status() say which ranks are where; None: never look."""
    on_stall: str = "report"
    """"report" (and keep running), or "raise": end the call with a StallError."""
    post_mortem: bool = False
    """A rank that raises opens pdb in the failing frame and waits for an attach."""
    placement_timeout: float | None = None
    """Seconds to wait for resources other jobs hold (None: as long as it takes)."""
    queue: bool = True
    """A call submitted while the previous one runs waits for it; False: BusyError."""
    max_restarts: int = 0
    """After a failed attempt, restart every rank on a fresh pool up to this many times."""
    restart_on: str = "any"
    """"any" failure, or only a "crash" (a rank's process died or its node was lost)."""
    min_replicas: int | None = None
    """The fewest ranks a restart may go on with, when a lost node's cannot be replaced
    (None: num_replicas: it waits for a node instead)."""
    shrink_after: float = 10.0
    """With min_replicas: how long a restart waits for a node to take a lost one's place."""
    spares_per_node: int | None = None
    """Warm spares kept on each node to replace a failed rank (orchestrator.standby); None:
    1 where max_restarts > 0, else 0."""
    detach: bool = False
    """Calls are supervised in the cluster and outlive this process (supervise.detached)."""
    idle_timeout: float = 600.0
    """Detached only: seconds its warm pool waits for the next call, from this driver or a
    later one that asks for the same pool, before it is released."""
    retention: float = RETENTION_S
    """Detached only: seconds each job's result and output are kept after it ends, unless
    `job.release()` lets them go sooner (math.inf: until then)."""

    def _shrink_problems(self) -> list[str]:
        least, count, per_node = self.min_replicas, self.num_replicas, self.replicas_per_node
        problems = []
        if least is not None and not (_is_int(least) and 1 <= least <= count):
            problems.append(
                f"min_replicas={least!r}: must be an int from 1 to num_replicas={count}"
            )
        elif least is not None and isinstance(per_node, int) and per_node > 0 and least % per_node:
            problems.append(
                f"min_replicas={least}: must be a multiple of replicas_per_node={per_node} "
                "(a lost node takes its ranks with it)"
            )
        if not (_is_number(self.shrink_after) and self.shrink_after >= 0):
            problems.append(f"shrink_after={self.shrink_after!r}: must be a number of seconds >= 0")
        return problems

    @property
    def spares(self) -> int:
        """`spares_per_node`, its default resolved."""
        if self.spares_per_node is not None:
            return self.spares_per_node
        return 1 if self.max_restarts > 0 else 0

    @property
    def job_name(self) -> str:
        """`name`; set by `create` (the function's name when none was given)."""
        return self.name or "job"

    @property
    def log_folder(self) -> Path | None:
        """Where calls' log folders go; None for no log files."""
        if self.log_dir is True:
            return default_log_dir()
        if self.log_dir is False or self.log_dir is None:
            return None
        assert isinstance(self.log_dir, str | os.PathLike), self.log_dir  # checked by problems()
        return Path(self.log_dir)

    @classmethod
    def create(cls, fn: object, **given: Any) -> Options:
        """Options for `fn` from distribute()'s keywords; ConfigError naming every bad one."""
        options = cls(**given)
        options = dataclasses.replace(
            options,
            name=options.name if options.name is not None else clean_name(_fn_name(fn)),
            resources_per_replica=dict(options.resources_per_replica or {}),
            env=dict(options.env or {}),
            log_ranks=None if options.log_ranks is None else tuple(options.log_ranks),
            post_mortem=bool(options.post_mortem),
        )
        problems = options.problems(fn)
        if problems:
            raise ConfigError("invalid arguments to distribute():\n  " + "\n  ".join(problems))
        return options

    def with_changes(self, **changes: Unpack[CallOptions]) -> Options:
        """These options with other per-call ones (`PER_CALL`); ConfigError for any other."""
        unknown = sorted(set(changes) - PER_CALL)
        if unknown:
            raise ConfigError(
                f"with_options() got {', '.join(unknown)}; valid: {', '.join(sorted(PER_CALL))} "
                "(the layout is fixed: make a new distribute() for another)"
            )
        options = dataclasses.replace(self, **changes)
        problems = options._call_problems()
        if problems:
            raise ConfigError("invalid arguments to with_options():\n  " + "\n  ".join(problems))
        return options

    def problems(self, fn: object) -> list[str]:  # noqa: PLR0912 - one check per option
        """Every problem with `fn` and these options, each naming the bad value and what is
        valid."""
        problems = []
        if not callable(fn):
            problems.append(f"fn={fn!r} is not callable; pass the function each rank runs")
        if not _is_int(self.num_replicas) or self.num_replicas < 1:
            problems.append(f"num_replicas={self.num_replicas!r}: must be an int >= 1")
        per_node, count = self.replicas_per_node, self.num_replicas
        if per_node is not None:
            if not _is_int(per_node) or per_node < 1:
                problems.append(f"replicas_per_node={per_node!r}: must be an int >= 1, or None")
            elif _is_int(count) and count >= 1 and count % per_node:
                problems.append(
                    f"replicas_per_node={per_node} does not divide num_replicas="
                    f"{count}; valid: {placement.valid_per_node(count)}"
                )
        for label, value in (
            ("cpus_per_replica", self.cpus_per_replica),
            ("gpus_per_replica", self.gpus_per_replica),
        ):
            if value is not None and (not _is_number(value) or value < 0):
                problems.append(f"{label}={value!r}: must be a number >= 0")
        for key, value in (self.resources_per_replica or {}).items():
            if key in ("CPU", "GPU"):
                problems.append(f"resources_per_replica[{key!r}]: use {key.lower()}s_per_replica")
            elif not isinstance(key, str) or not _is_number(value) or value < 0:
                problems.append(
                    f"resources_per_replica[{key!r}]={value!r}: must map str to a number >= 0"
                )
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(
                f"name={self.name!r}: must be 1-64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        for var, text in (self.env or {}).items():
            if not isinstance(var, str) or not isinstance(text, str) or not var or "=" in var:
                problems.append(
                    f"env[{var!r}]={text!r}: names and values must be strings, names without '='"
                )
        if self.address is not None and not isinstance(self.address, str):
            problems.append(
                f"address={self.address!r}: must be a string such as 'ray://host:10001' or "
                "'host:6379'"
            )
        if self.runtime_env is not None and not isinstance(self.runtime_env, Mapping):
            problems.append(f"runtime_env={self.runtime_env!r}: must be a dict, as for ray.init")
        elif self.runtime_env is not None:
            problems += runtime_env_problems(self.runtime_env)
        return problems + self._log_problems() + self._call_problems()

    def _call_problems(self) -> list[str]:
        problems = []
        limits = (
            ("timeout", self.timeout),
            ("placement_timeout", self.placement_timeout),
            ("stall_after", self.stall_after),
        )
        for label, value in limits:
            if value is not None and not (_is_number(value) and value > 0):
                problems.append(
                    f"{label}={value!r}: must be a number of seconds > 0, or None for no limit"
                )
        if self.on_stall not in ("report", "raise"):
            problems.append(
                f"on_stall={self.on_stall!r}: must be 'report' (say who is where, keep "
                "running) or 'raise' (end the call with a StallError)"
            )
        if not isinstance(self.queue, bool):
            problems.append(
                f"queue={self.queue!r}: must be True (wait for the previous call) or False"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            problems.append(
                f"max_restarts={self.max_restarts!r}: must be an int >= 0 (0: fail fast)"
            )
        problems += self._shrink_problems()
        spares = self.spares_per_node
        if spares is not None and (not _is_int(spares) or spares < 0):
            problems.append(
                f"spares_per_node={spares!r}: must be an int >= 0 (0: none), or None "
                "(1 where max_restarts > 0)"
            )
        if not (_is_number(self.idle_timeout) and self.idle_timeout > 0):
            problems.append(f"idle_timeout={self.idle_timeout!r}: must be a number of seconds > 0")
        if not isinstance(self.detach, bool):
            problems.append(
                f"detach={self.detach!r}: must be True (calls outlive this process) or False"
            )
        if not ((_is_number(self.retention) and self.retention > 0) or self.retention == math.inf):
            problems.append(
                f"retention={self.retention!r}: must be a number of seconds > 0, or math.inf "
                "(kept until job.release())"
            )
        elif self.retention != RETENTION_S and self.detach is False:
            problems.append(
                f"retention={self.retention!r}: only a detached job is kept after it ends (its "
                "result is returned to this process); give detach=True, or leave retention out"
            )
        if self.restart_on not in ("any", "crash"):
            problems.append(
                f"restart_on={self.restart_on!r}: must be 'any' (every failure) or 'crash' "
                "(only a dead process or a lost node)"
            )
        return problems

    def _log_problems(self) -> list[str]:
        problems = []
        try:
            self.log_prefix.format(name="n", rank=0)
        except (AttributeError, KeyError, IndexError, ValueError):
            problems.append(
                f"log_prefix={self.log_prefix!r}: must be a format string using only {{name}} "
                "and {rank}, e.g. '[{name} r{rank}]', or ''"
            )
        if self.log_ranks is not None and _is_int(self.num_replicas):
            bad = [r for r in self.log_ranks if not _is_int(r) or not 0 <= r < self.num_replicas]
            if bad:
                problems.append(
                    f"log_ranks={list(self.log_ranks)!r}: {bad} not ranks; valid: "
                    f"0..{self.num_replicas - 1}"
                )
        if self.fold_output is not None and not isinstance(self.fold_output, bool):
            problems.append(
                f"fold_output={self.fold_output!r}: must be True, False, or None (folded from "
                f"{FOLD_FROM_RANKS} ranks shown)"
            )
        if not isinstance(self.log_dir, bool | str | os.PathLike | None):
            problems.append(
                f"log_dir={self.log_dir!r}: must be True (the default folder), a folder's path, "
                "or False for no log files"
            )
        elif self.log_folder is not None:
            why = private.unsafe(self.log_folder / self.job_name)
            if why is not None:
                problems.append(unsafe_log_dir(self.log_folder, why))
        return problems


class CallOptions(TypedDict, total=False):
    """The options `with_options` may change: they concern calls, not the ranks' layout."""

    timeout: float | None
    stall_after: float | None
    on_stall: Literal["report", "raise"]
    placement_timeout: float | None
    queue: bool
    max_restarts: int
    restart_on: Literal["any", "crash"]
    retention: float


PER_CALL = frozenset(CallOptions.__annotations__)
"""The names of `CallOptions`."""


def default_log_dir() -> Path:
    """$ORCHESTRATOR_LOG_DIR, else ~/.cache/orchestrator/logs."""
    env = os.environ.get("ORCHESTRATOR_LOG_DIR")
    return Path(env) if env else Path.home() / ".cache" / "orchestrator" / "logs"


def clean_name(raw: str) -> str:
    """`raw` made a valid job name: other characters become '_', at most 64 ('job' if empty)."""
    return _NAME_CHARS.sub("_", raw).strip("_.-")[:64] or "job"


def _fn_name(fn: object) -> str:
    return str(getattr(fn, "__name__", "job"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool, nan or inf)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
