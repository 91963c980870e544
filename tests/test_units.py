"""Fast tests of the pure parts: rank layout, environment, errors, validation. No Ray."""

from __future__ import annotations

import importlib
import os
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

import orchestrator
from orchestrator import (
    ConfigError,
    DistributedError,
    PlacementError,
    distribute,
    errors,
    placement,
    shipping,
)
from orchestrator_workers import environment, sharing
from orchestrator_workers.protocol import RankFailure, RankSpec


def test_public_api_is_small_and_stable():
    assert sorted(orchestrator.__all__) == [
        "BusyError",
        "CallOptions",
        "ClusterUnreachableError",
        "ConfigError",
        "DistributedError",
        "DistributedFunction",
        "Job",
        "JobStatus",
        "JobTimeoutError",
        "OrchestratorError",
        "PlacementError",
        "PlacementTimeoutError",
        "RankFailure",
        "RankStatus",
        "default_log_dir",
        "distribute",
    ]
    # Every public name a user's type checker can follow: a typed package (py.typed).
    for package in ("orchestrator", "orchestrator_workers"):
        assert (Path(importlib.import_module(package).__file__).parent / "py.typed").exists()


def test_layout_is_contiguous_per_node():
    slots = placement.layout(6, 3)
    assert [(s.rank, s.node_rank, s.local_rank) for s in slots] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2),
    ]


def test_bundles_ordered_with_driver_node_first():
    assert placement.order_bundles({0: "b", 1: "a", 2: "c"}, "a") == [1, 0, 2]
    assert placement.order_bundles({0: "b", 1: "c"}, "elsewhere") == [0, 1]


def test_default_replicas_per_node_follows_gpus():
    nodes = [{"GPU": 8.0}, {"GPU": 8.0}]
    assert placement.default_replicas_per_node(16, 1, nodes) == 8
    assert placement.default_replicas_per_node(12, 1, nodes) == 6  # largest divisor that fits
    assert placement.default_replicas_per_node(4, 2, nodes) == 4
    assert placement.default_replicas_per_node(4, 0, [{"CPU": 2.0}]) == 4  # CPU-only: one node


def test_request_bundle_scales_per_node():
    req = placement.Request(4, 2, cpus_per_replica=1, gpus_per_replica=1,
                            resources_per_replica={"nvlink": 1})
    assert req.num_nodes == 2
    assert req.per_replica() == {"CPU": 1, "GPU": 1, "nvlink": 1}
    assert req.bundle() == {"CPU": 2, "GPU": 2, "nvlink": 2}


def test_infeasible_request_lists_the_nodes_and_what_is_valid():
    req = placement.Request(6, 3, cpus_per_replica=1, gpus_per_replica=1)
    nodes = [("10.0.0.1", {"CPU": 8.0, "GPU": 2.0}), ("10.0.0.2", {"CPU": 8.0, "GPU": 2.0})]
    with pytest.raises(PlacementError) as info:
        placement.check_feasible(req, nodes, one_node=False)
    text = str(info.value)
    assert "10.0.0.1: {CPU: 8, GPU: 2}" in text
    assert "10.0.0.2: {CPU: 8, GPU: 2}" in text
    assert "replicas_per_node <= 2" in text
    placement.check_feasible(placement.Request(4, 2, 1, 1), nodes, one_node=False)


def test_simulated_nodes_must_fit_on_one_node():
    nodes = [("127.0.0.1", {"CPU": 4.0})]
    placement.check_feasible(placement.Request(4, 2, 1, 0), nodes, one_node=True)
    with pytest.raises(PlacementError, match="simulated"):
        placement.check_feasible(placement.Request(8, 2, 1, 0), nodes, one_node=True)


def _spec(**kw):
    base = dict(job_name="j", rank=3, local_rank=1, node_rank=1, world_size=4,
                local_world_size=2, num_nodes=2, master_addr="10.1.2.3", master_port=29500,
                ranks_on_node=2)
    base.update(kw)
    return RankSpec(**base)


def test_rank_env_matches_torchrun():
    env = environment.rank_env(_spec(interface="eth7", cuda_visible_devices=("4", "6")))
    assert env["RANK"] == "3"
    assert env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.1.2.3"
    assert env["MASTER_PORT"] == "29500"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth7"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_threads_follow_torchrun_unless_the_rank_reserved_more_cpus():
    cores = environment.physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    # Several ranks on a node: one thread each (torchrun), or the CPUs each reserved.
    assert environment.default_threads(_spec(ranks_on_node=2)) == 1
    assert environment.default_threads(_spec(ranks_on_node=2, cpus=4)) == 4
    assert environment.default_threads(_spec(ranks_on_node=2, cpus=0.5)) == 1
    # Alone on its node: torch's own default, one per physical core (more if reserved).
    assert environment.default_threads(_spec(ranks_on_node=1)) == cores
    assert environment.default_threads(_spec(ranks_on_node=1, cpus=cores + 3)) == cores + 3
    assert environment.rank_env(_spec(ranks_on_node=1))["OMP_NUM_THREADS"] == str(cores)


def test_user_env_wins_over_defaults():
    env = environment.rank_env(
        _spec(interface="eth0", env={"OMP_NUM_THREADS": "8", "GLOO_SOCKET_IFNAME": "ib0"})
    )
    assert env["OMP_NUM_THREADS"] == "8"
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_devices_put_each_local_rank_first_gpu_at_its_index():
    assert environment.order_devices([("3",), ("1",)]) == ("3", "1")
    assert environment.order_devices([("0", "1"), ("2", "3")]) == ("0", "2", "1", "3")
    assert environment.order_devices([(), ()]) == ()


def test_interface_for_loopback():
    assert environment.interface_for_ip("127.0.0.1") == "lo"
    assert environment.interface_for_ip("203.0.113.254") is None


def _failure(rank, when, exc, message=None):
    return RankFailure(
        rank=rank, local_rank=rank % 2, node_ip="10.0.0.1", hostname="h", pid=100 + rank,
        time=when, exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=message or str(exc), traceback=f'  File "train.py", line 7\n{exc!r}\n',
        exception=cloudpickle.dumps(exc),
    )


def test_secondary_errors_are_not_the_root_cause():
    peer = _failure(0, 1.0, RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:123"))
    root = _failure(3, 2.0, ValueError("boom"))
    err = errors.distributed_error([peer, root])
    assert err.root_cause.rank == 3
    assert [f.rank for f in err.failures] == [3, 0]
    assert isinstance(err, ValueError)
    assert isinstance(err, DistributedError)
    text = str(err)
    assert text.startswith("rank 3 (local rank 1) on 10.0.0.1 (host h, pid 103) raised ValueError")
    assert "1 other rank(s) failed after it" in text
    assert "rank 0" in text.split("failed after it")[1]


def test_earliest_failure_is_the_root_cause():
    first = _failure(1, 1.0, KeyError("k"))
    later = _failure(2, 5.0, ValueError("v"))
    err = errors.distributed_error([later, first])
    assert err.root_cause.rank == 1
    assert isinstance(err, KeyError)
    with pytest.raises(KeyError):
        raise err


def test_unpicklable_exception_type_still_gives_distributed_error():
    failure = _failure(0, 1.0, ValueError("x"))
    failure = RankFailure(**{**failure.__dict__, "exception": b"garbage"})
    err = errors.distributed_error([failure])
    assert type(err) is DistributedError
    assert "raised ValueError: x" in str(err)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_replicas": 0}, "num_replicas=0: must be an int >= 1"),
        ({"num_replicas": 2.5}, "num_replicas=2.5"),
        ({"num_replicas": 4, "replicas_per_node": 3},
         "replicas_per_node=3 does not divide num_replicas=4; valid: 1, 2, 4"),
        ({"num_replicas": 4, "replicas_per_node": 0}, "replicas_per_node=0"),
        ({"num_replicas": 2, "cpus_per_replica": -1}, "cpus_per_replica=-1"),
        ({"num_replicas": 2, "resources_per_replica": {"GPU": 1}}, "use gpus_per_replica"),
        ({"num_replicas": 2, "name": "has space"}, "name='has space'"),
        ({"num_replicas": 2, "env": {"A": 1}}, "env['A']=1"),
        ({"num_replicas": 2, "cpus_per_replica": float("nan")}, "cpus_per_replica=nan"),
        ({"num_replicas": 2, "gpus_per_replica": float("inf")}, "gpus_per_replica=inf"),
        ({"num_replicas": 2, "timeout": float("inf")}, "timeout=inf"),
        ({"num_replicas": 2, "log_dir": 123}, "log_dir=123: must be True"),
        # A huge count: a few divisors, found at once, in a short message.
        ({"num_replicas": 10**12, "replicas_per_node": 7},
         "valid: 1, 2, 4, 5, 8, 10, 16, ... 1000000000000 (169 in all)"),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_valid(kwargs, fragment):
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        distribute(len, **kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert time.monotonic() - started < 1


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        distribute("not a function", num_replicas=0, name="")  # type: ignore[arg-type]
    text = str(info.value)
    assert "is not callable" in text
    assert "num_replicas=0" in text
    assert "name=''" in text


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
    assert shipping.is_local(__import__("tests.test_units").test_units)
    assert not shipping.is_local(os)
    assert not shipping.is_local(pytest)
    assert not shipping.is_local(orchestrator)


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


def test_files_ranks_leave_go_in_a_folder_of_this_user_alone(tmp_path, monkeypatch):
    import stat

    from orchestrator_workers import private, tail

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = private.folder()
    assert folder == tmp_path / "orchestrator"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert tail.tail_path(42) == folder / "tail-42.json"
    folder.chmod(0o777)  # others may write there now: plant, read or redirect files
    with pytest.raises(private.UnsafeFolderError, match="not this user's private folder"):
        private.folder()
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder.symlink_to(elsewhere)  # a planted link
    with pytest.raises(private.UnsafeFolderError):
        private.folder()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert private.folder().name == f"orchestrator-{os.getuid()}"  # in the temp dir


def test_distribute_s_keywords_are_the_options_dataclass():
    """Options is the one definition: distribute() spells out the same names, defaults
    and types for editors and type checkers, and with_options takes the per-call ones."""
    import dataclasses
    import inspect

    from orchestrator.options import PER_CALL, Options

    params = inspect.signature(distribute).parameters
    fields = {f.name: f for f in dataclasses.fields(Options)}
    assert list(params)[1:] == list(fields)
    for name, field in fields.items():
        param = params[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert param.default == default, name
        assert param.annotation == field.type, name
    assert set(fields) >= PER_CALL


def test_driver_messages_go_through_logging(capsys):
    """Shown on stderr by default; silenced or redirected with standard logging."""
    import logging

    from orchestrator import messages

    log = logging.getLogger("orchestrator")
    messages.say("hello")
    messages.warn("careful", job="train")
    assert capsys.readouterr().err == "[orchestrator] hello\n[train] careful\n"
    level = log.level
    assert level == logging.INFO  # shown by default, whatever the root logger's level
    log.setLevel(logging.ERROR)
    try:
        messages.say("hidden")
        messages.warn("hidden too")
        assert capsys.readouterr().err == ""
    finally:
        log.setLevel(level)
    caught: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    saved = log.handlers[:]
    log.handlers[:] = [Keep()]
    try:
        messages.say("elsewhere", job="train")
    finally:
        log.handlers[:] = saved
    assert caught == ["[train] elsewhere"] and capsys.readouterr().err == ""
    # An application that set up logging owns them: its handler, its levels, shown once.
    root = logging.getLogger()
    keep, level = Keep(), root.level
    root.addHandler(keep)
    root.setLevel(logging.INFO)
    try:
        messages.say("through the app", job="train")
        log.setLevel(logging.WARNING)  # the application's choice for our logger
        messages.say("below the level it set")
        messages.warn("a warning")
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
        log.setLevel(logging.INFO)
    assert caught[1:] == ["[train] through the app", "[orchestrator] a warning"]
    assert capsys.readouterr().err == ""


def test_status_line_of_a_quiet_call(capsys, monkeypatch):
    """Shown after 10 s of a call and 10 s without output: printed at most once a minute,
    or redrawn in place on a terminal; ORCHESTRATOR_STATUS=0 or logging turn it off."""
    import logging

    from orchestrator import messages, status

    line = status.StatusLine("train", 4, started=100.0)
    line._in_place = False
    assert line.tick(105.0, last_output=100.0) == 110.0  # not yet: the call is young
    assert line.tick(135.0, last_output=130.0) == 140.0  # not yet: output 5 s ago
    assert capsys.readouterr().err == ""
    assert line.tick(142.0, last_output=130.0) == 202.0
    assert capsys.readouterr().err == "[train] 4 ranks running 0:42; last output 0:12 ago\n"
    assert line.tick(150.0, last_output=130.0) == 202.0  # at most once a minute
    line.tick(203.0, last_output=130.0)
    assert capsys.readouterr().err == "[train] 4 ranks running 1:43; last output 1:13 ago\n"
    drawn = status.StatusLine("train", 2, started=0.0)
    drawn._in_place = True
    assert drawn.tick(12.0, last_output=0.0) == 13.0  # redrawn every second
    drawn.tick(13.0, last_output=0.0)
    messages.clear_in_place()  # before other output
    assert capsys.readouterr().err == (
        "\r\x1b[K[train] 2 ranks running 0:12; last output 0:12 ago"
        "\r\x1b[K[train] 2 ranks running 0:13; last output 0:13 ago\r\x1b[K"
    )
    # Under an application's handler (or pytest's), never redrawn: a new line each time
    # would flood its log, so at most once a minute.
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    root, keep, level = logging.getLogger(), Keep(), logging.getLogger().level
    root.addHandler(keep)
    root.setLevel(logging.INFO)
    try:
        handled = status.StatusLine("train", 2, started=0.0)
        handled._in_place = True  # a terminal, yet an application's handler
        assert handled.tick(12.0, last_output=0.0) == 72.0
        assert handled.tick(13.0, last_output=0.0) == 72.0
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
    assert lines == ["[train] 2 ranks running 0:12; last output 0:12 ago"]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ORCHESTRATOR_STATUS", "0")
    assert status.StatusLine("train", 4, started=0.0).tick(500.0, last_output=0.0) is None
    monkeypatch.delenv("ORCHESTRATOR_STATUS")
    quiet = logging.getLogger("orchestrator.status")
    quiet.setLevel(logging.WARNING)
    try:
        status.StatusLine("train", 4, started=0.0).tick(500.0, last_output=0.0)
    finally:
        quiet.setLevel(logging.NOTSET)
    assert capsys.readouterr().err == ""
