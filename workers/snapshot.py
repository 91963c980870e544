"""In-memory snapshots: a rank saves its training state every K steps, and after a restart
every rank resumes from the newest step all of them can restore, with no disk.

    from orchestrator import snapshot        # imports none of the driver's machinery

    state = {"model": model, "optimizer": optimizer}
    restored = snapshot.restore(state)       # None on a fresh start (and when lost)
    step = 0 if restored is None else restored.step + 1
    position = 0 if restored is None else restored.data
    for step in range(step, steps):
        ...
        if (step + 1) % 50 == 0:
            snapshot.save(step, state, data=position)

Two copies of each rank's snapshot: its own, in its process, and one its buddy keeps, a
rank on another node (see buddies), so that a lost rank or a lost node loses none. Both
live in process memory, not in Ray's object store (Ray frees a dead owner's objects) and
not in /dev/shm. `save` is collective: every rank calls it at the same step, after
`init_process_group`. A snapshot counts only once every rank's buddy holds it; until
then the previous one is kept, so a rank lost in the middle of one costs one interval
more, never a mix of steps. `restore` is collective too: the ranks agree on the newest
step every one of them can restore, survivors from their own copies, replaced ranks from
their buddies'. What is saved: each value's `state_dict()` (or the value itself), the
RNG states (Python's, torch's, CUDA's, numpy's), the step and `data` (a position in the
data: DataLoader iterators are not captured).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator_workers import buddies, copies, frames
from orchestrator_workers.errors import SnapshotError

if TYPE_CHECKING:
    import torch

PAUSE_VAR = "ORCHESTRATOR_SNAPSHOT_PAUSE"
"""Test hook: `STEP:RANK:FILE` makes rank RANK, on a job's first attempt, once half of its
copy of step STEP has reached its buddy, write its pid to FILE and wait there for ever
(to be killed in the middle of a snapshot)."""

DCP_KEY = "torch.distributed.checkpoint"
"""The one name in the state of a snapshot saved through dcp.save() (see dcp.Writer)."""


@dataclass(frozen=True)
class Restored:
    """What `restore` brought back: the state was loaded into the objects given."""

    step: int
    data: Any
    """The `data` given to `save` (a position in the data)."""
    state: dict[str, Any] = field(repr=False)
    """What was loaded, by name: a module's state dict, a tensor or an optimizer's state
    dict (loaded in place), or a copy of a plain value."""
    source: str = "own"
    """"own" (this process's copy) or "rank N" (the copy its buddy, rank N, kept)."""
    world_size: int = 0
    """The world size it was saved at: after a shrink, more than WORLD_SIZE now (so `data`,
    a position in the data, counts samples of a wider world)."""


@dataclass(frozen=True)
class _Call:
    """What the rank's actor tells this module about the call running now."""

    rank: int
    world_size: int
    restart_count: int
    secret: bytes = field(repr=False)
    host: str
    node: str
    identity: int
    """What its snapshots are kept as: its rank when they were saved (see RankSpec.identity)."""


@dataclass
class _Own:
    """This rank's own copy: its header and body, and the step (None while rewritten)."""

    step: int | None
    header: bytes
    body: bytearray = field(repr=False)
    layout: tuple[tuple[str, tuple[int, ...], int, int], ...]


_call: _Call | None = None
_own: _Own | None = None
_gloo: Any = None
"""The gloo group this module's collectives use where the default group is not gloo's;
dropped as each call ends (held, it would keep its peers' connections open)."""


def enter(
    rank: int,
    world_size: int,
    *,
    restart_count: int,
    secret: bytes,
    host: str,
    node: str,
    identity: int | None = None,
) -> None:
    """Called by the rank's actor before each call: a new job's secret drops what an
    earlier job left (its own copy and the copies kept for its wards)."""
    global _call, _own  # noqa: PLW0603 - one rank per process
    if _call is None or _call.secret != secret:
        _own = None
        buddies.keeper.forget()
    known = rank if identity is None else identity
    _call = _Call(rank, world_size, restart_count, secret, host, node, known)


def leave() -> None:
    """Called by the rank's actor as each call ends: no process group is held past it (a
    survivor's would keep its dead peer's connections, and its peers, waiting)."""
    global _gloo  # noqa: PLW0603 - one rank per process
    _gloo = None


def keeper_port() -> int:
    """The port this rank's keeper listens on (0: none yet)."""
    return buddies.keeper.address[1]


def save(step: int, state: Mapping[str, Any], *, data: Any = None) -> None:
    """Snapshot `state` (objects with `state_dict()`, or plain values) at `step`, with
    `data` (the position in the data to resume from), into memory here and at a buddy
    rank; collective: every rank calls it at the same step."""
    import torch
    import torch.distributed as dist

    call, group = _enter_collective("save")
    header, tensors = frames.frame(step, state, data, call.world_size)
    layout = frames.layout_of(tensors)
    body_len = layout[-1][2] + layout[-1][3] if layout else 0
    host, port = buddies.keeper.serve(call.host, call.secret)
    grown = 0 if _own is not None and _own.layout == layout else body_len
    mine = (call.node, host, port, len(header) + body_len, grown, copies.available_memory())
    ranks: list[Any] = [None] * call.world_size
    dist.all_gather_object(ranks, mine, group=group)
    copies.check_room(ranks, step)
    buddy = copies.buddies([r[0] for r in ranks])[call.rank]
    failure = ""
    if buddy != call.rank:
        try:
            buddies.put(
                (ranks[buddy][1], ranks[buddy][2]),
                call.secret,
                ward=call.identity,
                step=step,
                header=header,
                body=frames.chunks(tensors, layout),
                body_len=body_len,
                pause=_pause(step, call.rank),
            )
        except (buddies.ChannelError, OSError) as exc:
            failure = f"rank {call.rank} could not give its copy to rank {buddy}: {exc}"
    # Whether some rank's copy did not arrive. An all_reduce, not a gather: gloo's ring
    # gather leaves a rank waiting for ever on a live neighbour that failed out when a rank
    # is lost here; its all_reduce fails them all.
    failed = torch.tensor([1 if failure else 0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item():  # keep the previous snapshot: it is still whole everywhere
        if failure:
            print(
                f"[snapshot] step {step} not kept (the last one stays): {failure}",
                file=sys.stderr,
                flush=True,
            )
        return
    buddies.keeper.settle(step)
    _keep_own(step, header, tensors, layout)


def restore(state: Mapping[str, Any]) -> Restored | None:
    """Load the newest snapshot every rank can restore into `state`'s objects; None on a
    fresh start, or when some rank's copies are all lost (said on rank 0: then load
    your own checkpoint). Collective: every rank calls it, after init_process_group."""
    fetched = fetch("restore")
    if fetched is None:
        return None
    saved, source = fetched
    if DCP_KEY in saved["state"]:
        raise SnapshotError(
            f"the snapshot of step {saved['step']} was saved by dcp.save() with "
            "snapshot.writer(): load it with dcp.load(state, storage_reader=snapshot.reader())"
        )
    loaded = frames.load(saved, state)
    return Restored(saved["step"], saved["data"], loaded, source, saved["world_size"])


def fetch(what: str) -> tuple[dict[str, Any], str] | None:
    """What the newest snapshot every rank can restore saved (see frames.unpack: its
    tensors are views of this rank's copy, rewritten by the next save), with the RNGs
    set back, and where it came from ("own" or "rank N"); None as for `restore`.
    Collective: every rank calls it."""
    import torch.distributed as dist

    global _own  # noqa: PLW0603 - one rank per process
    call = _current(what)
    if call.restart_count == 0:
        _forget()
        return None
    call, group = _enter_collective(what)
    host, port = buddies.keeper.serve(call.host, call.secret)
    own_step = _own.step if _own is not None else None
    mine = (host, port, own_step, buddies.keeper.holdings(), call.identity)
    ranks: list[Any] = [None] * call.world_size
    dist.all_gather_object(ranks, mine, group=group)
    step, missing = copies.agree(ranks)
    if step is None:
        if call.rank == 0:
            _say_lost(missing, any(r[2] is not None or r[3] for r in ranks))
        _forget()
        return None
    source = "own"
    if own_step == step and _own is not None:
        header, body = _own.header, _own.body
    else:
        holder = next(h for h, r in enumerate(ranks) if step in r[3].get(call.identity, ()))
        where = (ranks[holder][0], ranks[holder][1])
        copy = buddies.get(where, call.secret, call.identity, step)
        header, body = copy.header, copy.body
        source = f"rank {holder}"
    buddies.keeper.settle(step)
    saved, layout = frames.unpack(header, body)
    _own = _Own(step, header, body, layout)
    sources: list[Any] = [None] * call.world_size
    dist.all_gather_object(sources, source, group=group)
    if call.rank == 0:
        _say_restored(step, sources)
    frames.set_rng(saved["rng"])
    return saved, source


def _current(what: str) -> _Call:
    if _call is None:
        raise SnapshotError(
            f"snapshot.{what}() works inside a function run by distribute(); here there "
            "is no rank to keep it (save a checkpoint to disk instead)"
        )
    return _call


def _enter_collective(what: str) -> tuple[_Call, Any]:
    """The call, and the group for this module's collectives: the default one where it
    is gloo's (None), else a gloo group made once per call, on every rank at once."""
    global _gloo  # noqa: PLW0603 - one rank per process
    import torch.distributed as dist

    call = _current(what)
    if not dist.is_available() or not dist.is_initialized():
        raise SnapshotError(
            f"snapshot.{what}() is collective: call it on every rank after "
            "torch.distributed.init_process_group()"
        )
    if dist.get_backend() == "gloo":
        return call, None
    if _gloo is None:
        _gloo = dist.new_group(backend="gloo")
    return call, _gloo


def _forget() -> None:
    global _own  # noqa: PLW0603 - one rank per process
    _own = None
    buddies.keeper.forget()


def _keep_own(step: int, header: bytes, tensors: list[torch.Tensor], layout: Any) -> None:
    """This rank's own copy becomes `step`'s, rewritten in place where the layout is the same."""
    global _own  # noqa: PLW0603 - one rank per process
    size = layout[-1][2] + layout[-1][3] if layout else 0
    if _own is None or _own.layout != layout:
        _own = None  # the old one's memory first
        _own = _Own(None, header, bytearray(size), layout)
    _own.step = None  # not whole while rewritten
    body = memoryview(_own.body)
    for tensor, (_, _, offset, nbytes) in zip(tensors, layout, strict=True):
        with frames.bytes_of(tensor) as view:
            body[offset : offset + nbytes] = view
    _own.header = header
    _own.step = step


def _say_lost(missing: list[int], any_kept: bool) -> None:
    if not any_kept:
        print(
            "[snapshot] nothing to restore: no rank holds a snapshot (none was taken "
            "before the failure, or every rank that held one was replaced)",
            file=sys.stderr,
            flush=True,
        )
        return
    who = ", ".join(map(str, missing))
    print(
        f"[snapshot] nothing restored: every copy of the snapshots of rank(s) {who} is "
        "lost (a rank and the buddy that kept its copy, or their nodes, were lost "
        "together); no step is whole on every rank, and a mix of steps is never "
        "restored: load your own checkpoint",
        file=sys.stderr,
        flush=True,
    )


def _say_restored(step: int, sources: list[str]) -> None:
    from_buddy = [f"rank {r} from {s}'s copy" for r, s in enumerate(sources) if s != "own"]
    own = [str(r) for r, s in enumerate(sources) if s == "own"]
    parts = from_buddy + ([f"rank(s) {', '.join(own)} from their own"] if own else [])
    print(
        f"[snapshot] restored step {step} from memory: {'; '.join(parts)}",
        file=sys.stderr,
        flush=True,
    )


def _pause(step: int, rank: int) -> threading.Event | None:
    """The test hook's event for this save (see PAUSE_VAR), or None."""
    spec = os.environ.get(PAUSE_VAR, "")
    if not spec or _call is None or _call.restart_count:
        return None
    at_step, at_rank, path = spec.split(":", 2)
    if (int(at_step), int(at_rank)) != (step, rank):
        return None
    paused = threading.Event()

    def note() -> None:
        paused.wait()
        with open(path, "w") as out:
            out.write(str(os.getpid()))

    threading.Thread(target=note, daemon=True).start()
    return paused
