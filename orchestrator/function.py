"""`distribute()` and the distributed function it returns."""

from __future__ import annotations

import atexit
import copy
import gc
import html
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

from typing_extensions import Unpack

from orchestrator import runner, shipping
from orchestrator.connect import cluster
from orchestrator.errors import BusyError
from orchestrator.job import Job, Submission, stop_all
from orchestrator.observe import dashboard
from orchestrator.options import (
    DEFAULT_PREFIX,
    RETENTION_S,
    STALL_AFTER_S,
    CallOptions,
    Options,
)
from orchestrator.runner import Runner
from orchestrator.show import messages, notebook
from orchestrator.supervise.detached import Detached
from orchestrator.supervise.follow import stop_following

P = ParamSpec("P")
R = TypeVar("R")


class Executor(Protocol):
    """What runs a distributed function's calls: a `Runner` in this process, or a detached
    function's `Detached` (its supervisor's, in the cluster)."""

    @property
    def last(self) -> Job[Any] | None:
        """The job submitted last."""

    @property
    def current(self) -> Job[Any] | None:
        """The job running now, if any."""

    def busy_with(self) -> Job[Any] | None:
        """The job that runs or waits on this function now, if any."""

    def submit(self, call: Submission) -> Job[Any]:
        """Queue `call`; its Job, at once."""

    def interrupt(self, job: Job[Any]) -> KeyboardInterrupt:
        """Ctrl-C while the caller waited for `job`: what becomes of it; what to raise."""

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty while it has none)."""

    def shutdown(self) -> None:
        """Release what it holds (see `DistributedFunction.shutdown`)."""


class DistributedFunction(Generic[P, R]):
    """`fn` run on every rank at once; calling it returns the ranks' results in rank order."""

    def __init__(self, fn: Callable[P, R], options: Options) -> None:
        """Wrap `fn`; use `distribute()` rather than this constructor."""
        self.fn = fn
        self.options = options
        self._runner: Executor = (
            Detached(options.job_name, options)
            if options.detach
            else Runner(options.job_name, options)
        )

    @property
    def name(self) -> str:
        """The job name used in log prefixes and actor names."""
        return self.options.job_name

    @property
    def log_dir(self) -> Path | None:
        """The last call's log folder (rank-N.log for every rank)."""
        last = self._runner.last
        return last.log_dir if last is not None else None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run `fn(*args, **kwargs)` on every rank; return each rank's result, by rank."""
        job = self._submit(args, kwargs, waits=True)  # output goes where the caller's prints go
        try:
            return job.result()
        except KeyboardInterrupt:
            raise self._runner.interrupt(job) from None

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> Job[R]:
        """Start `fn(*args, **kwargs)` on every rank and return at once with its Job.

        A call submitted while the previous one runs waits for it (queue=False: raises
        BusyError instead). The Job is a concurrent.futures.Future, awaitable in asyncio.
        In a notebook, the ranks' output is shown in the cell that submitted the job.
        """
        return self._submit(args, kwargs, show_in_cell=notebook.in_kernel())

    def _submit(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        show_in_cell: bool = False,
        waits: bool = False,
    ) -> Job[R]:
        """Submit the call; `waits`: the caller waits for its result at once."""
        busy = self._runner.busy_with()
        if busy is not None and not self.options.queue:  # before the payload is pickled
            raise BusyError.still_running(self.name, busy)
        payload, uses_torch = shipping.pack(self.fn, args, kwargs)
        # The pool lives while a job of it is not done: the job keeps this function alive.
        call = Submission(payload, uses_torch, self.options, self, show_in_cell, waits)
        job: Job[R] = self._runner.submit(call)
        if not self.options.detach:
            dashboard.submitted(job)  # on this driver's page, started with its first job
        if job._cell is not None:
            job._cell.tick_while(lambda: not job.done())  # the elapsed times move on
        return job

    def with_options(self, **changes: Unpack[CallOptions]) -> DistributedFunction[P, R]:
        """The same function and warm pool with other per-call options.

        Accepted: timeout, stall_after, on_stall, placement_timeout, queue, max_restarts,
        restart_on, retention (detached only).
        """
        clone = copy.copy(self)
        clone.options = self.options.with_changes(**changes)
        return clone

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, by rank, from any thread while a call runs."""
        current = self._runner.current
        return current.stacks() if current is not None else {}

    def logs(self, rank: int) -> str:
        """Everything rank `rank` wrote during the last call."""
        last = self._runner.last
        if last is None:
            raise FileNotFoundError(f"{self.name} has kept no log files yet")
        return last.logs(rank)

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty before the first call)."""
        return self._runner.pids()

    def shutdown(self) -> None:
        """Cancel its queued and running calls, stop every rank's actor, release resources."""
        self._runner.shutdown()

    def __enter__(self) -> DistributedFunction[P, R]:
        """Use as a context manager: resources are released on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release everything."""
        self.shutdown()

    def _repr_html_(self) -> str:
        """Jupyter: the ranks' table of its last call, as it is now."""
        last = self._runner.last
        if last is None:
            return f"<code>{html.escape(repr(self))}</code>: not called yet"
        return last.table().html()

    def __repr__(self) -> str:
        """E.g. <DistributedFunction train x4 (2 per node)>."""
        per_node = self.options.replicas_per_node
        layout = f" ({per_node} per node)" if per_node else ""
        return f"<DistributedFunction {self.name} x{self.options.num_replicas}{layout}>"


def distribute(
    fn: Callable[P, R],
    *,
    num_replicas: int,
    replicas_per_node: int | None = None,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1,
    resources_per_replica: Mapping[str, float] | None = None,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    address: str | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    log_prefix: str = DEFAULT_PREFIX,
    log_ranks: Collection[int] | None = None,
    log_dir: str | os.PathLike[str] | bool | None = True,
    fold_output: bool | None = None,
    timeout: float | None = None,
    stall_after: float | None = STALL_AFTER_S,
    on_stall: str = "report",
    post_mortem: bool = False,
    placement_timeout: float | None = None,
    queue: bool = True,
    max_restarts: int = 0,
    restart_on: str = "any",
    min_replicas: int | None = None,
    shrink_after: float = 10.0,
    spares_per_node: int | None = None,
    detach: bool = False,
    idle_timeout: float = 600.0,
    retention: float = RETENTION_S,
) -> DistributedFunction[P, R]:
    """Make `fn` a function that runs on `num_replicas` ranks of a torch.distributed job.

    Nothing starts until the first call; the ranks' actors then stay warm for the
    next call until `.shutdown()`, the end of a `with` block, or interpreter exit.
    `log_dir=True` keeps each call's per-rank logs under `default_log_dir()`; a path
    puts them there instead; False keeps none. From 8 ranks shown, lines the ranks
    write alike are shown once with their ranks (`[train r0-127] ...`, numbers as
    ranges); `fold_output=False` shows every line, True folds at any size. `timeout`
    (seconds) stops a call that runs longer with a JobTimeoutError showing every
    rank's stacks. Ranks that make no progress (the same stack, no output) for
    `stall_after` seconds are named with where they are, in the status line, table
    and `job.status()`; `on_stall="raise"` ends the call with a StallError instead.
    `breakpoint()` in `fn` and `post_mortem=True` open pdb on that
    rank; its output says how to attach.
    When other jobs hold the resources, the first call waits for them (the console
    says what for), or raises PlacementTimeoutError after `placement_timeout` seconds.
    `.submit(...)` returns a Job at once; with `queue=False` a call submitted while
    the previous one runs raises BusyError instead of waiting for it. `max_restarts=N`
    restarts every rank on a fresh pool after a failure (`restart_on="crash"`: only when
    a rank's process died or its node was lost), up to N times per call; each rank
    reads the attempt number from RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT). A failed
    rank is replaced by one of `spares_per_node` warm processes kept on its node (torch
    imported, no resources reserved, about 250 MB of host memory each; None: 1 where
    max_restarts > 0, else 0), not a cold start. With `min_replicas`, a restart whose lost
    node no other can replace within `shrink_after` seconds goes on with the ranks left
    (at least `min_replicas`), renumbered, each restoring its own snapshot.
    `detach=True` supervises each call in the cluster: it runs on when this process exits
    or dies, and `orchestrator.get_job(job.id)` gets it back from any process; its warm
    ranks wait `idle_timeout` seconds for the next call, which a later driver asking for the
    same pool (a notebook after a kernel restart) gets too; each job's result and output are
    kept `retention` seconds after it ends (7 days; math.inf: until `job.release()`).
    """
    given = {name: value for name, value in locals().items() if name != "fn"}
    options = Options.create(fn, **given)
    shipping.check(fn)
    return DistributedFunction(fn, options)


SETTLE_AT_EXIT_S = 2.0
"""How long the exit waits for cancelled calls to end before Ray shuts down."""


def _at_exit() -> None:
    """Interpreter exit: stop this process's unfinished jobs, then the embedded Ray.

    Registered after `import ray`, so it runs before Ray's own exit hook.
    """
    stop_following(say=True)
    stop_all(say=True)
    late = runner.settle(SETTLE_AT_EXIT_S)  # the cancelled calls' threads leave Ray
    if late:  # then Ray, shut down under them, may end this process with its own words
        messages.warn(
            f"the cancelled call of {', '.join(late)} was still ending {SETTLE_AT_EXIT_S:g} s "
            "after exit began; Ray may report its core worker shut down under it"
        )
    shipping.at_exit()
    cluster.at_exit()
    # Everything left is freed as the interpreter ends. Its last garbage collection would
    # walk every object torch and Ray made (0.2-0.45 s, on the exit's path) only to run
    # finalizers of objects in reference cycles, which Python does not promise at exit.
    gc.freeze()


atexit.register(_at_exit)
