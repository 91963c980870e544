"""Driver side of `orchestrator run`, `nodes` and `stacks`: ship the working dir, run, report."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ray

from orchestrator import _ray_compat, placement
from orchestrator.cli import torchrun, upload
from orchestrator.connect import cluster, discovery, probe
from orchestrator.errors import DistributedError, JobTimeoutError, LaunchError
from orchestrator.function import distribute
from orchestrator.options import clean_name
from orchestrator.show import messages, text
from orchestrator_workers.script import Script, ScriptExit, run_script

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
"""As timeout(1) exits when its command ran too long."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command stopped with Ctrl-C."""
EXIT_TERMINATED = 143
"""128 + SIGTERM, as a shell reports a command that `timeout` or a scheduler ended."""


@dataclass(frozen=True)
class RunOptions:
    """Everything `orchestrator run` was asked to do."""

    target: str
    """The script's path, or a module's name with `module`."""
    args: tuple[str, ...] = ()
    nproc: int | None = None
    """Ranks in all (None: from nnodes x nproc_per_node, else 1)."""
    per_node: int | None = None
    nnodes: int | None = None
    """torchrun's --nnodes (N or N:N, read once by `torchrun.parse_nnodes`)."""
    nproc_per_node: str | None = None
    """torchrun's --nproc-per-node as given: a number, gpu, cpu or auto."""
    node_rank: int | None = None
    standalone: bool = False
    """Run on an embedded Ray here, whatever RAY_ADDRESS or a `ray start` here say."""
    unneeded: tuple[str, ...] = ()
    """torchrun options given that have no use here (--master-port, --rdzv-*...)."""
    address: str | None = None
    name: str | None = None
    timeout: float | None = None
    max_restarts: int = 0
    restart_on: str = "any"
    module: bool = False
    working_dir: Path | None = None
    """The folder shipped to every node; None: the current folder, or the script's own
    folder when the script is outside it."""
    excludes: tuple[str, ...] = ()
    """Extra gitignore-style patterns left out of the upload."""
    default_excludes: bool = True
    max_upload: int = upload.DEFAULT_MAX_UPLOAD
    upload: bool = True
    """False: every node sees `working_dir` at the same path; ship nothing."""
    local_rank_arg: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


def upload_excludes(options: RunOptions) -> list[str]:
    """The patterns left out of the upload: the defaults, Ray's own, then the user's."""
    defaults = list(upload.DEFAULT_EXCLUDES) if options.default_excludes else []
    # Ray adds its defaults (.git, .venv, venv, __pycache__) when it packages; they are
    # in the list measured here too, so the measured size is the uploaded one.
    return [*defaults, *_ray_compat.upload_default_excludes(), *options.excludes]


def script_for(options: RunOptions, *, shipped: bool) -> tuple[Script, Path]:
    """What every rank runs, and the folder that holds it (what is shipped, when shipped).

    A script outside the current folder runs where it is on this machine; shipped, its
    own folder is. Either way its folder is the rank's sys.path[0], as `python script.py`
    gives. Paths are compared resolved (`..` and symlinks followed), as ranks open them.
    """
    root = (options.working_dir or Path()).resolve()
    if not root.is_dir():
        raise LaunchError(f"--working-dir {options.working_dir}: no such folder")
    folder = root
    if options.module:
        target = options.target
    else:
        path = Path(options.target).resolve()
        if not path.is_file():
            raise LaunchError(
                f"{options.target}: no such file (from {Path.cwd()}); to run a module "
                "as `python -m` would, use -m NAME"
            )
        _check_syntax(options.target, path)
        if path.is_relative_to(root):
            target = str(path.relative_to(root))
        elif options.working_dir is not None:
            raise LaunchError(
                f"{options.target} is outside --working-dir {root}, which is what every "
                "node gets: pass a --working-dir that holds it, or none"
            )
        elif shipped:  # every node gets the script's own folder
            folder, target = path.parent, path.name
        else:  # on this machine: run it where it is, from the current folder
            target = str(path)
    script = Script(
        target=target,
        args=tuple(options.args),
        module=options.module,
        cwd=None if shipped else str(root),
        local_rank_arg=options.local_rank_arg,
        argv0=None if options.module else _as_typed(options.target, folder, root, shipped),
    )
    return script, folder


def _as_typed(typed: str, folder: Path, root: Path, shipped: bool) -> str | None:
    """The script's path as typed, for sys.argv[0] (torchrun passes it so), where it names
    the same file from the ranks' working folder (the shipped `folder`, else `root`); a
    shipped copy is never named by this machine's absolute path."""
    if shipped and Path(typed).is_absolute():
        return None
    rank_cwd = folder if shipped else root
    return typed if (rank_cwd / typed).resolve() == Path(typed).resolve() else None


def _check_syntax(given: str, path: Path) -> None:
    """Compile the script here first: a syntax error is shown at once, as python shows it,
    instead of by every rank after the cluster started them."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        shown = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
        raise LaunchError(f"{given} does not compile; nothing was started:\n{shown}") from None
    except (OSError, ValueError):  # unreadable here, or null bytes: the ranks will say
        pass


def job_name(options: RunOptions) -> str:
    """--name, else the script's file name (or the module's last part) without `.py`."""
    if options.name is not None:
        return options.name
    raw = options.target.rsplit(".", 1)[-1] if options.module else Path(options.target).stem
    return clean_name(raw)


def validate(options: RunOptions) -> list[str]:
    """Problems with the command line, in its own spelling, before anything starts."""
    problems = []
    per_node, nproc = options.per_node, options.nproc
    if nproc is not None and nproc < 1:
        problems.append(f"--nproc {nproc}: must be at least 1")
    if per_node is not None:
        if per_node < 1:
            problems.append(f"--per-node {per_node}: must be at least 1")
        elif nproc is not None and nproc >= 1 and nproc % per_node:
            problems.append(
                f"--per-node {per_node} does not divide --nproc {nproc}; "
                f"valid: {placement.valid_per_node(nproc)}"
            )
    given = options.nproc_per_node
    if given is not None and not given.isdigit() and given not in torchrun.SYMBOLIC:
        problems.append(
            f"--nproc-per-node {given}: give a number of ranks per node, or gpu, cpu or auto"
        )
    if options.node_rank not in (None, 0):
        problems.append(
            f"--node-rank {options.node_rank}: one `orchestrator run` launches the ranks of "
            "every node (torchrun runs once per node); run it once, from any machine that "
            "reaches the cluster, without --node-rank"
        )
    if options.standalone and options.address:
        problems.append(
            f"--standalone and --address {options.address}: give one (--standalone runs here)"
        )
    if options.timeout is not None and options.timeout <= 0:
        problems.append(f"--timeout {options.timeout:g}: must be a number of seconds > 0")
    if options.max_restarts < 0:
        problems.append(f"--max-restarts {options.max_restarts}: must be 0 or more")
    if options.max_upload < 0:
        problems.append(f"--max-upload {options.max_upload}: must be a size >= 0")
    return problems


def _layout(options: RunOptions, *, one_machine: bool) -> torchrun.Layout:
    """The ranks' count and per-node count; gpu/cpu/auto against the cluster's nodes."""
    given = options.nproc_per_node
    per = None
    if given is not None:
        nodes = [] if given.isdigit() else cluster.nodes()
        per = torchrun.per_node_for(given, nodes, one_machine=one_machine)
    return torchrun.layout(options.nproc, options.per_node, options.nnodes, per)


def _only_this_machine(target: str) -> bool:
    """Whether the cluster at `target` is one node on this machine (started here)."""
    if target != discovery.local_cluster()[0]:
        return False
    return cluster.count_nodes(target) == 1  # before joining: the join ships the folder


def run(options: RunOptions) -> int:
    """Run the script on every rank; the exit status (0: every rank succeeded)."""
    problems = validate(options)
    if problems:
        raise LaunchError("\n".join(problems))
    if options.nproc_per_node is None or options.nproc_per_node.isdigit():
        _layout(options, one_machine=True)  # wrong counts are refused before anything starts
    if options.unneeded:
        messages.say(
            f"{', '.join(options.unneeded)}: not needed here (rank 0's address and a free "
            "port are found for every call; one command launches every node); ignored"
        )
    target = None if options.standalone else discovery.cluster_address(options.address)
    if options.standalone:
        _say_standalone()
    # The embedded instance, and a one-node `ray start` or local runtime here, run on this
    # machine: the ranks read the files in place (and may start in warm spares).
    shipped = target is not None and options.upload and not _only_this_machine(target)
    script, folder = script_for(options, shipped=shipped)
    started = False
    name = job_name(options)
    terminated = threading.Event()
    try:
        if shipped:
            _join_and_ship(target or "", folder, options)
        else:
            hint = _slots_hint(options)
            cluster.connect(options.address, min_cpus=hint, standalone=options.standalone)
        _stop_on_sigterm(terminated)
        layout = _layout(options, one_machine=not shipped)
        fn = distribute(
            run_script,
            num_replicas=layout.nproc,
            replicas_per_node=layout.per_node,
            name=name,
            address=options.address,
            timeout=options.timeout,
            env=dict(options.env),
            max_restarts=options.max_restarts,
            restart_on=options.restart_on,
        )
        with fn:
            started = True
            fn(script)
    except JobTimeoutError as err:
        _report(err)
        return EXIT_TIMEOUT
    except DistributedError as err:
        _report(err)
        return _exit_status(err)
    except KeyboardInterrupt:
        stopped = f": every rank of {name} was stopped" if started else ""
        if terminated.is_set():
            messages.say(f"terminated (SIGTERM){stopped}")
            return EXIT_TERMINATED
        messages.say(f"interrupted{stopped}")
        return EXIT_INTERRUPTED
    finally:
        # Leave the cluster (or stop the embedded instance) now, while it is all alive.
        ray.shutdown()
    return 0


def _stop_on_sigterm(came: threading.Event) -> None:
    """From now on (Ray joined), SIGTERM stops the ranks as Ctrl-C does, and sets `came`.
    Ray's core worker put its crash reporter there, which printed six lines of `*** SIGTERM
    received ***` and addresses, and ended this process with the ranks left to Ray."""

    def terminate(_signum: int, _frame: object) -> None:
        came.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminate)


def _slots_hint(options: RunOptions) -> float:
    """CPUs an embedded instance needs at least for this job (cpu/auto: this machine's)."""
    given = options.nproc_per_node or "1"
    per = int(given) if given.isdigit() else os.cpu_count() or 1
    return max(options.nproc or 0, (options.nnodes or 1) * per)


def _say_standalone() -> None:
    """Say what --standalone leaves aside, if anything."""
    ignored = []
    if os.environ.get("RAY_ADDRESS"):
        ignored.append(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}")
    live, _ = discovery.local_cluster()
    if live:
        ignored.append(f"the Ray cluster running here at {live}")
    if ignored:
        messages.say(
            "--standalone: running on an embedded Ray instance here; ignoring "
            + " and ".join(ignored)
        )


def _join_and_ship(address: str, root: Path, options: RunOptions) -> None:
    """Join the cluster with `root` as the job's runtime_env, after the size guard."""
    # The list holds Ray's own default excludes: what is measured is what Ray uploads.
    excludes = upload_excludes(options)
    measured = upload.check_upload(root, excludes, options.max_upload)
    size = "size unknown"
    if measured is not None:
        size = f"{measured.files} files, {text.format_size(measured.total)}"
    why = "" if root == Path.cwd().resolve() else " (the script's folder: it is outside this one)"
    messages.say(f"shipping {root}{why} to the cluster at {address}: {size}")
    probe.check_reachable(address, "address")
    # Per-actor runtime_envs take URIs only; the job's own takes a local folder and
    # uploads it once (content-addressed: an unchanged folder is not sent again).
    cluster.join(address, runtime_env={"working_dir": str(root), "excludes": excludes})


def _report(err: DistributedError) -> None:
    sys.stdout.flush()
    print(f"\n[orchestrator] the job failed: {err}", file=sys.stderr, flush=True)


def _exit_status(err: DistributedError) -> int:
    """The root cause's own sys.exit status, if that is what failed; else 1."""
    root = err.root_cause
    if root is None or root.exception is None or not root.exc_type.endswith(".ScriptExit"):
        return EXIT_FAILED
    try:
        exc = pickle.loads(root.exception)  # noqa: S301 - our own rank's record
    except Exception:  # noqa: BLE001 - the generic status will do
        return EXIT_FAILED
    status = exc.status if isinstance(exc, ScriptExit) else EXIT_FAILED
    return status if 0 < status < 256 else EXIT_FAILED
