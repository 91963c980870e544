"""Serialize the function and its arguments once, shipping local code by value."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import linecache
import os
import pickle
import stat
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cloudpickle
import ray

from orchestrator import _ray_compat
from orchestrator.connect import cluster, rankside
from orchestrator.errors import ConfigError
from orchestrator.runtime_env import SETUP_HOOK
from orchestrator_workers import sharing
from orchestrator_workers.protocol import Payload
from orchestrator_workers.script import Script

# Code under these folders is installed, so workers import it by reference.
_INSTALLED = tuple(
    {str(Path(p).resolve()) for k, p in sysconfig.get_paths().items() if k != "scripts"}
    | {str(Path(sys.base_prefix).resolve()), str(Path(sys.prefix).resolve())}
)
_OURS = ("orchestrator", "orchestrator_workers")
_registered: set[str] = set()
_seen_modules = 0
OUT_OF_BAND_BYTES = 1 << 20
"""Tensors and arrays this big travel out of band, one copy per node (workers/sharing.py)."""


@dataclass(frozen=True)
class Shipment:
    """A call's payload as the ranks get it, and what the driver knows of it."""

    data: bytes | ray.ObjectRef
    """Pickled inline (small), or one object in Ray's store."""
    uses_torch: bool
    """Whether the function or its arguments refer to torch: ranks then load it ahead."""


FORGET_WAIT_S = 5.0
"""After a failure, how long to wait for stopped ranks to be gone before cleaning up."""
INLINE_BYTES = 64 * 1024
"""Payloads up to this size are sent with each rank's task instead of through ray.put."""


def ship(shipped: Payload, *, uses_torch: bool = True) -> Shipment:
    """Make a payload ready to send to any number of ranks, now (a snapshot of its buffers).

    Large payloads go into the object store once, whatever the number of ranks, and each
    rank reads the bytes in place; small ones travel inside each task (bytes: Ray passes
    them as they are, where it would pickle a dataclass per rank). `uses_torch`: see
    `pack`.
    """
    if shipped.size() <= INLINE_BYTES:
        return Shipment(pickle.dumps(shipped, protocol=pickle.HIGHEST_PROTOCOL), uses_torch)
    if cluster.through_ray_client():  # its server on the head unpickles it: builtins only
        return Shipment(ray.put(shipped.parts()), uses_torch)
    return Shipment(ray.put(replace(shipped, call=pickle.PickleBuffer(shipped.call))), uses_torch)


def forget_buffers(share_key: str, nodes: list[str], pending: list[ray.ObjectRef]) -> None:
    """After a failed call's ranks were told to stop: remove what they left in /dev/shm.

    A rank stopped before it mapped its node's copy of the large buffers never counts
    itself, so the copy's name would stay. In the background: the ranks still running
    (`pending`, their runs) are first given a moment to be gone (a rank killed is not
    gone at once; at exit, no more); then each of `nodes` (node ids) removes the call's
    copies.
    """

    def forget() -> None:
        try:
            with contextlib.suppress(Exception):  # Ray shut down meanwhile: the sweep remains
                waiting, deadline = pending, time.monotonic() + FORGET_WAIT_S
                while waiting and not _exiting.is_set() and time.monotonic() < deadline:
                    _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0.1)
                here = cluster.driver_node()
                for node in nodes:
                    if node == here:
                        sharing.remove(share_key)
                    else:
                        rankside.task(node, sharing.remove, share_key)
        finally:
            _forgetting.discard(thread)

    thread = threading.Thread(target=forget, name="forget buffers", daemon=True)
    _forgetting.add(thread)
    thread.start()


_forgetting: set[threading.Thread] = set()
"""The cleanups running now."""
_exiting = threading.Event()


def at_exit(wait_s: float = 2.0) -> None:
    """Interpreter exit: let the running cleanups finish now, before Ray shuts down (a
    thread in a Ray call then would have Ray print that its core worker is gone)."""
    _exiting.set()
    deadline = time.monotonic() + wait_s
    for thread in list(_forgetting):
        thread.join(max(0.0, deadline - time.monotonic()))


def payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload:
    """`(fn, args, kwargs)` cloudpickled with `fn`'s current code, and that code's source."""
    return pack(fn, args, kwargs)[0]


def pack(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Payload, bool]:
    """The payload of `fn(*args, **kwargs)`, and whether the call loads torch.

    As far as the driver can tell: it pickles a torch module, class, function or tensor,
    something of an installed library that imports torch, or a torchrun script. Code that
    reaches torch only by a name built at run time is not seen: its ranks then load torch
    when it runs.
    """
    fn = current(fn)
    _register_local_modules()
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump((fn, args, kwargs))
        shipped = Payload(
            call=buffer.getvalue(),
            sources=_sources(pickler.files),
            buffers=tuple(pickler.buffers),
            readonly=tuple(b.raw().readonly for b in pickler.buffers),
        )
        return shipped, bool(shipped.buffers) or _loads_torch(pickler.modules)
    except Exception as exc:
        culprit = find_unpicklable(fn, args, kwargs)
        raise ConfigError(
            f"cannot ship {_name(fn)} to the workers: {culprit or 'it'} cannot be pickled "
            f"({type(exc).__name__}: {exc}). Create such objects inside the function, "
            "or pass something picklable (a path, a config) instead."
        ) from exc


class _Pickler(cloudpickle.Pickler):
    """Keeps the file names of code shipped by value (cloudpickle drops them), and big
    CPU tensors' and arrays' bytes out of band, as they are, with no copy."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._out_of_band)
        self.files: set[str] = set()
        self.modules: set[str] = set()
        """The modules of what was pickled: modules, classes, functions, instances' types."""
        self.buffers: list[pickle.PickleBuffer] = []
        self._storages: dict[tuple[int, int, Any], tuple[Any, ...]] = {}
        self._raw: dict[tuple[int, int], tuple[pickle.PickleBuffer]] = {}

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < OUT_OF_BAND_BYTES:
            return True  # in band: small ones cost less inside the pickle
        self.buffers.append(buffer)
        return False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            self.modules.add(obj.__name__)
        elif isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType):
            self.modules.add(str(getattr(obj, "__module__", "")))
        elif isinstance(obj, Script):
            self.modules.add("torch")  # torchrun scripts use it
        else:
            self.modules.add(type(obj).__module__)
        if isinstance(obj, types.CodeType):
            # Code shipped by value: a name it imports or uses, e.g. `import torch`.
            self.modules.update(name for name in obj.co_names if name == "torch")
            reduced = _ray_compat.code_reduce(obj)
            if reduced is not None:
                self.files.add(obj.co_filename)
                rebuild, args = reduced
                args = tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
                return rebuild, args
        if "torch" in sys.modules:
            reduced = self._reduce_storage(obj, sys.modules["torch"])
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _reduce_storage(self, obj: Any, torch: Any) -> tuple[Any, tuple[Any, ...]] | None:
        """A big CPU storage as its raw bytes (torch would copy them into a torch.save)."""
        typed = isinstance(obj, torch.storage.TypedStorage)
        if not typed and not isinstance(obj, torch.UntypedStorage):
            return None
        untyped = _ray_compat.untyped_storage(obj) if typed else obj
        if untyped.device.type != "cpu" or untyped.nbytes() < OUT_OF_BAND_BYTES:
            return None
        dtype = obj.dtype if typed else None
        where = (untyped.data_ptr(), untyped.nbytes())
        if where not in self._raw:  # one tuple, pickled once: every view maps the same bytes
            raw = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy()
            self._raw[where] = (pickle.PickleBuffer(raw),)
        key = (*where, dtype)
        if key not in self._storages:  # the same args object: one storage per dtype
            self._storages[key] = (self._raw[where], dtype) if typed else (self._raw[where],)
        rebuild = sharing.typed_storage if typed else sharing.untyped_storage
        return rebuild, self._storages[key]


def _loads_torch(modules: set[str]) -> bool:
    """Whether any of `modules` is torch's, or an installed one that imported torch."""
    return any(_torch_module(name) for name in modules)


@functools.lru_cache(maxsize=4096)
def _torch_module(name: str) -> bool:
    """Whether module `name` is torch's, or installed and holding a torch module (the
    answer of an installed module does not change; code shipped by value is seen apart)."""
    if name.partition(".")[0] == "torch":
        return True
    module = sys.modules.get(name)
    if module is None or name == "__main__" or is_local(module):
        return False
    return any(
        isinstance(value, types.ModuleType) and value.__name__.partition(".")[0] == "torch"
        for value in list(vars(module).values())
    )


def _sources(files: set[str]) -> dict[str, list[str]]:
    """Source lines of `files` (notebook cells included), so remote tracebacks show them."""
    sources = {}
    for name in files:
        lines = linecache.getlines(name)
        if lines:
            sources[name] = lines
    return sources


def check(fn: Callable[..., Any]) -> None:
    """Raise ConfigError now if `fn` itself can never be shipped."""
    payload(fn, (), {})


def current(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The newest definition of a module-level function (after a cell re-run or reload)."""
    if not inspect.isfunction(fn) or "<" in fn.__qualname__:
        return fn
    obj: Any = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    if inspect.isfunction(obj) and obj.__qualname__ == fn.__qualname__:
        return obj
    return fn


def is_local(module: types.ModuleType) -> bool:
    """Whether `module` is the user's own code rather than an installed package."""
    name = module.__name__
    file = getattr(module, "__file__", None)
    if not file or name == "__main__" or name.split(".")[0] in _OURS:
        return False
    return _local_file(file)


@functools.lru_cache(maxsize=8192)
def _local_file(file: str) -> bool:
    """Whether the module file `file` is outside the installed packages' folders."""
    folder, name = os.path.split(file)
    try:
        link = stat.S_ISLNK(os.lstat(file).st_mode)
    except OSError:
        link = False
    # Each folder resolved once: a first call looks at every module torch loaded (1,600
    # files, 67 ms resolved one by one, 15 ms so).
    path = os.path.realpath(file) if link else os.path.join(_real_folder(folder), name)
    return not path.startswith(_INSTALLED) and "site-packages" not in path


@functools.lru_cache(maxsize=4096)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def _register_local_modules() -> None:
    global _seen_modules  # noqa: PLW0603 - a cache of sys.modules' size
    if len(sys.modules) == _seen_modules:
        return
    for name, module in list(sys.modules.items()):
        if name not in _registered and isinstance(module, types.ModuleType) and is_local(module):
            cloudpickle.register_pickle_by_value(module)
            _registered.add(name)
    _seen_modules = len(sys.modules)


def hook_by_value(runtime_env: Mapping[str, Any]) -> Mapping[str, Any]:
    """`runtime_env` with its setup hook (a function) shipped as a call's function is: by
    value where it comes from the user's own modules, with its file names and source for
    tracebacks. Ray's pickler took it by name, and a node without the script's folder
    could not load it ("Failed to deserialize the setup hook method")."""
    hook = runtime_env.get(SETUP_HOOK)
    if not callable(hook):
        return runtime_env
    shipped = payload(hook, (), {})
    call, sources, buffers = shipped.call, shipped.sources, shipped.buffers

    def unpickled_then_run() -> None:  # not importable by name: Ray pickles it by value
        for name, lines in sources.items():  # as a rank does for a call's code
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
        fn, _, _ = cloudpickle.loads(call, buffers=buffers)
        fn()

    unpickled_then_run.__name__ = getattr(hook, "__name__", "hook")  # Ray's messages name it
    return {**runtime_env, SETUP_HOOK: unpickled_then_run}


def find_unpicklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Name the first object in `fn`'s closure, globals or arguments that cannot be pickled."""
    for label, value in _parts(fn, args, kwargs, depth=0):
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - probing is the point
            return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"
    return None


def _parts(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], depth: int
) -> Iterator[tuple[str, Any]]:
    for i, value in enumerate(args):
        yield f"positional argument {i}", value
    for key, value in kwargs.items():
        yield f"argument {key!r}", value
    if not inspect.isfunction(fn) or depth > 2:
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield from _parts(value, (), {}, depth + 1)
        yield f"closure variable {name!r} of {_name(fn)}", value
    for name in _global_names(code):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType):
                continue
            yield from _parts(value, (), {}, depth + 1)
            yield f"global {name!r} used by {_name(fn)}", value


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
