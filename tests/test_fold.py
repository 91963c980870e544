"""Folding: lines many ranks write alike shown once, with their ranks and number ranges.

The driver's Console, fed chunks directly (no Ray): what folds and what never does, the
order of lines, a late rank's line, the bound on a line's delay, the default by size.
"""

from __future__ import annotations

import pytest

from orchestrator import distribute
from orchestrator.show.logs import Console
from orchestrator_workers.protocol import OutputChunk


def _lines(console: Console, rank: int, stream: str, text: str, now: float) -> None:
    console.write(rank, [OutputChunk(0, stream, text.encode())], now=now)


def test_alike_lines_fold_with_rank_ranges(capsys):
    console = Console("train", 128)  # folded by default at this size
    for rank in range(128):
        _lines(console, rank, "stdout", "epoch 3 done\n", now=0)
    assert capsys.readouterr().out == "[train r0-127] epoch 3 done\n"  # complete: at once
    for rank in range(128):
        _lines(console, rank, "stdout", "odd one\n" if rank == 64 else "saved\n", now=1)
    assert console.tick(now=1.2) == 1.5  # waits for rank 64's "saved" ...
    assert capsys.readouterr().out == ""
    console.tick(now=1.5)  # ... not longer than that
    assert capsys.readouterr().out == "[train r0-63,65-127] saved\n[train r64] odd one\n"
    # The user's prefix, {rank} spelled as the ranks; a number's format still fits one rank.
    custom = Console("exp", 8, prefix="<{name}:{rank:03d}>")
    for rank in (0, 1, 2, 5, 6, 7):
        _lines(custom, rank, "stdout", "hi\n", now=0)
    _lines(custom, 3, "stdout", "alone\n", now=0)
    custom.flush()
    assert capsys.readouterr().out == "<exp:0-2,5-7> hi\n<exp:003> alone\n"


def test_numbers_fold_into_their_ranges():
    shown: list[str] = []
    console = Console("train", 4, fold=True, sink=lambda stream, text: shown.append(text))
    for rank, loss in enumerate(["0.21", "-1.01", "0.44", "0.30"]):
        _lines(console, rank, "stdout", f"Rank {rank}: Epoch 3, Loss {loss}\n", now=0)
    for rank, lr in enumerate(["1e-05", "1e-05", "2.50e-05", "1e-05"]):
        _lines(console, rank, "stdout", f"lr {lr}, step 10\n", now=0)
    assert shown == [
        "[train r0-3] Rank 0..3: Epoch 3, Loss -1.01..0.44\n",
        "[train r0-3] lr 1e-05..2.50e-05, step 10\n",  # as written, lowest..highest
    ]


def test_different_text_does_not_fold(capsys):
    console = Console("j", 8)
    for rank in range(8):
        _lines(console, rank, "stdout", f"host {'ab'[rank % 2]}: Loss {rank}\n", now=0)
    _lines(console, 0, "stdout", "Loss nan\n", now=0)
    console.flush()
    assert capsys.readouterr().out == (
        "[j r0,2,4,6] host a: Loss 0..6\n[j r1,3,5,7] host b: Loss 1..7\n[j r0] Loss nan\n"
    )


def test_stdout_and_stderr_fold_apart(capsys):
    console = Console("j", 8)
    for rank in range(8):
        _lines(console, rank, "stdout" if rank < 4 else "stderr", "loading data\n", now=0)
    console.flush()
    out = capsys.readouterr()
    assert out.out == "[j r0-3] loading data\n"
    assert out.err == "[j r4-7] loading data\n"


def test_a_traceback_or_warning_on_stderr_is_never_folded(capsys):
    console = Console("j", 8)
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        "    step()\n"
        "\n"
        "RuntimeError: NCCL timeout\n"
    )
    for rank in range(8):
        _lines(console, rank, "stderr", traceback, now=0)
        _lines(console, rank, "stderr", "UserWarning: TypedStorage is deprecated\n", now=0)
        _lines(console, rank, "stderr", "[W socket.cpp:663] client socket timed out\n", now=0)
        _lines(console, rank, "stderr", "INFO step 10\n", now=0)  # not an alarm: folds
        _lines(console, rank, "stdout", "RuntimeError: on stdout\n", now=0)  # stdout folds
    console.flush()
    out = capsys.readouterr()
    err = out.err.splitlines()
    for rank in range(8):
        mine = [line for line in err if line.startswith(f"[j r{rank}] ")]
        assert mine == [f"[j r{rank}] {line}" for line in traceback.splitlines()] + [
            f"[j r{rank}] UserWarning: TypedStorage is deprecated",
            f"[j r{rank}] [W socket.cpp:663] client socket timed out",
        ]
    assert err[-1] == "[j r0-7] INFO step 10"
    assert len(err) == 8 * 7 + 1
    assert out.out == "[j r0-7] RuntimeError: on stdout\n"


def test_a_late_line_gets_a_fold_of_its_own(capsys):
    console = Console("j", 8)
    for rank in range(7):
        _lines(console, rank, "stdout", "step 1 done\n", now=0)
    console.tick(now=0.6)
    assert capsys.readouterr().out == "[j r0-6] step 1 done\n"
    _lines(console, 7, "stdout", "step 1 done\n", now=2.0)  # after its fold was shown
    assert capsys.readouterr().out == "[j r7] step 1 done\n"  # no other rank owes it: at once
    # A straggler's line never joins the others' next one: late lines fold only together.
    for rank in range(6):
        _lines(console, rank, "stdout", "Epoch 0, Loss 0.5\n", now=3.0)
    console.tick(now=3.5)
    for rank in range(6):
        _lines(console, rank, "stdout", "Epoch 1, Loss 0.4\n", now=4.0)
    _lines(console, 6, "stdout", "Epoch 0, Loss 0.7\n", now=4.1)
    _lines(console, 7, "stdout", "Epoch 0, Loss 0.6\n", now=4.2)
    assert console.tick(now=4.2) == 4.5
    console.tick(now=4.5)
    assert capsys.readouterr().out == (
        "[j r0-5] Epoch 0, Loss 0.5\n[j r0-5] Epoch 1, Loss 0.4\n[j r6-7] Epoch 0, Loss 0.6..0.7\n"
    )
    for rank in (6, 7):  # late again, after "Epoch 1" was shown without them
        _lines(console, rank, "stdout", "Epoch 1, Loss 0.3\n", now=5.0)
    assert capsys.readouterr().out == "[j r6-7] Epoch 1, Loss 0.3\n"


def test_each_rank_keeps_its_order_and_folds_show_in_order_of_first_line(capsys):
    console = Console("j", 2, fold=True)
    _lines(console, 1, "stdout", "b\n", now=0.0)
    _lines(console, 0, "stdout", "a\n", now=0.1)  # alone yet: moved before the "b" it joins
    _lines(console, 0, "stdout", "b\n", now=0.1)
    _lines(console, 1, "stdout", "a\n", now=0.2)
    console.flush()
    assert capsys.readouterr().out == "[j r0] a\n[j r0-1] b\n[j r1] a\n"
    _lines(console, 1, "stdout", "b\n", now=1.0)
    _lines(console, 0, "stdout", "a\n", now=1.1)
    _lines(console, 1, "stdout", "a\n", now=1.2)  # now rank 0's "a" is shared: it stays ...
    _lines(console, 0, "stdout", "b\n", now=1.3)  # ... and this "b" may not go before it
    console.flush()
    assert capsys.readouterr().out == "[j r1] b\n[j r0-1] a\n[j r0] b\n"


def test_ranks_not_shown_do_not_count(capsys):
    console = Console("j", 16, show=range(8))
    for rank in range(8):
        _lines(console, rank, "stdout", "ready\n", now=0)
    assert capsys.readouterr().out == "[j r0-7] ready\n"  # complete without ranks 8-15
    assert console.tick(now=0) is None


def test_folding_delays_no_line_by_more_than_a_second():
    """Ranks that print at scattered times, ticked as the driver's watch loop does: at
    each write and when tick says. A rank's k-th line shown is the k-th it wrote."""
    import random

    rng = random.Random(7)  # noqa: S311 - a repeatable scatter, not a secret
    ranks, epochs = 32, 20
    writes = sorted(
        (epoch * 0.7 + rng.uniform(0, 1.5), rank, epoch)
        for rank in range(ranks)
        for epoch in range(epochs)
    )
    written: dict[int, list[float]] = {rank: [] for rank in range(ranks)}
    shown: dict[int, list[float]] = {rank: [] for rank in range(ranks)}
    clock, printed = [0.0], []

    def sink(stream: str, text: str) -> None:
        for line in text.splitlines():
            printed.append(line)
            for rank in _ranks(line.split("|", 1)[0]):
                shown[rank].append(clock[0])

    console = Console("j", ranks, prefix="{rank}|", sink=sink)
    due: float | None = None
    while writes or due is not None:
        if writes and (due is None or writes[0][0] <= due):
            clock[0], rank, epoch = writes.pop(0)
            written[rank].append(clock[0])
            line = f"Rank {rank}: Epoch {epoch}, Loss 0.{rank}\n"
            _lines(console, rank, "stdout", line, clock[0])
        else:
            clock[0] = due
        due = console.tick(now=clock[0])
    assert all(len(shown[rank]) == epochs for rank in range(ranks))
    waited = [shown[r][k] - written[r][k] for r in range(ranks) for k in range(epochs)]
    assert 0 < max(waited) <= 1.0, max(waited)
    assert len(printed) < ranks * epochs / 4  # and they did fold


def _ranks(label: str) -> list[int]:
    """A prefix's ranks: "0-2,5" -> [0, 1, 2, 5]."""
    found = []
    for part in label.split(","):
        first, _, last = part.partition("-")
        found += range(int(first), int(last or first) + 1)
    return found


def test_log_files_stay_unfolded(capsys, tmp_path):
    console = Console("j", 8, log_dir=tmp_path)
    for epoch in range(3):
        for rank in range(8):
            _lines(console, rank, "stdout", f"Rank {rank}: Epoch {epoch}, Loss 0.{rank}\n", epoch)
    console.flush()
    console.close_logs()
    assert capsys.readouterr().out == "".join(
        f"[j r0-7] Rank 0..7: Epoch {epoch}, Loss 0.0..0.7\n" for epoch in range(3)
    )
    for rank in range(8):
        assert (tmp_path / f"rank-{rank}.log").read_text() == "".join(
            f"Rank {rank}: Epoch {epoch}, Loss 0.{rank}\n" for epoch in range(3)
        )


def test_folding_is_on_by_size_unless_the_option_says(capsys):
    from orchestrator import ConfigError
    from orchestrator.options import FOLD_FROM_RANKS

    assert FOLD_FROM_RANKS == 8
    assert Console("j", 7).folder is None
    assert Console("j", 8).folder is not None
    assert Console("j", 128, show=[0, 1]).folder is None  # two ranks on the console
    assert Console("j", 2, fold=True).folder is not None
    assert Console("j", 128, fold=False).folder is None
    unfolded = Console("j", 128, fold=False)
    for rank in range(3):
        _lines(unfolded, rank, "stdout", "same\n", now=0)
    assert capsys.readouterr().out == "[j r0] same\n[j r1] same\n[j r2] same\n"
    assert distribute(len, num_replicas=2).options.fold_output is None
    assert distribute(len, num_replicas=2, fold_output=False).options.fold_output is False
    with pytest.raises(ConfigError, match="fold_output='yes': must be True, False, or None"):
        distribute(len, num_replicas=2, fold_output="yes")  # type: ignore[arg-type]
