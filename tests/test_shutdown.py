"""How a pool ends, leaving nothing behind: shutdown(), a driver that exits without it, is
killed or is interrupted, and what a killed rank held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from orchestrator import distribute
from tests.helpers import ROOT, sigint_raises, wait_for, wait_resources_back


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
    script.write_text(
        textwrap.dedent(f"""\
        import atexit, gc, os
        import ray
        # Between Ray's exit hook and ours: runs after ours, before Ray's.
        atexit.register(lambda: print("after ours:", ray.is_initialized(),
                                      gc.get_freeze_count() > 0, flush=True))
        from orchestrator import distribute
        fn = distribute(os.getpid, num_replicas=4, replicas_per_node=2,
                        address={cluster.address!r})
        print(fn())
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(os.path.dirname(os.path.dirname(__file__)))}
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    *_, printed, after = proc.stdout.strip().splitlines()
    # It ended the session it began itself: Ray's hook would first wait 0.5 s for log
    # lines, which a session joined with log_to_driver=False never gets. And it kept
    # every object out of the interpreter's last garbage collection (0.2-0.5 s of exit).
    assert after == "after ours: False True", proc.stdout
    pids = [int(p) for p in printed.strip("[]").split(",")]
    wait_resources_back()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


THEIRS = """\
import atexit
import ray
ray.init(address={address!r}, log_to_driver=True)
atexit.register(lambda: print("after ours:", ray.is_initialized(), flush=True))
import orchestrator.function  # registers our exit hook
"""


def test_a_ray_session_the_user_began_is_left_to_ray_s_exit_hook(cluster, tmp_path):
    """Ray's hook waits for the log lines of the user's session (log_to_driver=True) and
    prints them; ours ends only a session it began (see the test above)."""
    script = tmp_path / "theirs.py"
    script.write_text(THEIRS.format(address=cluster.address))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "after ours: True", proc.stdout


DRIVER = """\
import os, sys, time
from orchestrator import distribute

def hold(seconds):
    time.sleep(seconds)

job = distribute(hold, num_replicas=4, replicas_per_node=2, address={address!r}).submit(300)
while job.status().state != "running":
    time.sleep(0.05)
print("running", flush=True)
if sys.argv[1] == "raise":
    raise SystemExit("the driver gives up")
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_driver_that_exits_leaves_nothing_behind(cluster, tmp_path, how):
    wait_resources_back()
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(address=cluster.address)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), how],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "running\n"
        # Ray's view of free resources lags the placement by up to a second or so under load.
        wait_for(lambda: ray.available_resources().get("GPU", 0) < 4, 10, "the job's GPUs held")
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "raise":
        assert "the driver gives up" in err
        assert "stopping job hold (running) at exit" in err
    wait_resources_back(timeout=60)


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
