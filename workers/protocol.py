"""Dataclasses that cross the driver/actor boundary."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

RAY_MARKERS = (b":actor_name:", b":task_name:", b":job_id:")
"""Lines Ray's worker writes to its stdout/stderr at each task, for its own log files."""
EXIT_STREAM = "exit"
"""The pseudo-stream of the chunk that carries the status a rank passed to os._exit."""
STATE_STREAM = "state"
"""The pseudo-stream of chunks that say what a rank waits on, e.g. a debugger ('' when nothing)."""
"""A rank's states on STATE_STREAM while it stops at a breakpoint (job.status() shows them)."""


SUPERVISOR_PREFIX = "supervisor-"
"""How the name of a detached function's supervisor (an actor in the namespace
"orchestrator") begins: the local runtime stays up while one lives."""


def wire(value: Any) -> bytes:
    """`value` cloudpickled (a user's exception class defined in a script, say), as an
    actor returns it to the driver: between them a Ray Client server (a driver through
    `ray://`) unpickles what it passes on, and it may lack this package (a head that has
    none), never bytes."""
    return bytes(cloudpickle.dumps(value, pickle.HIGHEST_PROTOCOL))


def unwire(data: bytes) -> Any:
    """What `wire` pickled."""
    return pickle.loads(data)  # noqa: S301 - from our own actors, through Ray (token)


@dataclass(frozen=True)
class NodeInfo:
    """What one rank's actor reports about where it runs."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]
    """Accelerator ids Ray assigned to this actor alone."""
    interface: str | None
    """Network interface that carries `node_ip`, if one could be found."""
    tail_path: str = ""
    """Where the rank's unread output is left if its process dies."""
    niceness: int = 0
    """The actor process's nice value (Ray's worker_niceness sets it on each node)."""
    door: str = ""
    """The abstract Unix socket its node's first rank hands it calls on ("": none)."""
    door_key: bytes = field(default=b"", repr=False)
    """The secret its door's peer must send first (see handoff); never shown."""


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to know about its place in the job."""

    job_name: str
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int
    master_addr: str
    master_port: int
    cuda_visible_devices: tuple[str, ...] = ()
    """All GPUs of the job on this node, the rank's own at index `local_rank`."""
    interface: str | None = None
    cpus: float = 1.0
    node_ip: str = ""
    post_mortem: bool = False
    """Open a debugger in the failing frame before reporting an exception."""
    env: dict[str, str] = field(default_factory=dict)
    """The user's extra variables; they win over ours."""
    restart_count: int = 0
    """How many times the job was restarted before this attempt."""
    max_restarts: int = 0
    workdir: str | None = None
    """Where the rank runs, when it runs on the driver's machine (the local runtime)."""
    share_key: str = ""
    """Names this call's node-wide copy of the payload's large buffers (see sharing.py)."""
    uses_torch: bool = True
    """Whether the call's function refers to torch (or GPUs are asked for): the rank
    then loads torch before it runs, to set its threads and bind its GPU."""
    ranks_on_node: int = 1
    """How many ranks of the job run on this rank's Ray node (they share its cores and
    read one copy of the payload's large buffers)."""
    identity: int = -1
    """What its snapshots are kept as (see orchestrator_workers.snapshot): its rank when the
    pool started, kept by a replacement and through a shrink's renumbering (-1: `rank`)."""


@dataclass(frozen=True)
class Peer:
    """A rank as its node's first rank reaches it, to hand it a call (see handoff)."""

    rank: int
    door: str
    """Its Door's abstract socket name."""
    pid: int
    """Its process, which must hold the door."""
    spec: bytes
    """Its RankSpec, pickled."""
    key: bytes = field(default=b"", repr=False)
    """Its door's secret, sent first on each link (see handoff); never shown."""


@dataclass(frozen=True)
class RemoteNode:
    """Another node of the job, as the job's first rank reaches it (see handoff)."""

    actor: Any
    """The actor of the node's first rank, which hands the call to the node's ranks."""
    ranks: tuple[int, ...]
    peers: bytes = field(repr=False)
    """The node's ranks' Peers, pickled (their doors' keys: never shown)."""


@dataclass(frozen=True)
class RankResult:
    """A rank's return value."""

    rank: int
    value: object
    output_seq: int = 0
    """Seq of the last output chunk written before the function returned."""
    next_master_port: int | None = None
    """Rank 0 only: the port it reserved for the next call's store."""
    store_open: bool = False
    """Rank 0 only: its store still serves (a rank connected to it) until the driver,
    once every rank is done, says to close it; else it closed it itself."""


@dataclass(frozen=True)
class CallSpec:
    """What one call adds to every rank's RankSpec: the same for all, pickled once."""

    master_port: int
    restart_count: int
    max_restarts: int
    share_key: str
    """The call's key; a rank's node-wide copy of the large buffers adds its node's id."""
    uses_torch: bool
    watched: bool = True
    """Whether the rank looks where its function is, five times a second (stall_after)."""
    job_secret: bytes = field(default=b"", repr=False)
    """The job's secret, the same for all its attempts: its ranks' snapshot channel proves
    it (see buddies); never shown."""


Outcomes = list[tuple[int, bytes | None]]
"""(rank, its pickled RankResult or RankFailure); None where the driver must ask the
rank's actor for it: its socket closed first (Ray will say why), its node's hand is gone,
or it is large."""


@dataclass(frozen=True)
class Collected:
    """A call's outcomes as a node's first rank hands them to one reader (see handoff)."""

    outcomes: Outcomes
    """Those this reader had not collected yet."""
    running: tuple[int, ...]
    """The ranks whose outcomes have not come yet."""
    failed: bool
    """Whether a rank failed or was lost."""


@dataclass(frozen=True)
class Lease:
    """A start's tokens: a start that carries `token` must find it the one rank 0's hand
    holds (it is then used up); `lend` is what the hand holds from then on (see
    `handoff.Hand.start`). Neither is ever shown."""

    token: bytes | None = field(default=None, repr=False)
    lend: bytes | None = field(default=None, repr=False)


NO_LEASE = Lease()
"""A start that carries no token and lends none (a live function's)."""


@dataclass(frozen=True)
class Used:
    """A lease token a start used up, as taking it back finds it: the call that used it,
    and the token that start lent next (never shown)."""

    call_id: bytes
    lend: bytes | None = field(repr=False)


@dataclass(frozen=True)
class RankFailure:
    """A rank that raised, or whose process died."""

    rank: int
    local_rank: int
    node_ip: str
    hostname: str
    pid: int
    time: float
    """Wall-clock time of the failure (time.time() on the rank's node)."""
    exc_type: str
    """Qualified name of the exception type, or "crash" when the process died."""
    message: str
    traceback: str
    exception: bytes | None = None
    """The exception itself, cloudpickled, when it could be pickled."""
    output_seq: int = 0
    """Seq of the last output chunk written before the failure was reported."""
    error_file: str = ""
    """The torchelastic error file the message, time and traceback were read from, if the
    rank's entry point used torch's `record` (as torchrun's root-cause summary does): on
    the driver, the copy kept beside the rank's log (`error_json` written there)."""
    error_json: bytes = field(default=b"", repr=False)
    """What torch wrote there, sent for the driver to keep (b"" once it is kept)."""


@dataclass(frozen=True)
class Payload:
    """What one call ships to every rank, put in the object store once."""

    call: bytes | pickle.PickleBuffer
    """`(fn, args, kwargs)`, cloudpickled (a PickleBuffer, read in place, when large)."""
    sources: dict[str, list[str]]
    """Source lines of the code shipped by value, by file name, for tracebacks."""
    buffers: tuple[pickle.PickleBuffer, ...] = ()
    """The big tensors' and arrays' bytes, out of band: `call` is unpickled with them."""
    readonly: tuple[bool, ...] = ()
    """For each of `buffers`, whether its object was read-only (a numpy array can be)."""

    def parts(self) -> tuple[Any, ...]:
        """Its fields as builtins, for a process that may lack this package (Ray Client's
        server, which unpickles what a laptop puts in the object store); see `received`."""
        return (self.call, self.sources, self.buffers, self.readonly)

    @classmethod
    def received(cls, packed: Received) -> Payload:
        """A payload as a rank gets it: pickled (small, inline), from the object store, or
        from there as `parts()` (put by a driver through Ray Client)."""
        if isinstance(packed, bytes):
            return pickle.loads(packed)  # noqa: S301 - from our own driver
        return cls(*packed) if isinstance(packed, tuple) else packed

    def size(self) -> int:
        """Bytes in all: the call, its sources and its buffers."""
        sources = sum(len(line) for lines in self.sources.values() for line in lines)
        return memoryview(self.call).nbytes + sources + sum(b.raw().nbytes for b in self.buffers)


Received = bytes | Payload | tuple[Any, ...]
"""A call's payload as a rank's `run` gets it (see Payload.received)."""


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a rank wrote to one of its standard streams, numbered in arrival order; or a
    note from the rank on a pseudo-stream (EXIT_STREAM, STATE_STREAM), numbered alike."""

    seq: int
    stream: str
    """"stdout" or "stderr"; or EXIT_STREAM (`data`: the status given to os._exit) or
    STATE_STREAM (`data`: what the rank waits on now, a State such as WAITING; empty: nothing)."""
    data: bytes
