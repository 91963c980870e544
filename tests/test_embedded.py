"""The embedded local default, in fresh processes: no address, no RAY_ADDRESS, no Ray."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

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
""")


@pytest.fixture
def fresh_env():
    """A private Ray temp dir, so the subprocess sees no other Ray."""
    tmp = tempfile.mkdtemp(prefix="re", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = tmp
    env["PYTHONPATH"] = str(ROOT)
    yield env, Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _run(env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    script = tmp / "used_by.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180,
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


def test_used_by_line_runs_unchanged_on_a_laptop_without_gpus(fresh_env):
    env, tmp = fresh_env
    _check(_run(env, tmp))


def test_stale_cluster_file_starts_a_fresh_instance(fresh_env):
    env, tmp = fresh_env
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # nothing listens
    started = time.monotonic()
    proc = _run(env, tmp)
    _check(proc)
    assert "is gone; starting a fresh local one" in proc.stderr
    assert time.monotonic() - started < 60
