"""What runs first on a node that lacks our rank side: the driver's copy put on the path.

A Ray `runtime_env` would bring it, but Ray starts every worker that has one through a
second Python (its `setup_worker.py` imports Ray, then execs the worker): about 0.4 s more
at every pool start and every restart here. So a rank on such a node is a shell instead,
an actor class made here from `RankActor`'s methods, and shipped by value like the rest
of this module: its constructor takes the archive (both sides: `from orchestrator import
snapshot` works in a rank, and a supervisor runs the driver side; bytes, through Ray's
object store), unpacks it once per content in this user's own folder on the node, checks
it, puts it first on `sys.path` (and on `PYTHONPATH`, for the rank's own child
processes), and only then imports `orchestrator_workers` and builds the real rank, to
which every method forwards. A task of ours (a dead rank's last words, removing a call's
buffers) does the same through `call`.

Ranks live for days, and a name on the path is looked up at every import. So the path
names a folder only where no other user can make, remove or rename a name in it or on its
way: `$XDG_CACHE_HOME/orchestrator`, else `~/.cache/orchestrator`. Elsewhere (a shared
temp dir, which a cleaner empties and anyone may fill again) the path names this
process's descriptor of the checked folder, `/proc/PID/fd/N`: a folder made anew under the
same name is never reached, and a removed one yields nothing. A copy is used only once it
is this user's alone and holds exactly the files of its content id; another is unpacked
in its place.

Standard library only: this module runs before anything of ours is on the node.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib
import io
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

PACKAGE = "orchestrator_workers"
UNUSED_S = 3600.0
"""A copy of another content that no process holds, unpacked longer ago than this, is
removed when a new content is unpacked beside it."""


def _files(folder: str) -> list[str]:
    """A package's files below `folder` (its .py files and py.typed, in its subpackages
    too; no caches), as sorted paths relative to it."""
    found: list[str] = []
    for where, folders, names in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith((".", "__pycache__")))
        relative = os.path.relpath(where, folder)
        found.extend(
            name if relative == "." else os.path.join(relative, name)
            for name in names
            if name.endswith(".py") or name == "py.typed"
        )
    return sorted(found)


def content_id(folder: str) -> str:
    """The content of the package in `folder`: every .py file's path and bytes."""
    return _digest(folder, [name for name in _files(folder) if name.endswith(".py")])


def _digest(folder: str, sources: list[str]) -> str:
    """The content id of `sources`, .py files below `folder` (paths relative to it)."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        with open(os.path.join(folder, name), "rb") as source:
            digest.update(name.encode() + b"\0" + source.read())
    return digest.hexdigest()[:16]


def archive(folder: str, *more: tuple[str, str]) -> bytes:
    """A zip of the rank side in `folder` under its import name, and of each (folder,
    import name) in `more` (their .py files, no caches)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zipped:
        for package_folder, name in ((folder, PACKAGE), *more):
            for path in _files(package_folder):
                zipped.write(os.path.join(package_folder, path), f"{name}/{path}")
    return buffer.getvalue()


def archive_id(package: bytes) -> str:
    """The content id of `package`, an archive: `content_id` of the folder it unpacks into."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(io.BytesIO(package)) as zipped:
        for name in sorted(n for n in zipped.namelist() if n.endswith(".py")):
            digest.update(name.encode() + b"\0" + zipped.read(name))
    return digest.hexdigest()[:16]


def ensure(package: bytes, content: str) -> str:
    """The driver's rank side (`package`, an archive whose `archive_id` is `content`; the
    driver side beside it) unpacked on this node, checked, and first on this process's
    path and PYTHONPATH: the entry put there (a folder's name, or a descriptor's path)."""
    placed = _placed(content)
    if placed is not None:  # an earlier call of this process put it there
        return placed
    entry, fd = _unpacked(package, content)
    folder = _through(fd, entry)
    # A worker Ray reuses may have run a task of ours before: the same copy will do.
    elsewhere = set()
    names = sorted(os.listdir(folder))  # the rank side, and the driver side
    for name in names:
        loaded = sys.modules.get(name)
        if loaded is None:
            continue
        where = os.path.dirname(loaded.__file__ or "")
        if content_id(where) != content_id(os.path.join(folder, name)):
            if name != PACKAGE:  # the driver side: our tasks need none, a supervisor is new
                continue
            os.close(fd)
            raise ImportError(
                f"this process imported another {name} ({loaded.__file__}) before the "
                f"driver's reached it ({os.path.realpath(folder)})"
            )
        elsewhere.add(os.path.dirname(where))
    if len(elsewhere) == 1 and all(name in sys.modules for name in names):
        os.close(fd)
        return elsewhere.pop()
    sys.path.insert(0, entry)
    paths = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = entry + (os.pathsep + paths if paths else "")
    return entry  # its descriptor stays open, and held, for as long as this process lives


def _placed(content: str) -> str | None:
    """The entry of this process's path that an earlier `ensure` put there for `content`
    (a descriptor's, even where its folder was removed since: nothing else replaces it)."""
    ours = f"/proc/{os.getpid()}/fd/"
    for entry in sys.path:
        target = entry
        if entry.startswith(ours):
            try:
                target = os.readlink(entry).removesuffix(" (deleted)")
            except OSError:
                continue
        if os.path.basename(target) == f"rank-side-{content}":
            return entry
    return None


def _unpacked(package: bytes, content: str) -> tuple[str, int]:
    """The rank side of `content` unpacked in a folder of this user's and checked: what to
    put on the path (the folder's name, where no other user can make or remove it; else
    this process's descriptor of it, as /proc/PID/fd/N), and that descriptor, held."""
    for base, by_name in _bases():
        folder = os.path.join(base, f"rank-side-{content}")
        for _ in range(3):  # another process may replace or prune it meanwhile
            fresh = not os.path.lexists(folder) and _unpack(package, folder, content)
            fd = _hold(folder)
            if fd is None:
                _set_aside(folder)
                continue
            if _matches(_through(fd, folder), content) and _same(fd, folder):
                if fresh:
                    _prune(base, folder)
                return (folder if by_name else f"/proc/{os.getpid()}/fd/{fd}"), fd
            os.close(fd)
            _set_aside(folder)
    raise PermissionError(
        f"no folder of this user's alone to unpack the rank side in (uid {os.getuid()}, "
        f"home {os.path.expanduser('~')}, temp dir {tempfile.gettempdir()}): set "
        "XDG_CACHE_HOME to a folder of your own that no other user can write in or above, "
        "in the environment of `ray start` on this node"
    )


def _bases() -> Iterator[tuple[str, bool]]:
    """Folders of this user's to unpack in, best first, each with whether its name may go
    on the path: only where no other user can make, remove or rename a name in it or on
    its way; else a descriptor's path does (where /proc has one)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    temp = tempfile.gettempdir()
    found = []
    for named in (
        os.path.join(cache, "orchestrator"),
        os.path.join(temp, f"orchestrator-{os.getuid()}"),
    ):
        if not os.path.isabs(named):  # no home ("~" unexpanded)
            continue
        try:
            os.makedirs(named, mode=0o700, exist_ok=True)
            mine = os.lstat(named)  # itself no link: the folders on its way may be
            if (
                stat.S_ISDIR(mine.st_mode)
                and mine.st_uid == os.getuid()
                and not mine.st_mode & 0o022
            ):
                base = os.path.realpath(named)
                found.append((base, _kept(base)))
        except OSError:  # not made, or not ours: the next place
            continue
    proc = os.path.isdir(f"/proc/{os.getpid()}/fd")
    yield from sorted((f for f in found if f[1] or proc), key=lambda f: not f[1])
    if proc:  # a folder of a new name, made here: another user may have taken the others'
        made = tempfile.mkdtemp(prefix=f"orchestrator-{os.getuid()}-")
        atexit.register(shutil.rmtree, made, True)
        yield made, False


def _kept(path: str) -> bool:
    """Whether no other user can make, remove or rename a name in `path` (resolved) or on
    its way: each folder this user's or root's, and not writable by others (sticky or not:
    a /tmp cleaner may remove a name there, and another user make it again)."""
    parts = path.split(os.sep)
    for end in range(1, len(parts) + 1):
        found = os.lstat(os.sep.join(parts[:end]) or os.sep)
        if found.st_uid not in (os.getuid(), 0) or found.st_mode & 0o022:
            return False
        if not found.st_mode & 0o011:
            return True  # nobody else can enter it: what lies below is out of their reach
    return True


def _unpack(package: bytes, folder: str, content: str) -> bool:
    """`package` unpacked as `folder` (made whole, then renamed into place, so a half-written
    copy is never imported); False where another process's copy took the name first."""
    staging = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".rank-side-")
    with zipfile.ZipFile(io.BytesIO(package)) as zipped:
        zipped.extractall(staging)
    unpacked = content_id(staging)
    if unpacked != content:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(
            f"the archive sent as content {content} holds {unpacked}: the driver and this "
            "module disagree on the content id; use one version of orchestrator for both"
        )
    try:
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


def _hold(folder: str) -> int | None:
    """A descriptor of `folder`, with a shared lock that keeps `_prune` off it, where it is
    a folder of this user's that no one else can enter; else None."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    found = os.fstat(fd)
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        os.close(fd)
        return None
    with contextlib.suppress(OSError):  # a file system without locks: nothing is pruned
        fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _through(fd: int, folder: str) -> str:
    """The path that reaches what `fd` holds (its name, where /proc is missing)."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.isdir(proc) else folder


def _same(fd: int, folder: str) -> bool:
    """Whether `folder` names what `fd` holds (not another folder made there since)."""
    try:
        named, held = os.lstat(folder), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _matches(folder: str, content: str) -> bool:
    """Whether the tree at `folder` is this user's, without links or hidden names, holds
    the .py files of `content` and nothing else Python would import (only py.typed, and
    __pycache__'s compiled files, which Python loads only beside their source)."""
    sources = []
    for where, folders, names in os.walk(folder):
        relative = os.path.relpath(where, folder)
        cache = os.path.basename(where) == "__pycache__"
        for name in (*folders, *names):
            found = os.lstat(os.path.join(where, name))
            kind = stat.S_ISDIR(found.st_mode) or stat.S_ISREG(found.st_mode)
            if found.st_uid != os.getuid() or not kind or name.startswith("."):
                return False
        for name in names:
            if cache or name == "py.typed":  # compiled files (or one being written)
                continue
            if not name.endswith(".py"):
                return False
            sources.append(name if relative == "." else os.path.join(relative, name))
    return _digest(folder, sources) == content


def _set_aside(folder: str) -> None:
    """`folder` moved out of the way, and removed where no process holds it."""
    aside = os.path.join(os.path.dirname(folder), f".rank-side-{secrets.token_hex(8)}")
    with contextlib.suppress(OSError):
        os.rename(folder, aside)
        _remove(aside)


def _remove(folder: str) -> None:
    """Remove `folder` unless a process holds it (`_hold`'s lock)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(folder, ignore_errors=True)
    except OSError:  # held, or no locks here: left to a later prune
        pass
    finally:
        os.close(fd)


def _prune(base: str, keep: str) -> None:
    """Remove the other contents unpacked in `base` long ago that no process holds now."""
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if path == keep or not name.startswith(("rank-side-", ".rank-side-")):
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path).st_mtime < time.time() - UNUSED_S:
                _remove(path)


def call(package: bytes, content: str, module: str, name: str, *args: Any) -> Any:
    """`module.name(*args)`, a function of our rank side, run where the node may lack it
    (a task)."""
    ensure(package, content)
    return getattr(importlib.import_module(module), name)(*args)


def shell(actor: type) -> type:
    """A class with `actor`'s public methods (and their Ray options), whose instances build
    a real `actor` (a class of our rank side) once our rank side is on the path."""
    module, name = actor.__module__, actor.__name__

    def __init__(self: Any, package: bytes, content: str, *args: Any, **kwargs: Any) -> None:
        ensure(package, content)
        real = getattr(importlib.import_module(module), name)
        self._real = real(*args, **kwargs)

    def __repr__(self: Any) -> str:
        real = self.__dict__.get("_real")
        return repr(real) if real is not None else name

    members: dict[str, Any] = {"__init__": __init__, "__repr__": __repr__}
    for attribute, method in vars(actor).items():
        if attribute.startswith("_") or not isinstance(method, types.FunctionType):
            continue
        members[attribute] = _forward(attribute, method)
    return type(f"{name}Shell", (), members)


def _forward(attribute: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._real, attribute)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = attribute
    forward.__doc__ = method.__doc__
    for option, value in vars(method).items():  # Ray's per-method options (ray.method)
        if option.startswith("__ray_"):
            setattr(forward, option, value)
    return forward
