"""What runs first on a node without our rank side: the archive, unpacked once in this user's
own folder and put first on the path; a shell that builds the real rank and forwards to it.
(On real nodes without the package: tests/test_bare_nodes.py; another user's attacks on
the unpacked copy: tests/test_trust_rankside.py.)"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

import orchestrator_workers
from orchestrator.connect import bootstrap, inventory, rankside
from orchestrator_workers.actor import CONCURRENCY_GROUPS, RankActor


@pytest.fixture
def node_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A node's temp dir and cache folder of this test's own (in a temp dir, where a
    folder's name is not safe); the path and PYTHONPATH restored after."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/of/the/user")
    yield tmp_path


@pytest.fixture
def own_cache(node_temp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache folder in this user's home, where no other user can make or remove a name."""
    home = os.path.realpath(Path.home())
    if not bootstrap._kept(home):
        pytest.skip(f"{home} is not this user's alone")
    cache = Path(tempfile.mkdtemp(prefix=".orchestrator-test-", dir=home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


def _archive() -> tuple[bytes, str]:
    """What a node that lacks ours gets (both sides), and its content id."""
    return rankside._archive()


def test_the_archive_is_unpacked_once_in_this_user_s_folder_and_put_first(own_cache, monkeypatch):
    monkeypatch.delitem(sys.modules, "orchestrator_workers")  # a fresh worker has none
    package, content = _archive()
    folder = bootstrap.ensure(package, content)
    own = own_cache / "orchestrator"
    assert folder == str(own / f"rank-side-{content}")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert not (own_cache.parent / f"orchestrator-{os.getuid()}").exists()
    assert inventory.content_id(folder) == content == bootstrap.archive_id(package)
    unpacked = Path(folder) / "orchestrator_workers"
    assert inventory.content_id(str(unpacked)) == rankside.content()  # every file, as sent
    assert (Path(folder) / "orchestrator" / "snapshot.py").exists()  # for `import snapshot`
    assert sys.path[0] == folder
    assert os.environ["PYTHONPATH"] == f"{folder}:/somewhere/of/the/user"  # for its children
    (unpacked / "marker").write_text("kept")
    assert bootstrap.ensure(b"not read again", content) == folder  # once per content
    assert (unpacked / "marker").exists() and sys.path.count(folder) == 1


def test_a_folder_another_user_could_write_in_is_passed_over(node_temp, monkeypatch):
    """Not used, and not fatal: the rank side goes to a folder of this user's, and on the
    path through a descriptor (here, a temp dir, no name is safe)."""
    monkeypatch.delitem(sys.modules, "orchestrator_workers")
    for shared in (node_temp / f"orchestrator-{os.getuid()}", node_temp / "cache"):
        shared.mkdir(mode=0o700)
        shared.chmod(0o777)
    (node_temp / "cache" / "orchestrator").symlink_to(node_temp / "cache")
    entry = bootstrap.ensure(*_archive())
    assert entry.startswith(f"/proc/{os.getpid()}/fd/"), entry
    assert os.path.realpath(entry).startswith(f"{node_temp}/orchestrator-{os.getuid()}-")
    assert os.listdir(node_temp / f"orchestrator-{os.getuid()}") == []
    assert sys.path[0] == entry


def test_a_copy_already_imported_is_used_if_the_same_else_named(node_temp, monkeypatch):
    """Ray reuses a task's worker: one may have imported a copy of ours before."""
    same = bootstrap.ensure(*_archive())  # this process's own copy
    assert same == str(Path(orchestrator_workers.__file__).parent.parent)
    other = node_temp / "site" / "orchestrator_workers"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("OLDER = True\n")
    older = types.ModuleType("orchestrator_workers")
    older.__file__ = str(other / "__init__.py")
    monkeypatch.setitem(sys.modules, "orchestrator_workers", older)
    with pytest.raises(ImportError, match=f"imported another orchestrator_workers \\({other}"):
        bootstrap.ensure(*_archive())


def test_the_shell_has_the_rank_s_methods_and_their_ray_options():
    shell = bootstrap.shell(RankActor)
    public = {name for name in vars(RankActor) if not name.startswith("_")}
    assert public and public <= set(vars(shell))
    assert shell.drain.__ray_concurrency_group__ == RankActor.drain.__ray_concurrency_group__
    assert shell.run_node.__ray_concurrency_group__ == "node"
    ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(shell)  # Ray takes it as an actor class


def test_both_sides_unpack_together_for_a_supervisor(node_temp, monkeypatch):
    """A detached job's supervisor runs the driver side too: both packages, one folder."""
    for name in ("orchestrator_workers", "orchestrator"):
        monkeypatch.delitem(sys.modules, name)  # a fresh worker has neither
    driver_side = Path(orchestrator_workers.__file__).parent.parent / "orchestrator"
    folder = Path(os.path.realpath(bootstrap.ensure(*_archive())))
    assert inventory.content_id(str(folder / "orchestrator_workers")) == rankside.content()
    unpacked = folder / "orchestrator"
    assert (unpacked / "supervise" / "supervisor.py").exists()  # its subpackages too
    assert inventory.content_id(str(unpacked)) == inventory.content_id(str(driver_side))
    assert os.path.realpath(sys.path[0]) == str(folder)
