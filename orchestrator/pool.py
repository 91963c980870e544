"""The warm pool: one placement group and one actor per rank, kept between calls."""

from __future__ import annotations

import dataclasses
import pickle
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError, RuntimeEnvSetupError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import _ray_compat, crash, placement, reserve, shipping
from orchestrator.channel import RankChannel, rank_stacks
from orchestrator.connect import cluster, local, rankside
from orchestrator.dispatch import Routes
from orchestrator.errors import StopRequested, describe_rank
from orchestrator.options import Options
from orchestrator.placement import Request
from orchestrator.reserve import Plan
from orchestrator.show import notices
from orchestrator.standby import Standby
from orchestrator_workers import environment
from orchestrator_workers.environment import order_devices
from orchestrator_workers.protocol import NodeInfo, RankSpec, unwire
from orchestrator_workers.states import State

ACTOR_NAMESPACE = "orchestrator"
"""Ray namespace of every rank's actor, named `actor_name(...)`, so other drivers find them."""
_ACTOR_NAME = re.compile(r"^(?P<job>.+)-(?P<pool>[0-9a-f]{8})-r(?P<rank>\d+)(?:\.\d+)?$")
_SPARE_NAME = re.compile(r"^(?P<job>.+)-(?P<pool>[0-9a-f]{8})-spare\d+$")


def actor_name(job_name: str, pool_id: str, rank: int, attempt: int = 0) -> str:
    """The Ray actor name of `rank` in pool `pool_id` of job `job_name`: NAME-ID-rRANK.

    A rank's actor replaced at restart N is NAME-ID-rRANK.N (names are freed lazily).
    """
    return f"{job_name}-{pool_id}-r{rank}" + (f".{attempt}" if attempt else "")


def spare_name(job_name: str, pool_id: str, serial: int) -> str:
    """The Ray actor name of pool `pool_id`'s warm spare number `serial` (see standby): it
    keeps it when it serves a rank (ask it which: `serving`)."""
    return f"{job_name}-{pool_id}-spare{serial}"


def parse_spare_name(name: str) -> tuple[str, str] | None:
    """(job name, pool id) of one of our spares' names; None for any other name."""
    match = _SPARE_NAME.match(name)
    return None if match is None else (match["job"], match["pool"])


def parse_actor_name(name: str) -> tuple[str, str, int] | None:
    """(job name, pool id, rank) of one of our actors' names; None for any other name."""
    match = _ACTOR_NAME.match(name)
    if match is None:
        return None
    return match["job"], match["pool"], int(match["rank"])


class Pool:
    """The actors of one distributed function, laid out by node."""

    def __init__(
        self,
        name: str,
        plan: Plan,
        options: Options,
        *,
        preload_torch: bool = True,
        stop: threading.Event | None = None,
        on_phase: Callable[[State, str | None], None] | None = None,
    ) -> None:
        """Reserve one bundle per node as `plan` says, start one actor per rank as
        `options` say and learn where they are (its warm spares: `keep_spares`).

        While the placement group waits for resources, `on_phase("pending", what)` is
        called; then `on_phase("starting", None)`. A set `stop` ends any wait with
        StopRequested; `options.placement_timeout` (seconds) with a PlacementTimeoutError.
        """
        request, simulate_nodes = plan
        self.name = name
        self.request = request
        self.session = cluster.session()
        """The Ray session its actors belong to (see `cluster.rejoin`)."""
        self.actors: list[Any] = []
        self.channels: list[RankChannel] = []
        """Per rank, its output as the driver takes it in, for as long as its actor lives."""
        self.infos: list[NodeInfo] = []
        self.specs: list[RankSpec] = []
        """Each rank's place in the job; a call adds its own half (a CallSpec)."""
        self.packed_specs: list[bytes] = []
        """`specs`, pickled once for every call."""
        self.routes = Routes([], [], [])
        """How a call reaches the ranks (made once they are known)."""
        self.store_port = 0
        """The port of the rendezvous store rank 0 serves for the next call."""
        self._stop = stop or threading.Event()
        self._on_phase = on_phase or (lambda phase, detail: None)
        self._closing = threading.Lock()
        self._closed = False
        self._simulated = simulate_nodes
        self._placement_timeout = options.placement_timeout
        self.standby = Standby(self._spare)
        """Its warm spares, which replace failed ranks on their node."""
        # GPU ranks load torch at once: the first call binds each to its GPU.
        self._preload_torch = preload_torch or request.gpus_per_replica > 0
        self.id = uuid.uuid4().hex[:8]
        self.pg = placement_group(
            [request.bundle()] * request.num_nodes,
            strategy="PACK" if simulate_nodes else "STRICT_SPREAD",
            name=f"{name}-{self.id}",
        )
        try:
            self._place(self._placement_timeout)
            self._start(options)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, timeout: float | None, lost: frozenset[str] = frozenset()) -> None:
        """Wait until the placement group is placed (see reserve.wait)."""
        held = {node: [r for r, i in enumerate(self.infos) if i.node_id == node] for node in lost}
        reserve.wait(
            self.pg,
            self.request,
            name=self.name,
            timeout=timeout,
            stop=self._stop,
            on_phase=self._on_phase,
            one_node=self._simulated,
            lost=held,
        )

    def _wait(self, refs: list[ray.ObjectRef]) -> bool:
        """Wait a moment for all `refs`; True when ready. Raises StopRequested if asked."""
        if self._stop.is_set():
            raise StopRequested
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=reserve.POLL_S)
        return len(done) == len(refs)

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """ray.get(refs), stopping with StopRequested when the job is cancelled meanwhile."""
        while not self._wait(refs):
            pass
        return ray.get(refs)

    def _start(self, options: Options) -> None:
        request, runtime_env = self.request, options.runtime_env
        bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        bundles = placement.order_bundles(bundle_nodes, cluster.driver_node())
        self._slots = placement.layout(request.num_replicas, request.replicas_per_node)
        self._bundles = [bundles[slot.node_rank] for slot in self._slots]
        # Local folders in it are uploaded as ray.init uploads the job's (an actor takes URIs).
        uploaded = (
            _ray_compat.upload_runtime_env(shipping.hook_by_value(runtime_env))
            if runtime_env
            else None
        )
        self._env = environment.user_env(options.env or {}, runtime_env)
        self._runtime_env, self._post_mortem = uploaded, options.post_mortem
        runtime = local.broker()
        # On the local runtime ranks run in the driver's folder, as on the embedded instance.
        self._workdir = local.driver_paths().cwd if runtime is not None else None
        self._bundle_nodes = bundle_nodes
        if runtime is None:  # what each node has, ours brought where it lacks it
            rankside.check_nodes(set(bundle_nodes.values()), self.name)
        spares = self._spares(runtime, bundle_nodes) if runtime is not None else {}
        try:
            for slot in self._slots:  # one by one: shutdown() kills those made so far
                spare = spares.get(slot.rank)
                self.actors.append(spare[0] if spare else self._new_actor(slot.rank))
        except BaseException:
            for actor, _ in spares.values():  # claimed, perhaps not in self.actors yet
                ray.kill(actor, no_restart=True)
            raise
        self.channels = [RankChannel(actor) for actor in self.actors]
        self.infos = self._infos(range(len(self.actors)))
        notices.note_niceness(self.name, self.infos)
        self.store_port = self._open_store()
        self._respec()
        self._local_runtime = runtime is not None

    def keep_spares(self, options: Options) -> None:
        """Keep as many warm spares a node as `options` say (a call's own: more where it
        allows restarts); none by default where the local runtime's take failed ranks'
        places. Never fewer than before."""
        default = options.spares_per_node is None and self._local_runtime
        wanted = 0 if default else options.spares
        if wanted > self.standby.per_node:
            self.standby.per_node = wanted
            self.standby.fill(self._bundles)

    def _spares(
        self, runtime: Any, bundle_nodes: Mapping[int, str], ranks: Collection[int] | None = None
    ) -> dict[int, tuple[Any, int]]:
        """The local runtime's warm processes for CPU-only ranks without a runtime_env
        (all of them, or `ranks`)."""
        job_env = ray.get_runtime_context().runtime_env  # a spare has none of the job's
        if self._runtime_env or job_env or set(self.request.per_replica()) - {"CPU"}:
            return {}
        if environment.read_on_import(self._env):
            return {}  # a spare imported torch before it knew them
        by_node: dict[str, list[int]] = {}
        for slot in self._slots:
            if ranks is None or slot.rank in ranks:
                by_node.setdefault(bundle_nodes[self._bundles[slot.rank]], []).append(slot.rank)
        return local.spares_for(runtime, self.name, self.id, by_node)

    def _new_actor(self, rank: int, attempt: int = 0) -> Any:
        name = actor_name(self.name, self.id, rank, attempt)
        return self._actor(self._bundles[rank], name, rank, self.request.per_replica())

    def _spare(self, bundle: int, serial: int) -> Any:
        """A warm spare in `bundle`: a rank's actor that reserves nothing (see standby)."""
        return self._actor(bundle, spare_name(self.name, self.id, serial), -1, {})

    def _actor(self, bundle: int, name: str, rank: int, reserved: Mapping[str, float]) -> Any:
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        remote, carry = rankside.rank_actor(self._bundle_nodes[bundle])
        return remote.options(
            num_cpus=reserved.get("CPU", 0),
            num_gpus=reserved.get("GPU", 0),
            resources={k: v for k, v in reserved.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=strategy,
            runtime_env=self._runtime_env,
            name=name,
            namespace=ACTOR_NAMESPACE,
        ).remote(*carry, self.name, rank, dict(self._env), preload_torch=self._preload_torch)

    def _infos(self, ranks: Iterable[int]) -> list[NodeInfo]:
        infos: list[NodeInfo] = [unwire(info) for info in self._ask_starting("info", ranks)]
        notices.quiet_crash_notices([info.pid for info in infos])
        return infos

    def _open_store(self) -> int:
        [port] = self._ask_starting("open_store", [0])
        return port

    def _ask_starting(self, method: str, ranks: Iterable[int]) -> list[Any]:
        """The answers of `ranks`' actors to `method` while the pool starts; a
        DistributedError naming each one that died meanwhile, where and why."""
        asked = {rank: getattr(self.actors[rank], method).remote() for rank in ranks}
        try:
            return self._get(list(asked.values()))
        except (RayActorError, RuntimeEnvSetupError) as exc:  # one died, or never started
            raise crash.died_starting(asked, self._placed, exc) from None

    def _placed(self, rank: int) -> tuple[str, int]:
        """The node Ray placed `rank`'s actor on, and its local rank there."""
        return self._bundle_nodes[self._bundles[rank]], self._slots[rank].local_rank

    def replace(self, ranks: set[int], attempt: int) -> set[int] | None:
        """Replace the actors of `ranks` in place, keeping the others (warm, torch loaded):
        the ranks replaced (with a lost node's, `ranks` and more).

        For a restart after a failed call. The local runtime's warm processes take the
        ranks' places where ready (as at a pool's start). The ranks of a lost node are
        replaced on the node Ray places its bundle on instead, waiting up to
        placement_timeout for one (then PlacementTimeoutError). None where no rank is
        left to keep: the caller starts a whole new pool instead.
        """
        lost = frozenset(cluster.lost_nodes({info.node_id for info in self.infos}))
        ranks = ranks | {r for r, info in enumerate(self.infos) if info.node_id in lost}
        if len(ranks) == len(self.actors) or (lost and self._simulated):
            return None
        runtime = local.broker()  # its warm processes take the place of the ranks lost
        moved = {self._bundles[r] for r, info in enumerate(self.infos) if info.node_id in lost}
        if lost:
            self.standby.forget(moved)  # gone with their node
            self._place(self._placement_timeout, lost)
            self._bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
            if runtime is None:
                rankside.check_nodes({self._bundle_nodes[b] for b in moved}, self.name)
        standby = {r: self.standby.take(self._bundles[r]) for r in ranks if r not in moved}
        rest = {rank for rank in ranks if not standby.get(rank)}
        spares = self._spares(runtime, self._bundle_nodes, rest) if runtime is not None else {}
        for rank in ranks:
            ray.kill(self.actors[rank], no_restart=True)
            spare = standby.get(rank) or spares.get(rank)
            self.actors[rank] = spare[0] if spare else self._new_actor(rank, attempt)
            if standby.get(rank):
                self.actors[rank].serve_as.remote(self.name, rank)
            self.channels[rank] = RankChannel(self.actors[rank])  # its numbering starts anew
        for rank, info in zip(sorted(ranks), self._infos(sorted(ranks)), strict=True):
            old = self.infos[rank]  # a rank replaced on its node keeps its GPUs (standby)
            same = info.node_id == old.node_id
            self.infos[rank] = dataclasses.replace(info, gpu_ids=old.gpu_ids) if same else info
        self.standby.fill(self._bundles)  # what the replaced ones took, a lost node's
        self.store_port = self._open_store()  # the failed call's store holds stale keys
        self._respec()
        return ranks

    def _respec(self) -> None:
        self.specs = _specs(
            self.name,
            self.request,
            self._slots,
            self.infos,
            self._env,
            post_mortem=self._post_mortem,
            workdir=self._workdir,
        )
        self.packed_specs = [pickle.dumps(spec, pickle.HIGHEST_PROTOCOL) for spec in self.specs]
        self.routes = Routes(self.actors, self.infos, self.packed_specs)

    def use_store(self, port: int | None, *, close: bool) -> None:
        """After a call: rank 0 reserved `port` for the next call's store; `close`: its
        store still serves, and every rank is done with it.

        Not waited for: rank 0 closes it while the driver returns the results.
        """
        if port is not None:
            if close:
                self.actors[0].close_store.remote(self.store_port)
            self.store_port = port

    def stacks(self) -> dict[int, str]:
        """Each rank's current stacks, asked of all ranks at once; never blocks for long."""
        return rank_stacks(dict(enumerate(self.actors)))

    def places(self) -> dict[int, str]:
        """Where each rank runs, as errors say it: rank -> "rank 3 (local rank 1) on ..."."""
        return {
            rank: describe_rank(rank, spec.local_rank, info.node_ip, info.hostname, info.pid)
            for rank, (spec, info) in enumerate(zip(self.specs, self.infos, strict=True))
        }

    def pids(self) -> list[int]:
        """Process ids of the ranks' actors, by rank."""
        return [info.pid for info in self.infos]

    def shutdown(self) -> None:
        """Kill every actor and release the placement group; safe from any thread, twice."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.standby.close()  # first: none starts in a removed placement group
        try:
            remove_placement_group(self.pg)  # first: it takes its actors with it
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)


def _specs(
    name: str,
    request: Request,
    slots: list[placement.Slot],
    infos: list[NodeInfo],
    env: Mapping[str, str],
    *,
    post_mortem: bool,
    workdir: str | None = None,
) -> list[RankSpec]:
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
            world_size=request.num_replicas,
            local_world_size=request.replicas_per_node,
            num_nodes=request.num_nodes,
            master_addr=infos[0].node_ip,
            master_port=0,
            cuda_visible_devices=devices[slot.node_rank],
            interface=info.interface,
            cpus=request.cpus_per_replica,
            node_ip=info.node_ip,
            post_mortem=post_mortem,
            env=dict(env),
            workdir=workdir,
            ranks_on_node=on_node[info.node_id],
        )
        for slot, info in zip(slots, infos, strict=True)
    ]
