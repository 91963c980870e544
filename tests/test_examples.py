"""The examples, run as a user would: each a subprocess on its own embedded Ray instance."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT_S = 240  # generous: a 2-core machine may be busy with other tests' clusters
# Variables a launcher or an enclosing Ray session would leave; the examples must start fresh.
_INHERITED = (
    "RAY_ADDRESS",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
EMBEDDED = "[orchestrator] running locally on an embedded Ray instance"


def run_example(*argv: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run `examples/<argv>` from the repository root; fail with its output if it fails."""
    ray_tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")  # short: Ray's socket paths live here
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["RAY_TMPDIR"] = ray_tmp
    # Unbuffered, print() writes text and newline apart: torchrun ranks sharing one pipe
    # would interleave their lines.
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [*launcher] if launcher else [sys.executable]
    cmd += [f"examples/{argv[0]}", *argv[1:]]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a hung run can be stopped with everything it started
    )
    try:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{cmd} did not finish in {TIMEOUT_S} s\n{_show(out, err)}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited with {proc.returncode}\n{_show(out, err)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _show(out: str, err: str) -> str:
    return f"--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def message_lines(prefix: str = "") -> list[str]:
    """What the message passing example prints on 4 ranks, each line after `prefix`."""
    rank0 = [f"{prefix.format(0)}worker_0 sent data to Rank {n}" for n in range(1, 4)]
    others = [f"{prefix.format(n)}worker_{n} has received data from rank 0" for n in range(1, 4)]
    return sorted(rank0 + others)


def test_linear_ddp_four_ranks_ten_epochs() -> None:
    """The Runhouse example: 4 ranks on 2 simulated nodes, each reports all 10 epochs."""
    result = run_example("linear_ddp.py")
    assert EMBEDDED in result.stderr
    lines = _lines(result.stdout)
    for rank in range(4):
        assert f"[train_loop r{rank}] Rank {rank} of 4 initialized" in lines
        epochs = [
            int(m.group(1))
            for line in lines
            if (
                m := re.fullmatch(
                    rf"\[train_loop r{rank}\] Rank {rank}: Epoch (\d+), Loss \S+", line
                )
            )
        ]
        assert epochs == list(range(10)), (rank, result.stdout)
        assert any(re.fullmatch(rf"rank {rank}: final loss -?\d+\.\d+", line) for line in lines)


def test_message_passing_through_distribute() -> None:
    """Without a launcher the example runs `run(backend)` on 4 ranks through distribute()."""
    result = run_example("message_passing.py", "--num-replicas", "4", "--replicas-per-node", "2")
    assert EMBEDDED in result.stderr
    assert sorted(_lines(result.stdout)) == message_lines("[message_passing r{}] ")


def test_message_passing_under_torchrun() -> None:
    """The same file, unchanged, as a plain torchrun script (no Ray)."""
    result = run_example(
        "message_passing.py",
        "--backend=gloo",
        launcher=(str(TORCHRUN), "--standalone", "--nproc_per_node=4"),
    )
    assert EMBEDDED not in result.stderr
    # torchrun runs its workers unbuffered (python -u) on one shared pipe, so a line's
    # text and its newline are separate writes that another rank's line can split.
    for line in message_lines():
        assert result.stdout.count(line) == 1, result.stdout


def test_resnet_tiny_configuration() -> None:
    """resnet18 on synthetic 32px images, 2 ranks x 3 steps of 8: reports images/s."""
    result = run_example(
        "resnet.py",
        "--arch=resnet18",
        "--image-size=32",
        "--batch_size=8",
        "--steps=3",
        "--num-replicas=2",
    )
    assert EMBEDDED in result.stderr
    throughput = re.search(r"^\[resnet r0\] Throughput: (\d+\.\d+) images/s", result.stdout, re.M)
    assert throughput, result.stdout
    assert float(throughput.group(1)) > 0
    by_rank = re.search(r"^images/s by rank: (\S+), (\S+)$", result.stdout, re.M)
    assert by_rank, result.stdout
    assert by_rank.group(1) == by_rank.group(2) == throughput.group(1)
