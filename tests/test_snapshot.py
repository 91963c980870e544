"""In-memory snapshots (orchestrator.snapshot): a lost rank is replaced and the job resumes
at the snapshot's step, from the survivors' own copies and the replaced rank's buddy's,
ending with exactly the weights of a run that never failed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator import DistributedFunction, PlacementTimeoutError, distribute, restart
from orchestrator_workers import buddies, copies, frames, snapshot
from tests.helpers import CPUS_PER_NODE, GPUS_PER_NODE, wait_resources_back

STEPS, EVERY = 50, 10


class _Net(torch.nn.Module):
    """Linear, ReLU, dropout (the global RNG), linear."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output for a batch `x` of 8 features."""
        hidden = torch.relu(self.hidden(x))
        return self.out(torch.nn.functional.dropout(hidden, 0.2, self.training))


class _Batches(torch.utils.data.Dataset):
    """Rank `rank`'s batches from step `first` on, each made from its step number."""

    def __init__(self, first: int, rank: int) -> None:
        self.first, self.rank = first, rank

    def __len__(self) -> int:
        return STEPS - self.first

    def __getitem__(self, i: int) -> torch.Tensor:
        data = torch.Generator().manual_seed((self.first + i) * 1000 + self.rank)
        return torch.randn(32, 8, generator=data)


def train(
    kill_step: int, kill_ranks: tuple[int, ...], hold: str = "", workers: int = 0
) -> dict[str, Any]:
    """DDP on data made from the step number (dropout draws from the global RNG); ranks
    `kill_ranks` kill their own processes at `kill_step` on the first attempt (or, given a
    `hold` file, write their node's id there and wait: the test takes the node away).
    With `workers`, a DataLoader's worker processes (forked from the rank) make the data."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from orchestrator import snapshot

    rank, attempt = int(os.environ["RANK"]), int(os.environ["RESTART_COUNT"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = _Net()
    # As docs/usage.md says: DDP regroups its gradients' buckets after its first step, so
    # a resumed run's first step (on 3 ranks or more) would sum them in another order than
    # a run that never failed, and the last bits differ; find_unused_parameters=True keeps
    # the first grouping for good.
    model = DistributedDataParallel(net, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": optimizer}
    torch.manual_seed(100 + rank)
    restored = snapshot.restore(state)
    start = 0 if restored is None else restored.data
    # Its own generator: an iterator made with none draws its seed from the global RNG,
    # which the restore has just set back (a run that never failed draws it elsewhere).
    batches = iter(
        torch.utils.data.DataLoader(
            _Batches(start, rank),
            batch_size=None,
            num_workers=workers,
            generator=torch.Generator().manual_seed(rank),
        )
    )
    for step in range(start, STEPS):
        if attempt == 0 and rank in kill_ranks and step == kill_step:
            if hold:
                import ray

                Path(hold).write_text(ray.get_runtime_context().get_node_id())
                time.sleep(300)
            os.kill(os.getpid(), signal.SIGKILL)
        x = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % EVERY == 0:
            snapshot.save(step, state, data=step + 1)
    weights = [p.detach().clone() for p in net.parameters()]
    dist.destroy_process_group()
    seen = None if restored is None else (restored.step, restored.data, restored.source)
    import ray

    node = ray.get_runtime_context().get_node_id()
    return {"restored": seen, "weights": weights, "pid": os.getpid(), "node": node}


# --- the pure parts ---------------------------------------------------------------------


def test_a_buddy_is_on_another_node_where_there_is_one():
    assert copies.buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert copies.buddies(["a", "a", "b"]) == [2, 2, 1]
    assert copies.buddies(["a", "b", "c", "d"]) == [1, 2, 3, 0]
    assert copies.buddies(["a", "a", "a"]) == [1, 2, 0]  # one node: the next rank
    assert copies.buddies(["a"]) == [0]


def _ranks(own: list[int | None], held: list[dict[int, list[int]]]) -> list[Any]:
    return [("h", 1, o, h, rank) for rank, (o, h) in enumerate(zip(own, held, strict=True))]


def test_the_ranks_agree_on_the_newest_step_each_can_restore():
    # Rank 2 replaced: its copy of 29 is kept by rank 0.
    ranks = _ranks([29, 29, None, 29], [{2: [29]}, {3: [29]}, {}, {1: [29]}])
    assert copies.agree(ranks) == (29, [])
    # Rank 1 lost half-way through step 19's snapshot: the others' keepers hold 9 and 19,
    # their own copies are still 9, rank 1's keeper (rank 3) holds only 9: 9, not a mix.
    ranks = _ranks([9, None, 9, 9], [{2: [9, 19]}, {}, {0: [9, 19]}, {1: [9]}])
    assert copies.agree(ranks) == (9, [])
    # Lost after every rank delivered 19: the copy it kept for rank 3 went with it, and
    # rank 3's own is 9 until it passes the commit, so 9 again.
    ranks = _ranks([9, None, 9, 9], [{2: [9, 19]}, {}, {0: [9, 19]}, {1: [9, 19]}])
    assert copies.agree(ranks) == (9, [])
    # Lost once ranks 0 and 3 had passed the commit (their own copies and keepers: 19).
    ranks = _ranks([19, None, 9, 19], [{2: [19]}, {}, {0: [9, 19]}, {1: [19]}])
    assert copies.agree(ranks) == (19, [])
    # Ranks 0 and 2 (each the other's buddy) lost together: nothing, and who.
    ranks = _ranks([None, 29, None, 29], [{}, {3: [29]}, {}, {1: [29]}])
    assert copies.agree(ranks) == (None, [0, 2])
    # A failure before the first snapshot: nothing anywhere.
    assert copies.agree(_ranks([None, None], [{}, {}])) == (None, [0, 1])


def test_after_a_shrink_copies_count_for_the_rank_they_were_saved_as():
    # 4 ranks kept as identities 0-3; identities 1 and 3 (a node) are lost, and the
    # survivors are renumbered 0 and 1. Rank 1 (identity 2) lacks its own copy of 29; the
    # keeper holding identity 1's copy of 29 must not count for it (it was another rank's).
    ranks = [("h", 1, 29, {1: [29]}, 0), ("h", 1, 19, {0: [19, 29]}, 2)]
    assert copies.agree(ranks) == (19, [])
    # Identity 2's copy of 29, kept by identity 0's keeper: 29 on both.
    ranks = [("h", 1, 29, {2: [29]}, 0), ("h", 1, 19, {0: [29]}, 2)]
    assert copies.agree(ranks) == (29, [])


def test_a_snapshot_frame_round_trips_state_rng_and_data_without_sharing_memory():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model,
        "optimizer": optimizer,
        "extra": {"bf16": torch.ones(3).bfloat16()},
        "scale": torch.tensor([2.5]),
    }
    torch.manual_seed(7)
    header, tensors = frames.frame(12, state, {"offset": 96}, 4)
    layout = frames.layout_of(tensors)
    body = bytearray(b"".join(bytes(c) for c in frames.chunks(tensors, layout)))
    expected_draw = torch.rand(3)

    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    torch.manual_seed(99)
    scale = torch.zeros(1)
    into = {"model": fresh, "optimizer": fresh_optimizer, "scale": scale}
    saved, _ = frames.unpack(header, body)
    frames.set_rng(saved["rng"])
    loaded = frames.load(saved, into)
    assert (saved["step"], saved["data"], saved["world_size"]) == (12, {"offset": 96}, 4)
    assert loaded["scale"] is scale and scale.item() == 2.5  # a tensor: in place
    assert torch.equal(loaded["extra"]["bf16"], torch.ones(3).bfloat16())
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG as it was at the save
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    moments = fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, optimizer.state_dict()["state"][0]["exp_avg"])
    body[:] = bytes(len(body))  # the loaded state is a copy, not a view of the snapshot
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], moments)
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(loaded["extra"]["bf16"], torch.ones(3).bfloat16())
    assert not torch.equal(moments, torch.zeros_like(moments))


def test_an_optimizer_with_state_is_loaded_into_its_own_tensors():
    """A survivor's optimizer already holds its moments: they are overwritten in place (no
    second copy of the state), and share nothing with the snapshot."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    header, tensors = frames.frame(5, {"optimizer": optimizer}, None, 1)
    body = bytearray(b"".join(bytes(c) for c in frames.chunks(tensors, frames.layout_of(tensors))))
    saved_moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the state moves on past the snapshot
    live = optimizer.state[model.weight]["exp_avg"]
    assert not torch.equal(live, saved_moments)

    frames.load(frames.unpack(header, body)[0], {"optimizer": optimizer})
    assert optimizer.state[model.weight]["exp_avg"] is live  # the same tensor, overwritten
    assert torch.equal(live, saved_moments)
    body[:] = bytes(len(body))
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], saved_moments)


def test_a_sparse_tensor_is_refused_with_what_to_use():
    with pytest.raises(snapshot.SnapshotError, match=r"dense tensors.*checkpoint"):
        frames.frame(0, {"t": torch.eye(2).to_sparse()}, None, 1)


def test_a_node_without_room_for_the_copies_is_refused_on_every_rank_alike():
    gib = 2**30
    # (node, host, port, copy bytes, own bytes new here, bytes available on the node)
    ranks = [
        ("a", "h", 1, gib, gib, 10 * gib),
        ("a", "h", 2, gib, gib, 10 * gib),
        ("b", "h", 3, gib, gib, 3 * gib),
        ("b", "h", 4, gib, gib, 3 * gib),
    ]
    with pytest.raises(
        snapshot.SnapshotError,
        match=r"4\.00 GiB more memory on the node of "
        r"ranks 2, 3 .* 3\.00 GiB is available there",
    ):
        copies.check_room(ranks, 9)
    copies.check_room([(n, h, p, c, 0, a) for n, h, p, c, _, a in ranks], 19)


def test_the_snapshot_api_outside_a_rank_says_where_it_works(monkeypatch):
    monkeypatch.setattr(snapshot, "_call", None)
    with pytest.raises(snapshot.SnapshotError, match="inside a function run by distribute"):
        snapshot.save(0, {})


def test_aborting_nccl_communicators_leaves_a_gloo_group_alone(tmp_path):
    import torch.distributed as dist

    from orchestrator_workers import leftovers

    assert not leftovers.abort_nccl()  # no group at all
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert not leftovers.abort_nccl()
        total = torch.ones(1)
        dist.all_reduce(total)  # the group still works
        assert dist.is_initialized() and total.item() == 1
    finally:
        dist.destroy_process_group()


# --- the channel ------------------------------------------------------------------------

KEY = os.urandom(32)


@pytest.fixture
def keeper():
    kept = buddies.Keeper()
    kept.serve("127.0.0.1", KEY)
    yield kept
    kept.close_in_child()  # closes the listener


def _put(address: tuple[str, int], key: bytes, body: bytes, step: int = 9) -> None:
    buddies.put(
        address, key, ward=3, step=step, header=b"head", body=[memoryview(body)], body_len=len(body)
    )


def test_a_copy_given_to_a_keeper_comes_back_whole(keeper):
    body = os.urandom(3 << 20)
    _put(keeper.address, KEY, body)
    assert keeper.holdings() == {3: [9]}
    copy = buddies.get(keeper.address, KEY, 3, 9)
    assert (copy.step, copy.header, bytes(copy.body)) == (9, b"head", body)
    _put(keeper.address, KEY, b"newer", step=19)
    assert keeper.holdings() == {3: [9, 19]}
    keeper.settle(19)
    assert keeper.holdings() == {3: [19]}


def test_a_peer_without_the_job_s_secret_can_neither_store_nor_fetch(keeper):
    with pytest.raises(buddies.ChannelError, match="did not prove"):
        _put(keeper.address, os.urandom(32), b"planted")
    _put(keeper.address, KEY, b"real")
    with pytest.raises(buddies.ChannelError, match="not a rank of this job"):
        buddies.get(keeper.address, os.urandom(32), 3, 9)
    assert bytes(buddies.get(keeper.address, KEY, 3, 9).body) == b"real"


def test_a_listener_without_the_secret_learns_nothing_from_a_rank(keeper):
    """A rank that reaches a stranger (say, an address planted in the store) sends no byte
    of its copy: the stranger cannot answer the challenge."""
    got = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as stranger:

        def pretend() -> None:
            conn, _ = stranger.accept()
            with conn:
                conn.settimeout(5)
                got.extend(conn.recv(1 << 16))
                conn.sendall(os.urandom(48))  # a nonce and a made-up proof
                time.sleep(0.5)
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    got.extend(conn.recv(1 << 16))

        thread = threading.Thread(target=pretend)
        thread.start()
        with pytest.raises(buddies.ChannelError, match="not a rank of this job"):
            _put(stranger.getsockname(), KEY, b"SECRET-WEIGHTS")
        thread.join()
    assert b"SECRET-WEIGHTS" not in got and KEY not in got


def test_a_silent_connection_does_not_hold_the_keeper(keeper, monkeypatch):
    monkeypatch.setattr(buddies, "HANDSHAKE_S", 4.0)  # a loaded machine's room for the put
    silent = [socket.create_connection(keeper.address) for _ in range(3)]
    try:
        _put(keeper.address, KEY, b"through")
        for conn in silent:  # the put went through while they still waited
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)
        for conn in silent:  # closed by the keeper once its time to prove itself ran out
            conn.settimeout(buddies.HANDSHAKE_S + 30)
            assert conn.recv(1) == b""
    finally:
        for conn in silent:
            conn.close()


def test_a_new_job_s_key_drops_what_an_earlier_job_left(keeper):
    _put(keeper.address, KEY, b"old job")
    keeper.serve("127.0.0.1", os.urandom(32))
    assert keeper.holdings() == {}


# --- on a real cluster ------------------------------------------------------------------


def test_importing_the_rank_side_api_loads_none_of_the_driver(processes):
    code = (
        "import sys, orchestrator.snapshot; "
        "print(sorted(m for m in sys.modules if m.startswith(('orchestrator', 'ray'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "orchestrator.function" not in out and "'ray'" not in out, out


@pytest.fixture(scope="module")
def snap(cluster) -> Iterator[DistributedFunction[..., dict[str, Any]]]:
    """The module's 4-rank function, its warm pool shared by the tests that use it (each
    call is a new job, with its own secret: a call restores nothing an earlier one saved)."""
    fn = distribute(train, num_replicas=4, replicas_per_node=2, max_restarts=1, name="snap")
    yield fn
    fn.shutdown()


@pytest.fixture
def released(snap) -> None:
    """The shared pool released first (this test's own pools need the whole cluster), and
    everything it held back: nothing leaked by the tests that used it."""
    snap.shutdown()
    wait_resources_back()


@pytest.fixture(scope="module")
def never_failed(snap) -> list[list[torch.Tensor]]:
    """Each rank's weights after a run that never failed."""
    results = snap(-1, ())
    assert {r["restored"] for r in results} == {None}
    return [r["weights"] for r in results]


def _same(results: list[dict[str, Any]], expected: list[list[torch.Tensor]]) -> None:
    for rank, (result, weights) in enumerate(zip(results, expected, strict=True)):
        for got, want in zip(result["weights"], weights, strict=True):
            assert torch.equal(got, want), f"rank {rank}: {(got - want).abs().max()}"


@pytest.fixture
def settle(monkeypatch):
    # A survivor still failing out of gloo after the settle time would be replaced: on a
    # 2-core machine busy with the other test process, 5 s was once too short.
    monkeypatch.setattr(restart, "SETTLE_S", 30.0)


def test_a_killed_rank_resumes_at_the_snapshot_with_bit_identical_weights(
    snap, never_failed, settle, capfd
):
    first = snap(-1, ())  # a fresh call on the warm pool restores nothing
    assert {r["restored"] for r in first} == {None}
    # Each rank's DataLoader forks 2 workers after the rank's keeper listens: the
    # children hold none of it.
    job = snap.submit(37, (2,), "", 2)
    results = job.result(timeout=180)
    assert job.status().restarts == 1
    assert [r["restored"] for r in results] == [
        (29, 30, "own"),
        (29, 30, "own"),
        (29, 30, "rank 0"),
        (29, 30, "own"),
    ]
    assert [r["pid"] for r in results] != [r["pid"] for r in first]
    assert [r["pid"] == p["pid"] for r, p in zip(results, first, strict=True)] == [
        True,
        True,
        False,
        True,  # survivors kept their processes
    ]
    _same(results, never_failed)
    err = capfd.readouterr().err
    assert "restart 1: rank(s) 2 in new processes; rank(s) 0-1,3 kept, with their memory" in err
    assert (
        "[snapshot] restored step 29 from memory: rank 2 from rank 0's copy; "
        "rank(s) 0, 1, 3 from their own" in err
    ), err


def test_a_rank_lost_with_its_buddy_restores_nothing_and_says_so(snap, never_failed, settle, capfd):
    results = snap(37, (0, 2))  # each the other's buddy
    assert {r["restored"] for r in results} == {None}  # the loop starts over: its own fallback
    _same(results, never_failed)
    err = capfd.readouterr().err
    assert "every copy of the snapshots of rank(s) 0, 2 is lost" in err, err
    assert "load your own checkpoint" in err


def test_two_jobs_at_once_each_restore_their_own_snapshots(cluster, released, settle):
    """Two 2-rank jobs of the same function run at once, each losing a rank: each restores
    its own step from its own ranks' copies (each job has its own secret and keepers), and
    both end with the same weights, each resumed from another step."""
    first = distribute(train, num_replicas=2, replicas_per_node=1, max_restarts=1, name="snapa")
    second = distribute(train, num_replicas=2, replicas_per_node=1, max_restarts=1, name="snapb")
    try:
        jobs = [first.submit(37, (1,)), second.submit(23, (0,))]
        results = [job.result(timeout=180) for job in jobs]
    finally:
        first.shutdown()
        second.shutdown()
    assert [r["restored"] for r in results[0]] == [(29, 30, "own"), (29, 30, "rank 0")]
    assert [r["restored"] for r in results[1]] == [(19, 20, "rank 1"), (19, 20, "own")]
    _same(results[0], [r["weights"] for r in results[1]])
    wait_resources_back()


def test_a_rank_killed_in_the_middle_of_a_snapshot_costs_one_interval(
    cluster, never_failed, released, settle, tmp_path
):
    paused = tmp_path / "paused"
    fn = distribute(
        train,
        num_replicas=4,
        replicas_per_node=2,
        max_restarts=1,
        name="snap",
        env={snapshot.PAUSE_VAR: f"19:1:{paused}"},
    )
    try:
        job = fn.submit(-1, ())
        deadline = time.monotonic() + 120
        while not paused.exists() or not paused.read_text():
            assert time.monotonic() < deadline and not job.done(), "the hook never paused"
            time.sleep(0.05)
        os.kill(int(paused.read_text()), signal.SIGKILL)
        results = job.result(timeout=180)
    finally:
        fn.shutdown()
    # Half of rank 1's copy of step 19 had reached rank 3: the step before it, on every rank.
    assert [r["restored"] for r in results] == [
        (9, 10, "own"),
        (9, 10, "rank 3"),
        (9, 10, "own"),
        (9, 10, "own"),
    ]
    _same(results, never_failed)
    wait_resources_back()


def test_a_restart_before_the_first_snapshot_has_nothing_to_restore(
    cluster, released, settle, capfd
):
    fn = distribute(train, num_replicas=2, replicas_per_node=1, max_restarts=1, name="snap")
    try:
        results = fn(3, (1,))
    finally:
        fn.shutdown()
    assert {r["restored"] for r in results} == {None}
    assert "nothing to restore: no rank holds a snapshot" in capfd.readouterr().err
    wait_resources_back()


@pytest.mark.usefixtures("released", "settle")
def test_a_lost_node_s_ranks_resume_on_the_node_added_from_their_buddies_copies(
    cluster, never_failed, tmp_path, capfd
):
    """Ranks 2-3's node is lost at step 37; Ray places their bundle on the node added
    first; they restore step 29 from ranks 0-1's copies, ranks 0-1 from their own, kept."""
    cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
    cluster.wait_for_nodes()
    held = tmp_path / "held"
    fn = distribute(train, num_replicas=4, replicas_per_node=2, max_restarts=1, name="snap")
    try:
        first = fn(-1, ())
        job = fn.submit(37, (2,), str(held))
        deadline = time.monotonic() + 120
        while not held.exists() or not held.read_text():
            assert time.monotonic() < deadline and not job.done(), "rank 2 never held"
            time.sleep(0.05)
        lost = held.read_text()
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
        cluster.remove_node(victim, allow_graceful=False)
        results = job.result(timeout=180)
    finally:
        fn.shutdown()
    assert job.status().restarts == 1
    assert "its node left the Ray cluster" in job.status().failed_attempts[0]
    assert [r["restored"] for r in results] == [
        (29, 30, "own"),
        (29, 30, "own"),
        (29, 30, "rank 0"),
        (29, 30, "rank 1"),
    ]
    assert [r["pid"] == p["pid"] for r, p in zip(results, first, strict=True)] == [
        True,
        True,
        False,
        False,  # the survivors' processes kept
    ]
    assert {r["node"] for r in first[2:]} == {lost}
    assert lost not in {r["node"] for r in results}
    assert results[2]["node"] == results[3]["node"] != results[0]["node"]
    _same(results, never_failed)
    err = capfd.readouterr().err
    assert "restart 1: rank(s) 2-3 in new processes; rank(s) 0-1 kept" in err, err
    assert (
        "[snapshot] restored step 29 from memory: rank 2 from rank 0's copy; rank 3 from "
        "rank 1's copy; rank(s) 0, 1 from their own" in err
    ), err
    wait_resources_back()  # the session's cluster: 2 nodes again, the added one in place


def test_a_lost_node_with_no_node_to_take_its_place_fails_after_placement_timeout(
    cluster, released, settle, tmp_path
):
    held = tmp_path / "held"
    fn = distribute(
        train,
        num_replicas=4,
        replicas_per_node=2,
        max_restarts=1,
        name="snapt",
        placement_timeout=2,
    )
    try:
        job = fn.submit(37, (2,), str(held))
        deadline = time.monotonic() + 120
        while not held.exists() or not held.read_text():
            assert time.monotonic() < deadline and not job.done(), "rank 2 never held"
            time.sleep(0.05)
        victim = next(n for n in cluster.list_all_nodes() if n.node_id == held.read_text())
        cluster.remove_node(victim, allow_graceful=False)
        with pytest.raises(PlacementTimeoutError) as raised:
            job.result(timeout=120)
    finally:
        fn.shutdown()
        cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)  # the session's 2
        cluster.wait_for_nodes()
    message = str(raised.value)
    assert "snapt's rank(s) 2-3 lost their node" in message, message
    assert "within placement_timeout=2 s" in message and "Add a node" in message, message
    assert "its node left the Ray cluster" in str(raised.value.earlier_attempts[0])
    wait_resources_back()  # the survivors, waiting in their processes, are gone too


def test_a_detached_job_recovers_where_it_is_supervised(cluster, never_failed, released, capfd):
    """The supervisor in the cluster restarts the job; the ranks restore as for a live call."""
    with distribute(
        train,
        num_replicas=4,
        replicas_per_node=2,
        max_restarts=1,
        name="snapd",
        detach=True,
        address=cluster.address,
    ) as fn:
        job = fn.submit(37, (2,))
        results = job.result(timeout=180)
        assert job.status().restarts == 1
        job.release()
    assert [r["restored"] for r in results] == [
        (29, 30, "own"),
        (29, 30, "own"),
        (29, 30, "rank 0"),
        (29, 30, "own"),
    ]
    _same(results, never_failed)
    assert "[snapshot] restored step 29 from memory: rank 2 from rank 0's copy" in (
        capfd.readouterr().err
    )
    wait_resources_back(timeout=30)
