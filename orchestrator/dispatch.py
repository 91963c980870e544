"""How a call reaches a pool's ranks: the driver's side of the hand-off (see
`orchestrator_workers.handoff`).

A pool's ranks are grouped by node (each a `RemoteNode`). A call whose payload is small goes to
each node's first rank, which hands it to the ranks of its node; from TREE_NODES nodes it
goes to rank 0 alone, which calls the other nodes' first ranks. A call whose payload is
large goes to each rank in a Ray task of its own. What a call adds to every rank's spec
is its CallSpec, made by one rule (`call_spec`); each Ray task in flight brings the
outcomes of the ranks it names (`Awaited`).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from orchestrator.connect import cluster
from orchestrator_workers import handoff
from orchestrator_workers.protocol import CallSpec, Lease, NodeInfo, Peer, RemoteNode

if TYPE_CHECKING:
    from orchestrator.options import Options
    from orchestrator.shipping import Shipment


@dataclass(frozen=True)
class Awaited:
    """The ranks whose outcomes one Ray task in flight brings."""

    ranks: tuple[int, ...]
    leader: int | None = None
    """The rank whose actor handed the call to `ranks`; None for a rank's own task."""


class Routes:
    """The ways a call reaches a pool's ranks as they are now (made anew when the pool
    replaces ranks)."""

    def __init__(
        self, actors: Sequence[Any], infos: Sequence[NodeInfo], specs: Sequence[bytes]
    ) -> None:
        """Routes to `actors`, which run where `infos` say; `specs`: each rank's RankSpec,
        pickled."""
        self.actors = actors
        self.specs = specs
        by_node: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            by_node.setdefault(info.node_id, []).append(rank)
        peers = [
            Peer(rank=rank, door=info.door, pid=info.pid, spec=specs[rank], key=info.door_key)
            for rank, info in enumerate(infos)
        ]
        self.nodes = {
            node_id: RemoteNode(
                actors[ranks[0]], tuple(ranks), handoff.pack_peers([peers[r] for r in ranks])
            )
            for node_id, ranks in by_node.items()
        }
        """The ranks by Ray's node id (the first rank 0's), each node reached through its
        first rank's actor."""
        tree = int(os.environ.get(handoff.TREE, handoff.TREE_NODES))
        self.others: tuple[RemoteNode, ...] = ()
        """The nodes after the first, where rank 0 hands each call to them (on many nodes:
        see handoff.TREE_NODES); none where the driver calls each node's first rank."""
        # Not through Ray Client: its server, which may lack this package, would pass them.
        if len(self.nodes) >= tree and not cluster.through_ray_client():
            self.others = tuple(self.nodes.values())[1:]
        self._others_sent = False
        self.handoff = os.environ.get(handoff.SWITCH, "1") != "0" and all(
            info.door for info in infos
        )
        """Whether a call with a small payload goes to each node's first rank, which hands
        it to the others (else one Ray task per rank)."""

    @property
    def first(self) -> RemoteNode:
        """Rank 0's node."""
        return next(iter(self.nodes.values()))

    @property
    def from_rank0(self) -> bool:
        """Whether a call rank 0 is handed reaches every rank: one node, or rank 0 calls
        the others."""
        return self.handoff and (len(self.nodes) == 1 or bool(self.others))

    def start(
        self, call_id: bytes, spec: bytes, data: bytes | ray.ObjectRef, lend: bytes | None
    ) -> dict[Any, Awaited]:
        """Start call `call_id` (`spec`: its CallSpec, pickled) on every rank: the Ray tasks
        in flight, each with the ranks whose outcomes it brings. A small payload is handed
        off: one Ray task to each node's first rank, or on many nodes to rank 0, which
        calls the others; each lends `lend` (see `hook.Start`). A large one goes in one Ray
        task per rank, each of which reads it from the object store in place."""
        actors = self.actors
        if self.handoff and isinstance(data, bytes) and self.others:  # rank 0 calls the nodes
            first = self.first
            args = (call_id, spec, data, first.peers, self._others_for_call())
            ref = _run_node(first.actor, args, lend)
            return {ref: Awaited(tuple(range(len(actors))), first.ranks[0])}
        if self.handoff and isinstance(data, bytes):  # the driver calls each node's first rank
            runs = {}
            for node in self.nodes.values():
                args = (call_id, spec, data, node.peers, ())
                ref = _run_node(node.actor, args, lend)
                runs[ref] = Awaited(node.ranks, node.ranks[0])
            return runs
        return {
            actor.run.remote(packed, spec, data): Awaited((rank,))
            for rank, (actor, packed) in enumerate(zip(actors, self.specs, strict=True))
        }

    def _others_for_call(self) -> tuple[RemoteNode, ...] | None:
        """`others`, for rank 0, with the first call since they changed; None after that
        (rank 0 keeps them: actor handles cost the driver to send)."""
        if self._others_sent:
            return None
        self._others_sent = True
        return self.others


def call_spec(
    options: Options,
    shipped: Shipment,
    *,
    gpus: bool,
    port: int,
    share_key: str,
    job_secret: bytes,
    restart_count: int = 0,
) -> bytes:
    """What a call adds to every rank's RankSpec (a CallSpec), pickled once for all: the
    one rule, for a call started by a runner or by a detached function's driver. `gpus`:
    the ranks have GPUs (they load torch); `port`: rank 0's store's."""
    spec = CallSpec(
        master_port=port,
        restart_count=restart_count,
        max_restarts=options.max_restarts,
        share_key=share_key,
        uses_torch=shipped.uses_torch or gpus,
        watched=options.stall_after is not None,
        job_secret=job_secret,
    )
    return pickle.dumps(spec, pickle.HIGHEST_PROTOCOL)


def _run_node(actor: Any, args: tuple[Any, ...], lend: bytes | None) -> ray.ObjectRef:
    """`actor`'s `run_node(*args)`, lending `lend` where there is one to lend (else the
    start carries no lease at all: nothing more to send)."""
    if lend is None:
        return actor.run_node.remote(*args)
    return actor.run_node.remote(*args, lease=Lease(None, lend))
