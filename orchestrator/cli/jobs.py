"""`orchestrator jobs`, `orchestrator logs ID [--rank R] [-f]`, `orchestrator stop ID` and
`orchestrator dashboard`: the detached jobs of a cluster, from any terminal that reaches
it (their subcommands and what each runs)."""

from __future__ import annotations

import argparse
import sys
import time

import ray

from orchestrator.show.text import printable
from orchestrator.supervise import catalog, detached, follow, registry
from orchestrator_workers.protocol import SUPERVISOR_PREFIX


def jobs(address: str | None) -> int:
    """Print every detached job (id, state, ranks, nodes, age, who started it), then the
    warm pools that wait for a next call, and what they hold. What the cluster recorded is
    printed with its control characters escaped: any token holder may have written it."""
    found = catalog.list_jobs(address)
    listed = [job for job in found if not job.is_pool]
    pools = [job for job in found if job.is_pool]
    if not listed:
        print("no detached jobs in this cluster (distribute(..., detach=True) makes one)")
    else:
        rows: list[tuple[str, ...]] = [("ID", "STATE", "RANKS", "NODES", "STARTED", "BY")]
        for job in listed:
            started = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.started))
            nodes = ",".join(job.nodes) or "-"
            ranks = "-" if job.state in (catalog.LOST, catalog.EARLIER) else str(job.ranks)
            rows.append((job.id, job.state, ranks, nodes, started, job.user))
        _print_rows(rows)
    if pools:
        print("\nwarm pools (orchestrator stop SUPERVISOR releases one):")
        rows = [("SUPERVISOR", "NAME", "RANKS", "NODES", "HOLDS", "IDLE")]  # a new table
        for pool in pools:
            idle = f"{pool.idle_s or 0:.0f} s of {pool.idle_timeout or 0:g} s"
            holds = ", ".join(f"{amount:g} {kind}" for kind, amount in pool.holds.items())
            nodes = ",".join(pool.nodes) or "-"
            rows.append((pool.id, pool.name, str(pool.ranks), nodes, holds, idle))
        _print_rows(rows)
    return 0


def _print_rows(rows: list[tuple[str, ...]]) -> None:
    rows = [tuple(map(printable, row)) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())


def logs(job_id: str, rank: int | None, keep_following: bool, address: str | None) -> int:
    """Print everything the job's ranks wrote (one rank's whole log with `rank`), then,
    with `keep_following`, what they write next until the job ends; Ctrl-C stops
    following, not the job. The exit status: 0, or 1 when the job failed."""
    detached.connect_lasting(address)
    record, handle = catalog.find_job(job_id)
    if rank is not None and not keep_following:
        sys.stdout.write(ray.get(handle.logs.remote(record.id, rank)))
        return 0
    if not keep_following:
        out, err = ray.get(handle.text.remote(record.id, record.console.log_prefix))
        sys.stdout.write(out)
        sys.stderr.write(err)
        sys.stdout.flush()
        return 0
    shown = None if rank is None else (rank,)
    job: follow.FollowedJob[object] = follow.FollowedJob(record, handle, fold=False, ranks=shown)
    try:
        job.exception()
    except KeyboardInterrupt:
        job.unfollow(say=True)
        return 130
    return 0 if not job.cancelled() and job.exception() is None else 1


def stop(job_id: str, address: str | None) -> int:
    """Stop a detached job's ranks (or release a warm pool, given its supervisor; or forget
    a lost supervisor; or remove a record that cannot be read, given its key)."""
    if job_id.startswith(registry.RECORDS):
        detached.connect_lasting(address)
        for key in catalog.remove_unreadable(job_id):
            print(f"removed {printable(key)}, which could not be read, from the cluster")
        return 0
    if job_id.startswith(SUPERVISOR_PREFIX) and catalog.release_pool(job_id, address):
        print(f"{printable(job_id)} releases its warm pool (once no job of it runs)")
        return 0
    if job_id.startswith(SUPERVISOR_PREFIX) and catalog.forget_lost(job_id):
        print(f"{printable(job_id)} was gone with its jobs; its record is removed")
        return 0
    detached.connect_lasting(address)
    print(catalog.stop(job_id))
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """The detached jobs' subcommands: jobs, logs, stop, dashboard."""
    _cluster_command(
        commands,
        "jobs",
        "list the detached jobs of a cluster",
        "List the jobs started with distribute(..., detach=True): id, state, ranks, nodes, "
        "when and by whom.",
    )
    logs_cmd = _cluster_command(
        commands,
        "logs",
        "print what a detached job's ranks wrote; -f follows it to its end",
        "Print every line a detached job's ranks wrote (within the journal's bound), "
        "labelled by rank; --rank R prints that rank's whole log file. -f then follows the "
        "job until it ends: Ctrl-C stops following, not the job.",
        epilog="example: orchestrator logs train-3f9a1c -f",
    )
    logs_cmd.add_argument("id", help="the job's id (or its name: your newest job of that name)")
    logs_cmd.add_argument("--rank", type=int, help="only this rank")
    logs_cmd.add_argument("-f", "--follow", action="store_true", help="follow it to its end")
    stop_cmd = _cluster_command(
        commands,
        "stop",
        "stop a detached job's ranks",
        "Stop every rank of a detached job (as job.cancel() does).",
    )
    stop_cmd.add_argument(
        "id",
        help="the job's id (or its name: your newest job of that name); a warm pool's "
        "supervisor; or the key of a record that cannot be read, as the warning wrote it",
    )
    page_cmd = _cluster_command(
        commands,
        "dashboard",
        "serve a page of the cluster's detached jobs and warm pools on 127.0.0.1",
        "Serve a page (on 127.0.0.1, with a secret token in its address) that lists the "
        "cluster's detached jobs and warm pools; each job's ranks, numbers over time, output "
        "and stacks. Prints its address; runs until Ctrl-C. The page takes no action: "
        "`orchestrator stop` stops a job.",
    )
    page_cmd.add_argument("--port", type=int, default=0, help="port (default: a free one)")


def _cluster_command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    description: str,
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand about a cluster's detached jobs: it takes the cluster's --address."""
    command: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=description, epilog=epilog
    )
    command.add_argument(
        "--address",
        help="Ray cluster (default: RAY_ADDRESS, or `ray start`/the local runtime here)",
    )
    return command


def dashboard(address: str | None, port: int) -> int:
    """Serve the cluster's page until Ctrl-C (see cli/dashboard.py)."""
    from orchestrator.cli.dashboard import dashboard  # the page's modules: only for it

    return dashboard(address, port)
