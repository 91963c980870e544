"""The embedded local default, in fresh processes: no address, no RAY_ADDRESS, no Ray."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import http2_server

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""\
    import os, json
    import torch, torch.distributed as dist
    from orchestrator import distribute

    def train_loop(epochs):
        dist.init_process_group(backend="gloo")
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        print(f"Rank {dist.get_rank()} of {dist.get_world_size()} initialized")
        dist.destroy_process_group()
        return [int(os.environ[k]) for k in ("RANK", "NODE_RANK", "LOCAL_RANK")] + [t.item()]

    if __name__ == "__main__":
        results = distribute(train_loop, num_replicas=4, replicas_per_node=2)(epochs=10)
        print("RESULTS", json.dumps(results))
        daemons = []  # what the embedded instance runs: the driver's own children
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
                argv = open(f"/proc/{pid}/cmdline").read().split("\\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                script = next((a for a in argv if a.endswith(".py")), argv[0])
                daemons.append(os.path.basename(script))
        print("DAEMONS", json.dumps(sorted(daemons)))
""")


@pytest.fixture
def fresh_env():
    """A private Ray temp dir and state folder, so the subprocess sees no other Ray (not a
    local runtime another test process started either)."""
    tmp = tempfile.mkdtemp(prefix="re", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = tmp
    env["XDG_STATE_HOME"] = str(Path(tmp) / "state")
    env["PYTHONPATH"] = str(ROOT)
    yield env, Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


HOLD = textwrap.dedent("""\
    import time
    from orchestrator import distribute

    def hold():
        time.sleep(300)

    job = distribute(hold, num_replicas=2, replicas_per_node=1).submit()
    while job.status().state != "running":
        time.sleep(0.05)
    raise SystemExit("the driver gives up")
""")


FROM_THREADS = textwrap.dedent("""\
    import os, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from orchestrator import distribute

    def rank():
        return int(os.environ["RANK"])

    def fails():
        raise ValueError("boom")

    def crashes_once():
        if os.environ["RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            os._exit(3)
        return int(os.environ["RESTART_COUNT"])

    def daemons():
        states = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            name = stat.split("(", 1)[1].rsplit(")", 1)[0]
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and name in ("gcs_server", "raylet"):
                states[name] = state
        return " ".join(f"{name}:{state}" for name, state in sorted(states.items()))

    first = distribute(rank, num_replicas=2)
    with ThreadPoolExecutor(2) as pool:  # Ray starts in a pool thread, which then ends
        print("POOL", pool.submit(first).result())
    thread = threading.Thread(target=lambda: print("THREAD", first()))
    thread.start()
    thread.join()
    time.sleep(1)
    print("DAEMONS", daemons())
    print("NEW", distribute(rank, num_replicas=2, name="second")())  # needs the GCS
    try:
        distribute(fails, num_replicas=2, name="fails")()
    except ValueError as exc:
        print("FAILED", str(exc).splitlines()[0])
    print("RESTARTED", distribute(crashes_once, num_replicas=2, max_restarts=1)())
""")


ONE_RANK = textwrap.dedent("""\
    from orchestrator import distribute

    print("RESULT", distribute(lambda: 1, num_replicas=1)())
""")


def _run(env: dict[str, str], tmp: Path, source: str = SCRIPT) -> subprocess.CompletedProcess[str]:
    script = tmp / "used_by.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _check(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    # rank, node rank, local rank, all_reduce sum: laid out as 2 simulated nodes x 2.
    assert line == "RESULTS [[0, 0, 0, 4.0], [1, 0, 1, 4.0], [2, 1, 0, 4.0], [3, 1, 1, 4.0]]"
    for rank in range(4):
        assert f"[train_loop r{rank}] Rank {rank} of 4 initialized" in proc.stdout
    assert "running locally" in proc.stderr
    # Ray's own start-up chatter stays out of the user's way.
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert "INFO" not in proc.stderr
    # Ray's head without the processes a script has no use for (1-2 s of a cold start).
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DAEMONS"))
    daemons = json.loads(line.split(" ", 1)[1])
    assert {"gcs_server", "raylet"} <= set(daemons), daemons
    assert not {"dashboard.py", "monitor.py", "log_monitor.py"} & set(daemons), daemons


def _left_behind(tmp: Path, within: float = 20) -> list[str]:
    """Processes of this Ray instance (by RAY_TMPDIR) still alive after `within` seconds.

    A rank's tail keeps its last output for 10 s after the rank is gone, then exits.
    """
    mark = f"RAY_TMPDIR={tmp}".encode()
    deadline = time.monotonic() + within
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    left.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode())
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def test_used_by_line_runs_unchanged_on_a_laptop_without_gpus(fresh_env):
    env, tmp = fresh_env
    home = tmp / "home"  # a fresh machine's: no Ray token yet
    _check(_run({**env, "HOME": str(home)}, tmp))
    assert _left_behind(tmp) == []
    # Token auth is on, with a token for this user's eyes (Ray would make it 0644 in 0755).
    token = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700


def test_a_script_that_exits_mid_job_stops_it_then_ray(fresh_env):
    env, tmp = fresh_env
    proc = _run(env, tmp, HOLD)
    assert proc.returncode == 1
    assert proc.stderr.endswith(
        "the driver gives up\n[orchestrator] stopping job hold (running) at exit\n"
    ), proc.stderr
    assert _left_behind(tmp) == []


def test_ray_outlives_the_thread_that_started_it(fresh_env):
    """Ray's daemons die with the thread that started them (PR_SET_PDEATHSIG)."""
    env, tmp = fresh_env
    proc = _run(env, tmp, FROM_THREADS)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["POOL"] == lines["THREAD"] == lines["NEW"] == "[0, 1]", proc.stdout
    states = dict(item.split(":") for item in lines["DAEMONS"].split())
    assert sorted(states) == ["gcs_server", "raylet"], lines["DAEMONS"]
    assert "Z" not in states.values(), lines["DAEMONS"]  # not killed with the pool's thread
    assert "boom" in lines["FAILED"], lines["FAILED"]
    assert lines["RESTARTED"] == "[1, 1]", proc.stdout
    assert _left_behind(tmp) == []


def test_stale_cluster_file_starts_a_fresh_instance(fresh_env):
    env, tmp = fresh_env
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # nothing listens
    started = time.monotonic()
    proc = _run(env, tmp)
    _check(proc)
    assert "is gone; starting a fresh local one" in proc.stderr
    assert time.monotonic() - started < 60


def test_an_address_file_naming_a_server_that_is_not_ray_s_starts_a_fresh_instance(fresh_env):
    """Ray's address file names this user's HTTP/2 server that answers 404: Ray's connect
    would fail after about 27 s with a bare RuntimeError. Probed like a given address, it
    is passed over in one line."""
    env, tmp = fresh_env
    (tmp / "ray").mkdir()
    with http2_server("404", "text/html") as web:
        (tmp / "ray" / "ray_current_cluster").write_text(f"{web}\n")
        started = time.monotonic()
        proc = _run(env, tmp, ONE_RANK)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [1]" in proc.stdout, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "not joining" in line]
    assert len(said) == 1, proc.stderr
    assert f"the Ray cluster found at {web}" in said[0] and "HTTP status 404" in said[0]
    assert "starting a fresh local one" in said[0]
    assert time.monotonic() - started < 60


def test_a_long_tmpdir_falls_back_to_a_short_private_folder(fresh_env):
    """A Slurm job's TMPDIR (/scratch/job_12345678/tmp and longer) leaves Ray's socket
    paths no room under the private folder: Ray's files go in a short one, said in a line.
    Without XDG_RUNTIME_DIR or RAY_TMPDIR, which would hide it."""
    env, tmp = fresh_env
    long = tmp / ("t" * (60 - len(str(tmp)) - 1))
    long.mkdir(mode=0o700)
    assert len(str(long)) == 60
    env = {k: v for k, v in env.items() if k not in ("RAY_TMPDIR", "XDG_RUNTIME_DIR")}
    proc = _run({**env, "TMPDIR": str(long)}, tmp, SCRIPT + "\nprint('PID', os.getpid())\n")
    # The short folder is this user's own, for every script: Ray's session there (its logs,
    # kept as Ray keeps them) is this test's to remove.
    said = [line for line in proc.stderr.splitlines() if "Ray's socket paths" in line]
    pid = next((x.split()[1] for x in proc.stdout.splitlines() if x.startswith("PID ")), None)
    if said and pid is not None:
        ray_files = Path(said[0].split("Ray's files go in ", 1)[1].split(", not ", 1)[0])
        for session in ray_files.glob(f"session_*_{pid}"):
            shutil.rmtree(session, ignore_errors=True)
    _check(proc)
    assert len(said) == 1 and f"not {long}/orchestrator-" in said[0], proc.stderr
