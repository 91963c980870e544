"""A local runtime started from a folder another user writes in (`cd /tmp`): nothing of it
reaches a rank, live or detached. Its ranks run where their driver runs.

Before the fix, `orchestrator local start` made that folder every warm spare's working
directory and first on its sys.path: another user's `wave.py` there ran in a detached job's
ranks, and a detached job's relative writes landed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator_workers import private
from tests.helpers import OTHER, ROOT, stop_head, wait_for

WAVE = textwrap.dedent("""\
    import os
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "MARK"), "a") as mark:
        mark.write(f"{os.getuid()} {os.getpid()}\\n")
""")

DRIVER = textwrap.dedent("""\
    import json, os, sys
    from orchestrator import distribute

    def probe(tag):
        import sibling  # beside the driver's script: its folder is on the rank's sys.path
        import wave  # the standard library's, never a module some other user left
        with open(f"written-{tag}.txt", "a") as out:  # relative: the driver's working dir
            out.write(os.environ["RANK"] + "\\n")
        return [wave.__file__, os.getcwd(), sys.path, sibling.WHO, os.getpid()]

    live = distribute(probe, num_replicas=1)
    print("LIVE", json.dumps(live("live")), flush=True)
    live.shutdown()
    detached = distribute(probe, num_replicas=2, detach=True, name="workdir")
    job = detached.submit("detached")
    print("DETACHED", json.dumps(job.result(timeout=120)), flush=True)
    job.release()
    detached.shutdown()
""")


class Runtime:
    """A local runtime started in `shared`, a folder uid 65534 writes in."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.shared = tmp / "shared"
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))
        }
        self.env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT), HOME=str(tmp / "home"))
        self.pid = 0
        self.port = 0

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`orchestrator local ARGS`, run from the shared folder (as `cd /tmp` would)."""
        # The command as installed: `python -m` would put the shared folder on its own path.
        return subprocess.run(
            [str(Path(sys.executable).with_name("orchestrator")), "local", *args],
            cwd=self.shared,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=420,  # a start on a loaded machine (connect/head.py waits 300 s)
            check=False,
        )


def _as_other_user(path: Path, text: str) -> None:
    """Write `path` as uid 65534 (as this user where it cannot act as another)."""
    if os.getuid() != 0:
        path.write_text(text)
        return
    pid = os.fork()
    if pid == 0:  # the child: only system calls
        code = 1
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, text.encode())
            os.close(fd)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"uid {OTHER} could not write {path}"
    assert path.stat().st_uid == OTHER


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _spare_pids(ray_tmpdir: Path) -> set[int]:
    """Pids of this runtime's spare processes."""
    found = set()
    want = f"RAY_TMPDIR={ray_tmpdir}".encode()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if not entry.name.isdigit():
                continue
            spare = (entry / "cmdline").read_bytes().startswith(b"ray::Spare")
            if spare and want in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
    return found


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    """`orchestrator local start` with 2 spares, run in a 1777 folder with another user's
    `wave.py` in it; stopped at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="rw", dir="/tmp"))
    tmp.chmod(0o755)
    rt = Runtime(tmp)
    rt.shared.mkdir(mode=0o1777)
    rt.shared.chmod(0o1777)
    _as_other_user(rt.shared / "wave.py", WAVE)
    port = _free_port()
    try:
        started = rt.cli("start", "--spares", "2", "--port", str(port), "--cpus", "4")
        assert started.returncode == 0, started.stdout + started.stderr
        head = re.search(r"\(pid (\d+)\)", started.stdout)
        assert head, started.stdout
        rt.pid, rt.port = int(head[1]), port
        yield rt
    finally:
        rt.cli("stop")
        if rt.pid:  # stopped, or stopped here: our own pid only
            stop_head(rt.pid)
        for spare in _spare_pids(tmp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(spare, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(private.folder(lasting=True) / f"ray-{port}", ignore_errors=True)


def test_the_runtime_and_its_spares_run_in_a_private_folder(runtime: Runtime) -> None:
    """Ray's head and the idle spares run in a folder of this user's alone, not the one
    `local start` ran in."""
    wait_for(lambda: bool(_spare_pids(runtime.tmp)), 120, "a spare started")
    for pid in [runtime.pid, *_spare_pids(runtime.tmp)]:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        assert cwd != runtime.shared, pid
        found = cwd.stat()
        assert found.st_uid == os.getuid() and stat.S_IMODE(found.st_mode) == 0o700, cwd


def test_live_and_detached_ranks_import_nothing_from_that_folder(runtime: Runtime) -> None:
    """A driver in its own folder: its live rank and its detached job's ranks (a spare and
    a new process) import the standard library's `wave`, and write beside the driver."""
    scripts, work = runtime.tmp / "scripts", runtime.tmp / "work"
    scripts.mkdir()
    work.mkdir()
    (scripts / "driver.py").write_text(DRIVER)
    (scripts / "sibling.py").write_text("WHO = 'sibling'\n")
    spares = _spare_pids(runtime.tmp)
    ran = subprocess.run(
        [sys.executable, str(scripts / "driver.py")],
        cwd=work,
        env=runtime.env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    found = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in ran.stdout.splitlines()
        if line.startswith(("LIVE ", "DETACHED "))
    }
    ranks = [("live", *found["LIVE"][0]), *(("detached", *r) for r in found["DETACHED"])]
    assert len(ranks) == 3, ran.stdout
    assert {pid for *_, pid in ranks} & spares, (ranks, spares)  # spares served, as warm ones do
    for how, wave, cwd, path, who, _ in ranks:
        assert Path(wave).parent != runtime.shared, (how, wave)
        assert cwd == str(work), (how, cwd)  # where the driver ran, not where the runtime did
        assert str(runtime.shared) not in path, (how, path)
        assert who == "sibling", how
    assert not (runtime.shared / "MARK").exists(), (runtime.shared / "MARK").read_text()
    assert (work / "written-live.txt").read_text().split() == ["0"]
    assert sorted((work / "written-detached.txt").read_text().split()) == ["0", "1"]
    assert not list(runtime.shared.glob("written-*")), list(runtime.shared.iterdir())


def test_a_runtime_too_busy_to_answer_is_said_to_run_never_taken_for_none(
    runtime: Runtime,
) -> None:
    """On a loaded machine its Ray may not answer in time: `status` says it runs and did
    not answer, never that none runs (a test's teardown then left its head running, and
    orphaned it). `stop` asks Ray nothing: it signals the pid its record names."""
    gcs = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and b"gcs_server" in _read(entry / "cmdline")
        and f"ray-{runtime.port}".encode() in _read(entry / "cmdline")
    ]
    assert len(gcs) == 1, gcs
    os.kill(gcs[0], signal.SIGSTOP)  # as busy as a machine can make it
    try:
        said = runtime.cli("status")
    finally:
        os.kill(gcs[0], signal.SIGCONT)
    assert said.returncode == 1, said.stdout + said.stderr
    assert f"(pid {runtime.pid}) is running, but it did not answer" in said.stdout, said.stdout
    assert "no local runtime is running" not in said.stdout


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
