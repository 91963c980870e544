"""In-memory snapshots through torch.distributed.checkpoint (snapshot.writer and
snapshot.reader): sharded state (FSDP2, DTensor) saved with dcp.save and loaded with
dcp.load, each rank from its own copy or its buddy's, to the bit; the FSDP2 loop is
examples/fsdp_snapshot.py's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from examples.fsdp_snapshot import train
from orchestrator import distribute, restart
from orchestrator import snapshot as api
from orchestrator_workers import snapshot
from tests.helpers import wait_resources_back

# --- the pure parts ---------------------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A rank of one: a gloo group of one process, and the snapshot module entered."""
    monkeypatch.setattr(snapshot, "_call", None)
    monkeypatch.setattr(snapshot, "_own", None)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    secret = os.urandom(32)
    snapshot.enter(0, 1, restart_count=0, secret=secret, host="127.0.0.1", node="n")
    try:
        yield lambda: snapshot.enter(
            0, 1, restart_count=1, secret=secret, host="127.0.0.1", node="n"
        )
    finally:
        snapshot.leave()
        dist.destroy_process_group()


def test_a_dtensor_state_round_trips_through_dcp_with_rng_and_data(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    state = {"sharded": sharded, "plain": torch.arange(5.0), "extra": {"lr": 0.1, "tags": ["a"]}}
    dcp.save(state, storage_writer=api.writer(5, data={"offset": 96}))
    expected_draw = torch.rand(3)
    saved = {"sharded": sharded.full_tensor().clone(), "plain": torch.arange(5.0)}

    with torch.no_grad():
        sharded.zero_()
        state["plain"].zero_()
    state["extra"] = {"lr": 9.0, "tags": []}
    torch.manual_seed(99)
    one_rank()  # the restart
    reader = api.reader()
    assert reader is not None
    assert (reader.step, reader.data, reader.source) == (5, {"offset": 96}, "own")
    dcp.load(state, storage_reader=reader)
    assert torch.equal(sharded.full_tensor(), saved["sharded"])  # in place, in its sharding
    assert torch.equal(state["plain"], saved["plain"])
    assert state["extra"] == {"lr": 0.1, "tags": ["a"]}
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG as it was at the save
    with pytest.raises(api.SnapshotError, match=r"saved by dcp\.save\(\).*storage_reader"):
        api.restore(state)


def test_a_snapshot_saved_one_way_is_refused_the_other_way_with_which(one_rank):
    api.save(3, {"plain": torch.ones(2)})
    one_rank()
    with pytest.raises(api.SnapshotError, match=r"saved by snapshot\.save\(\).*restore"):
        api.reader()


def test_the_reader_is_none_on_a_fresh_start(one_rank):
    assert api.reader() is None


# --- through distribute -----------------------------------------------------------------


def test_a_killed_fsdp2_rank_resumes_from_its_buddy_s_copy_with_bit_identical_weights(
    cluster, monkeypatch, capfd
):
    monkeypatch.setattr(restart, "SETTLE_S", 30.0)  # a busy 2-core machine: see test_snapshot
    fn = distribute(train, num_replicas=2, replicas_per_node=1, max_restarts=1, name="dcps")
    try:
        first = fn(50, 10)  # a run that never failed, on the same warm pool
        job = fn.submit(50, 10, 37)  # the last rank, 1, kills itself at step 37
        results = job.result(timeout=180)
    finally:
        fn.shutdown()
    assert job.status().restarts == 1
    assert [r["resumed"] for r in first] == [None, None]
    assert [r["resumed"] for r in results] == [(29, 30, "own"), (29, 30, "rank 0")]
    assert [r["pid"] == p["pid"] for r, p in zip(results, first, strict=True)] == [True, False]
    for name, want in first[0]["weights"].items():
        for rank, result in enumerate(results):
            got = result["weights"][name]
            assert torch.equal(got, want), f"rank {rank}, {name}: {(got - want).abs().max()}"
    assert "[snapshot] restored step 29 from memory: rank 1 from rank 0's copy" in (
        capfd.readouterr().err
    )
    wait_resources_back()
