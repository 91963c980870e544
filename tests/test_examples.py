"""The examples, run as a user would: each a subprocess on its own embedded Ray instance."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import TORCHRUN, message_lines, run_example

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "[orchestrator] running locally on an embedded Ray instance"


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_linear_ddp_four_ranks_ten_epochs(processes) -> None:
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


def test_message_passing_through_distribute(processes) -> None:
    """Without a launcher the example runs `run(backend)` on 4 ranks through distribute()."""
    result = run_example("message_passing.py", "--num-replicas", "4", "--replicas-per-node", "2")
    assert EMBEDDED in result.stderr
    assert sorted(_lines(result.stdout)) == message_lines("[message_passing r{}] ")


def test_message_passing_under_torchrun(processes) -> None:
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


def test_resnet_tiny_configuration(processes) -> None:
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
