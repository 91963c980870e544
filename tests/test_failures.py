"""A call that fails: which rank's failure is the root cause, a rank that raises or crashes, a
result that cannot be sent back, and the exit status of `orchestrator run`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import cloudpickle
import pytest
from ray.exceptions import RuntimeEnvSetupError

from orchestrator import DistributedError, distribute, errors
from orchestrator.errors import is_secondary
from orchestrator_workers.protocol import RankFailure
from tests.helpers import cli, show, wait_resources_back, write

# --- the root cause, without Ray ----------------------------------------------------------


def _failure(rank, when, exc, message=None):
    return RankFailure(
        rank=rank,
        local_rank=rank % 2,
        node_ip="10.0.0.1",
        hostname="h",
        pid=100 + rank,
        time=when,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=message or str(exc),
        traceback=f'  File "train.py", line 7\n{exc!r}\n',
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


# --- distribute() on the session's two-node cluster ---------------------------------------


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
    # At once: not gloo's 30 minutes in the others' all_reduce (the pool starts too, slowly
    # on a loaded machine).
    assert time.monotonic() - started < 120
    err = info.value
    assert isinstance(err, DistributedError)
    assert err.root_cause.rank == 2
    assert 'raise ValueError("boom")' in str(err)
    assert str(err).startswith("rank 2 (local rank 0)")
    assert "[raise_on_rank_2 r2] rank 2 about to fail" in capfd.readouterr().out
    # The peers' errors caused by rank 2 leaving are listed after it, never as the cause.
    assert err.failures[0].rank == 2
    secondary = err.failures[1:]
    # gloo says "Connection closed by peer" or "Connection reset by peer", by timing. On a
    # loaded machine the call may end before any peer reached its all_reduce: none listed.
    assert all(is_secondary(f) for f in secondary), secondary
    assert not secondary or "other rank(s) failed after it" in str(err)

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

    def one_print(_how: str) -> list[bytes]:
        """The writes a print makes to fd 1 in a rank, one packet each. A rank killed right
        after a print must leave its line whole: written in two pieces, the reading thread
        may take the text and die with it before its keeper has a copy."""
        import socket

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(ours.fileno(), 1)
        try:
            print("last words")
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        theirs.setblocking(False)
        packets = []
        with contextlib.suppress(BlockingIOError):
            while True:
                packets.append(theirs.recv(1 << 10))
        return packets

    fn = distribute(die_on_rank_1, num_replicas=4, replicas_per_node=2)
    fn.fn = one_print  # start the pool first, so the timing below is the crash's alone
    assert fn("warm") == [[b"last words\n"]] * 4  # a line is one write: no text lost
    fn.fn = die_on_rank_1
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        fn(how)
    assert time.monotonic() - started < 40  # well before the other ranks' 60 s sleep ends
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


def _uses_torch() -> str:
    import torch  # so the ranks import torch as they start: the window below

    return torch.__version__


def _kill_first_starting_rank(mark: str, killed: list[int]) -> None:
    """SIGKILL the first rank (its process carries `mark`) seen while its pool waits for it
    to start (its actor answering `info` once torch is imported: a second or more)."""
    deadline = time.monotonic() + 120
    while not killed and time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                title = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if f"DIE_MARK={mark}".encode() in environ and title.startswith(b"ray::RankActor.info"):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
                return
        time.sleep(0.01)


def test_a_rank_that_dies_while_its_pool_starts_is_named_with_where_and_why(cluster):
    """The OOM killer during a rank's torch import, say: the call raises a DistributedError
    naming that rank, its node and Ray's reason (not Ray's bare ActorDiedError, with our
    code's traceback); everything is released, and the next call works."""
    mark, killed = uuid.uuid4().hex, []
    killer = threading.Thread(target=_kill_first_starting_rank, args=(mark, killed))
    killer.start()
    fn = distribute(
        _uses_torch,
        num_replicas=2,
        replicas_per_node=1,
        log_dir=False,
        runtime_env={"env_vars": {"DIE_MARK": mark}},
    )
    try:
        with pytest.raises(DistributedError) as info:
            fn()
    finally:
        killer.join()
    root = info.value.root_cause
    assert [root.pid] == killed and root.exc_type == "crash", (killed, str(info.value))
    assert [f.rank for f in info.value.failures] == [root.rank]  # the other one lived
    assert root.node_ip and root.hostname != "?", root
    text = str(info.value)
    assert text.startswith(f"rank {root.rank} (local rank 0) on {root.node_ip}"), text
    assert "crashed: while its pool started, before the function ran, its process died" in text
    assert "killed by a signal" in text
    wait_resources_back()  # the other rank's actor and the placement went with the pool
    assert fn() == [fn()[0]] * 2  # a new pool, then warm
    fn.shutdown()
    wait_resources_back()


def test_a_runtime_env_that_cannot_be_set_up_names_the_ranks_and_ray_s_reason(cluster):
    """Ray's RuntimeEnvSetupError came raw, naming no rank and no node: now a
    DistributedError that is also a RuntimeEnvSetupError, naming each rank, its node, the
    setup's own last word and what to change; everything is released."""
    fn = distribute(
        os.getpid,
        num_replicas=2,
        replicas_per_node=1,
        log_dir=False,
        runtime_env={"conda": "orchestrator-no-such-env"},
    )
    with pytest.raises(RuntimeEnvSetupError) as info:
        fn()
    error = info.value
    assert isinstance(error, DistributedError), repr(error)
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    root = error.root_cause
    assert root.pid == 0 and root.node_ip and root.hostname != "?", root
    first = str(error).splitlines()[0]
    assert first.startswith(f"rank {root.rank} (local rank 0) on {root.node_ip} (host "), first
    assert "its runtime_env could not be set up on its node, before its process started: " in first
    assert "Change runtime_env=, or leave it out" in first
    assert "Could not create the actor because its associated runtime env" in str(error)
    wait_resources_back()
    other = distribute(os.getpid, num_replicas=2, replicas_per_node=1, log_dir=False)
    assert len(set(other())) == 2
    other.shutdown()
    wait_resources_back()


def broken_hook() -> None:
    """A setup hook that raises."""
    raise RuntimeError("the hook broke")


def test_a_setup_hook_that_raises_is_named_with_its_traceback(cluster):
    """Ray ends a rank's process whose setup hook raised: that was "died without a word:
    killed by a signal ...". Now the hook is named, with what it raised and where."""
    fn = distribute(
        os.getpid,
        num_replicas=2,
        replicas_per_node=1,
        log_dir=False,
        runtime_env={"worker_process_setup_hook": broken_hook},
    )
    with pytest.raises(DistributedError) as info:
        fn()
    error = info.value
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    first = str(error).splitlines()[0]
    assert f"rank {error.root_cause.rank} (local rank 0) on " in first, first
    assert (
        "raised RuntimeError: its runtime_env's worker_process_setup_hook failed as its "
        "process started, before the function ran: the hook broke. Fix the hook" in first
    )
    assert 'raise RuntimeError("the hook broke")' in str(error)  # the hook's own traceback
    assert "without a word" not in str(error)
    wait_resources_back()


# --- `orchestrator run` on the session's cluster -------------------------------------------


def test_failing_rank_root_cause_last_and_exit_zero_is_success(cluster, tmp_path):
    project = write(
        tmp_path / "p",
        {
            "fail.py": """\
                import os, sys, time
                rank = int(os.environ["RANK"])

                def explode():
                    raise ValueError("rank one is broken")

                if rank == 0:
                    print("rank 0 leaves with sys.exit(0)", flush=True)
                    sys.exit(0)
                time.sleep(0.5)
                explode()
            """
        },
    )
    proc = cli(
        f"run --nproc 2 --per-node 1 --address {cluster.address} fail.py",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 1, show(proc)
    assert "[fail r0] rank 0 leaves with sys.exit(0)" in proc.stdout
    report = proc.stderr[proc.stderr.index("[orchestrator] the job failed: ") :]
    assert report.splitlines()[0].endswith("raised ValueError: rank one is broken"), show(proc)
    assert "rank 1 (local rank 0)" in report.splitlines()[0]
    assert 'fail.py", line 5, in explode' in report
    assert "other rank(s) failed" not in report  # rank 0's sys.exit(0) is no failure
    assert "[fail r" not in report  # every line of the ranks came before it


def test_exit_status_of_sys_exit_and_of_a_timeout(cluster, tmp_path):
    project = write(
        tmp_path / "p",
        {
            "three.py": "import sys\nsys.exit(3)\n",
            "sleepy.py": "import time\nprint('asleep', flush=True)\ntime.sleep(600)\n",
        },
    )
    proc = cli(f"run --nproc 1 --address {cluster.address} three.py", cwd=project, tmp=tmp_path)
    assert proc.returncode == 3, show(proc)
    assert "ScriptExit: the script called sys.exit(3)" in proc.stderr, show(proc)
    proc = cli(
        f"run --nproc 1 --address {cluster.address} --timeout 2 sleepy.py",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 124, show(proc)
    assert "the call did not finish within 2 s" in proc.stderr
    assert "time.sleep(600)" in proc.stderr.split("did not finish")[1]
