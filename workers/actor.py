"""The Ray actor that hosts one rank: prepares its environment, runs the function, reports."""

from __future__ import annotations

import copy
import linecache
import os
import pickle
import socket
import threading
import time
import traceback

import cloudpickle
import ray

from orchestrator_workers import (
    _compat,
    debugger,
    elastic,
    environment,
    handoff,
    leftovers,
    script,
    sharing,
    snapshot,
    stacks,
    torchgroup,
)
from orchestrator_workers.capture import Capture
from orchestrator_workers.protocol import (
    NO_LEASE,
    CallSpec,
    Lease,
    NodeInfo,
    Payload,
    Peer,
    RankFailure,
    RankResult,
    RankSpec,
    Received,
    RemoteNode,
    Used,
    wire,
)
from orchestrator_workers.sampler import Sampler
from orchestrator_workers.store import StoreKeeper
from orchestrator_workers.where import read as read_where

CONCURRENCY_GROUPS = {"control": 4, "node": 4}
"""Calls that must be answered while a call runs: output and stacks ("control"); a node's
hand-off and its outcomes ("node"; two readers of a detached call's, and other nodes')."""


class RankActor:
    """One rank of a distributed function; stays alive between calls (the warm pool)."""

    def __init__(
        self,
        job_name: str,
        rank: int,
        env: dict[str, str] | None = None,
        *,
        preload_torch: bool = True,
    ) -> None:
        """Remember who this actor is, and (`preload_torch`) start importing torch.

        The import (a second or more of CPU, ~250 MB) then overlaps the pool's other
        start-up work and the other ranks' imports, instead of waiting for the first
        call; a job that does not use torch skips it. The user's `env` is set first:
        torch reads some variables only on import.
        """
        environment.preset(env or {})
        _compat.tracker_in_own_session()  # what the rank leaves in /dev/shm is removed
        self._label = f"{job_name} r{rank}"
        self._rank = rank
        self._local_rank = 0
        self._node_ip = ray.util.get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        self._stores = StoreKeeper(self._node_ip)
        """As rank 0: the running call's rendezvous store, and the next call's port."""
        self._packed_spec = b""
        self._spec: RankSpec | None = None
        self._capture = Capture()
        self._sampler = Sampler(self._node_ip)
        self._door = handoff.Door(self._serve_call)
        self._hand = handoff.Hand()
        self._packed_peers = b""
        self._peers: tuple[Peer, ...] = ()
        self._nodes: tuple[RemoteNode, ...] = ()
        """As rank 0: the other nodes, as the driver last sent them."""
        self._importing: threading.Thread | None = None
        if preload_torch:
            self._importing = threading.Thread(
                target=torchgroup.import_torch, name="import torch", daemon=True
            )
            self._importing.start()
        sharing.remove("", older_than=sharing.STALE_S)  # what killed ranks may have left here
        leftovers.note_servers()  # Ray's: connections to them are never a call's leftovers

    def __repr__(self) -> str:
        """Ray prefixes this actor's log lines with its repr."""
        return self._label

    def serve_as(self, job_name: str, rank: int) -> None:
        """Be `rank` of `job_name` from now on (a spare started ahead of need)."""
        self._label = f"{job_name} r{rank}"
        self._rank = rank

    @ray.method(concurrency_group="control")
    def serving(self) -> int:
        """The rank this actor serves (-1: a spare not yet taken); answered while a call runs."""
        return self._rank

    def info(self) -> bytes:
        """Where this actor runs and what Ray gave it (a NodeInfo, wired: see
        `protocol.wire`), once torch is loaded if it is to be.

        The pool's start waits for it: a call's time (and its `timeout`) is then the
        call's own, not torch's import.
        """
        if self._importing is not None:
            self._importing.join()
        context = ray.get_runtime_context()
        gpus = tuple(str(gpu) for gpu in context.get_accelerator_ids().get("GPU", []))
        return wire(
            NodeInfo(
                node_id=context.get_node_id(),
                node_ip=self._node_ip,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                gpu_ids=gpus,
                interface=environment.interface_for_ip(self._node_ip),
                tail_path=self._capture.tail,
                niceness=os.getpriority(os.PRIO_PROCESS, 0),
                door=self._door.name,
                door_key=self._door.key,
            )
        )

    @ray.method(concurrency_group="control")
    def drain(self, timeout: float, gather: float = 0.0) -> bytes:
        """Output not yet sent to the driver (OutputChunks, wired), waiting up to
        `timeout` s for some, then up to `gather` s for more (see Capture.drain)."""
        return wire(self._capture.drain(timeout, gather))

    @ray.method(concurrency_group="control")
    def unblock(self) -> None:
        """After a peer failed: shut the connections this rank's process group accepted,
        so that a collective waiting on them fails now (see leftovers)."""
        self._unblock()

    def _unblock(self) -> None:
        store = self._stores.port
        keep = (snapshot.keeper_port(),) if store is None else (snapshot.keeper_port(), store)
        leftovers.shut_accepted(keep_ports=keep)
        leftovers.abort_nccl()

    @ray.method(concurrency_group="control")
    def stacks(self) -> str:
        """The current stack of each of this rank's threads, without disturbing them."""
        return stacks.current_stacks()

    @ray.method(concurrency_group="control")
    def where(self, pids: dict[int, int] | None = None) -> bytes:
        """Where each rank of this node (rank -> pid; default: this rank) was when it last
        looked (see sampler): Wheres, wired."""
        return wire(read_where(pids if pids is not None else {self._rank: os.getpid()}))

    def open_store(self) -> int:
        """Reserve the next call's rendezvous port (nothing listens there until the call
        starts), closing any store still open; return the port."""
        self._stores.close()
        return self._stores.reserve()

    @ray.method(concurrency_group="control")
    def close_store(self, port: int) -> None:
        """Close the store of the call that used `port`: every rank of it is done."""
        self._stores.close(port)

    @ray.method(concurrency_group="node")
    def run_node(
        self,
        call_id: bytes,
        packed_call: bytes,
        payload: bytes,
        peers: bytes,
        nodes: tuple[RemoteNode, ...] | None,
        *,
        lease: Lease = NO_LEASE,
        reader: str = "",
    ) -> bytes:
        """As its node's first rank: hand call `call_id` to every rank of the node (pickled
        Peers, this rank among them); as rank 0, also to every other node's first rank
        (`nodes`; None: the same as the last call's). Return the first outcomes `reader`
        collects (a Collected), pickled; None, pickled, where `lease` is refused."""
        if peers != self._packed_peers:  # the same while the pool lives
            self._peers = pickle.loads(peers)  # noqa: S301 - our driver's
            self._packed_peers = peers
        if nodes is not None:
            self._nodes = nodes
        if not self._hand.start(
            call_id, self._peers, packed_call, payload, self._nodes, lease=lease
        ):
            return pickle.dumps(None)
        return pickle.dumps(self._hand.collect(call_id, reader), pickle.HIGHEST_PROTOCOL)

    @ray.method(concurrency_group="node")
    def collect(self, call_id: bytes, reader: str = "") -> bytes:
        """As a node's first rank: the outcomes of call `call_id` not yet collected by
        `reader` (a Collected), pickled; once all are done, or at once after a failure."""
        return pickle.dumps(self._hand.collect(call_id, reader), pickle.HIGHEST_PROTOCOL)

    @ray.method(concurrency_group="control")
    def revoke(self, token: bytes) -> Used | None:
        """As rank 0: take back a detached job's lease (see `handoff.Hand.revoke`)."""
        return self._hand.revoke(token)

    @ray.method(concurrency_group="node")
    def outcome(self, call_id: bytes) -> bytes:
        """This rank's outcome of handed-off call `call_id`, once it has one (for when the
        rank that handed it the call is gone)."""
        return self._door.outcome(call_id)

    def run(self, packed_spec: bytes, packed_call: bytes, payload: Received) -> bytes:
        """Run the shipped function as the rank the pickled RankSpec names, with what the
        pickled CallSpec adds; never raises.

        A small payload comes pickled (bytes), a large one from the object store. The
        RankResult or RankFailure goes back cloudpickled: bytes cost Ray nothing more to
        pass, and a value that cannot be pickled becomes this rank's failure.
        """
        return self._serve_call(packed_spec, packed_call, payload)[1]

    def _serve_call(
        self, packed_spec: bytes, packed_call: bytes, payload: Received
    ) -> tuple[bool, bytes]:
        """`run`'s work, wherever the call came from: (whether it failed, the outcome)."""
        try:
            call: CallSpec = pickle.loads(packed_call)  # noqa: S301 - our driver's
            base = self._spec
            if base is None or packed_spec != self._packed_spec:  # the same while the pool lives
                base = self._spec = pickle.loads(packed_spec)  # noqa: S301 - our driver's
                self._packed_spec = packed_spec
            spec = _for_call(base, call, share_key=f"{call.share_key}-{self._node_id[:16]}")
            if spec.rank != self._rank:  # a spare taken, or a shrink renumbered it
                self.serve_as(spec.job_name, spec.rank)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, not raised
            return True, cloudpickle.dumps(self._failure(exc, time.time(), setup=True))
        snapshot.enter(
            spec.rank,
            spec.world_size,
            restart_count=spec.restart_count,
            secret=call.job_secret,
            host=self._node_ip,
            node=self._node_id,
            identity=spec.identity if spec.identity >= 0 else spec.rank,
        )
        outcome = self._run(spec, payload, watched=call.watched, call_key=call.share_key)
        try:
            return isinstance(outcome, RankFailure), cloudpickle.dumps(outcome)
        except Exception as exc:  # noqa: BLE001 - reported as the rank's failure
            problem = TypeError(
                f"the function returned a value that cannot be sent to the driver ({exc}); "
                "return something picklable (tensors, numbers, dicts), or save it to a file"
            )
            return True, cloudpickle.dumps(self._failure(problem, time.time(), setup=False))

    def _run(
        self, spec: RankSpec, packed: Received, *, watched: bool = True, call_key: str = ""
    ) -> RankResult | RankFailure:
        payload = Payload.received(packed)
        self._local_rank = spec.local_rank
        try:
            if spec.rank == 0:  # first, so that it listens before a peer connects
                self._stores.serve(spec.master_port)
            # First: every rank of this node must count itself as a reader (see sharing).
            readers = spec.ranks_on_node if environment.shares_buffers(spec) else 1
            buffers = sharing.private_buffers(
                payload.buffers, payload.readonly, spec.share_key, readers
            )
            device = environment.apply(spec)
            for name, lines in payload.sources.items():
                # mtime None: linecache keeps the entry even where no such file exists.
                linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
            fn, args, kwargs = cloudpickle.loads(payload.call, buffers=buffers)
            del payload, buffers  # this rank holds no reference to the object store's copy
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, not raised
            return self._failure(exc, time.time(), setup=True)
        error_file = os.environ.get(elastic.VAR, "")
        elastic.prepare(error_file)  # new and empty: an earlier call's (a caught error's) goes
        started = time.time()
        sampler = self._sampler if watched else None
        if sampler is not None:
            sampler.begin(device, call_key, spec.job_name)
        try:
            with script.driver_main(fn):
                value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, not raised
            when = time.time()  # before peers notice, so the root cause is the earliest
            if sampler is not None:
                sampler.end()
            if spec.post_mortem and exc.__traceback__ is not None:
                debugger.post_mortem(exc.__traceback__)
            torchgroup.leave()
            self._unblock()  # what gloo keeps open: peers waiting on this rank fail now
            failure = self._failure(exc, when, setup=False)
            return elastic.reported(failure, error_file, started, type(exc).__name__)
        if sampler is not None:
            sampler.end()
        torchgroup.leave()
        next_port, store_open = None, False
        if spec.rank == 0:
            # Peers may still use a store they connected to: the driver closes it once all
            # are done. One nobody connected to (no rendezvous) closes now.
            store_open = self._stores.made
            if not store_open:
                self._stores.close()
            next_port = self._stores.reserve()
        return RankResult(
            rank=spec.rank,
            value=value,
            output_seq=self._capture.sync(),
            next_master_port=next_port,
            store_open=store_open,
        )

    def _failure(self, exc: BaseException, when: float, *, setup: bool) -> RankFailure:
        tb = exc.__traceback__
        if setup:  # our own failure: keep every frame, and say so
            note = "while preparing the rank, before the function ran (an orchestrator problem)"
            text = f"{note}:\n" + "".join(traceback.format_exception(type(exc), exc, tb))
        else:  # drop this frame so the report starts at the user's code
            tb = tb.tb_next if tb else None
            text = "".join(traceback.format_exception(type(exc), exc, tb))
        try:
            pickled = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001 - the text report is enough
            pickled = None
        return RankFailure(
            rank=self._rank,
            local_rank=self._local_rank,
            node_ip=self._node_ip,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            time=when,
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback=text,
            exception=pickled,
            output_seq=self._capture.sync(),
        )


def _for_call(base: RankSpec, call: CallSpec, *, share_key: str) -> RankSpec:
    """`base` with the call's fields (`share_key`: this call's copy of the buffers on
    this node). A copy set field by field: `dataclasses.replace` runs `__init__` over
    every field, which is a good part of a warm call's cost on a rank."""
    spec = copy.copy(base)
    for name, value in (
        ("master_port", call.master_port),
        ("restart_count", call.restart_count),
        ("max_restarts", call.max_restarts),
        ("share_key", share_key),
        ("uses_torch", call.uses_torch),
    ):
        object.__setattr__(spec, name, value)  # frozen: the copy is ours alone
    return spec
