"""Rank layout, per-node bundles and whether a cluster can ever hold them: pure, given
the cluster's nodes (reserve.py asks the cluster)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.errors import PlacementError
from orchestrator.show.text import format_resources


@dataclass(frozen=True)
class Request:
    """What one distributed function needs from the cluster."""

    num_replicas: int
    replicas_per_node: int
    cpus_per_replica: float
    gpus_per_replica: float
    resources_per_replica: Mapping[str, float] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """How many nodes (bundles) the ranks spread over."""
        return self.num_replicas // self.replicas_per_node

    def per_replica(self) -> dict[str, float]:
        """Ray resources of one replica's actor."""
        res = {"CPU": self.cpus_per_replica, "GPU": self.gpus_per_replica}
        res.update(self.resources_per_replica)
        return {k: v for k, v in res.items() if v}

    def bundle(self) -> dict[str, float]:
        """Ray resources of one node's bundle: `replicas_per_node` replicas."""
        return {k: v * self.replicas_per_node for k, v in self.per_replica().items()}

    def describe(self) -> str:
        """E.g. '2 nodes x {CPU: 2, GPU: 2}'."""
        return f"{self.num_nodes} node(s) x {{{format_resources(self.bundle())}}}"


@dataclass(frozen=True)
class Slot:
    """Where one rank sits."""

    rank: int
    local_rank: int
    node_rank: int


def layout(num_replicas: int, replicas_per_node: int) -> list[Slot]:
    """Ranks contiguous per node: node 0 holds ranks 0..k-1, node 1 the next k, ..."""
    return [
        Slot(rank=r, local_rank=r % replicas_per_node, node_rank=r // replicas_per_node)
        for r in range(num_replicas)
    ]


def valid_per_node(num_replicas: int, shown: int = 8) -> str:
    """The ranks-per-node values that divide `num_replicas`, for a message: a few, if many.

    Found in O(sqrt(n)) steps, so a huge `num_replicas` is answered at once.
    """
    small, large = [], []
    d = 1
    while d * d <= num_replicas:
        if num_replicas % d == 0:
            small.append(d)
            if d != num_replicas // d:
                large.append(num_replicas // d)
        d += 1
    found = small + large[::-1]
    if len(found) <= shown:
        return ", ".join(map(str, found))
    head = ", ".join(map(str, found[: shown - 1]))
    return f"{head}, ... {found[-1]} ({len(found)} in all)"


def order_bundles(bundle_nodes: Mapping[int, str], first_node: str | None) -> list[int]:
    """Bundle indices in node-rank order: the driver's node first, then by bundle index."""
    return sorted(bundle_nodes, key=lambda b: (bundle_nodes[b] != first_node, b))


def default_replicas_per_node(
    num_replicas: int, gpus_per_replica: float, nodes: Sequence[Mapping[str, float]]
) -> int:
    """As many replicas per node as a node has GPUs (all on one node without GPUs).

    Picks the largest divisor of `num_replicas` that fits the biggest node, so that
    every node gets the same number of ranks.
    """
    if not gpus_per_replica:
        return num_replicas
    capacity = max(int(n.get("GPU", 0) // gpus_per_replica) for n in nodes) if nodes else 0
    fitting = [k for k in range(1, num_replicas + 1) if num_replicas % k == 0 and k <= capacity]
    return max(fitting) if fitting else num_replicas


def check_feasible(
    request: Request, nodes: Sequence[tuple[str, Mapping[str, float]]], *, one_node: bool
) -> None:
    """Raise PlacementError at once if no amount of waiting could place `request`.

    `nodes` are (ip, total resources) of the cluster's live nodes. With `one_node`
    (the embedded local instance) every bundle goes on one node.
    """
    bundle = request.bundle()
    if one_node:
        need = {k: v * request.num_nodes for k, v in bundle.items()}
        fits = [ip for ip, total in nodes if _fits(need, total)]
        if fits:
            return
        reason = (
            f"no node can hold all {request.num_nodes} simulated node(s) "
            f"{{{format_resources(need)}}}"
        )
    else:
        fits = [ip for ip, total in nodes if _fits(bundle, total)]
        if len(fits) >= request.num_nodes:
            return
        reason = (
            f"it needs {request.describe()} on distinct nodes, and only "
            f"{len(fits)} of the cluster's {len(nodes)} node(s) can hold one such bundle"
        )
    listing = (
        "\n".join(f"  {ip}: {{{format_resources(total)}}}" for ip, total in nodes) or "  (none)"
    )
    raise PlacementError(
        f"Cannot place {request.num_replicas} replica(s), {request.replicas_per_node} per "
        f"node, each {{{format_resources(request.per_replica())}}}: {reason}."
        f"{_hint(request, nodes)}\n"
        f"The cluster's nodes (total resources):\n{listing}"
    )


def _hint(request: Request, nodes: Sequence[tuple[str, Mapping[str, float]]]) -> str:
    gpus = request.gpus_per_replica
    if not gpus or not nodes:
        return ""
    most = max(int(total.get("GPU", 0) // gpus) for _, total in nodes)
    if 0 < most < request.replicas_per_node:
        return f" Valid: replicas_per_node <= {most} with gpus_per_replica={gpus:g}."
    return ""


def _fits(need: Mapping[str, float], total: Mapping[str, float]) -> bool:
    return all(total.get(k, 0) >= v for k, v in need.items())
