"""In-memory snapshots through torch.distributed.checkpoint, for sharded state (FSDP2,
DTensor): a storage writer and reader pair that user code passes to `dcp.save` and
`dcp.load`, with the snapshot's two copies and its restore rules (see snapshot).

    import torch.distributed.checkpoint as dcp
    from orchestrator import snapshot

    reader = snapshot.reader()               # None on a fresh start (and when lost)
    if reader is not None:
        dcp.load(state, storage_reader=reader)
    start = 0 if reader is None else reader.data
    for step in range(start, steps):
        ...
        if (step + 1) % 50 == 0:
            dcp.save(state, storage_writer=snapshot.writer(step, data=step + 1))

Each rank keeps what it itself holds: its shards, and its replica of every replicated
value, which dcp's planner would write on one rank only. So a rank restores from its own
copy (or its buddy's) alone, and the load must use the sharding of the save (the same
world size and mesh), which is what a restart gives. `dcp.async_save` is not supported:
the copy to the buddy is collective and would run beside training's collectives.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from orchestrator_workers import snapshot
from orchestrator_workers.errors import SnapshotError

_Key = tuple[str, tuple[int, ...] | None]


def writer(step: int, *, data: Any = None) -> Writer:
    """A storage writer for `dcp.save` that snapshots `step` into memory (see Writer)."""
    return Writer(step, data=data)


def reader() -> Reader | None:
    """A storage reader for `dcp.load` of the newest snapshot every rank can restore (the
    RNGs are set back now); None on a fresh start or when some rank's copies are all
    lost, as for snapshot.restore. Collective: every rank calls it."""
    fetched = snapshot.fetch("reader")
    if fetched is None:
        return None
    saved, source = fetched
    held = saved["state"].get(snapshot.DCP_KEY)
    if held is None:
        raise SnapshotError(
            f"the snapshot of step {saved['step']} was saved by snapshot.save(): load it "
            "with snapshot.restore(state)"
        )
    world = torch.distributed.get_world_size()
    if saved["world_size"] != world:  # a shrink: its shards are laid out for another world
        if torch.distributed.get_rank() == 0:
            print(
                f"[snapshot] nothing restored: the snapshot of step {saved['step']} was saved "
                f"by {saved['world_size']} ranks and dcp.load needs it resharded for {world}, "
                "which snapshots do not do yet: load your own checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return None
    return Reader(saved["step"], saved["data"], source, held["items"], held["metadata"])


class Writer(StorageWriter):
    """`dcp.save(state, storage_writer=snapshot.writer(step, data=position))`: this rank's
    shards and replicas become its in-memory snapshot of `step`, kept here and at its
    buddy, with the RNGs and `data`. Collective, as dcp.save is; one per save."""

    def __init__(self, step: int, *, data: Any = None) -> None:
        super().__init__()
        self.step, self.data = step, data
        self._plan = SavePlan([])

    def reset(self, checkpoint_id: Any = None) -> None:
        """No path or id: the snapshot's place is the rank's memory."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Keep this rank's whole plan (the global plan drops replicas held elsewhere)."""
        self._plan = plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans as the planner made them."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Snapshot everything this rank holds (see snapshot.save), and report `plan`'s items."""
        items: dict[_Key, Any] = {}
        metadata: dict[str, Any] = {}
        for item in _whole(self._plan, planner):
            value: Any = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items[_key(item.index)] = value.getvalue()
                metadata[item.index.fqn] = BytesStorageMetadata()
                continue
            items[_key(item.index)] = value.detach()
            described = item.tensor_data
            if described is None:
                raise SnapshotError(f"dcp gave no tensor description for {item.index.fqn!r}")
            entry = metadata.setdefault(
                item.index.fqn, TensorStorageMetadata(described.properties, described.size, [])
            )
            chunk = described.chunk
            entry.chunks.append(ChunkStorageMetadata(chunk.offsets, chunk.sizes))
        local = Metadata(metadata, planner_data=self._plan.planner_data)
        held = {"items": items, "metadata": local}
        snapshot.save(self.step, {snapshot.DCP_KEY: held}, data=self.data)
        done: Future[list[WriteResult]] = Future()
        done.set_result(
            [
                WriteResult(
                    index=item.index,
                    size_in_bytes=_size(items.get(_key(item.index))),
                    storage_data=None,
                )
                for item in plan.items
            ]
        )
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: each rank's snapshot is whole once write_data returns."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """No checkpoint id names an in-memory snapshot."""
        return False


class Reader(StorageReader):
    """`dcp.load(state, storage_reader=snapshot.reader())`: this rank's snapshot of `step`
    (its own copy or its buddy's), loaded into `state` in the sharding it was saved in."""

    step: int
    data: Any
    """The `data` given to the writer (a position in the data)."""
    source: str
    """"own" (this process's copy) or "rank N" (the copy its buddy, rank N, kept)."""

    def __init__(
        self, step: int, data: Any, source: str, items: dict[_Key, Any], metadata: Metadata
    ) -> None:
        super().__init__()
        self.step, self.data, self.source = step, data, source
        self._items, self._metadata = items, metadata

    def __repr__(self) -> str:
        return f"snapshot.Reader(step={self.step}, data={self.data!r}, source={self.source!r})"

    def reset(self, checkpoint_id: Any = None) -> None:
        """No path or id: the snapshot is in the rank's memory."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """What this rank saved: its own shards and replicas, not the other ranks'."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as the planner made it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as the planner made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each planned item out of the snapshot into the state being loaded."""
        for item in plan.items:
            stored = self._items.get(_key(item.storage_index))
            if stored is None:
                raise SnapshotError(
                    f"this rank's snapshot of step {self.step} holds no {item.storage_index.fqn!r} "
                    f"at offset {list(item.storage_index.offset or ())}: a snapshot is loaded "
                    "into the sharding it was saved in (the same world size and mesh)"
                )
            if isinstance(stored, bytes):
                planner.load_bytes(item, io.BytesIO(stored))
                continue
            spans = zip(item.storage_offsets, item.lengths, strict=True)
            for dim, (offset, length) in enumerate(spans):
                stored = stored.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.shape != stored.shape:
                raise SnapshotError(
                    f"{item.dest_index.fqn!r} is {tuple(target.shape)} here and "
                    f"{tuple(stored.shape)} in the snapshot of step {self.step}"
                )
            target.copy_(stored)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """No checkpoint id names an in-memory snapshot."""
        return False


def _whole(plan: SavePlan, planner: SavePlanner) -> list[WriteItem]:
    """This rank's plan, with every value it holds (some torch versions plan plain values
    on the coordinator only)."""
    items = {_key(item.index): item for item in plan.items}
    if isinstance(planner, DefaultSavePlanner):
        for item in create_default_local_save_plan(planner.state_dict, True).items:
            items.setdefault(_key(item.index), item)
    return list(items.values())


def _key(index: MetadataIndex) -> _Key:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(value) if isinstance(value, bytes) else 0
