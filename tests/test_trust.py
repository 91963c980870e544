"""Another user on the same machine: what they may plant is not believed, what we write they
cannot read, and what we signal is ours.

The checks that need a second uid run as root (as on this project's machines) and use
uid 65534 (nobody), which needs no account to be made.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import cluster, local
from orchestrator.logs import Console
from orchestrator_workers import private
from orchestrator_workers.protocol import OutputChunk

OTHER = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")


def readable_by_other_user(path: Path) -> bool:
    """Whether uid 65534 can read `path` (its folders included)."""
    probe = subprocess.run(
        ["cat", str(path)],
        user=OTHER,
        group=OTHER,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.fixture
def ray_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Ray temp folder of this test's own, 0777 as Ray leaves it, with a live 'cluster'."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    root = tmp_path / "ray"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with socket.create_server(("127.0.0.1", 0)) as server:  # something answers there
        (root / "ray_current_cluster").write_text(f"127.0.0.1:{server.getsockname()[1]}")
        yield root


def test_an_address_file_another_user_could_have_written_is_ignored_and_said_so(
    ray_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray's address file sits in a folder every user may write in: only ours (or root's)
    counts; otherwise the script would send its code and data to their address."""
    named = ray_root / "ray_current_cluster"
    address = named.read_text()
    assert cluster.local_cluster() == (address, None)
    named.chmod(0o666)  # anyone may rewrite it
    assert cluster.local_cluster() == (None, None)
    assert "may be written by other users (mode 666)" in capsys.readouterr().err
    named.chmod(0o644)
    planted = ray_root / "elsewhere"
    named.rename(planted)
    named.symlink_to(planted)
    assert cluster.local_cluster() == (None, None)
    said = capsys.readouterr().err
    assert f"not using the Ray cluster named in {named}" in said and "is a symlink" in said
    assert "address= or RAY_ADDRESS" in said  # what to do if it is trusted after all


@as_root
def test_an_address_file_or_record_of_another_uid_is_ignored(
    ray_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    named = ray_root / "ray_current_cluster"
    os.chown(named, OTHER, OTHER)
    assert cluster.local_cluster() == (None, None)
    said = capsys.readouterr().err
    assert f"belongs to another user (uid {OTHER})" in said, said
    # The local runtime's record names the auth mode and the pid `local stop` signals.
    address = "127.0.0.1:1"
    record = cluster.runtime_record_path(address)
    private.write(record, f'{{"address": "{address}", "pid": 1, "auth": "token"}}')
    try:
        assert cluster.runtime_record(address) == {"address": address, "pid": 1, "auth": "token"}
        os.chown(record, OTHER, OTHER)
        assert cluster.runtime_record(address) is None
    finally:
        record.unlink()


def test_local_stop_signals_only_this_user_s_ray_start_for_that_address() -> None:
    """A pid from a record or a broker is signalled only if it is our `ray start` there."""
    script = "import time; time.sleep(60)"
    lookalike = subprocess.Popen(
        [sys.executable, "-c", script, "start", "--head", "--block", "--port=6399"]
    )
    other = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert local._not_ours(lookalike.pid, "10.0.0.1:6399") is None
        why = local._not_ours(lookalike.pid, "10.0.0.1:6400")  # another runtime's port
        assert why and "--port=6400" in why, why
        why = local._not_ours(other.pid, "10.0.0.1:6399")
        assert why and "its command line is not" in why, why
    finally:
        for process in (lookalike, other):
            process.kill()
            process.wait()
    assert local._not_ours(lookalike.pid, "10.0.0.1:6399") == "no such process"


@as_root
def test_local_stop_leaves_another_user_s_process_alone() -> None:
    theirs = subprocess.Popen(  # a shell that stays (it runs two commands), with that argv
        ["sh", "-c", "sleep 60; :", "start", "--head", "--block", "--port=6399"], user=OTHER
    )
    try:
        why = local._not_ours(theirs.pid, "10.0.0.1:6399")
        assert why == f"it belongs to uid {OTHER}, not to this user (uid 0)"
    finally:
        theirs.kill()
        theirs.wait()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user may enter, as a home folder is (pytest's own is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="trust", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@as_root
def test_another_user_reads_none_of_our_files(open_dir: Path) -> None:
    """Private-folder files (keeper copies, the runtime's record and log) and rank logs."""
    mine = private.folder(lasting=True) / f"probe-{os.getpid()}.json"
    private.write(mine, "secret")
    try:
        assert stat.S_IMODE(mine.stat().st_mode) == 0o600
        assert not readable_by_other_user(mine)
        mine.parent.chmod(0o711)  # even where the folder could be entered, the file is ours
        try:
            assert not readable_by_other_user(mine)
        finally:
            mine.parent.chmod(0o700)
    finally:
        mine.unlink()
    console = Console("train", 1, log_dir=open_dir / "logs" / "train")
    console.write(0, [OutputChunk(1, "stdout", b"password=hunter2\n")], now=0)
    console.close_logs()
    log = open_dir / "logs" / "train" / "rank-0.log"
    assert log.read_text() == "password=hunter2\n"
    assert not readable_by_other_user(log)
    control = open_dir / "public.txt"
    control.write_text("anyone")
    control.chmod(0o644)
    assert readable_by_other_user(control)  # the probe itself can read what it may


def test_files_are_created_new_never_through_a_link(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = private.folder()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (folder / "out.json.part").symlink_to(victim)  # planted before our write
    private.write(folder / "out.json", "ours")
    assert victim.read_text() == "untouched"
    assert (folder / "out.json").read_text() == "ours"
    assert stat.S_IMODE((folder / "out.json").stat().st_mode) == 0o600
