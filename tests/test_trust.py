"""Another user on the same machine: what they may plant is not believed, what we write they
cannot read, and what we signal is ours.

The checks that need a second uid run as root (as on this project's machines) and use
uid 65534 (nobody), which needs no account to be made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator import distribute, logfiles, testing
from orchestrator.connect import discovery, ray_files
from orchestrator.errors import ConfigError
from orchestrator.show.logs import Console
from orchestrator_workers import handoff, private, sockets
from orchestrator_workers.protocol import Collected, OutputChunk, Peer
from tests.helpers import OTHER, needs_namespaces, readable_by_other_user, sibling_attacks

as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")


@pytest.fixture
def ray_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Ray temp folder of this test's own, 0777 as Ray leaves it, with a live 'cluster'.

    This user's state folder and temp dir are the test's own too: no record of a real
    local runtime is seen, and none is left.
    """
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
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
    assert discovery.local_cluster() == (address, None)
    named.chmod(0o666)  # anyone may rewrite it
    assert discovery.local_cluster() == (None, None)
    assert "may be written by other users (mode 666)" in capsys.readouterr().err
    named.chmod(0o644)
    planted = ray_root / "elsewhere"
    named.rename(planted)
    named.symlink_to(planted)
    assert discovery.local_cluster() == (None, None)
    said = capsys.readouterr().err
    assert f"not using the Ray cluster named in {named}" in said and "is a symlink" in said
    assert "address= or RAY_ADDRESS" in said  # what to do if it is trusted after all


@as_root
def test_an_address_file_or_record_of_another_uid_is_ignored(
    ray_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    named = ray_root / "ray_current_cluster"
    os.chown(named, OTHER, OTHER)
    assert discovery.local_cluster() == (None, None)
    said = capsys.readouterr().err
    assert f"belongs to another user (uid {OTHER})" in said, said
    # The local runtime's record names the auth mode and the pid `local stop` signals.
    address = "127.0.0.1:1"
    record = discovery.record_path(1)
    private.write(record, f'{{"address": "{address}", "pid": 1, "auth": "token"}}')
    found = discovery.runtime_record(address)
    assert found is not None and (found.pid, found.auth, found.temp_dir) == (1, "token", None)
    os.chown(record, OTHER, OTHER)
    assert discovery.runtime_record(address) is None


def squat_a_port(host: str = "0.0.0.0", port: int = 0) -> tuple[int, int]:  # noqa: S104
    """(pid, port) of a process of uid 65534 listening on `host`:`port` (all interfaces, and
    a port of its own, by default, as Ray's GCS listens).

    Forked rather than started: uid 65534 may not read this interpreter's files.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then wait to be killed
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = socket.create_server((host, port), family=family)
            os.write(write, str(server.getsockname()[1]).encode())
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(write)
    port = int(os.read(read, 16))
    os.close(read)
    return pid, port


@as_root
def test_a_stale_address_file_naming_a_port_another_user_took_is_not_joined(
    processes, ray_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Root's own address file, left by a stopped head, names a port that uid 65534 now
    listens on: joining would give them the script, and unpickling their answers would run
    their code as root. What listens there must be this user's (or root's)."""
    named = ray_root / "ray_current_cluster"
    squatter, port = squat_a_port()
    try:
        named.write_text(f"127.0.0.1:{port}")  # root's, 0644: yesterday's trust check passed it
        assert discovery.listener_uids("127.0.0.1", port) == {OTHER}
        assert discovery.local_cluster() == (None, None)
        said = capsys.readouterr().err
        assert f"a process of uid {OTHER} listens" in said, said
        assert f"127.0.0.1:{port}" in said and "address= or RAY_ADDRESS" in said
    finally:
        os.kill(squatter, signal.SIGKILL)
        os.waitpid(squatter, 0)
    # Its head gone and nobody listening: the next driver removes the stale name.
    assert discovery.local_cluster() == (None, named)
    assert not named.exists()


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare for its own /etc/hosts")
@as_root
def test_an_address_file_naming_a_host_whose_other_address_another_user_holds_is_ignored(
    processes, ray_root: Path, tmp_path: Path
) -> None:
    """The file names a host with two addresses: at the first, this user's listener; at
    the second, uid 65534's. Ray may connect to either, so every listener must be ours."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 twohomed\n::1 twohomed\n")
    with socket.create_server(("127.0.0.1", 0)) as ours:
        port = ours.getsockname()[1]
        squatter, _ = squat_a_port("::1", port)
        try:
            (ray_root / "ray_current_cluster").write_text(f"twohomed:{port}")
            look = (
                "from orchestrator.connect import discovery; "
                f"print(sorted(discovery.listener_uids('twohomed', {port})), "
                "discovery.local_cluster())"
            )
            env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
            seen = subprocess.run(
                [
                    "unshare",
                    "--mount",
                    "sh",
                    "-c",
                    'mount --bind "$1" /etc/hosts && exec "$2" -c "$3"',
                    "-",
                    str(hosts),
                    sys.executable,
                    look,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
        finally:
            os.kill(squatter, signal.SIGKILL)
            os.waitpid(squatter, 0)
    assert seen.stdout.strip() == f"[0, {OTHER}] (None, None)", seen.stdout + seen.stderr
    assert f"a process of uid {OTHER} listens" in seen.stderr, seen.stderr
    assert f"twohomed:{port}" in seen.stderr


def test_a_dead_runtime_s_record_and_address_file_are_removed(processes, ray_root: Path) -> None:
    """The next driver that finds the runtime dead removes both names it left."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    temp = ray_root.parent / "private-ray"
    temp.mkdir()
    address = "127.0.0.1:1"
    (temp / "ray_current_cluster").write_text(address)
    record = discovery.record_path(1)
    fields = f'"address": "{address}", "pid": {dead.pid}, "auth": "token", "temp_dir": "{temp}"'
    private.write(record, "{" + fields + "}")
    (ray_root / "ray_current_cluster").unlink()  # no plain `ray start` either
    assert discovery.local_cluster() == (None, record)
    assert not record.exists() and not (temp / "ray_current_cluster").exists()


@as_root
def test_our_heads_never_use_a_ray_temp_folder_others_can_enter(
    ray_root: Path, open_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray makes its folders 0777: in RAY_TMPDIR/ray, which another user can reach, they
    could swap its address file for a link that Ray then writes through."""
    monkeypatch.setenv("RAY_TMPDIR", str(open_dir))
    made = ray_files.head_temp_dir(lasting=True, name="ray-test")
    # This test's temp dir is long: the short private folder then (see test_embedded).
    private_folders = (private.folder(lasting=True), private.folder(short=True))
    assert made is not None and Path(made).parent in private_folders, made
    Path(made).rmdir()
    assert "not putting Ray's files in RAY_TMPDIR" in capsys.readouterr().err
    open_dir.chmod(0o700)  # closed to others (as pytest's and mkdtemp's folders)
    assert ray_files.head_temp_dir(lasting=True, name="ray-test") is None  # Ray's, there


@as_root
@pytest.mark.parametrize("case", ["theirs", "open", "their-subfolder"])
def test_a_log_dir_another_user_can_reach_into_is_refused_before_anything_starts(
    open_dir: Path, case: str
) -> None:
    """/tmp/logs-like folders: the per-call folder could be guessed and pre-made, adopted
    without an owner check, or a link; another user then reads the training output."""
    shared = open_dir / "logs"
    shared.mkdir()
    shared.chmod(0o1777)
    if case == "theirs":
        os.chown(shared, OTHER, OTHER)
    elif case == "open":
        shared.chmod(0o777)  # ours, but anyone may rename what is in it
    else:
        (shared / "train").mkdir()
        os.chown(shared / "train", OTHER, OTHER)
    with pytest.raises(ConfigError) as error:
        distribute(print, num_replicas=1, name="train", log_dir=shared)
    said = str(error.value)
    assert f"log_dir='{shared}'" in said and "another user could read" in said, said
    assert {"theirs": f"uid {OTHER}", "open": "mode 777", "their-subfolder": "train"}[case] in said


@as_root
def test_a_call_s_log_folder_is_new_unguessable_and_its_files_made_new(
    processes, open_dir: Path
) -> None:
    """In a shared sticky folder: each call makes a fresh 0700 folder with a random name,
    and a rank's log is created new, never one someone planted."""
    shared = open_dir / "logs"
    shared.mkdir()
    shared.chmod(0o1777)
    first, second = logfiles.call_folder(shared, "train"), logfiles.call_folder(shared, "train")
    assert not first.exists()  # made on the first line written: a quiet call leaves none
    logfiles.make_call_folder(first)
    logfiles.make_call_folder(second)
    logfiles.make_call_folder(first)  # a restart's attempt finds its own
    assert first != second and first.parent == second.parent == shared / "train"
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    assert len(first.name.rsplit("-", 1)[1]) == 16  # 64 random bits
    planted = first / "rank-0.log"
    planted.write_text("")
    os.chown(planted, OTHER, OTHER)  # as if they had got in
    console = Console("train", 1, log_dir=first)
    with pytest.raises(private.UnsafeFolderError, match="was not made by this job"):
        console.write(0, [OutputChunk(1, "stdout", b"DB_PASSWORD=hunter2\n")])
    planted.unlink()
    console = Console("train", 1, log_dir=first)
    console.write(0, [OutputChunk(1, "stdout", b"secret\n")])
    console.close_logs()
    again = Console("train", 1, log_dir=first)  # a restart appends to its own file
    again.write(0, [OutputChunk(2, "stdout", b"more\n")])
    again.close_logs()
    assert planted.read_text().splitlines()[-2:] == ["secret", "more"]
    assert not readable_by_other_user(planted)


def test_local_stop_signals_only_this_user_s_ray_start_for_that_address(processes) -> None:
    """A pid from a record or a broker is signalled only if it is our `ray start` there."""
    script = "import time; time.sleep(60)"
    lookalike = subprocess.Popen(
        [sys.executable, "-c", script, "start", "--head", "--block", "--port=6399"]
    )
    other = subprocess.Popen([sys.executable, "-c", script])
    _wait_for_exec(lookalike.pid, b"--port=6399")
    _wait_for_exec(other.pid, script.encode())
    try:
        assert discovery.runtime_not_ours(lookalike.pid, "10.0.0.1:6399") is None
        why = discovery.runtime_not_ours(lookalike.pid, "10.0.0.1:6400")  # another runtime's port
        assert why and "--port=6400" in why, why
        why = discovery.runtime_not_ours(other.pid, "10.0.0.1:6399")
        assert why and "its command line is not" in why, why
    finally:
        for process in (lookalike, other):
            process.kill()
            process.wait()
    assert discovery.runtime_not_ours(lookalike.pid, "10.0.0.1:6399") == "no such process"


def _wait_for_exec(pid: int, mark: bytes) -> None:
    """Until `pid` runs its own program: before exec, /proc shows the parent's argv."""
    deadline = time.monotonic() + 30
    while mark not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"pid {pid} did not exec"
        time.sleep(0.01)


@as_root
def test_local_stop_leaves_another_user_s_process_alone(processes) -> None:
    theirs = subprocess.Popen(  # a shell that stays (it runs two commands), with that argv
        ["sh", "-c", "sleep 60; :", "start", "--head", "--block", "--port=6399"], user=OTHER
    )
    _wait_for_exec(theirs.pid, b"--port=6399")
    try:
        why = discovery.runtime_not_ours(theirs.pid, "10.0.0.1:6399")
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
def test_another_user_reads_none_of_our_files(processes, open_dir: Path) -> None:
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


def test_files_ranks_leave_go_in_a_folder_of_this_user_alone(tmp_path, monkeypatch):
    import stat

    from orchestrator_workers import private, tail

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = private.folder()
    assert folder == tmp_path / "orchestrator"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert tail.tail_path(42) == folder / "tail-42.json"
    folder.chmod(0o777)  # others may write there now: plant, read or redirect files
    with pytest.raises(private.UnsafeFolderError, match="not this user's private folder"):
        private.folder()
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder.symlink_to(elsewhere)  # a planted link
    with pytest.raises(private.UnsafeFolderError):
        private.folder()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert private.folder().name == f"orchestrator-{os.getuid()}"  # in the temp dir


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


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_the_rendezvous_store_listens_for_its_call_alone_on_the_ranks_interface(cluster) -> None:
    """torch's TCPStore has no authentication: between calls nothing listens on the
    store's port (the next call's is only reserved), and during a call only the ranks'
    interface answers, not loopback, as another local user would try first."""
    import torch.distributed as dist

    def rendezvous() -> tuple[str, int, bool]:
        dist.init_process_group("gloo")
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        loopback_refused = _refused("127.0.0.1", port)
        dist.barrier()
        dist.destroy_process_group()
        return host, port, loopback_refused

    fn = distribute(rendezvous, num_replicas=2, replicas_per_node=1)
    try:
        (host, port, loopback_refused), _ = fn()
        if host not in ("127.0.0.1", "localhost"):
            assert loopback_refused, "the store listened on every interface"
        deadline = time.monotonic() + 10  # closed once every rank is done, not waited for
        while not _refused(host, port):
            assert time.monotonic() < deadline, "the finished call's store stayed open"
            time.sleep(0.1)
        reserved = testing.pool(fn).store_port
        assert reserved != port and _refused(host, reserved)  # the next call's: reserved only
        if os.getuid() == 0:  # another user cannot take it between calls
            taken = _as_other_user(lambda: _try_to_take(host, reserved))
            assert taken.startswith(b"refused"), taken
        (_, used, _), _ = fn()  # the next call rendezvous there
        assert used == reserved
    finally:
        fn.shutdown()


def _try_to_take(host: str, port: int) -> bytes:
    """Bind and listen on `host`:`port` as Linux lets a second socket do: b"taken" or why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            return f"refused: {exc}".encode()
    return b"taken"


def _as_other_user(work: Callable[[], bytes]) -> bytes:
    """What `work` returns, run in a forked child of uid 65534 (within 10 s)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            os.write(write, work())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as answer:
            return answer.read()
    finally:
        os.waitpid(pid, 0)


def _served() -> tuple[handoff.Door, list[bytes]]:
    """A door in this process that notes each call it runs, and answers it."""
    calls: list[bytes] = []

    def serve(spec: bytes, call: bytes, payload: bytes) -> tuple[bool, bytes]:
        calls.append(payload)
        return False, b"outcome of " + payload

    return handoff.Door(serve), calls


@as_root
def test_a_rank_takes_calls_from_its_own_user_alone(processes) -> None:
    """A rank's door (see handoff) runs what comes through it: another user who connects
    is cut off before anything is read; the rank's own user is served."""
    door, calls = _served()
    assert door.name

    def intrude() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(f"\0{door.name}")
            with contextlib.suppress(OSError):  # cut off: writing may fail too
                sockets.send(sock, [b"call", b"spec", b"args", b"code"])
            try:
                return b"answered" if sock.recv(1) else b"cut off"
            except OSError as exc:
                return f"cut off ({exc})".encode()

    assert _as_other_user(intrude).startswith(b"cut off")
    assert calls == []
    hand = handoff.Hand()
    me = Peer(rank=5, door=door.name, pid=os.getpid(), spec=b"spec", key=door.key)
    hand.start(b"call-1", [me], b"call", b"code")
    assert hand.collect(b"call-1") == Collected([(5, b"outcome of code")], (), False)
    assert calls == [b"code"]


@as_root
def test_a_call_goes_to_no_door_but_the_rank_s_own_process(processes) -> None:
    """The hand checks who holds a door before it sends a call (its arguments may be
    secret): not another process of this user, and not another user who took a dead
    rank's socket name. The rank counts as lost instead."""
    door, calls = _served()
    hand = handoff.Hand()
    elsewhere = Peer(rank=1, door=door.name, pid=os.getpid() + 1, spec=b"", key=door.key)
    hand.start(b"call-1", [elsewhere], b"call", b"secret")
    assert hand.collect(b"call-1") == Collected([(1, None)], (), True)
    assert calls == []

    read, write = os.pipe()
    name = f"orchestrator-squatted-{os.getpid()}"
    pid = os.fork()
    if pid == 0:  # the child: takes the name, then tells what it was sent
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(f"\0{name}")
            listener.listen(1)
            os.write(write, b"listening\n")
            conn, _ = listener.accept()
            conn.settimeout(5)
            try:
                got = conn.recv(1 << 16)
            except OSError:
                got = b""
            os.write(write, got or b"nothing")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as told:
        assert told.readline() == b"listening\n"
        squatter = Peer(rank=2, door=name, pid=pid, spec=b"")
        hand.start(b"call-2", [squatter], b"call", b"secret")
        assert hand.collect(b"call-2") == Collected([(2, None)], (), True)
        assert told.read() == b"nothing"
    os.waitpid(pid, 0)


@needs_namespaces
def test_a_sibling_container_on_the_node_network_runs_nothing_through_a_door(
    processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An abstract socket is reachable from every process in the network namespace, and
    SO_PEERCRED's uid is the same for a root container: the door serves only a peer
    that sends its secret first. A connection queued before the hand's (as when a node's
    first rank is replaced) is not served next; a silent one does not hold the door."""
    monkeypatch.setattr(handoff, "KEY_WAIT_S", 5.0)  # a loaded machine's room to serve the hand
    door, calls = _served()
    marker = tmp_path / "planted"
    said = sibling_attacks(marker)
    assert f"{door.name} hung up" in said, said
    assert calls == [] and not marker.exists()
    # A connection that waits, silent, in the door's backlog, then the real hand.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(f"\0{door.name}")
        hand = handoff.Hand()
        me = Peer(rank=0, door=door.name, pid=os.getpid(), spec=b"", key=door.key)
        hand.start(b"call-1", [me], b"call", b"args")
        assert hand.collect(b"call-1") == Collected([(0, b"outcome of args")], (), False)
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):  # served while the silent one still waits
            silent.recv(1)
        silent.settimeout(handoff.KEY_WAIT_S + 5)
        assert silent.recv(1) == b""  # hung up on, within the key's wait
    assert "key" not in repr(door) and door.key.hex() not in repr(me)


@needs_namespaces
def test_a_sibling_container_runs_nothing_in_a_pool_s_ranks(cluster, tmp_path: Path) -> None:
    """Against real ranks: every door of a live pool, before its first handed-off call
    and between calls, refuses the sibling's call, and the results stay right."""
    marker = tmp_path / "planted"

    def add(x: float, pad: bytes = b"") -> float:
        return x + 1.0 + (1000.0 if os.path.exists(marker) else 0.0)

    fn = distribute(add, num_replicas=2, replicas_per_node=2)
    try:
        assert fn(2.0, pad=bytes(1 << 20)) == [3.0, 3.0]  # large: no call handed off yet
        first = sibling_attacks(marker)
        assert fn(2.0) == [3.0, 3.0]
        later = sibling_attacks(marker)
        assert fn(2.0) == [3.0, 3.0]
    finally:
        fn.shutdown()
    for said in (first, later):
        assert "served" not in said and "hung up" in said, said
    assert not marker.exists()


@needs_namespaces
def test_a_sibling_container_runs_nothing_when_a_node_s_first_rank_is_replaced(
    cluster, tmp_path: Path
) -> None:
    """The node's first rank (its hand) crashes and is replaced while the sibling attacks
    every door, again and again: whatever waited in a door's backlog when the old hand's
    link closed is not served next, and the new rank's door refuses it too."""
    marker, crashed = tmp_path / "planted", tmp_path / "crashed"

    def add(x: float, crash: bool = False) -> float:
        if crash and os.environ["LOCAL_RANK"] == "0" and not os.path.exists(crashed):
            open(crashed, "w").close()
            os._exit(3)
        return x + 1.0 + (1000.0 if os.path.exists(marker) else 0.0)

    fn = distribute(add, num_replicas=2, replicas_per_node=2, max_restarts=1)
    said: list[str] = []
    try:
        assert fn(2.0) == [3.0, 3.0]  # handed off: rank 0's link to rank 1's door is made
        attacker = threading.Thread(target=lambda: said.append(sibling_attacks(marker, 8)))
        attacker.start()
        time.sleep(1)  # the sibling's first round is under way
        assert fn(2.0, crash=True) == [3.0, 3.0]  # rank 0 is replaced, rank 1 kept
        assert fn(2.0) == [3.0, 3.0]
        attacker.join()
        assert fn(2.0) == [3.0, 3.0]
    finally:
        fn.shutdown()
    assert crashed.exists() and said, said
    rounds = said[0].count("doors ")
    assert rounds >= 2, said[0]
    assert "served" not in said[0] and "hung up" in said[0], said[0]
    assert not marker.exists()


@pytest.fixture
def sticky_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp dir of this test's own that every user may write in, sticky, as /tmp is."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="sticky"))
    folder.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@as_root
def test_a_private_folder_made_anew_by_another_user_yields_nothing(
    processes, sticky_tmp: Path
) -> None:
    """A /tmp cleaner removes orchestrator-UID while ranks live; another user makes one of
    the same name, with a link to a file of ours, a FIFO and a readable file in it.
    Nothing is read from it, written through it, or hangs on it."""
    from orchestrator_workers import elastic, tail

    ours = private.folder()
    error_file = elastic.error_file()  # pinned while the folder is this user's
    assert error_file.startswith("/proc/self/fd/")
    elastic.prepare(error_file)
    made = os.stat(ours / os.path.basename(error_file))
    assert stat.S_IMODE(made.st_mode) == 0o600 and made.st_uid == os.getuid()
    victim = sticky_tmp / "root-owned"
    victim.write_text("precious")
    shutil.rmtree(ours)  # the cleaner
    name = os.path.basename(error_file)
    tail_name = f"tail-{os.getpid()}.json"

    def remake() -> bytes:
        os.mkdir(ours, 0o777)
        os.chmod(ours, 0o777)  # noqa: S103 - the attacker's folder, open to all
        os.symlink(victim, ours / name)
        os.mkfifo(ours / tail_name, 0o666)
        fd = os.open(ours / "where", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"{}")
        os.close(fd)
        return b"done"

    assert _as_other_user(remake) == b"done"
    assert os.stat(ours).st_uid == OTHER
    # torch's error file: the pinned folder is gone, so none is handed to torch at all.
    assert elastic.error_file() == ""
    # A keeper saving a dead rank's last words, and the driver reading them.
    with pytest.raises(private.UnsafeFolderError):
        private.write(ours / tail_name, "secret output")
    started = time.monotonic()
    assert tail.read_tail(str(ours / tail_name), 0.2) is None
    assert time.monotonic() - started < 30  # the FIFO did not hang the read
    with pytest.raises(private.UnsafeFolderError):
        private.read_private(ours / "where")
    with pytest.raises(private.UnsafeFolderError):
        private.create(ours / "rank.json")
    assert victim.read_text() == "precious"


@as_root
def test_torch_s_record_writes_into_our_0600_file_not_through_a_link(
    processes, sticky_tmp: Path
) -> None:
    """torch's `record` opens TORCHELASTIC_ERROR_FILE by name, with mode 0644: the product
    makes the file 0600 first, through its pinned folder."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from orchestrator_workers import elastic

    error_file = elastic.error_file()
    elastic.prepare(error_file)

    @record
    def fail() -> None:
        raise ValueError("DB_PASSWORD=hunter2")

    with pytest.MonkeyPatch.context() as env:
        env.setenv(elastic.VAR, error_file)
        with pytest.raises(ValueError, match="DB_PASSWORD"):
            fail()
    written = private.folder() / os.path.basename(error_file)
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    assert "DB_PASSWORD" in written.read_text()
    assert not readable_by_other_user(written)
    report = elastic.read(error_file, time.time() - 5)
    assert report is not None and "DB_PASSWORD" in report.message
    written.unlink()


def test_each_call_s_error_file_is_new_and_empty(sticky_tmp: Path) -> None:
    """Before every call the error file is an empty 0600 file the rank made: one that the
    last call left empty is kept, one that torch wrote or that was replaced is made anew."""
    from orchestrator_workers import elastic

    error_file = elastic.error_file()
    name = private.folder() / os.path.basename(error_file)
    elastic.prepare(error_file)
    made = os.stat(name)
    elastic.prepare(error_file)  # left empty: the same file
    assert os.stat(name).st_ino == made.st_ino
    name.write_text('{"message": "an earlier call\'s"}')  # torch's record, a caught error
    elastic.prepare(error_file)
    assert name.read_text() == ""
    assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
    name.unlink()
    os.symlink(sticky_tmp / "elsewhere", name)  # replaced: removed, made anew
    elastic.prepare(error_file)
    found = os.lstat(name)
    assert stat.S_ISREG(found.st_mode) and found.st_size == 0
    assert not (sticky_tmp / "elsewhere").exists()
    os.chmod(name, 0o644)
    elastic.prepare(error_file)
    assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
    name.unlink()


@as_root
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_planted_shm_buffer_is_refused_and_left_to_its_owner() -> None:
    """Another user's file at a call's /dev/shm name never becomes a rank's tensors (the
    rank copies for itself instead), and the stale sweep leaves it alone."""
    from orchestrator_workers import sharing

    key = f"planted-{os.getpid()}"
    path = sharing.SHM / f"{sharing.PREFIX}{key}"
    path.write_bytes(b"\xff" * (1 << 16))
    os.chown(path, OTHER, OTHER)
    path.chmod(0o644)
    try:
        data = bytes(range(256)) * 64
        (copy,) = sharing.private_buffers([memoryview(data)], [False], key, readers=2)
        assert bytes(copy) == data
        assert path.read_bytes() == b"\xff" * (1 << 16)
        os.utime(path, (0, 0))  # long untouched
        sharing.remove("", older_than=sharing.STALE_S)
        assert path.exists()
    finally:
        path.unlink(missing_ok=True)
