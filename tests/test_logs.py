"""The driver's console: line assembly, partial lines, progress bars, files. No Ray."""

from __future__ import annotations

from orchestrator.logs import PARTIAL_DELAY_S, PROGRESS_INTERVAL_S, Console
from orchestrator_workers.protocol import OutputChunk


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


def test_log_files_and_the_folders_made_for_them_are_this_users_alone(tmp_path):
    import stat

    folder = tmp_path / "logs" / "train" / "stamp"
    console = Console("train", 1, log_dir=folder)
    console.write(0, [OutputChunk(1, "stdout", b"secret\n")], now=0)
    console.close_logs()
    log = folder / "rank-0.log"
    assert log.read_text() == "secret\n"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    for made in (folder, folder.parent, folder.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
