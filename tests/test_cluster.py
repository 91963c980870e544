"""distribute() on a real two-node Ray cluster (logical GPUs), with real gloo rendezvous."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from orchestrator import DistributedError, JobTimeoutError, PlacementError, distribute
from orchestrator.errors import is_secondary
from tests.conftest import GPUS_PER_NODE, sigint_raises, wait_resources_back


def _report(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says {tag}")
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
            "OMP_NUM_THREADS", "EXTRA")
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]],
        "pid": os.getpid(),
        "sum": total.item(),
    }


def test_ranks_laid_out_by_node_with_torchrun_environment(cluster, capfd):
    with distribute(_report, num_replicas=4, replicas_per_node=2, env={"EXTRA": "x"}) as fn:
        first = fn("hello")
        second = fn("again")
        assert fn.pids() == [r["pid"] for r in first]
    out = capfd.readouterr().out

    assert [r["sum"] for r in first] == [6.0] * 4
    assert [r["env"]["RANK"] for r in first] == ["0", "1", "2", "3"]
    assert [r["env"]["LOCAL_RANK"] for r in first] == ["0", "1", "0", "1"]
    assert [r["env"]["NODE_RANK"] for r in first] == ["0", "0", "1", "1"]
    assert all(r["env"]["GROUP_RANK"] == r["env"]["NODE_RANK"] for r in first)
    assert {r["env"]["WORLD_SIZE"] for r in first} == {"4"}
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in first} == {"2"}
    assert {r["env"]["EXTRA"] for r in first} == {"x"}
    assert {r["env"]["OMP_NUM_THREADS"] for r in first} == {"1"}
    assert all(r["env"]["GLOO_SOCKET_IFNAME"] for r in first)

    # Two ranks per node, contiguous, and rank 0 on the driver's node.
    assert first[0]["node"] == first[1]["node"] != first[2]["node"] == first[3]["node"]
    assert first[0]["node"] == ray.get_runtime_context().get_node_id()
    master = {r["env"]["MASTER_ADDR"] for r in first}
    assert master == {ray.util.get_node_ip_address()}

    # Each node's ranks see all the node's GPUs of the job, their own at LOCAL_RANK.
    for r in first:
        visible = r["env"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == GPUS_PER_NODE
        assert visible[int(r["env"]["LOCAL_RANK"])] == r["gpus"][0]

    # The warm call reuses the same processes and picks a new port.
    assert [r["pid"] for r in second] == [r["pid"] for r in first]
    assert second[0]["env"]["MASTER_PORT"] != first[0]["env"]["MASTER_PORT"]
    assert [r["sum"] for r in second] == [6.0] * 4

    for rank in range(4):
        assert f"[report r{rank}] rank {rank} says hello" in out
        assert f"[report r{rank}] rank {rank} says again" in out
    wait_resources_back()


def test_gpus_per_replica_defaults_to_one_on_a_gpu_cluster(cluster):
    with distribute(lambda: os.environ["CUDA_VISIBLE_DEVICES"], num_replicas=2) as fn:
        # replicas_per_node=None: as many as a node has GPUs.
        assert fn() == ["0,1", "0,1"] or sorted(fn()[0].split(",")) == ["0", "1"]
    wait_resources_back()


def test_results_in_rank_order_even_when_ranks_finish_out_of_order(cluster):
    def slow_low_ranks() -> int:
        rank = int(os.environ["RANK"])
        time.sleep(0.3 * (3 - rank))
        return rank * 10

    with distribute(slow_low_ranks, num_replicas=4, replicas_per_node=2) as fn:
        assert fn() == [0, 10, 20, 30]


def test_infeasible_request_fails_fast_with_the_cluster_resources(cluster):
    started = time.monotonic()
    fn = distribute(lambda: 0, num_replicas=6, replicas_per_node=3, gpus_per_replica=1)
    with pytest.raises(PlacementError) as info:
        fn()
    assert time.monotonic() - started < 10
    text = str(info.value)
    assert "GPU: 2" in text
    assert "replicas_per_node <= 2" in text
    wait_resources_back()


def _raise_on_rank_2() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 2:
        print("rank 2 about to fail")
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


def test_rank_exception_raised_at_once_and_pool_recovers(cluster, capfd):
    fn = distribute(_raise_on_rank_2, num_replicas=4, replicas_per_node=2)
    started = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        fn()
    assert time.monotonic() - started < 30
    err = info.value
    assert isinstance(err, DistributedError)
    assert err.root_cause.rank == 2
    assert 'raise ValueError("boom")' in str(err)
    assert str(err).startswith("rank 2 (local rank 0)")
    assert "[raise_on_rank_2 r2] rank 2 about to fail" in capfd.readouterr().out
    # The peers' errors caused by rank 2 leaving are listed after it, never as the cause.
    assert err.failures[0].rank == 2
    secondary = err.failures[1:]
    # gloo says "Connection closed by peer" or "Connection reset by peer", by timing.
    assert secondary and all(is_secondary(f) for f in secondary), secondary
    assert "other rank(s) failed after it" in str(err)

    # The same function works again: the stuck pool was replaced.
    fn.fn = lambda: int(os.environ["RANK"])
    assert fn() == [0, 1, 2, 3]
    fn.shutdown()
    wait_resources_back()


def _lock_on_rank_1():
    import threading

    return threading.Lock() if os.environ["RANK"] == "1" else int(os.environ["RANK"])


def test_a_value_that_cannot_be_pickled_is_that_ranks_failure(cluster):
    fn = distribute(_lock_on_rank_1, num_replicas=2, replicas_per_node=1)
    with pytest.raises(DistributedError) as info:
        fn()
    assert info.value.root_cause.rank == 1
    assert "cannot be sent to the driver" in str(info.value)
    assert "lock" in str(info.value)  # the pickling error names the type
    fn.fn = lambda: int(os.environ["RANK"])
    assert fn() == [0, 1]
    fn.shutdown()
    wait_resources_back()


@pytest.mark.parametrize("how", ["exit", "kill", "segfault"])
def test_crashed_rank_is_reported_as_a_crash(cluster, capfd, how):
    def die_on_rank_1(how: str) -> int:
        if os.environ["RANK"] == "1":
            print("last words of rank 1")
            if how == "exit":
                os._exit(3)
            if how == "segfault":
                import ctypes

                ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        return 0

    fn = distribute(die_on_rank_1, num_replicas=4, replicas_per_node=2)
    fn.fn = lambda how: 0  # start the pool first, so the timing below is the crash's alone
    fn("warm")
    fn.fn = die_on_rank_1
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        fn(how)
    assert time.monotonic() - started < 10
    assert info.value.root_cause.rank == 1
    assert info.value.root_cause.exc_type == "crash"
    text = str(info.value)
    assert text.startswith("rank 1 (local rank 1)")
    time.sleep(1)  # Ray's own notice of the death, if any, arrives by now
    captured = capfd.readouterr()
    assert "last words of rank 1" in captured.out  # shown though it died at once
    if how == "exit":
        assert "crashed: its process called os._exit(3)" in text
    elif how == "segfault":
        assert "crashed: its process died: Segmentation fault" in text
        assert "ctypes.string_at(0)" in captured.err or "in die_on_rank_1" in captured.err
    else:
        assert "killed by a signal" in text
    assert "A worker died" not in captured.out + captured.err  # we report it, Ray need not
    fn.shutdown()
    wait_resources_back()


def test_output_from_every_source_is_captured_with_rank_prefix(cluster, capfd):
    def chatty() -> None:
        import logging
        import subprocess

        rank = os.environ["RANK"]
        print(f"print from {rank}")
        os.write(1, f"fd1 from {rank}\n".encode())
        os.write(2, f"fd2 from {rank}\n".encode())
        logging.getLogger("t").warning("log from %s", rank)
        subprocess.run([sys.executable, "-c", f"print('child of {rank}')"], check=True)

    with distribute(chatty, num_replicas=2, replicas_per_node=1, name="chat") as fn:
        fn()
    captured = capfd.readouterr()
    for rank in range(2):
        assert f"[chat r{rank}] print from {rank}" in captured.out
        assert f"[chat r{rank}] fd1 from {rank}" in captured.out
        assert f"[chat r{rank}] child of {rank}" in captured.out
        assert f"[chat r{rank}] fd2 from {rank}" in captured.err
        assert f"[chat r{rank}] log from {rank}" in captured.err
        assert f"fd2 from {rank}" not in captured.out


def test_edited_local_module_runs_new_code_on_the_warm_pool(cluster, tmp_path, monkeypatch):
    module = tmp_path / "edited_mod.py"
    module.write_text("def version():\n    return 'v1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("edited_mod")
    with distribute(mod.version, num_replicas=2, replicas_per_node=1) as fn:
        assert fn() == ["v1", "v1"]
        pids = fn.pids()
        module.write_text(textwrap.dedent("""\
            def helper():
                return 'v2'

            def version():
                return helper()
        """))
        importlib.reload(mod)
        assert fn() == ["v2", "v2"]
        assert fn.pids() == pids
    sys.modules.pop("edited_mod", None)


def test_shutdown_releases_everything_and_a_new_call_works(cluster):
    fn = distribute(os.getpid, num_replicas=4, replicas_per_node=2)
    first = fn()
    fn.shutdown()
    wait_resources_back()
    second = fn()
    assert set(first).isdisjoint(second)
    fn.shutdown()
    wait_resources_back()


def test_driver_exit_without_shutdown_leaves_nothing_behind(cluster, tmp_path):
    script = tmp_path / "leaky.py"
    script.write_text(textwrap.dedent(f"""\
        import os
        from orchestrator import distribute
        fn = distribute(os.getpid, num_replicas=4, replicas_per_node=2,
                        address={cluster.address!r})
        print(fn())
    """))
    env = {**os.environ, "PYTHONPATH": str(os.path.dirname(os.path.dirname(__file__)))}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    wait_resources_back()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_every_line_arrives_once_in_order_before_the_call_returns(cluster, capfd):
    def flood(n: int) -> int:
        import subprocess

        rank = os.environ["RANK"]
        for i in range(n):
            print(f"line {i} of rank {rank}")
            if i % 1000 == 0:
                os.write(1, f"fd1 {i} of rank {rank}\n".encode())
                os.write(2, f"fd2 {i} of rank {rank}\n".encode())
        sys.stdout.flush()
        subprocess.run([sys.executable, "-c", f"print('child of rank {rank}')"], check=True)
        os.write(2, f"last stderr of rank {rank}".encode())  # no newline: still shown
        return n

    with distribute(flood, num_replicas=4, replicas_per_node=2, name="flood") as fn:
        assert fn(5000) == [5000] * 4
        captured = capfd.readouterr()
    for rank in range(4):
        prefix = f"[flood r{rank}] "
        out = [line[len(prefix) :] for line in captured.out.splitlines() if line.startswith(prefix)]
        err = [line[len(prefix) :] for line in captured.err.splitlines() if line.startswith(prefix)]
        # stdout: the printed lines, exactly once and in order, then the child's line.
        printed = [line for line in out if line.startswith("line ")]
        assert printed == [f"line {i} of rank {rank}" for i in range(5000)]
        assert [line for line in out if line.startswith("fd1 ")] == [
            f"fd1 {i} of rank {rank}" for i in range(0, 5000, 1000)
        ]
        assert out[-1] == f"child of rank {rank}"
        assert len(out) == 5000 + 5 + 1
        # stderr stays stderr.
        assert err == [f"fd2 {i} of rank {rank}" for i in range(0, 5000, 1000)] + [
            f"last stderr of rank {rank}"
        ]


def test_log_ranks_and_per_rank_log_files(cluster, capfd, tmp_path):
    def talk() -> None:
        rank = os.environ["RANK"]
        print(f"hello from {rank}")
        if rank == "1":
            raise RuntimeError("rank 1 gives up")

    fn = distribute(talk, num_replicas=2, replicas_per_node=1, log_ranks=[0], log_dir=tmp_path)
    with pytest.raises(DistributedError) as info:
        fn()
    out = capfd.readouterr().out
    assert "[talk r0] hello from 0" in out
    assert "hello from 1" not in out  # not shown on the console ...
    assert info.value.logs(1) == "hello from 1\n"  # ... but kept
    assert info.value.log_dir == fn.log_dir
    assert fn.log_dir is not None and fn.log_dir.parent == tmp_path / "talk"
    assert fn.logs(0) == "hello from 0\n"
    assert f"{fn.log_dir}/rank-N.log" in str(info.value)
    fn.shutdown()


def _deadlock() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    buf = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.recv(buf, src=1)  # rank 1 never sends
    else:
        dist.barrier()


def test_timeout_shows_where_every_rank_is_blocked(cluster):
    fn = distribute(_deadlock, num_replicas=2, replicas_per_node=1, timeout=60)
    started = time.monotonic()
    with pytest.raises(JobTimeoutError) as info:
        fn.with_options(timeout=5)()
    assert time.monotonic() - started < 15
    err = info.value
    assert isinstance(err, TimeoutError)
    assert "dist.recv(buf, src=1)" in err.stacks[0]
    assert "dist.barrier()" in err.stacks[1]
    text = str(err)
    assert "did not finish within 5 s" in text
    assert text.index("--- rank 0") < text.index("dist.recv") < text.index("--- rank 1")
    # The stuck pool was replaced: the function works again.
    fn.fn = lambda: os.environ["RANK"]
    assert fn() == ["0", "1"]
    fn.shutdown()
    wait_resources_back()


def test_stacks_on_demand_while_a_call_runs(cluster):
    import threading

    def nap() -> None:
        time.sleep(3)

    fn = distribute(nap, num_replicas=2, replicas_per_node=1)
    fn.fn = lambda: None
    fn()  # warm
    fn.fn = nap
    worker = threading.Thread(target=fn)
    worker.start()
    time.sleep(1.5)
    seen = fn.stacks()
    worker.join()
    assert sorted(seen) == [0, 1]
    assert all("time.sleep(3)" in text for text in seen.values())
    fn.shutdown()


def _attach_line(capfd) -> tuple[str, str, int]:
    """(secret, host, port) from the attach line a waiting rank prints."""
    import re

    seen = ""
    deadline = time.monotonic() + 60
    line = r"DEBUG_TOKEN=([0-9a-f]{32}) python -m orchestrator attach ([\d.]+):(\d+)"
    while (match := re.search(line, seen)) is None:
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
        seen += capfd.readouterr().err
    return match.group(1), match.group(2), int(match.group(3))


def _intrude(host: str, port: int) -> None:
    """A port scan (connect, hang up), a wrong secret, and a client that says nothing:
    each is hung up on without one byte of pdb."""
    import socket

    socket.create_connection((host, port), timeout=10).close()
    for hello in (b"0" * 32 + b"\n", b""):  # a guess; and silence until hung up on
        with socket.create_connection((host, port), timeout=30) as conn:
            conn.sendall(hello)
            assert conn.recv(4096) == b""


def _rank_state(job, rank: int, wanted: str) -> None:
    """Wait until job.status() shows rank `rank` in state `wanted` (it comes with the output)."""
    deadline = time.monotonic() + 30
    while (state := job.status().ranks[rank].state) != wanted:
        assert time.monotonic() < deadline, (state, wanted)
        time.sleep(0.1)


def _talk(host: str, port: int, token: str, commands: list[str], on_prompt=None) -> str:
    """Attach with `token` and drive the rank's pdb with `commands`; the transcript."""
    import socket

    def until_prompt(conn: socket.socket) -> bytes:
        data = b""
        while not data.rstrip().endswith(b")"):  # "(Pdb rank N) "
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(token.encode() + b"\n")
        transcript = until_prompt(conn)
        if on_prompt is not None:
            on_prompt()
        for command in commands:
            conn.sendall(command.encode() + b"\n")
            transcript += until_prompt(conn)
        return transcript.decode()


def test_breakpoint_on_one_rank_opens_a_debugger_the_driver_can_attach_to(cluster, capfd):
    def stop_on_rank_1() -> int:
        secret = 6 * 7
        if os.environ["RANK"] == "1":
            breakpoint()
        return secret

    fn = distribute(stop_on_rank_1, num_replicas=2, replicas_per_node=1)
    job = fn.submit()
    token, host, port = _attach_line(capfd)
    _rank_state(job, 1, "waiting for a debugger")
    status = job.status()
    assert status.state == "running" and status.ranks[0].state == "finished", status
    assert "rank 1 waits for a debugger" in str(status), status
    _intrude(host, port)  # the rank keeps waiting for the real client
    assert job.status().ranks[1].state == "waiting for a debugger" and not job.done()
    transcript = _talk(
        host, port, token, ["p secret + 1", "c"],
        on_prompt=lambda: _rank_state(job, 1, "in a debugger"),
    )
    assert job.result(timeout=60) == [42, 42]
    assert "43" in transcript
    assert job.status().ranks[1].state == "finished"
    fn.shutdown()


def test_a_rank_waiting_for_a_debugger_is_stopped_by_the_call_s_timeout(cluster, capfd):
    def stop_on_rank_0() -> int:
        if os.environ["RANK"] == "0":
            breakpoint()
        return 1

    fn = distribute(stop_on_rank_0, num_replicas=2, replicas_per_node=1, timeout=8)
    job = fn.submit()
    _, host, port = _attach_line(capfd)
    _rank_state(job, 0, "waiting for a debugger")
    _intrude(host, port)
    with pytest.raises(JobTimeoutError) as info:
        job.result(timeout=60)
    assert "_accept_with" in info.value.stacks[0]  # where it was: waiting for the secret
    fn.shutdown()
    wait_resources_back()


def test_post_mortem_opens_the_failing_frame(cluster, capfd):
    import threading

    def fail_on_rank_0() -> None:
        culprit = {"lr": -1}
        if os.environ["RANK"] == "0":
            raise ValueError("negative learning rate")
        del culprit

    fn = distribute(fail_on_rank_0, num_replicas=2, replicas_per_node=1, post_mortem=True)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    token, host, port = _attach_line(capfd)
    transcript = _talk(host, port, token, ["p culprit", "c"])
    caller.join(timeout=60)
    assert "{'lr': -1}" in transcript
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    fn.shutdown()


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
        while job.call is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # As a rank killed before it counted itself would leave it:
        left = sharing.SHM / f"{sharing.PREFIX}{job.call.share_key}-lost"
        left.write_bytes(b"x")
        go.touch()
        with pytest.raises(DistributedError, match="rank 1 fails"):
            job.result(timeout=60)
    deadline = time.monotonic() + 15
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left.exists()
    assert list(sharing.SHM.glob(f"{sharing.PREFIX}{job.call.share_key}*")) == []


def test_env_is_set_before_torch_is_imported(cluster):
    def debug_level() -> str:
        import torch.distributed as dist

        return str(dist.get_debug_level())  # read from the environment on import only

    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    with distribute(debug_level, num_replicas=2, replicas_per_node=1, env=env) as fn:
        assert fn() == ["DebugLevel.DETAIL"] * 2


def test_interrupting_the_driver_stops_every_rank(cluster):
    import threading

    def stuck() -> None:
        time.sleep(120)

    fn = distribute(os.getpid, num_replicas=2, replicas_per_node=1)
    pids = fn()
    fn.fn = stuck
    # As a notebook's stop button does: SIGINT to the main thread while it waits.
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(2.0, signal.pthread_kill, args=(main, signal.SIGINT))
    with sigint_raises(), pytest.raises(KeyboardInterrupt, match="all 2 ranks of getpid were"):
        timer.start()
        fn()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    fn.fn = os.getpid
    assert len(fn()) == 2  # usable again, on fresh processes
    fn.shutdown()
    wait_resources_back()


def test_tqdm_bar_on_rank_0_gives_a_bounded_number_of_lines(cluster, capfd):
    def progress() -> None:
        from tqdm import tqdm

        if os.environ["RANK"] == "0":
            for _ in tqdm(range(300), mininterval=0, miniters=1, desc="epoch 1"):
                time.sleep(0.01)  # 300 redraws over about 3 s

    with distribute(progress, num_replicas=2, replicas_per_node=1, name="bar") as fn:
        fn()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[bar r0]")]
    assert 1 <= len(lines) <= 10, lines
    assert "300/300" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_a_quiet_call_shows_a_status_line_and_a_table(cluster, capfd, monkeypatch):
    """Ranks silent past the quiet time: one status line on stderr (not a terminal here);
    the job's table has every rank, its node, state and last line."""
    from orchestrator import status

    monkeypatch.setattr(status, "QUIET_S", 1.0)

    def nap() -> int:
        print(f"rank {os.environ['RANK']} naps", flush=True)
        time.sleep(3)
        return 1

    with distribute(nap, num_replicas=2, replicas_per_node=1, name="quiet") as fn:
        job = fn.submit()
        assert job.result(timeout=60) == [1, 1]
        err = capfd.readouterr().err
        assert err.count("[quiet] 2 ranks running 0:0") == 1, err
        assert "; last output 0:01 ago" in err or "; last output 0:02 ago" in err, err
        table = job.table()
        assert [(r.rank, r.state, r.last_line) for r in table.rows] == [
            (0, "finished", "rank 0 naps"),
            (1, "finished", "rank 1 naps"),
        ]
        assert {r.node for r in table.rows} <= {n["NodeManagerAddress"] for n in ray.nodes()}
        assert 2.5 < table.rows[0].elapsed < 30
        assert "<table>" in fn._repr_html_() and "rank 1 naps" in job._repr_html_()


def test_a_quiet_warm_call_after_one_that_printed(cluster):
    """A rank's output is numbered across calls: a call whose ranks print nothing owes none
    of what the previous call already showed (it waited for it for ever)."""

    def maybe_print(say: bool) -> int:
        if say:
            print("hello", flush=True)
        return 1

    with distribute(maybe_print, num_replicas=2, replicas_per_node=1, name="quiet2") as fn:
        assert fn(True) == [1, 1]
        assert fn.submit(False).result(timeout=30) == [1, 1]
        assert fn.submit(True).result(timeout=30) == [1, 1]


def test_semaphores_a_killed_rank_held_are_removed(cluster):
    """Named semaphores (spawn multiprocessing) a rank still holds when its actor is killed:
    multiprocessing's tracker removes them, as at a normal exit (Ray kills the rank's
    process group; the tracker used to die with it and the files stayed in /dev/shm)."""

    def hold() -> str:
        import multiprocessing as mp

        lock = mp.get_context("spawn").Lock()
        os.__dict__.setdefault("_test_held", []).append(lock)  # still held at the kill
        return lock._semlock.name

    fn = distribute(hold, num_replicas=2, replicas_per_node=1, name="sems")
    names = fn()
    files = [Path("/dev/shm") / f"sem.{name.lstrip('/')}" for name in names]
    assert all(f.exists() for f in files), files
    fn.shutdown()
    deadline = time.monotonic() + 20
    while any(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(f.exists() for f in files), files
