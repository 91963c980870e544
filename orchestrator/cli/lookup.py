"""`orchestrator nodes` and `orchestrator stacks`: look at a running cluster from elsewhere."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import ray
from ray.exceptions import RayError

from orchestrator.actornames import ACTOR_NAMESPACE, parse_actor_name, parse_spare_name
from orchestrator.channel import rank_stacks
from orchestrator.connect import cluster, local, probe
from orchestrator.connect.discovery import cluster_address
from orchestrator.diagnose import stall
from orchestrator.errors import LaunchError
from orchestrator.show import messages
from orchestrator.show.summary import group_stacks, stacks_title
from orchestrator.show.text import format_size
from orchestrator_workers.protocol import unwire

_ASK_SPARE_S = 5.0
"""How long a warm spare may take to say which rank it serves (it answers while a call runs)."""


def connect_existing(address: str | None) -> None:
    """Join a running cluster (never start one): `address`, RAY_ADDRESS, or `ray start` here."""
    if ray.is_initialized():
        return
    target = cluster_address(address)
    if not target:
        raise LaunchError(
            "no Ray cluster to look at: pass --address HOST:PORT or set RAY_ADDRESS. "
            "A run without either uses a Ray instance embedded in its own process, which "
            "other processes cannot reach: to look at local runs from here, start Ray "
            "with `ray start --head` first"
        )
    given_as = "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else ""
    if given_as:
        probe.check_reachable(target, given_as)
    elif why := probe.problem(target):
        raise LaunchError(
            f"the Ray cluster found on this machine at {target} does not answer ({why}): "
            "pass --address HOST:PORT of a live cluster, or start one with `ray start --head`"
        )
    cluster.join(target)


def nodes(address: str | None) -> int:
    """Print the cluster's live nodes and what each offers ranks; the exit status."""
    connect_existing(address)
    rows = [("NODE IP", "NODE ID", "CPUS", "GPUS", "GPU TYPE", "MEMORY", "OTHER")]
    total_cpus = total_gpus = 0.0
    found = sorted(cluster.nodes(), key=lambda n: n.ip)
    for node in found:
        res = node.resources
        total_cpus += res.get("CPU", 0)
        total_gpus += res.get("GPU", 0)
        types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        other = {
            k: v
            for k, v in res.items()
            if k not in ("CPU", "GPU", "memory", "object_store_memory")
            and not k.startswith(("node:", "accelerator_type:"))
        }
        rows.append(
            (
                node.ip,
                node.node_id[:12],
                f"{res.get('CPU', 0):g}",
                f"{res.get('GPU', 0):g}",
                ",".join(types) or "-",
                format_size(res.get("memory", 0)),
                ", ".join(f"{k}={v:g}" for k, v in sorted(other.items())) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"{len(found)} node(s): {total_cpus:g} CPUs, {total_gpus:g} GPUs in all")
    return 0


def running_jobs() -> dict[tuple[str, str], dict[int, str]]:
    """Ranks' actor names of every running job, by (job name, pool id), then by rank."""
    jobs: dict[tuple[str, str], dict[int, str]] = {}
    listed = ray.util.list_named_actors(all_namespaces=True)
    ours = [entry["name"] for entry in listed if entry["namespace"] == ACTOR_NAMESPACE]
    for name in ours:
        parsed = parse_actor_name(name)
        if parsed is not None:
            job, pool_id, rank = parsed
            jobs.setdefault((job, pool_id), {})[rank] = name
    for (job, pool_id), rank, name in _serving_spares(ours):  # ranks a pool's spare took
        jobs.setdefault((job, pool_id), {})[rank] = name
    for claim in local.claims():  # ranks running in the local runtime's spares
        jobs.setdefault((claim.job_name, claim.pool_id), {})[claim.rank] = claim.actor_name
    return jobs


def _serving_spares(names: list[str]) -> list[tuple[tuple[str, str], int, str]]:
    """Of the actor names given, the warm spares that serve a rank: (job, pool), rank, name."""
    spares = {name: parsed for name in names if (parsed := parse_spare_name(name))}
    asked = {}
    for name in spares:
        with contextlib.suppress(ValueError):  # gone since listed
            asked[name] = ray.get_actor(name, namespace=ACTOR_NAMESPACE).serving.remote()
    found = []
    for name, ref in asked.items():
        with contextlib.suppress(RayError):
            rank = ray.get(ref, timeout=_ASK_SPARE_S)
            if rank >= 0:
                found.append((spares[name], rank, name))
    return found


def stacks(name: str, address: str | None, wait_s: float = 10.0) -> int:
    """Print the live stacks of every rank of job `name` (or NAME-POOLID); the exit status."""
    connect_existing(address)
    jobs = running_jobs()
    chosen = {key: ranks for key, ranks in jobs.items() if name in (key[0], f"{key[0]}-{key[1]}")}
    if not chosen:
        running = sorted(
            {f"{job} ({job}-{pool}, {len(r)} ranks)" for (job, pool), r in jobs.items()}
        )
        listing = "; running: " + ", ".join(running) if running else "; no job is running there"
        raise LaunchError(f"no running job named {name!r} on this cluster{listing}")
    if len(chosen) > 1:
        messages.say(
            f"{len(chosen)} jobs are named {name!r}; showing each (pick one with "
            f"NAME-POOLID: {', '.join(f'{j}-{p}' for j, p in sorted(chosen))})"
        )
    for (job, pool_id), ranks in sorted(chosen.items()):
        if len(chosen) > 1:
            print(f"=== {job}-{pool_id} ===")
        actors, texts = {}, {}
        for rank, actor_name in sorted(ranks.items()):
            try:
                actors[rank] = ray.get_actor(actor_name, namespace=ACTOR_NAMESPACE)
            except ValueError:
                texts[rank] = "(the rank's actor is gone)"
        deadline = time.monotonic() + wait_s  # one wait for both: a rank may not answer
        places = _places(job, actors, wait_s)
        if places:
            print(f"{places}\n", flush=True)
        texts.update(rank_stacks(actors, max(1.0, deadline - time.monotonic())))
        for same, text in group_stacks(dict(sorted(texts.items()))):
            print(f"--- {stacks_title(same)} ---\n{text}\n", flush=True)
    return 0


def _places(job: str, actors: dict[int, Any], wait_s: float) -> str:
    """Where each rank's function is, grouped by place, the odd ones out first, as a
    call's report of ranks without progress groups them; '' when no call is running."""
    refs = {actor.where.remote(): rank for rank, actor in actors.items()}
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
    now = time.monotonic()
    where = {}
    for ref in done:
        try:
            where.update({entry.rank: (entry, now) for entry in unwire(ray.get(ref))})
        except RayError:
            continue  # its stacks below say why
    if not any(entry.running for entry, _ in where.values()):
        return ""  # no call runs
    never = [-math.inf] * (max(actors) + 1)  # the ranks' output is not watched from here
    found = stall.report(job, now, where, sorted(where), never, after_s=0.0)
    return found.places() if found is not None else ""
