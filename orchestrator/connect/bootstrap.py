"""What runs first on a node that lacks our rank side: the driver's copy put on the path.

A Ray `runtime_env` would bring it, but Ray starts every worker that has one through a
second Python (its `setup_worker.py` imports Ray, then execs the worker): about 0.4 s more
at every pool start and every restart here. So a rank on such a node is a shell instead,
an actor class made here from `RankActor`'s methods, and shipped by value like the rest
of this module: its constructor takes the rank side's archive (bytes, through Ray's object
store), unpacks it once per content in this user's own folder on the node, puts it first
on `sys.path` (and on `PYTHONPATH`, for the rank's own child processes), and only then
imports `orchestrator_workers` and builds the real rank, to which every method forwards.
A task of ours (a dead rank's last words, removing a call's buffers) does the same through
`call`.

Standard library only: this module runs before anything of ours is on the node.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import shutil
import stat
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from typing import Any

PACKAGE = "orchestrator_workers"


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
    digest = hashlib.sha256()
    for name in _files(folder):
        if name.endswith(".py"):
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


def _own_folder() -> str:
    """orchestrator-UID in this node's temp dir: made 0700, else checked as this user's."""
    base = os.path.join(tempfile.gettempdir(), f"orchestrator-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    found = os.lstat(base)
    if (
        not stat.S_ISDIR(found.st_mode)
        or found.st_uid != os.getuid()
        or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise PermissionError(
            f"{base} is not this user's private folder (owner uid {found.st_uid}, mode "
            f"{stat.filemode(found.st_mode)}), so the rank side is not unpacked there: "
            "remove it, or set TMPDIR to a folder of your own in the environment of "
            "`ray start` on this node"
        )
    return base


def ensure(package: bytes, content: str) -> str:
    """The driver's rank side (`package`, of `content`; with the driver side too where a
    supervisor runs there) unpacked on this node and first on this process's path; its
    folder."""
    folder = os.path.join(_own_folder(), f"rank-side-{content}")
    if not os.path.isdir(os.path.join(folder, PACKAGE)):
        staging = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".rank-side-")
        with zipfile.ZipFile(io.BytesIO(package)) as zipped:
            zipped.extractall(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # another process on this node unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    # A worker Ray reuses may have run a task of ours before: the same copy will do.
    elsewhere = set()
    names = sorted(os.listdir(folder))  # the rank side, and the driver side where sent
    for name in names:
        loaded = sys.modules.get(name)
        if loaded is None:
            continue
        where = os.path.dirname(loaded.__file__ or "")
        if os.path.dirname(where) == folder:
            continue
        if content_id(where) != content_id(os.path.join(folder, name)):
            raise ImportError(
                f"this process imported another {name} ({loaded.__file__}) before the "
                f"driver's reached it ({folder})"
            )
        elsewhere.add(os.path.dirname(where))
    if len(elsewhere) == 1 and all(name in sys.modules for name in names):
        return elsewhere.pop()
    if folder not in sys.path:
        sys.path.insert(0, folder)
        paths = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = folder + (os.pathsep + paths if paths else "")
    return folder


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
