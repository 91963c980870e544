"""What a pool reserves on the cluster: its plan, checked against the cluster's nodes, then
its placement group waited for, until Ray places it, or places a lost node's bundle again
on another node, saying what it waits for and giving up where told."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from orchestrator import placement
from orchestrator.connect import cluster
from orchestrator.errors import PlacementTimeoutError, StopRequested
from orchestrator.placement import Request
from orchestrator.show import messages, text
from orchestrator_workers.states import State

if TYPE_CHECKING:
    from orchestrator.options import Options

_WAIT_NOTICE_S = 1.0
"""A request not placed within this long is announced on the console."""
_RECHECK_S = 2.0
"""While waiting for placement, how often to check that the live nodes can still hold it."""
POLL_S = 0.2
"""How often a wait for placement or for actors checks for a stop request."""

Plan = tuple[Request, bool]
"""What a pool is to hold, and whether it simulates its nodes on one machine."""


def plan(options: Options) -> Plan:
    """Connect, lay out the request, fail at once if the cluster can never hold it."""
    cpus_needed = options.num_replicas * options.cpus_per_replica
    embedded = cluster.connect(options.address, min_cpus=cpus_needed)
    nodes = cluster.nodes()
    simulate = embedded or len(nodes) == 1
    gpus = options.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if any(n.resources.get("GPU", 0) for n in nodes) else 0.0
    per_node = options.replicas_per_node or placement.default_replicas_per_node(
        options.num_replicas, gpus, [n.resources for n in nodes]
    )
    request = Request(
        num_replicas=options.num_replicas,
        replicas_per_node=per_node,
        cpus_per_replica=options.cpus_per_replica,
        gpus_per_replica=gpus,
        resources_per_replica=dict(options.resources_per_replica or {}),
    )
    placement.check_feasible(request, [(n.ip, n.resources) for n in nodes], one_node=simulate)
    return request, simulate


def wait(
    pg: PlacementGroup,
    request: Request,
    *,
    name: str,
    timeout: float | None,
    stop: threading.Event,
    on_phase: Callable[[State, str | None], None],
    one_node: bool,
    lost: Mapping[str, Collection[int]] | None = None,
    bundles: Collection[int] = (),
) -> None:
    """Wait until `pg` is placed; with `lost` nodes (each with the ranks it held), until
    Ray has placed their `bundles` again, on other nodes (others it holds may wait on).

    Says what it waits for (`on_phase("pending", what)`, and on the console after a
    moment), then `on_phase("starting", None)`. A set `stop` ends the wait with
    StopRequested; `timeout` (seconds) with PlacementTimeoutError; nodes that can no
    longer hold `request` with PlacementError.
    """
    lost = lost or {}
    lost_ranks = sorted(rank for ranks in lost.values() for rank in ranks)
    ready = None if lost else pg.ready()
    started = time.monotonic()
    announced = False
    checked = 0.0
    needs = request.describe()
    if lost:
        needs = f"{len(lost)} node(s) x {{{text.format_resources(request.bundle())}}}"
    while not _placed(pg, ready, frozenset(lost), stop, bundles):
        waited = time.monotonic() - started
        free = text.format_resources(ray.available_resources())
        waiting_for = f"waiting for {needs}; free now: {{{free}}}"
        on_phase(State.PENDING, waiting_for)
        if timeout is not None and waited >= timeout:
            raise PlacementTimeoutError(_late(name, timeout, needs, free, lost_ranks))
        if not announced and waited >= _WAIT_NOTICE_S:
            messages.say(waiting_for, job=name)
            announced = True
        if waited >= checked + _RECHECK_S:  # nodes leave too: waiting may become futile
            checked = waited
            live = [(node.ip, node.resources) for node in cluster.nodes()]
            placement.check_feasible(request, live, one_node=one_node)
    on_phase(State.STARTING, None)


def _placed(
    pg: PlacementGroup,
    ready: ray.ObjectRef | None,
    lost: frozenset[str],
    stop: threading.Event,
    bundles: Collection[int],
) -> bool:
    """Whether `pg` is placed (none of it on `lost` nodes; of `bundles`, where given),
    after waiting a moment."""
    if stop.is_set():
        raise StopRequested
    if ready is not None:
        done, _ = ray.wait([ready], timeout=POLL_S)
        return bool(done)
    table = placement_group_table(pg)
    nodes = table["bundles_to_node_id"]  # "" for a bundle not placed
    if bundles and all(nodes.get(b) and nodes[b] not in lost for b in bundles):
        return True
    if not bundles and table["state"] == "CREATED" and not lost & set(nodes.values()):
        return True
    time.sleep(POLL_S)
    return False


def _late(name: str, timeout: float, needs: str, free: str, lost_ranks: Collection[int]) -> str:
    """What a PlacementTimeoutError says: what could not be placed, and what to do."""
    if not lost_ranks:
        return (
            f"{name} could not be placed within placement_timeout={timeout:g} s: "
            f"it needs {needs}, and the cluster has only "
            f"{{{free}}} free (other jobs hold the rest). Raise placement_timeout, "
            "or None to wait as long as it takes."
        )
    return (
        f"{name}'s rank(s) {text.rank_label(lost_ranks)} lost their node, and no node "
        f"could take its place within placement_timeout={timeout:g} s: the restart needs "
        f"{needs}, and the cluster has only {{{free}}} free. Add a node (the other "
        "ranks and their snapshots wait in their processes), or raise placement_timeout, "
        "or None to wait as long as it takes."
    )
