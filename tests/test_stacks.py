"""Where every rank is: its stacks on demand (`fn.stacks()`, `job.stacks()`, `orchestrator
stacks`) and in the report of a call that timed out."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from orchestrator import JobTimeoutError, distribute
from orchestrator.cli import main
from tests.helpers import cli_env, default_sigint, wait_for, wait_resources_back, write


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
    # The call's 5 s, not the function's 60 (the message below names it too); a loaded
    # machine takes the stacks slowly (15 s failed at load 20).
    assert time.monotonic() - started < 45
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


def print_then_sleep(seconds: float) -> None:
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    time.sleep(seconds)


def test_a_running_job_shows_its_logs_and_stacks(cluster):
    fn = distribute(print_then_sleep, num_replicas=2, replicas_per_node=1, gpus_per_replica=0)
    job = fn.submit(30)
    wait_for(
        lambda: job.log_dir is not None and all("hello" in job.logs(r) for r in (0, 1)),
        90,
        "both ranks' lines",
    )  # on a busy machine, rank 0's may come after rank 1's
    assert job.logs(0) == "hello from rank 0\n"
    assert job.logs(1) == "hello from rank 1\n"
    stacks = job.stacks()
    assert sorted(stacks) == [0, 1]
    assert all("print_then_sleep" in text and "time.sleep" in text for text in stacks.values())
    assert fn.stacks().keys() == stacks.keys()
    status = job.status()
    assert [(r.rank, r.state) for r in status.ranks] == [(0, "running"), (1, "running")]
    assert all(r.pid for r in status.ranks)
    assert str(status).startswith("print_then_sleep: running (r0 running, r1 running)")
    job.cancel()
    assert job.stacks() == {}
    fn.shutdown()


def test_stacks_of_a_job_run_elsewhere_then_ctrl_c_stops_it(cluster, tmp_path, capsys):
    project = write(
        tmp_path / "p",
        {
            "stuck.py": """\
                import time
                import torch.distributed as dist

                def wait_for_rank_0():
                    dist.barrier()

                dist.init_process_group("gloo")
                print("ready", flush=True)
                if dist.get_rank() == 0:
                    time.sleep(600)
                wait_for_rank_0()
            """
        },
    )
    command = f"run --nproc 2 --per-node 1 --address {cluster.address} --name stuck stuck.py"
    job = subprocess.Popen(  # Ctrl-C must reach it, however this suite was started
        default_sigint([sys.executable, "-m", "orchestrator", *shlex.split(command)]),
        cwd=project,
        env=cli_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ready = 0
        assert job.stdout is not None
        for line in job.stdout:
            ready += line.endswith("ready\n")
            if ready == 2:
                break
        assert ready == 2, job.stderr.read() if job.stderr else ""

        assert main(["stacks", "nothing-here"]) == 2
        err = capsys.readouterr().err
        assert "no running job named 'nothing-here'" in err and "stuck (stuck-" in err

        # A second pool with the same name, from this process: both are shown.
        other = distribute(time.sleep, num_replicas=1, name="stuck")

        def sleep_there() -> None:
            with contextlib.suppress(Exception):  # cancelled by the shutdown below
                other(30)

        sleeper = threading.Thread(target=sleep_there, daemon=True)
        sleeper.start()
        try:
            out = ""
            deadline = time.monotonic() + 60
            while out.count("=== stuck-") < 2 and time.monotonic() < deadline:
                assert main(["stacks", "stuck"]) == 0
                out = capsys.readouterr().out
        finally:
            other.shutdown()
        blocks = out.split("=== stuck-")
        assert len(blocks) == 3, out
        ours = next(b for b in blocks if "--- rank 1 ---" in b)
        rank0, rank1 = ours.split("--- rank 1 ---")
        assert "time.sleep(600)" in rank0, out
        assert "in wait_for_rank_0" in rank1 and "dist.barrier()" in rank1, out
        assert "runpy" not in ours and "run_script" not in ours, out  # from the user's code

        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=60)
        assert job.returncode == 130, err
        assert "interrupted: every rank of stuck was stopped" in err
        deadline = time.monotonic() + 30
        while main(["stacks", "stuck"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "no running job named 'stuck'" in capsys.readouterr().err
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
