"""`distribute()` and the distributed function it returns."""

from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import math
import os
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import RayActorError

from orchestrator import call, cluster, notebook, placement, shipping
from orchestrator.errors import (
    CRASH,
    BusyError,
    ConfigError,
    DistributedError,
    JobTimeoutError,
    OrchestratorError,
)
from orchestrator.job import PENDING, RUNNING, Job, stop_all
from orchestrator.logs import DEFAULT_PREFIX, Console, read_log
from orchestrator.pool import Pool, StopRequested

P = ParamSpec("P")
R = TypeVar("R")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Options:
    """How a distributed function is laid out and started."""

    num_replicas: int
    replicas_per_node: int | None = None
    """None: as many as a node has GPUs; on a CPU-only cluster, all on one node."""
    gpus_per_replica: float | None = None
    """None: 1 when the cluster has GPUs, else 0."""
    cpus_per_replica: float = 1
    resources_per_replica: Mapping[str, float] = field(default_factory=dict)
    name: str = "job"
    env: Mapping[str, str] = field(default_factory=dict)
    address: str | None = None
    runtime_env: Mapping[str, Any] | None = None
    log_prefix: str = DEFAULT_PREFIX
    """Format of each console line's prefix, with {name} and {rank}; "" for none."""
    log_ranks: Collection[int] | None = None
    """Ranks shown on the console (None: all); the log files keep every rank."""
    log_dir: Path | None = None
    """Where each call's rank-N.log files go, in a folder per call; None: no files."""
    timeout: float | None = None
    """Seconds a call may run before it is stopped with every rank's stacks."""
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


def default_log_dir() -> Path:
    """$ORCHESTRATOR_LOG_DIR, else ~/.cache/orchestrator/logs."""
    env = os.environ.get("ORCHESTRATOR_LOG_DIR")
    return Path(env) if env else Path.home() / ".cache" / "orchestrator" / "logs"


_SETTLE_S = 2.0
"""Before a restart, how long ranks still running may take to return (else: stuck)."""
_LINGER_S = 2.0
"""How long a function's runner thread waits for the next call before it ends."""


class _PoolBox:
    """Holds a function's warm pool apart from everything else, for the finalizer."""

    def __init__(self) -> None:
        self.pool: Pool | None = None

    def release(self) -> None:
        """Stop the pool's actors and give back its resources."""
        pool, self.pool = self.pool, None
        if pool is not None and ray.is_initialized():
            pool.shutdown()


class _Runner:
    """Runs a function's jobs one after another on its warm pool, in a background thread.

    Shared by a function and its `with_options` copies; when the last of them and
    the thread are gone, a finalizer releases the pool.
    """

    def __init__(self) -> None:
        self.box = _PoolBox()
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.queue: deque[tuple[Job[Any], Callable[[Job[Any]], None]]] = deque()
        self.current: Job[Any] | None = None
        self.thread: threading.Thread | None = None
        self.calls = itertools.count(1)
        self.last: Job[Any] | None = None
        weakref.finalize(self, self.box.release)

    @property
    def pool(self) -> Pool | None:
        """The warm pool, if one is running."""
        return self.box.pool

    @pool.setter
    def pool(self, pool: Pool | None) -> None:
        self.box.pool = pool

    def busy_with(self) -> Job[Any] | None:
        """The job that runs or waits on this function now, if any."""
        waiting = [job for job, _ in self.queue if not job.done()]
        current = self.current if self.current is not None and not self.current.done() else None
        return current or (waiting[0] if waiting else None)

    def submit(self, job: Job[Any], start: Callable[[Job[Any]], None], queue: bool) -> None:
        """Queue `job`; `start(job)` is run for it in the runner thread when its turn comes."""
        with self.lock:
            busy = self.busy_with()
            if busy is not None and not queue:
                raise _busy_error(job.name, busy)
            self.queue.append((job, start))
            self.last = job
            self.wakeup.notify()
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._work, name=f"orchestrator-{job.name}", daemon=True
                )
                self.thread.start()

    def _work(self) -> None:
        while True:
            with self.lock:
                # Linger a moment: calls in a loop then cost no thread start each.
                self.wakeup.wait_for(lambda: bool(self.queue), timeout=_LINGER_S)
                if not self.queue:
                    self.thread = None
                    return
                job, start = self.queue.popleft()
                self.current = job
            try:
                job.context.run(start, job)
            except BaseException as exc:  # noqa: BLE001 - a bug here must not strand jobs
                job.finish(error=exc)
            finally:
                with self.lock:
                    self.current = None

    def release_if_idle(self, reason: str) -> bool:
        """Release the warm pool if no call runs or waits on it; True if released."""
        with self.lock:
            if self.pool is None or self.current is not None or self.queue:
                return False
            pool, self.pool = self.pool, None
        print(f"[{pool.name}] released its idle ranks: {reason}", file=sys.stderr, flush=True)
        pool.shutdown()
        return True

    def stop(self, job: Job[Any]) -> None:
        """Withdraw a queued `job`, or kill its ranks if it runs (a waiting one sees its flag)."""
        with self.lock:
            self.queue = deque(entry for entry in self.queue if entry[0] is not job)
            pool = job.pool
            if pool is not None and pool is self.pool:
                self.pool = None  # never hand a killed pool to the next call
        if pool is not None:
            pool.shutdown()

    def release(self) -> None:
        """Stop the warm pool's actors and give back its resources."""
        self.box.release()

    def shutdown(self) -> None:
        """Cancel every queued and running job, then release the pool."""
        with self.lock:
            jobs = [job for job, _ in self.queue]
            if self.current is not None:
                jobs.append(self.current)
        for job in jobs:
            job.cancel()
        self.release()


def _busy_error(name: str, busy: Job[Any]) -> BusyError:
    return BusyError(
        f"{name} is still running an earlier call ({busy!r}); wait for it "
        "(job.result()), cancel it, or submit with queue=True to run after it"
    )


_runners: weakref.WeakSet[_Runner] = weakref.WeakSet()
"""Every function's runner in this process, so a waiting job can reclaim idle pools."""


def _restartable(error: BaseException, options: Options, restarts: int) -> bool:
    """Whether a failed attempt is to be followed by another (max_restarts, restart_on)."""
    if restarts >= options.max_restarts:
        return False
    if isinstance(error, RayActorError):  # an actor lost while the pool started
        return True
    if not isinstance(error, DistributedError):
        return False
    root = error.root_cause
    return options.restart_on == "any" or (root is not None and root.exc_type == CRASH)


def _forget_buffers(failed: call.Call | None) -> None:
    """Once a failed call's ranks are stopped, remove what they may have left in /dev/shm."""
    if failed is not None:
        with contextlib.suppress(Exception):  # the cluster may be gone: nothing to remove
            failed.forget_buffers()


def _reclaim_idle(waiting: str) -> None:
    """Release this process's idle warm pools, so the waiting job `waiting` can be placed."""
    for runner in list(_runners):
        runner.release_if_idle(f"{waiting} is waiting for resources")


class DistributedFunction(Generic[P, R]):
    """`fn` run on every rank at once; calling it returns the ranks' results in rank order."""

    def __init__(self, fn: Callable[P, R], options: Options) -> None:
        """Wrap `fn`; use `distribute()` rather than this constructor."""
        self.fn = fn
        self.options = options
        self._runner = _Runner()
        _runners.add(self._runner)

    @property
    def name(self) -> str:
        """The job name used in log prefixes and actor names."""
        return self.options.name

    @property
    def log_dir(self) -> Path | None:
        """The last call's log folder (rank-N.log for every rank)."""
        last = self._runner.last
        return last.log_dir if last is not None else None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run `fn(*args, **kwargs)` on every rank; return each rank's result, by rank."""
        job = self._submit(args, kwargs)  # output goes where the caller's prints go
        try:
            return job.result()
        except KeyboardInterrupt:
            job.cancel()
            raise KeyboardInterrupt(
                f"interrupted: all {self.options.num_replicas} ranks of {self.name} were "
                "stopped; the next call starts fresh ones"
            ) from None

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> Job[R]:
        """Start `fn(*args, **kwargs)` on every rank and return at once with its Job.

        A call submitted while the previous one runs waits for it (queue=False: raises
        BusyError instead). The Job is a concurrent.futures.Future, awaitable in asyncio.
        In a notebook, the ranks' output is shown in the cell that submitted the job.
        """
        return self._submit(args, kwargs, show_in_cell=notebook.in_kernel())

    def _submit(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, show_in_cell: bool = False
    ) -> Job[R]:
        options = self.options
        runner = self._runner
        busy = runner.busy_with()
        if busy is not None and not options.queue:
            raise _busy_error(self.name, busy)
        payload = shipping.payload(self.fn, args, kwargs)
        # Connecting, and an impossible request, are settled here, in the caller's thread.
        plan = self._plan(options) if runner.pool is None else None
        # Now, before returning: the arguments' big tensors are pickled by reference, so a
        # caller changing them after submit() must not change what the ranks get.
        data = call.ship(payload)
        job: Job[R] = Job(self.name, options.num_replicas, runner.stop)
        if show_in_cell:
            job.view = notebook.CellOutput(f"[{self.name}] submitted")
        job.owner = self  # the pool lives while a job of it is not done
        try:
            runner.submit(job, lambda j: self._execute(j, data, options, plan), options.queue)
        except BusyError:
            job.discard()
            raise
        return job

    def _execute(
        self,
        job: Job[R],
        data: call.Shipment,
        options: Options,
        plan: tuple[placement.Request, bool] | None,
    ) -> None:
        """Run `job` in the runner thread: start the pool if needed, call, settle the job.

        With `max_restarts`, a failed attempt is followed by another with a fresh
        rendezvous, after its broken ranks (or, when a node is gone, the whole pool)
        were replaced, up to `max_restarts` times. A cancelled job is settled by cancel().
        """
        runner = self._runner
        earlier: list[BaseException] = []
        while not job.stop_requested.is_set():
            try:
                value = self._attempt(job, data, options, plan, len(earlier))
            except BaseException as exc:  # noqa: BLE001 - every outcome settles the job
                failed = job.call
                if isinstance(exc, StopRequested) or job.stop_requested.is_set():
                    runner.release()
                    _forget_buffers(failed)
                    return
                if _restartable(exc, options, len(earlier)):
                    earlier.append(exc)
                    job.restarted(exc)
                    if not self._repair(job, len(earlier), exc):
                        plan = None  # a whole new pool, laid out on the nodes alive now
                    _forget_buffers(failed)
                    continue
                # Ranks may be stuck in a collective: replace the whole pool next time.
                runner.release()
                _forget_buffers(failed)
                job.pool = None
                if earlier and isinstance(exc, OrchestratorError):
                    exc.earlier_attempts = tuple(earlier)  # type: ignore[attr-defined]
                job.finish(error=exc)
                return
            job.finish(value)
            return

    def _repair(self, job: Job[R], attempt: int, error: BaseException) -> bool:
        """Replace only the failed call's broken ranks; False: the whole pool was released.

        Healthy ranks (finished, or failed only because a peer did) keep their warm
        processes, so a restart costs one actor start, not a whole pool's.
        """
        runner, pool, failed = self._runner, job.pool, job.call
        with contextlib.suppress(Exception):  # anything amiss (a stop too): a whole new pool
            if pool is not None and failed is not None and pool is runner.pool:
                if not isinstance(error, JobTimeoutError):  # else they are all stuck
                    failed.settle(_SETTLE_S)  # a peer's death reaches gloo ranks in moments
                broken = failed.broken_ranks()
                if len(broken) < len(pool.actors) and pool.replace(broken, attempt):
                    return True
        runner.release()
        job.pool = None
        return False

    def _attempt(
        self,
        job: Job[R],
        data: call.Shipment,
        options: Options,
        plan: tuple[placement.Request, bool] | None,
        restart_count: int,
    ) -> list[R]:
        runner = self._runner
        if runner.pool is None:
            runner.pool = self._start(job, options, plan or self._plan(options))
        pool = job.pool = runner.pool
        if options.log_dir is not None and job.log_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            folder = f"{stamp}-{os.getpid()}-{next(runner.calls)}"
            job.log_dir = options.log_dir / self.name / folder
        if job.log_dir is not None:
            pool.console.open_logs(job.log_dir)
            if restart_count:
                attempt = f"attempt {restart_count + 1} (restart {restart_count})"
                pool.console.mark_files(f"--- {attempt} ---")
        job.set_phase(RUNNING)
        pool.console.sink = job.view.write if job.view is not None else None
        try:
            job.call = call.Call(
                pool,
                data,
                options.timeout,
                job.stop_requested,
                restart_count=restart_count,
                max_restarts=options.max_restarts,
            )
            return job.call.wait()
        finally:
            pool.console.close_logs()
            pool.console.sink = None

    def with_options(self, **changes: Any) -> DistributedFunction[P, R]:
        """The same function and warm pool with other per-call options.

        Accepted: timeout, placement_timeout, queue, max_restarts, restart_on.
        """
        allowed = {"timeout", "placement_timeout", "queue", "max_restarts", "restart_on"}
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise ConfigError(
                f"with_options() got {', '.join(unknown)}; valid: {', '.join(sorted(allowed))} "
                "(the layout is fixed: make a new distribute() for another)"
            )
        options = replace(self.options, **changes)
        problems = _validate_calls(options)
        if problems:
            raise ConfigError("invalid arguments to with_options():\n  " + "\n  ".join(problems))
        clone = copy.copy(self)
        clone.options = options
        return clone

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, by rank, from any thread while a call runs."""
        current = self._runner.current
        return current.stacks() if current is not None else {}

    def logs(self, rank: int) -> str:
        """Everything rank `rank` wrote during the last call."""
        if self.log_dir is None:
            raise FileNotFoundError(f"{self.name} has kept no log files yet")
        return read_log(self.log_dir, rank)

    def pids(self) -> list[int]:
        """Process ids of the warm pool's ranks, by rank (empty before the first call)."""
        pool = self._runner.pool
        return pool.pids() if pool else []

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

    def __repr__(self) -> str:
        """E.g. <DistributedFunction train x4 (2 per node)>."""
        per_node = self.options.replicas_per_node
        layout = f" ({per_node} per node)" if per_node else ""
        return f"<DistributedFunction {self.name} x{self.options.num_replicas}{layout}>"

    def _plan(self, opts: Options) -> tuple[placement.Request, bool]:
        """Connect, lay out the request, fail at once if the cluster can never hold it."""
        cpus_needed = opts.num_replicas * opts.cpus_per_replica
        embedded = cluster.connect(opts.address, min_cpus=cpus_needed)
        nodes = cluster.nodes()
        simulate = embedded or len(nodes) == 1
        gpus = opts.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if any(n.resources.get("GPU", 0) for n in nodes) else 0.0
        per_node = opts.replicas_per_node or placement.default_replicas_per_node(
            opts.num_replicas, gpus, [n.resources for n in nodes]
        )
        request = placement.Request(
            num_replicas=opts.num_replicas,
            replicas_per_node=per_node,
            cpus_per_replica=opts.cpus_per_replica,
            gpus_per_replica=gpus,
            resources_per_replica=dict(opts.resources_per_replica),
        )
        placement.check_feasible(request, [(n.ip, n.resources) for n in nodes], one_node=simulate)
        return request, simulate

    def _start(self, job: Job[R], opts: Options, plan: tuple[placement.Request, bool]) -> Pool:
        request, simulate = plan
        env = dict(opts.env)
        runtime_vars = (opts.runtime_env or {}).get("env_vars") or {}
        if "OMP_NUM_THREADS" in runtime_vars:  # the user's choice wins over our default
            env.setdefault("OMP_NUM_THREADS", str(runtime_vars["OMP_NUM_THREADS"]))
        console = Console(opts.name, opts.num_replicas, prefix=opts.log_prefix, show=opts.log_ranks)
        return Pool(
            opts.name,
            request,
            simulate_nodes=simulate,
            env=env,
            runtime_env=opts.runtime_env,
            console=console,
            post_mortem=opts.post_mortem,
            placement_timeout=opts.placement_timeout,
            stop=job.stop_requested,
            on_phase=lambda phase, detail: self._progress(job, phase, detail),
        )

    def _progress(self, job: Job[R], phase: str, detail: str | None) -> None:
        if phase == PENDING:
            _reclaim_idle(self.name)  # an idle warm pool of ours must not block a job of ours
        job.set_phase(phase, detail)


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
    timeout: float | None = None,
    post_mortem: bool = False,
    placement_timeout: float | None = None,
    queue: bool = True,
    max_restarts: int = 0,
    restart_on: str = "any",
) -> DistributedFunction[P, R]:
    """Make `fn` a function that runs on `num_replicas` ranks of a torch.distributed job.

    Nothing starts until the first call; the ranks' actors then stay warm for the
    next call until `.shutdown()`, the end of a `with` block, or interpreter exit.
    `log_dir=True` keeps each call's per-rank logs under `default_log_dir()`; a path
    puts them there instead; False keeps none. `timeout` (seconds) stops a call that
    runs longer with a JobTimeoutError showing every rank's stacks. `breakpoint()` in
    `fn` and `post_mortem=True` open pdb on that rank; its output says how to attach.
    When other jobs hold the resources, the first call waits for them (the console
    says what for), or raises PlacementTimeoutError after `placement_timeout` seconds.
    `.submit(...)` returns a Job at once; with `queue=False` a call submitted while
    the previous one runs raises BusyError instead of waiting for it. `max_restarts=N`
    restarts every rank on a fresh pool after a failure (`restart_on="crash"`: only when
    a rank's process died or its node was lost), up to N times per call; each rank
    reads the attempt number from RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT).
    """
    bad_log_dir = []
    if log_dir is True:
        folder: Path | None = default_log_dir()
    elif log_dir is False or log_dir is None:
        folder = None
    elif isinstance(log_dir, str | os.PathLike):
        folder = Path(log_dir)
    else:
        folder = None
        bad_log_dir.append(
            f"log_dir={log_dir!r}: must be True (the default folder), a folder's path, "
            "or False for no log files"
        )
    options = Options(
        num_replicas=num_replicas,
        replicas_per_node=replicas_per_node,
        gpus_per_replica=gpus_per_replica,
        cpus_per_replica=cpus_per_replica,
        resources_per_replica=dict(resources_per_replica or {}),
        name=name if name is not None else _default_name(fn),
        env=dict(env or {}),
        address=address,
        runtime_env=runtime_env,
        log_prefix=log_prefix,
        log_ranks=None if log_ranks is None else tuple(log_ranks),
        log_dir=folder,
        timeout=timeout,
        post_mortem=bool(post_mortem),
        placement_timeout=placement_timeout,
        queue=queue,
        max_restarts=max_restarts,
        restart_on=restart_on,
    )
    problems = validate(fn, options) + bad_log_dir
    if problems:
        raise ConfigError("invalid arguments to distribute():\n  " + "\n  ".join(problems))
    shipping.check(fn)
    return DistributedFunction(fn, options)


def validate(fn: object, o: Options) -> list[str]:  # noqa: PLR0912 - one check per option
    """Every problem with `fn` and `o`, each naming the bad value and what is valid."""
    problems = []
    if not callable(fn):
        problems.append(f"fn={fn!r} is not callable; pass the function each rank runs")
    if not _is_int(o.num_replicas) or o.num_replicas < 1:
        problems.append(f"num_replicas={o.num_replicas!r}: must be an int >= 1")
    per_node = o.replicas_per_node
    if per_node is not None:
        if not _is_int(per_node) or per_node < 1:
            problems.append(f"replicas_per_node={per_node!r}: must be an int >= 1, or None")
        elif _is_int(o.num_replicas) and o.num_replicas >= 1 and o.num_replicas % per_node:
            problems.append(
                f"replicas_per_node={per_node} does not divide num_replicas="
                f"{o.num_replicas}; valid: {placement.valid_per_node(o.num_replicas)}"
            )
    for label, value in (
        ("cpus_per_replica", o.cpus_per_replica),
        ("gpus_per_replica", o.gpus_per_replica),
    ):
        if value is not None and (not _is_number(value) or value < 0):
            problems.append(f"{label}={value!r}: must be a number >= 0")
    for key, value in o.resources_per_replica.items():
        if key in ("CPU", "GPU"):
            problems.append(f"resources_per_replica[{key!r}]: use {key.lower()}s_per_replica")
        elif not isinstance(key, str) or not _is_number(value) or value < 0:
            problems.append(
                f"resources_per_replica[{key!r}]={value!r}: must map str to a number >= 0"
            )
    if not isinstance(o.name, str) or not _NAME.match(o.name):
        problems.append(
            f"name={o.name!r}: must be 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    for key, value in o.env.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key:
            problems.append(
                f"env[{key!r}]={value!r}: names and values must be strings, names without '='"
            )
    if o.address is not None and not isinstance(o.address, str):
        problems.append(
            f"address={o.address!r}: must be a string such as 'ray://host:10001' or 'host:6379'"
        )
    if o.runtime_env is not None and not isinstance(o.runtime_env, Mapping):
        problems.append(f"runtime_env={o.runtime_env!r}: must be a dict, as for ray.init")
    problems += _validate_logs(o)
    problems += _validate_calls(o)
    return problems


def _validate_calls(o: Options) -> list[str]:
    problems = []
    for label, value in (("timeout", o.timeout), ("placement_timeout", o.placement_timeout)):
        if value is not None and not (_is_number(value) and value > 0):  # type: ignore[operator]
            problems.append(
                f"{label}={value!r}: must be a number of seconds > 0, or None for no limit"
            )
    if not isinstance(o.queue, bool):
        problems.append(f"queue={o.queue!r}: must be True (wait for the previous call) or False")
    if not _is_int(o.max_restarts) or o.max_restarts < 0:
        problems.append(f"max_restarts={o.max_restarts!r}: must be an int >= 0 (0: fail fast)")
    if o.restart_on not in ("any", "crash"):
        problems.append(
            f"restart_on={o.restart_on!r}: must be 'any' (every failure) or 'crash' "
            "(only a dead process or a lost node)"
        )
    return problems


def _validate_logs(o: Options) -> list[str]:
    problems = []
    try:
        o.log_prefix.format(name="n", rank=0)
    except (AttributeError, KeyError, IndexError, ValueError):
        problems.append(
            f"log_prefix={o.log_prefix!r}: must be a format string using only {{name}} "
            "and {rank}, e.g. '[{name} r{rank}]', or ''"
        )
    if o.log_ranks is not None and _is_int(o.num_replicas):
        bad = [r for r in o.log_ranks if not _is_int(r) or not 0 <= r < o.num_replicas]
        if bad:
            problems.append(
                f"log_ranks={list(o.log_ranks)!r}: {bad} not ranks; valid: 0..{o.num_replicas - 1}"
            )
    return problems


def _default_name(fn: object) -> str:
    raw = getattr(fn, "__name__", "job")
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", str(raw)).strip("_.-")[:64]
    return cleaned or "job"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool, nan or inf)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _at_exit() -> None:
    """Interpreter exit: stop this process's unfinished jobs, then the embedded Ray.

    Registered after `import ray`, so it runs before Ray's own exit hook.
    """
    stop_all(say=True)
    cluster.at_exit()


atexit.register(_at_exit)
