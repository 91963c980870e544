"""The exception tree, and how a failed call's report is put together.

OrchestratorError
 ├── ConfigError (also ValueError)   a bad argument, raised before anything starts
 │    └── LayoutError                `orchestrator run`: a rank count or layout that
 │                                   cannot be (says what to give instead)
 ├── LaunchError                     `orchestrator run`: a command line that cannot run
 ├── LocalRuntimeError               `orchestrator local`: the runtime cannot be
 │                                   started, found or stopped as asked
 ├── BusyError                       a call was submitted with queue=False while
 │                                   the function's previous call still runs
 ├── ClusterUnreachableError         no Ray cluster answers at the address given
 │                                   (also ConnectionError)
 ├── ClusterMismatchError            the cluster runs another Ray or Python, or a node
 │                                   lacks torch: says what to install where
 ├── PlacementError                  the cluster can never hold the request
 │    └── PlacementTimeoutError      it could not be placed within placement_timeout
 │                                   (also TimeoutError)
 ├── SupervisorLostError             a detached job's supervisor is gone (its node was
 │                                   lost, or it was killed)
 ├── SupervisorEndedError            a call came to a detached function's supervisor as
 │                                   it ended (the driver starts a new one, once)
 └── DistributedError                a call failed on one or more ranks; its class
      │                              also derives from the root cause's type, so
      │                              `except ValueError:` catches a rank's ValueError
      └── JobTimeoutError            the call ran past its time limit (also TimeoutError);
           │                         carries every rank's current stacks
           └── StallError            on_stall="raise": its ranks made no progress for
                                     stall_after; the report of who waits where, first

Raised in a rank by the rank side (`orchestrator_workers.errors`, which never imports this
package), re-exported here and by `orchestrator.snapshot`:

RuntimeError
 └── SnapshotError                   an in-memory snapshot cannot be saved or restored
      │                              as asked (outside distribute(), another API's...)
      └── SnapshotMemoryError        a node lacks the memory for one: its step, ranks,
                                     and the bytes needed and available

Never raised to a user: StopRequested (a cancelled job, to its waiting thread) and
BadRecord (a record in the cluster's key-value store that this version cannot read).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle

from orchestrator import logfiles
from orchestrator.logfiles import read_log
from orchestrator.show.text import describe_rank
from orchestrator_workers.errors import (  # noqa: F401 - re-exported: the one tree
    SnapshotError,
    SnapshotMemoryError,
)
from orchestrator_workers.protocol import RankFailure

CRASH = "crash"
"""`RankFailure.exc_type` of a rank whose process died."""

# Errors a rank gets because a peer died or left, never the reason the job failed.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"NCCL communicator was aborted|Socket Timeout|connectFullMesh failed|"
    r"killed because a peer failed|"
    # torch's TCPStore client, whose server (in rank 0's process) is gone
    r"Connection was likely closed",
    re.IGNORECASE,
)


class OrchestratorError(Exception):
    """Base of every error this package raises."""

    earlier_attempts: tuple[BaseException, ...] = ()
    """With max_restarts: the failures of the attempts before this one, oldest first."""

    def __str__(self) -> str:
        """The message, then how earlier attempts failed (after restarts)."""
        return super().__str__() + format_earlier(self.earlier_attempts)


class ConfigError(OrchestratorError, ValueError):
    """A bad argument: names the value and what would be valid."""


class LayoutError(ConfigError):
    """The ranks' count and layout asked for cannot be: says what to give instead."""


class LaunchError(OrchestratorError):
    """A command line that cannot run: says what to change."""


class LocalRuntimeError(OrchestratorError):
    """The local runtime cannot be started, found or stopped as asked."""


class StopRequested(Exception):
    """The job was cancelled while this thread waited for it (internal: never raised to users)."""


class BadRecord(ValueError):
    """A record in the cluster's key-value store that this version cannot read (internal:
    the record is skipped, and named once)."""


class BusyError(OrchestratorError):
    """The function's previous call still runs and the caller asked not to queue."""

    @classmethod
    def still_running(cls, name: str, busy: object) -> BusyError:
        """The error for a call of `name` while its earlier call `busy` runs."""
        return cls(
            f"{name} is still running an earlier call ({busy!r}); wait for it "
            "(job.result()), cancel it, or submit with queue=True to run after it"
        )


class ClusterUnreachableError(OrchestratorError, ConnectionError):
    """No Ray cluster answers at the address given: names it and what was tried."""


class ClusterMismatchError(OrchestratorError):
    """The cluster runs another Ray or Python than the driver, or a node lacks what ranks
    import: names both sides' versions and what to install where."""


class PlacementError(OrchestratorError):
    """The cluster as it stands can never hold the request."""


class PlacementTimeoutError(PlacementError, TimeoutError):
    """The request could not be placed within `placement_timeout` (other jobs hold it)."""


class SupervisorLostError(OrchestratorError):
    """The supervisor of a detached job is gone (its node was lost, or it was killed)."""


class SupervisorEndedError(OrchestratorError):
    """A call came to a supervisor that ends (its pool released, no job kept): the driver
    starts a new one."""


class DistributedError(OrchestratorError):
    """A call failed: the root cause first, then every other failed rank."""

    def __init__(
        self,
        failures: Sequence[RankFailure],
        *,
        log_dir: Path | None = None,
        earlier_attempts: Sequence[BaseException] = (),
        message: str | None = None,
    ) -> None:
        """The error for `failures` (any order: the root cause is found and put first)."""
        ordered = order_failures(failures) if failures else []
        # Not super(): a subclass mixes in the root cause's own type, whose constructor
        # may want other arguments.
        Exception.__init__(self, message if message is not None else describe(ordered[0]))
        self.root_cause: RankFailure | None = ordered[0] if ordered else None
        """The first failure in time that is not a consequence of another (None: a timeout)."""
        self.failures: list[RankFailure] = ordered
        self.log_dir = log_dir
        """The failed call's per-rank log files (rank-N.log), every rank's output."""
        self.earlier_attempts = tuple(earlier_attempts)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields: its constructor does not take its message back."""
        return (_restore, (type(self), self.args, self.__dict__))

    def __str__(self) -> str:
        """The full report (the message is built from the failure records)."""
        if self.root_cause is None:
            return super().__str__()
        return format_report(self.root_cause, self.failures) + self._ending()

    def _ending(self) -> str:
        """What every report of a failed call ends with: where the output is, and the
        earlier attempts."""
        where = f"\n\nEvery rank's output: {self.log_dir}/rank-N.log" if self.log_dir else ""
        return where + format_earlier(self.earlier_attempts)

    def logs(self, rank: int) -> str:
        """Everything rank `rank` wrote during the failed call."""
        if self.log_dir is None:
            raise FileNotFoundError("this call kept no log files (log_dir=False)")
        return read_log(self.log_dir, rank)


class JobTimeoutError(DistributedError, TimeoutError):
    """A call ran past its `timeout`; shows where every rank was."""

    def __init__(
        self,
        timeout: float,
        stacks: dict[int, str],
        where: dict[int, str],
        *,
        log_dir: Path | None = None,
        earlier_attempts: Sequence[BaseException] = (),
    ) -> None:
        """The error for a call stopped after `timeout` seconds, with every rank's stacks."""
        super().__init__(
            [],
            log_dir=log_dir,
            earlier_attempts=earlier_attempts,
            message=f"the call did not finish within {timeout:g} s",
        )
        self.timeout = timeout
        self.stacks = stacks
        """Per rank, the current stack of each of its threads (or why none could be had)."""
        self.where = where
        """Per rank, 'rank 2 (local rank 0) on IP (host H, pid P)'."""

    def __str__(self) -> str:
        """Every rank's stacks, so a deadlock can be read from the error alone."""
        lines = [
            f"the call did not finish within {self.timeout:g} s; every rank was stopped. "
            "Where each rank was:"
        ]
        for rank in sorted(self.stacks):
            lines += ["", f"--- {self.where.get(rank, f'rank {rank}')} ---", self.stacks[rank]]
        return "\n".join(lines) + self._ending()


class StallError(JobTimeoutError):
    """A call's ranks made no progress for `stall_after` seconds (`on_stall="raise"`):
    which ranks were where, the odd ones out first."""

    def __init__(
        self,
        stall_after: float,
        report: str,
        stacks: dict[int, str],
        where: dict[int, str],
        *,
        log_dir: Path | None = None,
        earlier_attempts: Sequence[BaseException] = (),
    ) -> None:
        """The error for a call ended after `stall_after` s without progress; `report`
        groups the ranks by where they were (see orchestrator.stall)."""
        super().__init__(
            stall_after, stacks, where, log_dir=log_dir, earlier_attempts=earlier_attempts
        )
        self.args = (report.split("\n", 1)[0],)
        self.report = report
        """The ranks grouped by place, each group's first stack (every thread of every
        rank: `stacks`)."""

    def __str__(self) -> str:
        """The report: who was where, and for how long."""
        lines = [
            f"ranks made no progress for {self.timeout:g} s (stall_after); every rank was "
            "stopped (on_stall='raise').",
            self.report,
        ]
        return "\n".join(lines) + self._ending()


def _restore(cls: type[DistributedError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An unpickled DistributedError: its fields set back, no constructor run."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


def summary(error: BaseException) -> str:
    """One line for a failed attempt: the root cause's rank and error, or the timeout."""
    root = getattr(error, "root_cause", None)
    if isinstance(root, RankFailure):
        return describe(root, limit=200)
    return str(error).strip().split("\n", 1)[0]


def format_earlier(earlier: Sequence[BaseException]) -> str:
    """The tail of a report after restarts: how each earlier attempt failed."""
    if not earlier:
        return ""
    lines = [f"  attempt {n}: {summary(e)}" for n, e in enumerate(earlier, 1)]
    return f"\n\nThe {len(earlier)} earlier attempt(s) failed too:\n" + "\n".join(lines)


def is_secondary(failure: RankFailure) -> bool:
    """Whether `failure` looks like a consequence of another rank's failure."""
    return bool(_SECONDARY.search(failure.message)) or "TimeoutError" in failure.exc_type


def order_failures(failures: Sequence[RankFailure]) -> list[RankFailure]:
    """Failures by time, the root cause first: the earliest that is not secondary."""
    by_time = sorted(failures, key=lambda f: f.time)
    primary = [f for f in by_time if not is_secondary(f)]
    root = primary[0] if primary else by_time[0]
    return [root] + [f for f in by_time if f is not root]


def describe(failure: RankFailure, limit: int | None = None) -> str:
    """One line naming the rank, where it ran and what happened (message cut at `limit`)."""
    where = describe_rank(
        failure.rank, failure.local_rank, failure.node_ip, failure.hostname, failure.pid
    )
    if failure.exc_type == CRASH:
        return f"{where} crashed: {failure.message}"
    name = failure.exc_type.removeprefix("builtins.")
    message = failure.message
    if limit is not None:
        message = message.strip().split("\n", 1)[0]
        message = message if len(message) <= limit else message[: limit - 3] + "..."
    return f"{where} raised {name}: {message}"


def format_report(root: RankFailure, failures: Sequence[RankFailure]) -> str:
    """The message of a DistributedError: root cause with traceback, then the others."""
    lines = [f"{describe(root)}"]
    if root.error_file:  # torch's `record` wrote it: torchrun's root-cause fields too
        when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(root.time))
        lines += [f"  time      : {when}", f"  error_file: {root.error_file}"]
    lines += ["", root.traceback.rstrip()]
    others = [f for f in failures if f is not root]
    if others:
        lines += ["", f"{len(others)} other rank(s) failed after it:"]
        lines += [f"  {describe(f, limit=200)}" for f in others]
    return "\n".join(lines)


def distributed_error(
    failures: Sequence[RankFailure],
    *,
    log_dir: Path | None = None,
    earlier_attempts: Sequence[BaseException] = (),
) -> DistributedError:
    """A DistributedError for `failures`, also an instance of the root cause's type; what
    torch's `record` wrote for a rank is kept beside its log in `log_dir`."""
    failures = [_keep_error_file(failure, log_dir) for failure in failures]
    cls = _error_class(_load_exception(order_failures(failures)[0]))
    try:
        return cls(failures, log_dir=log_dir, earlier_attempts=earlier_attempts)
    except Exception:  # noqa: BLE001 - a type with an unusual __new__: a plain error
        return DistributedError(failures, log_dir=log_dir, earlier_attempts=earlier_attempts)


def _keep_error_file(failure: RankFailure, log_dir: Path | None) -> RankFailure:
    """`failure` naming its error file where it outlives the rank: the copy kept in the
    call's log folder (the rank's own is removed with it, and named a path that meant
    something in that process alone)."""
    if not failure.error_json:
        return failure
    kept = logfiles.keep_error_file(log_dir, failure.rank, failure.error_json)
    if not kept:
        kept = "(not kept: log_dir=False)" if log_dir is None else f"(not kept in {log_dir})"
    return replace(failure, error_file=kept, error_json=b"")


def _load_exception(failure: RankFailure) -> BaseException | None:
    if failure.exception is None:
        return None
    try:
        loaded = cloudpickle.loads(failure.exception)
    except Exception:  # noqa: BLE001 - its type is not importable here
        return None
    return loaded if isinstance(loaded, BaseException) else None


_classes: dict[type, type[DistributedError]] = {}


def _error_class(exc: BaseException | None) -> type[DistributedError]:
    base = type(exc) if exc is not None else None
    if base is None or not issubclass(base, Exception) or issubclass(base, OrchestratorError):
        return DistributedError
    if base not in _classes:
        try:
            _classes[base] = type(
                f"DistributedError[{base.__name__}]",
                (DistributedError, base),
                {
                    "__module__": __name__,
                    "__init__": DistributedError.__init__,  # not the root cause type's
                    "__str__": DistributedError.__str__,
                },
            )
        except TypeError:  # final or layout-conflicting types cannot be mixed in
            return DistributedError
    return _classes[base]
