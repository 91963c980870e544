"""What a call sends its ranks: the function's current code, its closure and arguments (what
cannot be pickled named at once), and big tensors, once per node through /dev/shm, whose
files are removed after."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

import orchestrator
from orchestrator import ConfigError, DistributedError, distribute, shipping, testing
from orchestrator_workers import sharing

# --- without Ray ---------------------------------------------------------------------------


def test_unpicklable_closure_is_named_before_anything_starts():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(ConfigError) as info:
        distribute(train, num_replicas=2)
    assert "closure variable 'lock'" in str(info.value)
    assert "_thread.lock" in str(info.value)


def test_unpicklable_argument_is_named():
    with pytest.raises(ConfigError, match="argument 'handle'"):
        shipping.payload(len, (), {"handle": threading.Lock()})


def _old_version():
    return "old"


def test_current_finds_the_redefined_function():
    original = _old_version
    globals()["_old_version"] = lambda: "new"
    try:
        assert shipping.current(original) is original  # a lambda is not the same function

        def _old_version_new():
            return "new"

        _old_version_new.__qualname__ = original.__qualname__
        _old_version_new.__module__ = original.__module__
        globals()["_old_version"] = _old_version_new
        assert shipping.current(original) is _old_version_new
    finally:
        globals()["_old_version"] = original


def test_local_modules_ship_by_value_installed_ones_by_reference():
    assert shipping.is_local(__import__("tests.test_shipping").test_shipping)
    assert not shipping.is_local(os)
    assert not shipping.is_local(pytest)
    assert not shipping.is_local(orchestrator)


def test_a_module_file_is_judged_where_its_links_lead(tmp_path):
    """A link to an installed file is installed; a file in a folder reached through a link
    to the installed packages' folder is too; a plain local file is local."""
    installed = Path(pytest.__file__)
    (tmp_path / "mine.py").write_text("")
    (tmp_path / "linked.py").symlink_to(installed)
    (tmp_path / "site").symlink_to(installed.parent, target_is_directory=True)
    assert shipping._local_file(str(tmp_path / "mine.py"))
    assert not shipping._local_file(str(tmp_path / "linked.py"))
    assert not shipping._local_file(str(tmp_path / "site" / installed.name))
    assert shipping._local_file(str(tmp_path / "not-there.py"))  # as Path.resolve says


def _ship_and_load(value: object, readers: int, key: str) -> list[object]:
    """`value` pickled as the driver does, then loaded `readers` times as ranks on one node."""
    data = shipping.payload(lambda: value, (), {})
    loaded = []
    for _ in range(readers):
        buffers = sharing.private_buffers(data.buffers, data.readonly, key, readers)
        fn, _, _ = cloudpickle.loads(data.call, buffers=buffers)
        loaded.append(fn())
    return loaded


def _leftovers(key: str) -> list[str]:
    return [p.name for p in sharing.SHM.glob(f"{sharing.PREFIX}{key}*")]


@pytest.mark.skipif(not sharing.SHM.is_dir(), reason="no /dev/shm on this system")
def test_big_tensors_go_out_of_band_once_per_node_and_copy_on_write():
    import numpy as np
    import torch

    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB: out of band
    frozen = np.ones(1 << 18)  # 2 MB
    frozen.flags.writeable = False
    value = {
        "big": big,
        "view": big[10:20],
        "bits": big.view(torch.int32),  # another dtype over the same bytes
        "frozen": frozen,
        "small": torch.ones(8),
    }
    data = shipping.payload(lambda: value, (), {})
    assert [b.raw().nbytes for b in data.buffers] == [4 << 20, 2 << 20]  # the view shares
    assert data.readonly == (False, True)
    assert len(data.call) < 10_000  # the bytes themselves are not in the pickle

    key = f"test-{os.getpid()}"
    ranks = _ship_and_load(value, readers=3, key=key)
    assert _leftovers(key) == []  # the third reader removed the name
    for copy in ranks:
        assert torch.equal(copy["big"], big) and torch.equal(copy["small"], torch.ones(8))
        where = copy["big"].untyped_storage().data_ptr()
        assert copy["view"].untyped_storage().data_ptr() == where
        assert copy["bits"].untyped_storage().data_ptr() == where
        assert not copy["frozen"].flags.writeable
    ranks[0]["big"][0] = -1.0  # copy-on-write: the other readers' pages are untouched
    ranks[1]["view"][0] = -2.0
    assert float(ranks[0]["big"][0]) == -1.0 and float(ranks[2]["big"][0]) == 0.0
    assert float(ranks[1]["big"][10]) == -2.0 and float(ranks[2]["big"][10]) == 10.0
    assert float(big[0]) == 0.0 and float(big[10]) == 10.0


@pytest.mark.skipif(not sharing.SHM.is_dir(), reason="no /dev/shm on this system")
def test_shared_copy_falls_back_to_private_copies_and_removes_stale_files(monkeypatch):
    import torch

    stale = sharing.SHM / f"{sharing.PREFIX}test-stale-{os.getpid()}"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    big = torch.arange(1 << 19, dtype=torch.float64)
    monkeypatch.setattr(sharing, "_MIN_LEFT", 1 << 60)  # as if /dev/shm were full
    key = f"test-full-{os.getpid()}"
    ranks = _ship_and_load(big, readers=2, key=key)
    assert all(torch.equal(copy, big) for copy in ranks)
    ranks[0][0] = 5.0
    assert float(ranks[1][0]) == 0.0
    assert _leftovers(key) == [] and not stale.exists()
    assert _ship_and_load(big, readers=1, key=key)[0].sum() == big.sum()  # alone: own copy
    assert _leftovers(key) == []
    # After a failed call, the driver removes that call's files, and only those.
    mine, other = (sharing.SHM / f"{sharing.PREFIX}{k}-{os.getpid()}-n" for k in ("t1", "t2"))
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    sharing.remove("t1")
    assert not mine.exists() and other.exists()
    other.unlink()


# --- on the session's two-node cluster ----------------------------------------------------


def test_edited_local_module_runs_new_code_on_the_warm_pool(cluster, tmp_path, monkeypatch):
    module = tmp_path / "edited_mod.py"
    module.write_text("def version():\n    return 'v1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("edited_mod")
    with distribute(mod.version, num_replicas=2, replicas_per_node=1) as fn:
        assert fn() == ["v1", "v1"]
        pids = fn.pids()
        module.write_text(
            textwrap.dedent("""\
            def helper():
                return 'v2'

            def version():
                return helper()
        """)
        )
        importlib.reload(mod)
        assert fn() == ["v2", "v2"]
        assert fn.pids() == pids
    sys.modules.pop("edited_mod", None)


def test_large_closure_travels_through_the_object_store(cluster):
    import torch

    weights = torch.arange(1_000_000, dtype=torch.float64)  # 8 MB: put once, read in place

    def total() -> float:
        weights.add_(1)  # each rank gets its own writable copy
        return float(weights.sum())

    with distribute(total, num_replicas=2, replicas_per_node=1) as fn:
        expected = float(torch.arange(1_000_000, dtype=torch.float64).sum() + 1_000_000)
        assert fn() == [expected, expected]
        assert fn() == [expected, expected]  # the driver's tensor is untouched


def test_a_small_call_reaches_a_node_s_ranks_through_its_first_rank(cluster):
    """One Ray task per node (see handoff): each rank runs a small call in its door's
    thread, named "rank"; a large payload goes to each rank in a Ray task of its own."""
    padding = b"x" * (1 << 20)  # over the inline limit: through the object store

    def thread() -> str:
        return threading.current_thread().name

    with distribute(thread, num_replicas=4, replicas_per_node=2) as fn:
        assert fn() == ["rank"] * 4

    def thread_with_padding() -> str:
        assert len(padding) == 1 << 20
        return threading.current_thread().name

    with distribute(thread_with_padding, num_replicas=2, replicas_per_node=2) as fn:
        assert "rank" not in fn()


def test_large_results_and_small_ones_come_back_in_rank_order(cluster):
    """A small call is handed to a node's ranks by its first rank (see handoff), which
    brings their outcomes back; a large outcome is fetched from its own rank instead."""

    def result(big_ranks: tuple[int, ...]) -> bytes:
        rank = int(os.environ["RANK"])
        return bytes([rank]) * ((3 << 20) if rank in big_ranks else 10)

    with distribute(result, num_replicas=4, replicas_per_node=2) as fn:
        for big in [(), (1,), (0, 2, 3)]:
            values = fn(big)
            assert [len(v) for v in values] == [(3 << 20) if r in big else 10 for r in range(4)]
            assert [v[:1] for v in values] == [bytes([r]) for r in range(4)]


def test_big_tensors_shared_per_node_until_written_and_snapshotted_at_submit(cluster):
    import torch
    import torch.distributed as dist

    from orchestrator_workers import sharing

    table = torch.arange(1 << 20, dtype=torch.float64)  # 8 MB in the closure

    def write_then_read(step: torch.Tensor) -> dict:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        with open("/proc/self/maps") as maps:
            mapped = "orchestrator-buffers" in maps.read()
        untouched = float(table[rank]) == rank and float(step[1]) == 1.0
        table[rank] = -1.0  # in place: must not reach the other ranks of this node
        dist.barrier()
        others = [float(table[r]) for r in range(4) if r != rank]
        dist.destroy_process_group()
        return {"mapped": mapped, "untouched": untouched, "others": others}

    with distribute(write_then_read, num_replicas=4, replicas_per_node=2) as fn:
        step = torch.arange(1 << 19, dtype=torch.float64)  # 4 MB argument
        job = fn.submit(step)
        step.fill_(-5.0)  # after submit: the ranks still get what was submitted
        results = job.result(timeout=120)
    assert [r["mapped"] for r in results] == [True] * 4  # one copy per node, mapped
    assert [r["untouched"] for r in results] == [True] * 4
    assert all(r["others"] == [float(x) for x in range(4) if x != i] for i, r in enumerate(results))
    assert float(table[0]) == 0.0
    assert list(sharing.SHM.glob(f"{sharing.PREFIX}*")) == []


def test_a_failed_call_removes_what_its_ranks_left_in_shm(cluster, tmp_path):
    import torch

    from orchestrator_workers import sharing

    table = torch.ones(1 << 20)  # 4 MB: shared through /dev/shm by the two ranks
    go = tmp_path / "go"

    def fail_when_told() -> None:
        while not go.exists():
            time.sleep(0.05)
        if os.environ["RANK"] == "1":
            raise ValueError(f"rank 1 fails ({float(table.sum()):g})")
        time.sleep(60)  # rank 0 is stopped with the pool

    with distribute(fail_when_told, num_replicas=2, replicas_per_node=2) as fn:
        job = fn.submit()
        deadline = time.monotonic() + 60
        while testing.view(job) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # As a rank killed before it counted itself would leave it:
        key = testing.view(job).key
        left = sharing.SHM / f"{sharing.PREFIX}{key}-lost"
        left.write_bytes(b"x")
        go.touch()
        with pytest.raises(DistributedError, match="rank 1 fails"):
            job.result(timeout=60)
    deadline = time.monotonic() + 15
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left.exists()
    assert list(sharing.SHM.glob(f"{sharing.PREFIX}{key}*")) == []
