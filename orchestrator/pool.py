"""The warm pool: one placement group and one actor per rank, kept between calls."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RuntimeEnvSetupError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import _ray_compat, crash, placement, rankspecs, reserve, shipping
from orchestrator.actornames import ACTOR_NAMESPACE, actor_name, spare_name
from orchestrator.channel import RankChannel, rank_stacks
from orchestrator.connect import cluster, local, rankside
from orchestrator.dispatch import Routes
from orchestrator.errors import PlacementError, StopRequested, describe_rank
from orchestrator.options import Options
from orchestrator.reserve import Plan
from orchestrator.show import notices
from orchestrator.standby import Standby
from orchestrator_workers import environment
from orchestrator_workers.protocol import NodeInfo, RankSpec, unwire
from orchestrator_workers.states import State


@dataclass(frozen=True)
class Shrunk:
    """A restart that goes on with fewer ranks: a lost node's could not be replaced."""

    lost: tuple[int, ...]
    """The ranks lost with their nodes, as they were numbered."""
    old_world: int
    new_world: int
    renumbered: dict[int, int]
    """Each rank kept: its number before -> its number now."""
    replaced: frozenset[int] = frozenset()
    """Ranks on live nodes replaced too (broken by the failure), numbered anew."""


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
        """What its placement group reserves: `num_replicas` ranks, one bundle a node."""
        self.world = request
        """The job as its ranks run now: `request`, or fewer ranks after a shrink."""
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
        """Wait until the placement group is placed: the bundles of the `lost` nodes' ranks,
        where given (bundles a shrink left wait on: see reserve.wait)."""
        held = {node: [r for r, i in enumerate(self.infos) if i.node_id == node] for node in lost}
        reserve.wait(
            self.pg,
            self.world,
            name=self.name,
            timeout=timeout,
            stop=self._stop,
            on_phase=self._on_phase,
            one_node=self._simulated,
            lost=held,
            bundles={self._bundles[rank] for ranks in held.values() for rank in ranks},
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
        self.identities = list(range(request.num_replicas))
        """By rank, what its snapshots are kept as: its rank at the start (see shrink)."""
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

    @property
    def shrunk(self) -> bool:
        """Whether it runs fewer ranks than it was made for (see `_shrink`)."""
        return self.world.num_replicas < self.request.num_replicas

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

    def replace(
        self,
        ranks: set[int],
        attempt: int,
        *,
        min_ranks: int | None = None,
        shrink_after: float = 0,
    ) -> set[int] | Shrunk | None:
        """Replace the actors of `ranks` in place, keeping the others (warm, torch loaded):
        the ranks replaced (with a lost node's, `ranks` and more).

        For a restart after a failed call. A rank on a live node is served by its node's
        warm spare where one is ready, else the local runtime's, else a new process. The
        ranks of a lost node are replaced on the node Ray places its bundle on instead,
        waiting up to placement_timeout for one (then PlacementTimeoutError); where at
        least `min_ranks` would be left, only up to `shrink_after`, and at once where no
        live node could hold it: the job then goes on without them (a Shrunk, see
        `_shrink`). None where no rank is left to keep: the caller starts a whole new
        pool instead.
        """
        lost = frozenset(cluster.lost_nodes({info.node_id for info in self.infos}))
        ranks = ranks | {r for r, info in enumerate(self.infos) if info.node_id in lost}
        may_shrink = bool(lost) and min_ranks is not None
        if (len(ranks) == len(self.actors) and not may_shrink) or (lost and self._simulated):
            return None
        runtime = local.broker()  # its warm processes take the place of the ranks lost
        moved = {self._bundles[r] for r, info in enumerate(self.infos) if info.node_id in lost}
        shrunk = None
        if lost:
            self.standby.forget(moved)  # gone with their node
            left = sum(1 for bundle in self._bundles if bundle not in moved)
            if self._placed_again(lost, may_shrink and left >= (min_ranks or 0), shrink_after):
                self._bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
                if runtime is None:
                    rankside.check_nodes({self._bundle_nodes[b] for b in moved}, self.name)
            else:
                shrunk = self._shrink(moved)
                ranks = {shrunk.renumbered[r] for r in ranks if r in shrunk.renumbered}
                moved = set()
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
        return dataclasses.replace(shrunk, replaced=frozenset(ranks)) if shrunk else ranks

    def _placed_again(self, lost: frozenset[str], may_shrink: bool, shrink_after: float) -> bool:
        """Whether Ray placed the bundles of the `lost` nodes again; with `may_shrink`,
        False where it did not within `shrink_after`, or no live node could hold them."""
        if not may_shrink:
            self._place(self._placement_timeout, lost)
            return True
        limit = self._placement_timeout
        wait = shrink_after if limit is None else min(shrink_after, limit)
        try:
            live = [(n.ip, n.resources) for n in cluster.nodes() if n.node_id not in lost]
            placement.check_feasible(self.world, live, one_node=self._simulated)
            self._place(wait, lost)
        except PlacementError:  # PlacementTimeoutError too
            return False
        return True

    def _shrink(self, lost: set[int]) -> Shrunk:
        """Go on without the ranks of the `lost` bundles: the others renumbered in order
        (whole nodes gone, so each keeps its local rank), each keeping what its snapshots
        are kept as. The placement group keeps the lost bundles, which Ray places again
        when a node can take them."""
        old = len(self.actors)
        kept = [rank for rank in range(old) if self._bundles[rank] not in lost]
        for rank in set(range(old)) - set(kept):
            ray.kill(self.actors[rank], no_restart=True)
        self.actors = [self.actors[r] for r in kept]
        self.channels = [self.channels[r] for r in kept]
        self.infos = [self.infos[r] for r in kept]
        self.identities = [self.identities[r] for r in kept]
        self._bundles = [self._bundles[r] for r in kept]
        per_node = self.request.replicas_per_node
        self._slots = placement.layout(len(kept), per_node)
        self.world = dataclasses.replace(self.request, num_replicas=len(kept))
        renumbered = {rank: new for new, rank in enumerate(kept)}
        gone = tuple(sorted(set(range(old)) - set(kept)))
        return Shrunk(gone, old, len(kept), renumbered)

    def _respec(self) -> None:
        self.specs = rankspecs.specs(
            self.name,
            self.world,
            self._slots,
            self.infos,
            self._env,
            identities=self.identities,
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
