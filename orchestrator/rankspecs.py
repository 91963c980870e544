"""What each rank of a pool is told of its place in the job (a RankSpec), from the layout and
where its actor runs: its ranks, world, node, devices and environment."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from orchestrator import placement
from orchestrator.placement import Request
from orchestrator_workers.environment import order_devices
from orchestrator_workers.protocol import NodeInfo, RankSpec


def specs(
    name: str,
    world: Request,
    slots: list[placement.Slot],
    infos: list[NodeInfo],
    env: Mapping[str, str],
    *,
    identities: Sequence[int],
    post_mortem: bool,
    workdir: str | None = None,
) -> list[RankSpec]:
    """Each rank's place in a job of `world`'s size, laid out as `slots` say, its actor
    running where `infos` say (`identities`: what its snapshots are kept as)."""
    by_node: dict[int, list[tuple[str, ...]]] = {}
    for slot, info in zip(slots, infos, strict=True):
        by_node.setdefault(slot.node_rank, []).append(info.gpu_ids)
    devices = {node: order_devices(ids) for node, ids in by_node.items()}
    on_node = Counter(info.node_id for info in infos)
    return [
        RankSpec(
            job_name=name,
            rank=slot.rank,
            local_rank=slot.local_rank,
            node_rank=slot.node_rank,
            world_size=world.num_replicas,
            local_world_size=world.replicas_per_node,
            num_nodes=world.num_nodes,
            master_addr=infos[0].node_ip,
            master_port=0,
            cuda_visible_devices=devices[slot.node_rank],
            interface=info.interface,
            cpus=world.cpus_per_replica,
            node_ip=info.node_ip,
            post_mortem=post_mortem,
            env=dict(env),
            workdir=workdir,
            ranks_on_node=on_node[info.node_id],
            identity=identity,
        )
        for slot, info, identity in zip(slots, infos, identities, strict=True)
    ]
