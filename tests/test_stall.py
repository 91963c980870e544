"""A call that stops moving names its ranks and where they are (issue 24, part 1).

The report's logic is tested on made-up readings; then a real 4-rank gloo job on the
session's 2-node cluster is held back in each way the issue lists: a rank sleeping
before a collective, one blocked on a lock, one in a C call that holds the GIL, one
stopped with SIGSTOP, one that keeps moving while its peers wait, and ranks in
different collectives (with on_stall="raise"). Each injected hang but the last ends by
itself, so the warm pool serves the next case.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

from orchestrator import StallError, distribute
from orchestrator.diagnose import stall, stopped
from orchestrator.show.summary import group_stacks, stacks_title
from orchestrator_workers.places import Frame
from orchestrator_workers.where import Where
from tests.helpers import MachineClock, wait_resources_back

_LIB = "/usr/lib/python3/site-packages/torch/distributed"


def _user(line: int, code: str, function: str = "train") -> Frame:
    return Frame("/home/u/train.py", line, function, code, library=False)


def _collective(name: str, line: int) -> tuple[Frame, ...]:
    return (
        _user(line, f"dist.{name}(t)"),
        Frame(f"{_LIB}/c10d_logger.py", 83, "wrapper", "return func(*args)", library=True),
        Frame(f"{_LIB}/distributed_c10d.py", 3913, name, "work.wait()", library=True),
    )


def _read(frames: dict[int, tuple[Frame, ...]], still_s: float, age_s: float = 0.5):
    return {r: (Where(r, f, True, still_s, age_s), 100.0) for r, f in frames.items()}


def _report(where, *, now=100.0, quiet_s=100.0, after_s=60.0, ranks=None, **kw):
    ranks = sorted(where) if ranks is None else ranks
    last_output = [now - quiet_s] * (max(ranks) + 1)
    return stall.report("train", now, where, ranks, last_output, after_s=after_s, **kw)


def test_the_odd_rank_out_comes_first_with_its_place_and_code():
    frames = {r: _collective("all_reduce", 42) for r in range(128)}
    frames[5] = (_user(12, "batch = next(it)"), _user(88, "return load(i)", "__getitem__"))
    report = _report(_read(frames, still_s=75.0))
    assert report is not None and report.stalled
    line = report.line()
    assert line.startswith("[train] no progress for 1:15: rank 5 is at train.py:88 in __getitem__")
    assert "(`return load(i)`); 127 ranks (r0-4,6-127) wait in all_reduce at train.py:42" in line
    assert "outside" not in line  # one rank is elsewhere: the others wait for it
    text = str(report)
    assert "--- rank 5 ---" in text and "--- 127 ranks (r0-4,6-127): rank 0's stack ---" in text
    assert 'distributed_c10d.py", line 3913, in all_reduce' in text


def test_a_job_that_moves_has_no_report():
    frames = {r: _collective("all_reduce", 42) for r in range(4)}
    assert _report(_read(frames, still_s=0.5)) is None  # stacks change
    assert _report(_read(frames, still_s=90.0), quiet_s=2.0) is None  # output flows


def test_all_ranks_in_one_collective_say_what_they_wait_for_is_outside_the_job():
    frames = {r: _collective("barrier", 7) for r in range(8)}
    line = _report(_read(frames, still_s=61.0)).line()
    assert "8 ranks (r0-7) wait in barrier at train.py:7" in line
    assert "no rank of the job is elsewhere: what they wait for is outside" in line
    # Unless some ranks have returned: then that is what they wait for.
    frames.pop(7)
    line = _report(_read(frames, still_s=61.0), returned=[7]).line()
    assert "rank 7 has returned" in line and "outside" not in line
    # Or one has not begun its function (its call's setup is slow), or is returning.
    where = _read(frames, still_s=61.0)
    where[7] = (Where(7, (), False, 0.0, 0.5), 100.0)
    line = _report(where).line()
    assert line.endswith("rank 7 is not in the function (starting it, or returning)")


def test_ranks_in_different_collectives_are_said_to_be():
    frames = {r: _collective("all_reduce" if r < 2 else "broadcast", 9 + r // 2) for r in range(4)}
    line = _report(_read(frames, still_s=61.0)).line()
    assert "2 ranks (r0-1) wait in all_reduce" in line
    assert "2 ranks (r2-3) wait in broadcast" in line
    assert line.endswith("the ranks are in different collectives")


def test_a_rank_that_stopped_looking_does_not_answer():
    where = _read({r: _collective("all_reduce", 42) for r in range(4)}, still_s=70.0)
    stuck = Where(2, (_user(30, "libc.sleep(600)"),), True, 70.0, age_s=45.0)
    where[2] = (stuck, 100.0)
    line = _report(where).line()
    assert "rank 2 does not answer (no look at its stack for 0:45; last seen at train.py:30" in line
    # A node's reader that never answered, before any reading: named from the driver's side.
    line = _report({0: where[0], 1: where[1]}, ranks=[0, 1, 2, 3], mute=[2], quiet_s=80.0).line()
    assert "rank 2 does not answer (no look at its stack for 1:20)" in line
    assert line.endswith("; rank 3 not read lately")  # and no claim on what the others wait for


def test_a_rank_that_stopped_looking_is_read_again_and_out_of_order_readings_are_not():
    frames = (_user(9, "x = 1"),)
    first = Where(3, frames, True, still_s=2.0, age_s=0.4, sampled=1000.0)
    # Its record stays the same (it stopped): each reading of it is later, older by then,
    # whatever the reading's way back to the driver took.
    again = Where(3, frames, True, still_s=3.0, age_s=1.4, sampled=1000.0)
    assert stall.newer(first, None) and stall.newer(again, first)
    # A late answer from a reader passed over: an earlier look, or the same one read earlier.
    assert not stall.newer(Where(3, frames, True, 1.0, 0.2, sampled=999.0), again)
    assert not stall.newer(first, again)


def test_ranks_that_move_are_named_after_those_that_wait_for_them():
    frames = {r: _collective("barrier", 60) for r in range(1, 16)}
    where = _read(frames, still_s=90.0)
    saving = (
        _user(88, "torch.save(model, path)"),
        Frame("/x/site-packages/torch/serialization.py", 900, "save", "", library=True),
    )
    where[0] = (Where(0, saving, True, 0.3, 0.5), 100.0)
    report = _report(where)
    assert report is not None and not report.stalled
    line = report.line()
    assert line.startswith("[train] 15 ranks without progress for 1:30: 15 ranks (r1-15) wait in")
    assert line.endswith(
        "moved within the last 0:01: rank 0 is in torch.serialization.save at train.py:88"
    )


def test_same_stacks_are_shown_once_odd_ones_first():
    groups = group_stacks({0: "a", 1: "b", 2: "a", 3: "a"})
    assert groups == [((1,), "b"), ((0, 2, 3), "a")]
    assert stacks_title((0, 2, 3)) == "ranks 0,2-3 (3 ranks, the same stacks)"


# A real job. Each case holds the job back in one way; `held` is how long (given `stop`: how
# long each time, until the test makes that file once it has seen what it asserts).


def _hold(stop: str) -> Iterator[None]:
    """Once; or, given `stop`, until the test makes that file."""
    yield
    while stop and not os.path.exists(stop):
        yield


def _keep_going(case: str, held: float, stop: str) -> None:
    """A rank that keeps computing ('busy') or moving (evaluating, say) while its peers wait."""
    end = time.monotonic() + held
    # os.access, a builtin: os.path.exists is Python code, where a look would find it.
    while time.monotonic() < end and not (stop and os.access(stop, os.F_OK)):
        if case == "busy":  # a tight loop: its stack may read the same at each look
            total = sum(range(1000))
            total += 1
        else:
            time.sleep(0.03)
            time.sleep(0.03)  # its stack changes between looks: it makes progress


def _asleep(held: float, stop: str) -> None:
    """Sleep, as a rank busy with something slow outside torch (I/O, say)."""
    for _ in _hold(stop):
        time.sleep(held)


def _locked(held: float, stop: str) -> None:
    """Wait for a lock that no one will let go."""
    import threading

    lock = threading.Lock()
    lock.acquire()
    for _ in _hold(stop):
        lock.acquire(timeout=held)


def _case(case: str, held: float, stop: str = "") -> int:
    import ctypes
    import signal as sig

    import torch
    import torch.distributed as dist

    if case == "outside":  # a fifth rank, outside the job, is awaited: it never comes
        dist.init_process_group("gloo", world_size=5, rank=int(os.environ["RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is up
    if case == "sleep" and rank == 3:
        _asleep(held, stop)
    elif case == "lock" and rank == 1:
        _locked(held, stop)
    elif case == "gil" and rank == 2:
        time.sleep(1.5)  # its sampler looks here once or twice
        ctypes.PyDLL(None).sleep(int(held))  # libc's sleep, the GIL held throughout
    elif case == "sigstop" and rank == 1:
        time.sleep(1.5)
        os.kill(os.getpid(), sig.SIGSTOP)  # the test sends SIGCONT
    elif case in ("busy", "moving") and rank == 0:
        _keep_going(case, held, stop)
    elif case == "returns":  # rank 3 returns early; its peers wait (for it, in a real job)
        if rank == 3:
            return rank
        time.sleep(held)
    elif case == "mismatch":
        if rank < 2:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=2)
    dist.all_reduce(t)
    dist.barrier()
    return rank


def _until_reported(job, *words: str, limit_s: float = 40.0) -> str:
    """The job's stall report once it holds every one of `words`; fail after `limit_s` of
    machine time (longer on a loaded machine)."""
    clock, seen = MachineClock(), None
    while clock.seconds() < limit_s:
        seen = job.status().stall
        if seen and all(w in seen for w in words):
            return seen
        assert not job.done(), job.exception()
        time.sleep(0.3)
    pytest.fail(f"no report with {words} within {limit_s} s ({clock}); last: {seen}")


@pytest.fixture(scope="module")
def held(cluster):
    fn = distribute(
        _case, num_replicas=4, replicas_per_node=2, gpus_per_replica=0, stall_after=3, log_dir=False
    )
    yield fn
    fn.shutdown()
    wait_resources_back()


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_rank_sleeping_before_a_collective_is_named_with_its_line(held, tmp_path):
    log, kept = logging.getLogger("orchestrator.status"), _Kept()
    log.addHandler(kept)  # as an application's logging would: the report goes through it
    stop = tmp_path / "stop"
    try:
        job = held.submit("sleep", 0.5, str(stop))
        try:
            line = _until_reported(job, "rank 3 is at test_stall.py", "(last collective: gloo:")
            assert "in _asleep (`time.sleep(held)`)" in line
            assert "3 ranks (r0-2) wait in all_reduce at test_stall.py" in line
            assert "(last collective: gloo:all_reduce" in line and "not done" in line  # recorder
            assert job.table().stall is not None and "rank 3 is at" in job.table().text()
        finally:
            stop.touch()
        assert job.result() == [0, 1, 2, 3]  # a report, not a failure: the call goes on
    finally:
        log.removeHandler(kept)
    logged = [r.getMessage() for r in kept.records if r.levelno == logging.WARNING]
    assert any("rank 3 is at" in m and "--- rank 3 ---" in m for m in logged), logged
    assert job.status().stall is None


def test_a_rank_blocked_on_a_lock_shows_the_line(held, tmp_path):
    job = held.submit("lock", 0.5, str(tmp_path / "stop"))
    try:
        _until_reported(job, "rank 1 is at test_stall.py", "(`lock.acquire(timeout=held)`)")
    finally:
        (tmp_path / "stop").touch()
    assert job.result() == [0, 1, 2, 3]


def test_a_rank_holding_the_gil_does_not_answer_even_as_its_node_s_reader(held, monkeypatch):
    # Rank 2 reads its node's records for the driver: its node is then read through rank 3.
    monkeypatch.setattr(stall, "ANSWER_S", 4.0)
    job = held.submit("gil", 16)
    line = _until_reported(job, "rank 2 does not answer")
    assert "last seen at test_stall.py" in line and "time.sleep(1.5)" in line
    assert "3 ranks (r0-1,3) wait in all_reduce" in line
    assert job.result() == [0, 1, 2, 3]


def test_a_stopped_rank_does_not_answer(held, monkeypatch):
    monkeypatch.setattr(stall, "ANSWER_S", 4.0)
    job = held.submit("sigstop", 0)
    pid = held.pids()[1]
    try:
        _until_reported(job, "rank 1 does not answer", "last seen at test_stall.py")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert job.result() == [0, 1, 2, 3]


def test_a_rank_computing_in_a_loop_is_named_on_cpu(held, tmp_path):
    job = held.submit("busy", 60, str(tmp_path / "stop"))
    # A tight loop's stack may read the same at each look: what tells it from a wait is
    # its CPU. Either way it is the odd one out, or one that moved lately.
    try:
        line = _until_reported(job, "rank 0 is at test_stall.py", "on CPU")
    finally:
        (tmp_path / "stop").touch()
    assert "3 ranks (r1-3) wait in all_reduce at test_stall.py" in line
    assert job.result() == [0, 1, 2, 3]


def test_on_stall_raise_ends_a_call_in_mismatched_collectives(held):
    started = time.monotonic()
    with pytest.raises(StallError) as info:
        held.with_options(on_stall="raise")("mismatch", 0)
    assert time.monotonic() - started < 60
    err = info.value
    assert isinstance(err, TimeoutError)
    text = str(err)
    assert "2 ranks (r0-1) wait in all_reduce" in text and "wait in broadcast" in text
    assert "the ranks are in different collectives" in text
    assert set(err.stacks) == {0, 1, 2, 3}
    # The stuck pool is gone; the next call starts a fresh one and works.
    assert held("sleep", 0) == [0, 1, 2, 3]


def test_on_stall_raise_ends_a_call_whose_ranks_wait_on_one_that_moves(held):
    """The report names the one still moving (never calls it hung); raise mode, which the
    user chose, ends the call all the same: ranks have waited `stall_after`."""
    with pytest.raises(StallError) as info:
        held.with_options(on_stall="raise")("moving", 120)
    line = info.value.report.split("\n", 1)[0]
    assert "3 ranks without progress for 0:0" in line, line
    assert "3 ranks (r1-3) wait in all_reduce at test_stall.py" in line, line
    assert "moved within the last 0:0" in line and "rank 0 is at test_stall.py" in line, line
    wait_resources_back()


def test_a_rank_that_returned_while_the_others_wait_is_named(held):
    """A handed-off call brings its outcomes together once all are done (see handoff): the
    rank that returned early is known by its own record, not by its outcome."""
    with pytest.raises(StallError) as info:
        held.with_options(on_stall="raise")("returns", 120)
    line = info.value.report.split("\n", 1)[0]
    assert "3 ranks (r0-2)" in line and "test_stall.py" in line, line
    assert line.endswith("; rank 3 has returned"), line
    wait_resources_back()


def test_ranks_all_waiting_at_one_place_are_said_to_wait_for_something_outside(held):
    with pytest.raises(StallError) as info:
        held.with_options(on_stall="raise")("outside", 0)
    line = info.value.report.split("\n", 1)[0]
    assert "4 ranks (r0-3) wait in init_process_group at test_stall.py" in line, line
    assert line.endswith(
        "no rank of the job is elsewhere: what they wait for is outside the job's ranks "
        "(the network, or a process outside the job)"
    )
    wait_resources_back()


def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _nccl_case(held: float) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(held)
    dist.all_reduce(t)  # rank 0's waits for rank 1 on the GPU, and its stack stays...
    t.item()  # ...here, at the sync: the flight recorder says where it waits
    return rank


@pytest.mark.skipif(_cuda_gpus() < 2, reason="NCCL needs a GPU per rank: 2 CUDA GPUs here")
def test_an_nccl_hang_names_the_last_collective_and_the_gpu_use(cluster):
    """Written for a 2-GPU machine, not run on one yet: the flight recorder's last NCCL
    collective of a rank whose stack waits on the GPU, and each rank's GPU use."""
    fn = distribute(
        _nccl_case, num_replicas=2, replicas_per_node=2, gpus_per_replica=1, stall_after=5
    )
    try:
        job = fn.submit(25.0)
        line = _until_reported(job, "rank 1 is at test_stall.py", "(last collective: nccl:")
        assert "nccl:all_reduce #" in line and "not done" in line, line
        use = next(r for r in job.table().rows if r.rank == 0).use
        assert "GPU" in use and "% busy" in use, use
        assert job.result() == [0, 1]
    finally:
        fn.shutdown()
    wait_resources_back()


def test_a_rank_stopped_while_its_ddp_peers_wait_in_backward_is_named():
    """DDP's peers wait for the all-reduce inside autograd's backward: not in a collective's
    call, but their last collective (torch's flight recorder) is not done."""
    backward = (
        _user(46, "loss.backward()"),
        Frame(
            "/usr/lib/python3/site-packages/torch/_tensor.py",
            626,
            "backward",
            "torch.autograd.backward(",
            library=True,
        ),
    )
    asleep = (_user(52, "time.sleep(120)"),)

    def read(last: str) -> dict[int, tuple[Where, float]]:
        where = {r: (Where(r, backward, True, 30.0, 0.5, collective=last), 100.0) for r in range(3)}
        where[3] = (Where(3, asleep, True, 30.0, 0.5, quiet_s=30.0), 100.0)
        return where

    waiting = read("gloo:allreduce #120, not done")
    found = stopped.find(_report(waiting, after_s=12.0), waiting, 100.0, 12.0)
    assert found is not None and found.rank == 3
    assert found.line().startswith("[train] rank 3 stopped: no progress, CPU or I/O for 0:30")
    assert "3 ranks (r0-2) are in torch._tensor.backward" in found.line()
    computing = read("gloo:allreduce #120, done")  # their backward computes: no one waits
    assert stopped.find(_report(computing, after_s=12.0), computing, 100.0, 12.0) is None
