"""The `orchestrator` command line: `run` a script on every rank, `nodes`, `stacks`, `attach`,
and the detached jobs: `jobs`, `logs`, `stop`, `dashboard`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from pathlib import Path

from orchestrator.cli import jobs, launch, lookup, torchrun, upload
from orchestrator.cli.attach import attach
from orchestrator.connect import cluster, local
from orchestrator.errors import LaunchError, OrchestratorError
from orchestrator.show import text
from orchestrator_workers import private

RUN_EXAMPLE = """\
Runs SCRIPT as __main__ on every rank, with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*): a script written for torchrun runs unchanged.

example (4 ranks on 2 nodes, on the cluster at HEAD_IP:6379):
  orchestrator run --nproc 4 --per-node 2 --address HEAD_IP:6379 \\
      train.py --arch resnet50 --batch_size 64

torchrun's spellings work too: swap the program name (also `python -m orchestrator.run`):
  orchestrator run --nnodes 2 --nproc-per-node 2 train.py --lr 0.1
  --nproc-per-node takes a number or gpu/cpu/auto (a node's GPUs or CPUs, as Ray sees
  them); --nnodes N or N:N (not an elastic range); --standalone runs here on an embedded
  Ray, whatever RAY_ADDRESS says. Unlike torchrun, one command launches every node: no
  --node-rank, and --master-addr, --master-port and --rdzv-* are not needed (ignored).

  Every rank's lines are shown prefixed with "[train r2]". Exit status: 0 when every
  rank succeeded (sys.exit(0) included); else the failing rank's sys.exit status, or
  1 with its traceback printed last; 124 after --timeout; 130 after Ctrl-C, which
  stops every rank on every node.

the working dir:
  On a cluster, the current folder (--working-dir) is shipped to every node and each
  rank runs in its copy, so the modules beside the script import there (a script
  outside the current folder: its own folder is shipped instead). Left out:
%(excludes)s,
  anything in .gitignore or .rayignore, and --exclude PATTERN. Folders holding more
  than --max-upload (default %(limit)s) are refused before anything starts. Without
  --address, RAY_ADDRESS or a `ray start` cluster on this machine, an embedded Ray
  instance runs the ranks here, in the current folder, and nothing is shipped (a
  script elsewhere runs where it is). Either way, sys.path[0] is the script's folder.

legacy torch.distributed.launch scripts:
  --local-rank-arg local_rank   passes --local_rank=N before the script's arguments
  --local-rank-arg local-rank   passes --local-rank=N
"""


def _size(text: str) -> int:
    try:
        return upload.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. NCCL_DEBUG=INFO")
    return key, value


def _add_run(commands: argparse._SubParsersAction) -> None:
    run_cmd = commands.add_parser(
        "run",
        help="run a torchrun-style script on every rank of a Ray cluster",
        description="Run a Python script (or -m module) as a torch.distributed job on Ray.",
        epilog=RUN_EXAMPLE
        % {
            "excludes": textwrap.fill(
                ", ".join(upload.DEFAULT_EXCLUDES),
                width=84,
                initial_indent="  ",
                subsequent_indent="  ",
            ),
            "limit": text.format_size(upload.DEFAULT_MAX_UPLOAD),
        },
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] (SCRIPT | -m MODULE) [script args ...]",
    )
    run_cmd.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="number of ranks (default: --nnodes x --nproc-per-node, else 1)",
    )
    run_cmd.add_argument(
        "--per-node",
        type=int,
        metavar="N",
        help="ranks per node (must divide --nproc; default: a node's GPUs, or all on one "
        "node without GPUs)",
    )
    run_cmd.add_argument(
        "--address", metavar="ADDR", help="Ray cluster, HOST:PORT or ray://HOST:10001"
    )
    run_cmd.add_argument(
        "--name", help="job name: output prefix, and what `stacks` finds (default: the script's)"
    )
    run_cmd.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop every rank after this many seconds, showing stacks",
    )
    torchrun.add_arguments(run_cmd)
    run_cmd.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a failure, restart every rank up to N times (each reads RESTART_COUNT "
        "and TORCHELASTIC_RESTART_COUNT); default 0",
    )
    run_cmd.add_argument(
        "--restart-on",
        choices=["any", "crash"],
        default="any",
        help="restart after any failure (default), or only when a rank's process died or "
        "its node was lost",
    )
    run_cmd.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra variable for every rank (repeatable)",
    )
    run_cmd.add_argument(
        "--local-rank-arg",
        choices=["local_rank", "local-rank"],
        help="pass --local_rank=N / --local-rank=N to the script (torch.distributed.launch)",
    )
    run_cmd.add_argument(
        "--working-dir",
        type=Path,
        metavar="DIR",
        help="the folder shipped to every node; must hold the script (default: the current "
        "folder, or the script's own when it is outside it)",
    )
    run_cmd.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave files matching this gitignore pattern out of the upload (repeatable)",
    )
    run_cmd.add_argument(
        "--no-default-excludes",
        action="store_true",
        help="ship the checkpoints, caches and environments left out by default",
    )
    run_cmd.add_argument(
        "--max-upload",
        type=_size,
        default=upload.DEFAULT_MAX_UPLOAD,
        metavar="SIZE",
        help="largest working dir to ship, e.g. 500M or 2G "
        f"(default: {text.format_size(upload.DEFAULT_MAX_UPLOAD)})",
    )
    run_cmd.add_argument(
        "--no-upload",
        action="store_true",
        help="ship nothing: every node sees the working dir at the same path",
    )
    run_cmd.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as `python -m` would",
    )
    run_cmd.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, the module)")
    run_cmd.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _run(args: argparse.Namespace) -> int:
    fields = {field.name for field in dataclasses.fields(launch.RunOptions)}
    same = {name: value for name, value in vars(args).items() if name in fields}  # by name
    options = launch.RunOptions(
        **{
            **same,
            "target": args.script,
            "args": tuple(args.args),
            "nnodes": torchrun.parse_nnodes(args.nnodes) if args.nnodes is not None else None,
            "unneeded": tuple(torchrun.unneeded(args)),
            "excludes": tuple(args.exclude),
            "default_excludes": not args.no_default_excludes,
            "upload": not args.no_upload,
            "local_rank_arg": f"--{args.local_rank_arg}" if args.local_rank_arg else None,
            "env": dict(args.env),
        }
    )
    return launch.run(options)


def _add_local(commands: argparse._SubParsersAction) -> None:
    local_cmd = commands.add_parser(
        "local",
        help="start, stop or show the local runtime: a Ray here with warm rank processes",
        description="The local runtime keeps a Ray instance and SPARES rank processes, with "
        "torch imported, on this machine between scripts. A script's distribute(...) finds "
        "it and starts its CPU-only ranks in those processes (each used once, then "
        "replaced in the background), so a fresh script starts in about a second instead "
        "of starting Ray and importing torch in every rank.",
    )
    actions = local_cmd.add_subparsers(dest="action", required=True)
    start_cmd = actions.add_parser("start", help="start it and wait for its warm processes")
    start_cmd.add_argument(
        "--spares", type=int, default=4, help="warm rank processes kept ready (default 4)"
    )
    start_cmd.add_argument("--port", type=int, default=6379, help="Ray's port (default 6379)")
    start_cmd.add_argument(
        "--cpus",
        type=int,
        help=f"logical CPUs: slots for ranks, not cores (default {cluster.LOCAL_SLOTS})",
    )
    start_cmd.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        help="stop after this many seconds without a script connected (default 3600; 0: never)",
    )
    actions.add_parser("stop", help="stop it: its Ray processes and warm ranks")
    actions.add_parser("status", help="show its address, warm processes and the ranks in use")


def _local(args: argparse.Namespace) -> int:
    if args.action == "start":
        info = local.start(
            spares=args.spares,
            port=args.port,
            cpus=args.cpus,
            idle_timeout=args.idle_timeout or None,
        )
        ready = f"{len(info.ready)} of {info.count}" if len(info.ready) < info.count else info.count
        print(
            f"local runtime running (pid {info.runtime_pid}): {ready} warm rank processes; "
            "scripts here use it without an address. Stop: orchestrator local stop"
        )
        return 0
    if args.action == "stop":
        print(f"local runtime stopped (pid {local.stop()})")
        return 0
    return _local_status()


def _local_status() -> int:
    found = local.status()
    if found is None:
        print("no local runtime is running (start one: orchestrator local start)")
        return 3
    address, info = found.address, found.info
    if info is None:
        print(
            f"local runtime at {address} (pid {found.pid}) is running, but {found.problem}; "
            "`orchestrator local status` asks again, `orchestrator local stop` stops it"
        )
        return 1
    idle = f"stops after {info.idle_timeout:g} s idle" if info.idle_timeout else "no idle stop"
    print(
        f"local runtime at {address} (pid {info.runtime_pid}, {idle}): "
        f"{len(info.ready)} of {info.count} warm rank processes ready"
        + (", 1 starting" if info.starting else "")
    )
    if info.error:
        print(f"  the last warm process failed to start: {info.error}")
    free, total = local.cpus()
    print(f"  CPUs free: {free:g} of {total:g}")
    for claim in info.claims:
        print(f"  in use: {claim.job_name} rank {claim.rank} (pid {claim.pid})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; the exit status."""
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description=__doc__,
        epilog="example: orchestrator run --nproc 4 --per-node 2 train.py --epochs 3\n"
        "`orchestrator COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    nodes_cmd = commands.add_parser(
        "nodes",
        help="list the cluster's nodes with their CPUs and GPUs",
        description="List the live nodes of a Ray cluster and what each offers ranks.",
    )
    nodes_cmd.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, or `ray start`)")
    stacks_cmd = commands.add_parser(
        "stacks",
        help="show the current Python stacks of every rank of a running job",
        description="Show where every rank of a running job is, from another terminal.",
        epilog="example: orchestrator stacks train --address HEAD_IP:6379",
    )
    stacks_cmd.add_argument("name", help="the job's name (its --name), or NAME-POOLID")
    stacks_cmd.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, or `ray start`)")
    attach_cmd = commands.add_parser(
        "attach",
        help="open the pdb session of a rank stopped at breakpoint() or post_mortem",
        description=(
            "Example: ORCHESTRATOR_DEBUG_TOKEN=... orchestrator attach 10.0.0.2:41234 (the "
            "line the rank printed: its one-time secret comes in the environment, not argv)"
        ),
    )
    attach_cmd.add_argument("address", help="HOST:PORT printed by the waiting rank")
    _add_local(commands)
    jobs.add_commands(commands)
    args = parser.parse_args(argv)
    commands_of = {
        "run": lambda: _run(args),
        "nodes": lambda: lookup.nodes(args.address),
        "stacks": lambda: lookup.stacks(args.name, args.address),
        "local": lambda: _local(args),
        "attach": lambda: attach(args.address),
        "jobs": lambda: jobs.jobs(args.address),
        "logs": lambda: jobs.logs(args.id, args.rank, args.follow, args.address),
        "stop": lambda: jobs.stop(args.id, args.address),
        "dashboard": lambda: jobs.dashboard(args.address, args.port),
    }
    try:
        return commands_of[args.command]()
    except OrchestratorError as exc:
        print(f"orchestrator {args.command}: {exc}", file=sys.stderr)
        return launch.EXIT_USAGE if isinstance(exc, ValueError | LaunchError) else 1
    except (ConnectionError, private.UnsafeFolderError) as exc:  # Ray unreachable; a folder
        print(f"orchestrator {args.command}: {exc}", file=sys.stderr)
        return 1
