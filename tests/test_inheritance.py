"""What a rank's process inherits, and what it passes on to the processes it forks,
compared with a torchrun worker's (docs/ranks.md: "What a rank inherits")."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator import distribute
from orchestrator.show import notices
from orchestrator_workers.protocol import NodeInfo
from tests.helpers import default_sigint
from tests.inherit_probe import TAG, facts

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "inherit_probe.py"

FATAL = ("SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV")
"""Caught in a rank by Ray's crash reporter and Python's faulthandler: they print the
stacks, then the process dies of the same signal."""
RANK_ONLY = {
    "SIGTERM": "Ray's handler, for the actor's orderly exit; forked children get the default",
    "SIGCHLD": "torch's DataLoader sets its handler only on the main thread, which Ray keeps",
    **dict.fromkeys(FATAL, "crash reporters"),
}
"""Signals whose disposition in a rank may differ from a torchrun worker's, and why."""


def _facts(lines: str) -> list[dict]:
    tagged = [line for line in lines.splitlines() if line.startswith(TAG)]
    found = [json.loads(line.split(" ", 1)[1]) for line in tagged]
    return sorted(found, key=lambda f: f["rank"])


def _torchrun(ranks: int, env: dict[str, str]) -> list[dict]:
    proc = subprocess.run(  # as from a terminal, however this suite was started
        default_sigint(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                str(PROBE),
            ]
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return _facts(proc.stdout)


@pytest.fixture
def fresh_env():
    """A private Ray temp dir and state folder, so the embedded instance sees no other Ray
    (not a local runtime another test process started either: its ranks inherit what that
    runtime's starter had, not what this test's torchrun does)."""
    tmp = tempfile.mkdtemp(prefix="ri", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")}
    env["RAY_TMPDIR"] = tmp
    env["XDG_STATE_HOME"] = str(Path(tmp) / "state")
    env["PYTHONPATH"] = str(ROOT)
    yield env
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_rank_inherits_what_a_torchrun_worker_does(fresh_env):
    ours = subprocess.run(
        default_sigint([sys.executable, str(PROBE), "1", "2"]),
        env=fresh_env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert ours.returncode == 0, ours.stderr
    by_world = {ranks: [f for f in _facts(ours.stdout) if f["world"] == ranks] for ranks in (1, 2)}
    for ranks, rank_facts in by_world.items():
        theirs = _torchrun(ranks, fresh_env)
        assert len(rank_facts) == len(theirs) == ranks
        for mine, worker in zip(rank_facts, theirs, strict=True):
            # The same priority, CPUs and torch threads: 1 each when a node runs several.
            for key in (
                "niceness",
                "affinity",
                "torch_threads",
                "interop_threads",
                "start_method",
                "umask",
                "flags",
                "rlimits",
                "pool_map",
            ):
                assert mine[key] == worker[key], (ranks, key, mine[key], worker[key])
            differ = {
                name for name, how in worker["signals"].items() if mine["signals"][name] != how
            }
            assert differ <= set(RANK_ONLY), (differ, mine["signals"], worker["signals"])
            assert worker["main_thread"] and not mine["main_thread"]  # docs/ranks.md: the door
            # What a process forked from each gets.
            child, their_child = mine["forked"], worker["forked"]
            assert child["niceness"] == their_child["niceness"]
            assert child["threads"] == their_child["threads"] == 1
            assert child["pipe_ends"] == their_child["pipe_ends"] == 0
            differ = {
                name
                for name, how in their_child["signals"].items()
                if child["signals"][name] != how
            }
            assert differ <= set(FATAL), (differ, child["signals"])
            assert mine["fork_s"] < 3 and mine["loader_teardown_s"] < 3, mine  # see below
            # The script's own functions reach a pool's children, forked or spawned.
            assert mine["pool_map"] == {"fork": [4, 9], "spawn": [4, 9]}, mine["pool_map"]


def test_forked_processes_exit_at_once_in_a_rank(cluster):
    """A forked child used to wait 6 s in the rank's os._exit hook for a thread it lacks
    (3 s: half of it, and room for a loaded machine's slow forks)."""
    with distribute(facts, num_replicas=2, replicas_per_node=1, name="forks") as probe:
        for found in probe():
            assert found["fork_s"] < 3, found
            assert found["loader_teardown_s"] < 3, found
            forked = found["forked"]
            assert forked["signals"]["SIGTERM"] == "default", forked  # not Ray's handler
            assert forked["pipe_ends"] == 0, forked  # no end of the rank's capture pipes


def _sigterm_as_forked(times: int) -> list[int]:
    """Fork `times` children, SIGTERM each as soon as fork returns; their exit statuses."""
    statuses = []
    for _ in range(times):
        pid = os.fork()
        if pid == 0:
            time.sleep(3)
            os._exit(7)
        os.kill(pid, signal.SIGTERM)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    return statuses


def test_a_child_sigtermed_as_it_is_forked_dies(cluster):
    """Until its at-fork hook ran, a child had Ray's handler and lost the SIGTERM (27 of 30
    lived on; `with Pool() as p` then hung when map raised at once)."""
    with distribute(_sigterm_as_forked, num_replicas=1, name="sigterm") as fork:
        (statuses,) = fork(10)
    assert statuses == [-signal.SIGTERM] * 10, statuses


def test_ranks_niced_by_the_cluster_are_pointed_out_once(capfd):
    niced = os.getpriority(os.PRIO_PROCESS, 0) + 15
    info = NodeInfo("n", "10.0.0.1", "h", 1, (), None, niceness=niced)
    notices._niced_noted.clear()
    notices.note_niceness("train", [info, info])
    notices.note_niceness("train", [info])
    err = capfd.readouterr().err
    assert err.count("the ranks run at niceness") == 1, err
    assert "RAY_worker_niceness=0" in err
    notices._niced_noted.clear()
    notices.note_niceness("train", [NodeInfo("n", "10.0.0.1", "h", 1, (), None)])
    assert capfd.readouterr().err == ""
