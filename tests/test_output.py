"""What the ranks print, as the driver shows and keeps it: prefixed lines, whole and in order,
partial lines, progress bars, per-rank log files; and the driver's own messages and the
status line of a quiet call. (Lines many ranks write alike: test_fold.py.)"""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from orchestrator import DistributedError, distribute, testing
from orchestrator.diagnose.stall import READ_EVERY_S
from orchestrator.show.logs import PARTIAL_DELAY_S, PROGRESS_INTERVAL_S, Console
from orchestrator_workers.protocol import OutputChunk

# --- the driver's console, without Ray ----------------------------------------------------


class _Seq:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, stream: str, text: str | bytes) -> OutputChunk:
        self.n += 1
        data = text.encode() if isinstance(text, str) else text
        return OutputChunk(self.n, stream, data)


def test_lines_are_prefixed_and_split_across_chunks(capsys):
    chunk = _Seq()
    console = Console("train", 2)
    console.write(1, [chunk("stdout", "Epoch 1, Lo"), chunk("stdout", "ss 0.5\nEpoch 2")], now=0)
    console.write(0, [chunk("stderr", "warn\n")], now=0)
    out = capsys.readouterr()
    assert out.out == "[train r1] Epoch 1, Loss 0.5\n"
    assert out.err == "[train r0] warn\n"
    console.flush()
    assert capsys.readouterr().out == "[train r1] Epoch 2\n"


def test_multibyte_characters_split_across_chunks(capsys):
    chunk = _Seq()
    console = Console("j", 1)
    data = "naïve ✓\n".encode()
    console.write(0, [chunk("stdout", data[:3]), chunk("stdout", data[3:])], now=0)
    assert capsys.readouterr().out == "[j r0] naïve ✓\n"


def test_partial_line_is_shown_without_waiting_for_its_newline(capsys):
    chunk = _Seq()
    console = Console("j", 1)
    console.write(0, [chunk("stdout", "Password: ")], now=10.0)
    assert console.tick(now=10.0) == 10.0 + PARTIAL_DELAY_S
    assert capsys.readouterr().out == ""
    console.tick(now=10.0 + PARTIAL_DELAY_S)
    assert capsys.readouterr().out == "[j r0] Password: \n"
    console.tick(now=20.0)  # unchanged: not shown again
    assert capsys.readouterr().out == ""


def test_a_line_cut_short_is_shown_once_and_filed_whole(capsys, tmp_path):
    """In a flood, a chunk may end mid-line and its rest come after the partial delay: the
    start is shown, then only the rest, and the log file has the line once, whole."""
    chunk = _Seq()
    console = Console("j", 1, log_dir=tmp_path)
    console.write(0, [chunk("stdout", "line 1\nline 2 cut sh")], now=0.0)
    console.tick(now=PARTIAL_DELAY_S)
    console.write(0, [chunk("stdout", "ort\nline 3\nPassword: ")], now=1.0)
    console.tick(now=1.0 + PARTIAL_DELAY_S)
    console.write(0, [chunk("stdout", "\n")], now=2.0)  # its end, nothing more
    console.flush()
    console.close_logs()
    assert capsys.readouterr().out.splitlines() == [
        "[j r0] line 1",
        "[j r0] line 2 cut sh",
        "[j r0] ort",
        "[j r0] line 3",
        "[j r0] Password: ",
    ]
    assert (tmp_path / "rank-0.log").read_text() == "line 1\nline 2 cut short\nline 3\nPassword: \n"


def test_carriage_return_progress_bar_gives_few_lines(capsys):
    chunk = _Seq()
    console = Console("j", 1)
    now = 0.0
    for i in range(1, 101):  # 100 redraws over 10 s, like tqdm
        console.write(0, [chunk("stderr", f"\r{i:3d}%|{'#' * (i // 10)}")], now=now)
        console.tick(now=now)
        now += 0.1
    console.write(0, [chunk("stderr", "\n")], now=now)
    lines = capsys.readouterr().err.splitlines()
    assert 5 <= len(lines) <= 10 / PROGRESS_INTERVAL_S + 3
    assert lines[-1] == "[j r0] 100%|##########"
    assert all("\r" not in line for line in lines)


def test_log_ranks_limit_the_console_but_files_keep_every_rank(capsys, tmp_path):
    chunk = _Seq()
    console = Console("j", 3, show=[0], log_dir=tmp_path)
    for rank in range(3):
        console.write(rank, [chunk("stdout", f"hello from {rank}\n")], now=0)
    console.write(2, [chunk("stderr", "error on 2\n")], now=0)
    console.flush()
    console.close_logs()
    assert capsys.readouterr().out == "[j r0] hello from 0\n"
    assert (tmp_path / "rank-2.log").read_text() == "hello from 2\nerror on 2\n"
    assert (tmp_path / "rank-1.log").read_text() == "hello from 1\n"


def test_custom_prefix_and_ray_markers(capsys):
    chunk = _Seq()
    console = Console("exp", 4, prefix="{rank}|")
    console.write(3, [chunk("stdout", ":actor_name:exp r3\nreal line\n")], now=0)
    assert capsys.readouterr().out == "3| real line\n"
    plain = Console("exp", 1, prefix="")
    plain.write(0, [chunk("stdout", "bare\n")], now=0)
    assert capsys.readouterr().out == "bare\n"


# --- the driver's own messages and the status line, without Ray --------------------------


def test_driver_messages_go_through_logging(capsys):
    """Shown on stderr by default; silenced or redirected with standard logging."""
    import logging

    from orchestrator.show import messages

    log = logging.getLogger("orchestrator")
    messages.say("hello")
    messages.warn("careful", job="train")
    assert capsys.readouterr().err == "[orchestrator] hello\n[train] careful\n"
    level = log.level
    assert level == logging.INFO  # shown by default, whatever the root logger's level
    log.setLevel(logging.ERROR)
    try:
        messages.say("hidden")
        messages.warn("hidden too")
        assert capsys.readouterr().err == ""
    finally:
        log.setLevel(level)
    caught: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    saved = log.handlers[:]
    log.handlers[:] = [Keep()]
    try:
        messages.say("elsewhere", job="train")
    finally:
        log.handlers[:] = saved
    assert caught == ["[train] elsewhere"] and capsys.readouterr().err == ""
    # An application that set up logging owns them: its handler, its levels, shown once.
    root = logging.getLogger()
    keep, level = Keep(), root.level
    root.addHandler(keep)
    root.setLevel(logging.INFO)
    try:
        messages.say("through the app", job="train")
        log.setLevel(logging.WARNING)  # the application's choice for our logger
        messages.say("below the level it set")
        messages.warn("a warning")
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
        log.setLevel(logging.INFO)
    assert caught[1:] == ["[train] through the app", "[orchestrator] a warning"]
    assert capsys.readouterr().err == ""


def test_status_line_of_a_quiet_call(capsys, monkeypatch):
    """Shown after 10 s of a call and 10 s without output: printed at most once a minute,
    or redrawn in place on a terminal; ORCHESTRATOR_STATUS=0 or logging turn it off."""
    import logging

    from orchestrator.show import messages, status

    line = status.StatusLine("train", 4, started=100.0)
    line._in_place = False
    assert line.tick(105.0, last_output=100.0) == 110.0  # not yet: the call is young
    assert line.tick(135.0, last_output=130.0) == 140.0  # not yet: output 5 s ago
    assert capsys.readouterr().err == ""
    assert line.tick(142.0, last_output=130.0) == 202.0
    assert capsys.readouterr().err == "[train] 4 ranks running 0:42; last output 0:12 ago\n"
    assert line.tick(150.0, last_output=130.0) == 202.0  # at most once a minute
    line.tick(203.0, last_output=130.0)
    assert capsys.readouterr().err == "[train] 4 ranks running 1:43; last output 1:13 ago\n"
    drawn = status.StatusLine("train", 2, started=0.0)
    drawn._in_place = True
    assert drawn.tick(12.0, last_output=0.0) == 13.0  # redrawn every second
    drawn.tick(13.0, last_output=0.0)
    messages.clear_in_place()  # before other output
    assert capsys.readouterr().err == (
        "\r\x1b[K[train] 2 ranks running 0:12; last output 0:12 ago"
        "\r\x1b[K[train] 2 ranks running 0:13; last output 0:13 ago\r\x1b[K"
    )
    # Under an application's handler (or pytest's), never redrawn: a new line each time
    # would flood its log, so at most once a minute.
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    root, keep, level = logging.getLogger(), Keep(), logging.getLogger().level
    root.addHandler(keep)
    root.setLevel(logging.INFO)
    try:
        handled = status.StatusLine("train", 2, started=0.0)
        handled._in_place = True  # a terminal, yet an application's handler
        assert handled.tick(12.0, last_output=0.0) == 72.0
        assert handled.tick(13.0, last_output=0.0) == 72.0
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
    assert lines == ["[train] 2 ranks running 0:12; last output 0:12 ago"]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ORCHESTRATOR_STATUS", "0")
    assert status.StatusLine("train", 4, started=0.0).tick(500.0, last_output=0.0) is None
    monkeypatch.delenv("ORCHESTRATOR_STATUS")
    quiet = logging.getLogger("orchestrator.status")
    quiet.setLevel(logging.WARNING)
    try:
        status.StatusLine("train", 4, started=0.0).tick(500.0, last_output=0.0)
    finally:
        quiet.setLevel(logging.NOTSET)
    assert capsys.readouterr().err == ""


# --- folding: the lines many ranks write alike, shown once, without Ray -------------------


# --- on the session's two-node cluster ----------------------------------------------------


def test_output_from_every_source_is_captured_with_rank_prefix(cluster, capfd):
    def chatty() -> None:
        import logging
        import subprocess

        rank = os.environ["RANK"]
        print(f"print from {rank}")
        os.write(1, f"fd1 from {rank}\n".encode())
        os.write(2, f"fd2 from {rank}\n".encode())
        logging.getLogger("t").warning("log from %s", rank)
        subprocess.run([sys.executable, "-c", f"print('child of {rank}')"], check=True)

    with distribute(chatty, num_replicas=2, replicas_per_node=1, name="chat") as fn:
        fn()
    captured = capfd.readouterr()
    for rank in range(2):
        assert f"[chat r{rank}] print from {rank}" in captured.out
        assert f"[chat r{rank}] fd1 from {rank}" in captured.out
        assert f"[chat r{rank}] child of {rank}" in captured.out
        assert f"[chat r{rank}] fd2 from {rank}" in captured.err
        assert f"[chat r{rank}] log from {rank}" in captured.err
        assert f"fd2 from {rank}" not in captured.out


def test_every_line_arrives_once_in_order_before_the_call_returns(cluster, capfd):
    def flood(n: int) -> int:
        import subprocess

        rank = os.environ["RANK"]
        for i in range(n):
            print(f"line {i} of rank {rank}")
            if i % 1000 == 0:
                os.write(1, f"fd1 {i} of rank {rank}\n".encode())
                os.write(2, f"fd2 {i} of rank {rank}\n".encode())
        sys.stdout.flush()
        subprocess.run([sys.executable, "-c", f"print('child of rank {rank}')"], check=True)
        os.write(2, f"last stderr of rank {rank}".encode())  # no newline: still shown
        return n

    with distribute(flood, num_replicas=4, replicas_per_node=2, name="flood") as fn:
        assert fn(5000) == [5000] * 4
        captured = capfd.readouterr()
    for rank in range(4):
        prefix = f"[flood r{rank}] "
        out = [line[len(prefix) :] for line in captured.out.splitlines() if line.startswith(prefix)]
        err = [line[len(prefix) :] for line in captured.err.splitlines() if line.startswith(prefix)]
        # stdout: the printed lines, exactly once and in order, then the child's line.
        printed = [line for line in out if line.startswith("line ")]
        assert printed == [f"line {i} of rank {rank}" for i in range(5000)]
        assert [line for line in out if line.startswith("fd1 ")] == [
            f"fd1 {i} of rank {rank}" for i in range(0, 5000, 1000)
        ]
        assert out[-1] == f"child of rank {rank}"
        assert len(out) == 5000 + 5 + 1
        # stderr stays stderr.
        assert err == [f"fd2 {i} of rank {rank}" for i in range(0, 5000, 1000)] + [
            f"last stderr of rank {rank}"
        ]


def test_log_ranks_and_per_rank_log_files(cluster, capfd, tmp_path):
    def talk() -> None:
        rank = os.environ["RANK"]
        print(f"hello from {rank}")
        if rank == "1":
            raise RuntimeError("rank 1 gives up")

    fn = distribute(talk, num_replicas=2, replicas_per_node=1, log_ranks=[0], log_dir=tmp_path)
    with pytest.raises(DistributedError) as info:
        fn()
    out = capfd.readouterr().out
    assert "[talk r0] hello from 0" in out
    assert "hello from 1" not in out  # not shown on the console ...
    assert info.value.logs(1) == "hello from 1\n"  # ... but kept
    assert info.value.log_dir == fn.log_dir
    assert fn.log_dir is not None and fn.log_dir.parent == tmp_path / "talk"
    assert fn.logs(0) == "hello from 0\n"
    assert f"{fn.log_dir}/rank-N.log" in str(info.value)
    fn.shutdown()


def test_tqdm_bar_on_rank_0_gives_a_bounded_number_of_lines(cluster, capfd):
    def progress() -> None:
        from tqdm import tqdm

        if os.environ["RANK"] == "0":
            for _ in tqdm(range(300), mininterval=0, miniters=1, desc="epoch 1"):
                time.sleep(0.01)  # 300 redraws over about 3 s

    with distribute(progress, num_replicas=2, replicas_per_node=1, name="bar") as fn:
        fn()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[bar r0]")]
    assert 1 <= len(lines) <= 10, lines
    assert "300/300" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_a_quiet_call_shows_a_status_line_and_a_table(cluster, capfd, monkeypatch):
    """Ranks silent past the quiet time: one status line on stderr (not a terminal here);
    the job's table has every rank, its node, state and last line."""
    from orchestrator.show import status

    monkeypatch.setattr(status, "QUIET_S", 1.0)

    def nap() -> int:
        print(f"rank {os.environ['RANK']} naps", flush=True)
        time.sleep(3)
        return 1

    with distribute(nap, num_replicas=2, replicas_per_node=1, name="quiet") as fn:
        job = fn.submit()
        assert job.result(timeout=60) == [1, 1]
        err = capfd.readouterr().err
        assert err.count("[quiet] 2 ranks running 0:0") == 1, err
        assert "; last output 0:01 ago" in err or "; last output 0:02 ago" in err, err
        table = job.table()
        assert [(r.rank, r.state, r.last_line) for r in table.rows] == [
            (0, "finished", "rank 0 naps"),
            (1, "finished", "rank 1 naps"),
        ]
        assert {r.node for r in table.rows} <= {n["NodeManagerAddress"] for n in ray.nodes()}
        assert 2.5 < table.rows[0].elapsed < 30
        assert "<table>" in fn._repr_html_() and "rank 1 naps" in job._repr_html_()


def test_a_quiet_warm_call_after_one_that_printed(cluster):
    """A rank's output is numbered across calls: a call whose ranks print nothing owes none
    of what the previous call already showed (it waited for it for ever)."""

    def maybe_print(say: bool) -> int:
        if say:
            print("hello", flush=True)
        return 1

    with distribute(maybe_print, num_replicas=2, replicas_per_node=1, name="quiet2") as fn:
        assert fn(True) == [1, 1]
        assert fn.submit(False).result(timeout=30) == [1, 1]
        assert fn.submit(True).result(timeout=30) == [1, 1]


def test_a_line_is_shown_while_the_call_runs_and_a_quiet_wait_is_cheap(cluster, tmp_path):
    """The driver wakes when a rank prints (the line is shown while the call still runs)
    or a run ends; otherwise only every `testing.idle_wait_s()`: a quiet call costs it a
    few passes."""
    go = tmp_path / "go"

    def speak_then_wait(path: str) -> int:
        print(f"rank {os.environ['RANK']} waits", flush=True)
        while not os.path.exists(path):
            time.sleep(0.02)
        time.sleep(2.0)  # quiet
        return 1

    with (
        testing.wait_passes() as passes,
        distribute(speak_then_wait, num_replicas=2, replicas_per_node=1, name="wake") as fn,
    ):
        job = fn.submit(str(go))
        deadline = time.monotonic() + 60
        while {r.last_line for r in job.table().rows} != {"rank 0 waits", "rank 1 waits"}:
            assert not job.done(), job.result()
            assert time.monotonic() < deadline, job.table().rows
            time.sleep(0.05)
        quiet_from = time.monotonic()
        go.touch()  # the ranks go on only once the driver has shown their lines
        assert job.result(timeout=60) == [1, 1]
        quiet_s = time.monotonic() - quiet_from
    quiet = [t for t in passes if t > quiet_from]
    # 2 s without output (longer on a loaded machine): a pass every idle_wait_s; every
    # READ_EVERY_S while it is watched, one to ask each node for its ranks' records and
    # one as each node's reading comes (2 nodes); and one as the runs end; not one per
    # poll of the table (40 in those 2 s).
    wakes = quiet_s / testing.idle_wait_s() + quiet_s / READ_EVERY_S * (1 + 2)
    assert len(quiet) <= wakes + 3, (len(quiet), quiet_s)
