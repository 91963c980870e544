"""Another user against the rank side shipped to a node that lacks it (connect/bootstrap):
the folder it is unpacked in, removed by a /tmp cleaner while ranks live and made again by
uid 65534 with code of theirs; taken before the first unpack; or an unpacked copy that
is not what its content id says. Nothing of theirs runs, and ranks still start.

The checks that need a second uid run as root (as on this project's machines) and use
uid 65534 (nobody), which needs no account to be made.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import orchestrator_workers
from orchestrator import DistributedError, distribute, testing
from orchestrator.connect import bootstrap, inventory, rankside
from tests.helpers import OTHER, wait_for

as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")

PLANT = "open({mark!r} + '/{name}-' + str(__import__('os').getuid()), 'w').close()\n"
"""What another user's planted module does when it runs: leaves a mark, named after it."""


def _as_other_user(work: Callable[[], None]) -> None:
    """Run `work` in a forked child of uid 65534; fail if it raised."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls and plain file writes
        code = 1
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            work()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's work failed"


def _plant(folder: Path, marks: Path) -> None:
    """What another user makes at `folder`, the rank side's name: modules a rank or its
    children would import from there (a standard library's, one that every Python child
    runs at start, our package's and two of its lazily imported modules)."""
    for name in (
        "wave.py",
        "sitecustomize.py",
        "orchestrator_workers/__init__.py",
        "orchestrator_workers/script.py",
        "orchestrator_workers/private.py",
    ):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o777)
        path.write_text(PLANT.format(mark=str(marks), name=name.replace("/", ".")))
    for made in (folder, *folder.rglob("*")):
        made.chmod(0o777)


@pytest.fixture
def sticky() -> Iterator[Path]:
    """A temp dir of this test's own that every user may write in, sticky, as /tmp is,
    with a folder `marks` that planted code can write in."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="sticky"))
    folder.chmod(0o1777)
    (folder / "marks").mkdir(mode=0o777)
    (folder / "marks").chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _look(marks: str, step: str) -> dict[str, Any]:
    """In a rank: where its copy of ours is, what `import wave` and a Python child reach
    now, and (step "look") whether a lazily imported module of ours comes; step "die":
    it dies."""
    import importlib
    import subprocess
    import sys

    import orchestrator_workers
    from orchestrator_workers import capture

    if step == "die":
        print("dies", flush=True)
        os._exit(3)
    sys.modules.pop("wave", None)
    import wave

    child = subprocess.run(
        [sys.executable, "-c", "import wave; print(wave.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lazy = None
    try:
        if step == "look":
            lazy = importlib.import_module("orchestrator_workers.dcp").__file__
    except ImportError as exc:
        lazy = f"{type(exc).__name__}: {exc}"
    keeper = capture._active._keeper if capture._active is not None else None
    return {
        "file": orchestrator_workers.__file__,
        "where": os.path.realpath(os.path.dirname(orchestrator_workers.__file__)),
        "wave": wave.__file__,
        "child": child.stdout.strip() or child.stderr[-500:],
        "lazy": lazy,
        "keeper": keeper.pid if keeper is not None else None,
        "marks": sorted(os.listdir(marks)),
    }


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (reaped, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@as_root
def test_a_rank_side_folder_made_anew_by_another_user_runs_nothing_in_live_ranks(
    cluster, sticky: Path
) -> None:
    """Ranks on a node without a safe cache folder (here, another user took it) unpack in
    the temp dir. A cleaner removes the folder; uid 65534 makes it again with a `wave.py`,
    a `sitecustomize.py` and modules of our package. Nothing of theirs runs: not in the
    live ranks (`import wave`, a lazily imported module of ours), not in their Python
    children, not in a dead rank's keeper; and a rank started afterwards still starts."""
    marks = sticky / "marks"
    cache = sticky / "cache"
    (cache / "orchestrator").mkdir(parents=True)
    os.chown(cache / "orchestrator", OTHER, OTHER)  # taken before the first unpack
    env = {"TMPDIR": str(sticky), "XDG_CACHE_HOME": str(cache)}
    with testing.ship_rank_side():
        fn = distribute(_look, num_replicas=1, log_dir=False, runtime_env={"env_vars": env})
        try:
            first = fn(str(marks), "first")
            shipped = Path(first[0]["where"]).parent
            assert shipped.parent == sticky / f"orchestrator-{os.getuid()}", first
            assert {rank["where"] for rank in first} == {str(shipped / "orchestrator_workers")}
            assert all(rank["file"].startswith("/proc/") for rank in first), first  # a descriptor
            shutil.rmtree(shipped.parent)  # the cleaner
            _as_other_user(lambda: (shipped.parent.mkdir(mode=0o777), _plant(shipped, marks)))
            assert shipped.parent.stat().st_uid == OTHER

            second = fn(str(marks), "look")
            for rank in second:
                assert rank["wave"].startswith(os.path.dirname(os.__file__)), rank
                assert rank["child"].startswith(os.path.dirname(os.__file__)), rank
                # Gone with the folder (this node's own copy, where it has one): not theirs.
                assert rank["lazy"].startswith("ModuleNotFoundError") or rank["lazy"] == str(
                    Path(orchestrator_workers.__file__).with_name("dcp.py")
                ), rank
            with pytest.raises(DistributedError, match="rank 0"):
                fn(str(marks), "die")  # its keeper saves its last words: imports `private`
            keeper = second[0]["keeper"]
            assert keeper is not None
            wait_for(lambda: _gone(keeper), 30, "the dead rank's keeper gone")

            again = fn(str(marks), "look")  # a rank started now, where the name is theirs
            assert Path(again[0]["where"]).parent.parent.name.startswith(
                f"orchestrator-{os.getuid()}-"
            ), again  # a folder of a new name, made by the rank
        finally:
            fn.shutdown()
    assert os.listdir(marks) == []
    assert sorted(p.name for p in shipped.iterdir()) == sorted(
        ["wave.py", "sitecustomize.py", "orchestrator_workers"]
    )  # theirs, left alone


@pytest.fixture
def node(sticky: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A node's temp dir of this test's own, sticky as /tmp; this process's path and
    PYTHONPATH restored after (`ensure` puts ours first on both)."""
    monkeypatch.setattr(tempfile, "tempdir", str(sticky))
    monkeypatch.setenv("XDG_CACHE_HOME", str(sticky / "cache"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.delitem(sys.modules, "orchestrator_workers")  # a fresh worker has none
    yield sticky


@pytest.fixture
def home_cache(node: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache folder in this user's home, where no other user can make or remove a name."""
    home = os.path.realpath(Path.home())
    if not bootstrap._kept(home):
        pytest.skip(f"{home} is not this user's alone")
    cache = Path(tempfile.mkdtemp(prefix=".orchestrator-test-", dir=home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


@as_root
def test_in_a_safe_cache_folder_the_name_is_this_user_s_alone(processes, home_cache, node):
    """The rank side goes on the path by name only where no other user can make, remove or
    rename a name on its way: not the old public name in the temp dir, which another user
    may fill; and a Python child started with the PYTHONPATH runs nothing of theirs."""
    package, content = rankside._archive()
    public = node / f"orchestrator-{os.getuid()}" / f"rank-side-{content}"
    entry = bootstrap.ensure(package, content)
    assert entry == str(home_cache / "orchestrator" / f"rank-side-{content}")
    assert os.environ["PYTHONPATH"] == entry
    shutil.rmtree(public.parent, ignore_errors=True)
    _as_other_user(lambda: (public.parent.mkdir(mode=0o777), _plant(public, node / "marks")))

    def intrude() -> None:
        for folder in (home_cache / "orchestrator", Path(entry)):
            try:
                (folder / "wave.py").write_text("taken")
            except PermissionError:
                continue
            raise AssertionError(f"uid {OTHER} wrote in {folder}")

    _as_other_user(intrude)
    child = subprocess.run(
        [sys.executable, "-c", "import wave, orchestrator_workers as w; print(w.__file__)"],
        env={**os.environ, "PYTHONPATH": entry},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == f"{entry}/orchestrator_workers/__init__.py"
    assert os.listdir(node / "marks") == []


@as_root
def test_a_name_taken_before_the_first_unpack_does_not_stop_the_rank_side(node):
    """Another user made both folders the rank side would go in, with a copy of it of
    theirs at its name: it unpacks in a folder of a new name, reached by a descriptor."""
    package, content = rankside._archive()
    for taken in (node / f"orchestrator-{os.getuid()}", node / "cache" / "orchestrator"):
        _plant(taken / f"rank-side-{content}", node / "marks")
        for made in (taken, *taken.rglob("*")):
            os.chown(made, OTHER, OTHER)
    entry = bootstrap.ensure(package, content)
    assert entry.startswith(f"/proc/{os.getpid()}/fd/") and sys.path[0] == entry
    assert Path(entry).resolve().parent.name.startswith(f"orchestrator-{os.getuid()}-")
    assert inventory.content_id(entry) == content
    assert os.listdir(node / "marks") == []


def test_an_unpacked_copy_that_is_not_its_content_is_unpacked_again(home_cache, node):
    """A copy with a file changed, one added (a module, or anything Python would import
    such as an extension module), a link, or a file of another user is not used: the next
    process unpacks it again."""
    package, content = rankside._archive()
    path = list(sys.path)
    folder = Path(bootstrap.ensure(package, content))
    init = folder / "orchestrator_workers" / "__init__.py"
    original = init.read_bytes()
    tampered: list[Callable[[], None]] = [
        lambda: init.write_bytes(original + b"print('changed')\n"),
        lambda: (folder / "wave.py").write_text("print('added')\n"),
        lambda: (
            folder / "orchestrator_workers" / "evil.cpython-311-x86_64-linux-gnu.so"
        ).write_bytes(b"\x7fELF"),
        lambda: (folder / "orchestrator_workers" / "linked.py").symlink_to(init),
        lambda: os.chown(init, OTHER, OTHER),
    ]
    for tamper in tampered:
        tamper()
        sys.path[:] = path  # a new process
        assert bootstrap.ensure(package, content) == str(folder)
        assert init.read_bytes() == original and init.stat().st_uid == os.getuid()
        assert sorted(p.name for p in folder.iterdir()) == ["orchestrator", "orchestrator_workers"]
        assert inventory.content_id(str(folder)) == content


def test_copies_of_other_contents_nobody_holds_are_removed(home_cache, node):
    """A new content, unpacked, removes copies of others that no process holds and that
    were unpacked long ago; one that a live process holds is kept."""
    package, content = rankside._archive()
    base = home_cache / "orchestrator"
    old, held, recent = (base / f"rank-side-{name}" for name in ("0ld", "he1d", "recent"))
    for folder in (old, held, recent):
        (folder / "orchestrator_workers").mkdir(parents=True, mode=0o700)
    long_ago = time.time() - bootstrap.UNUSED_S - 60
    for folder in (old, held):
        os.utime(folder, (long_ago, long_ago))
    holder = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)  # as a live rank's `ensure` holds its copy
        bootstrap.ensure(package, content)
        assert sorted(p.name for p in base.iterdir()) == sorted(
            [held.name, recent.name, f"rank-side-{content}"]
        )
    finally:
        os.close(holder)
