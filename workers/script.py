"""What `__main__` is in a rank: the user's script, as under python or torchrun.

`orchestrator run` runs a script or module as `__main__`; a function shipped from a
driver's script runs with a stand-in `__main__` made of that script's globals.
"""

from __future__ import annotations

import contextlib
import io
import os
import pkgutil
import runpy
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

_HIDDEN = frozenset({__name__, "runpy"})
"""Modules whose frames are cut from a script's traceback, so the user's code starts it."""


@dataclass(frozen=True)
class Script:
    """What every rank runs: a file or a module, its arguments, and where."""

    target: str
    """A file's path relative to `cwd` (or absolute), or a module's dotted name."""
    args: tuple[str, ...] = ()
    """sys.argv[1:]."""
    module: bool = False
    """Run `target` as `python -m` would."""
    cwd: str | None = None
    """Folder to run in; None: stay in the actor's own (Ray's unpacked working_dir)."""
    local_rank_arg: str | None = None
    """'--local-rank' or '--local_rank': passed as `--local-rank=N` before `args`, as
    torch.distributed.launch did."""
    argv0: str | None = None
    """sys.argv[0] where it is not `target`: the path as the user typed it (torchrun passes
    it so), where it names the same file from `cwd`."""


class ScriptExit(Exception):
    """The script called sys.exit() with a failure status."""

    def __init__(self, code: object) -> None:
        """`code`: what was passed to sys.exit() (an int, or a message meaning 1)."""
        self.code = code
        super().__init__(f"the script called sys.exit({code!r})")

    def __reduce__(self) -> tuple[type[ScriptExit], tuple[object]]:
        """Pickle with the exit code, not the message."""
        return (ScriptExit, (self.code,))

    @property
    def status(self) -> int:
        """The process exit status python would have used: the int, else 1."""
        code = self.code
        return code if isinstance(code, int) and not isinstance(code, bool) else 1


def run_script(script: Script) -> None:
    """Run `script` as `__main__` with sys.argv set; sys.exit(0) or None is success.

    sys.path[0] is the script's folder (for a module, the working folder), as python
    sets it. sys.argv, sys.path and the working folder are restored afterwards.
    """
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    try:
        if script.cwd is not None:
            if not Path(script.cwd).is_dir():
                raise FileNotFoundError(
                    f"the working folder {script.cwd} does not exist on this node "
                    f"(rank {os.environ.get('RANK')}, {os.uname().nodename}); without "
                    "--no-upload it is shipped to every node"
                )
            os.chdir(script.cwd)
        args = list(script.args)
        if script.local_rank_arg:
            args.insert(0, f"{script.local_rank_arg}={os.environ.get('LOCAL_RANK', '0')}")
        _execute(script, args)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return
        # A bare `raise` adds no traceback entry for this frame: the report starts at
        # the user's code (the actor drops its own frame), where sys.exit was called.
        user_tb = _user_frames(exc.__traceback__)
        try:
            raise ScriptExit(exc.code) from None
        except ScriptExit as failure:
            failure.with_traceback(user_tb)
            raise
    except BaseException as exc:
        exc.with_traceback(_user_frames(exc.__traceback__))
        raise
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)


def _execute(script: Script, args: list[str]) -> None:
    if script.module:
        sys.path.insert(0, os.getcwd())
        sys.argv = [script.target, *args]  # run_module puts the module's file in argv[0]
        runpy.run_module(script.target, run_name="__main__", alter_sys=True)
        return
    path = Path(script.target).absolute()
    if not path.is_file():
        where = "it was not shipped" if script.cwd is None else "it is not there on this node"
        raise FileNotFoundError(f"no script {path} on rank {os.environ.get('RANK')}: {where}")
    sys.path.insert(0, str(path.parent))
    sys.argv = [script.argv0 or script.target, *args]
    _run_file(path)


def _run_file(path: Path) -> None:
    """Run the file at `path` as `__main__`, as python does: `__file__` its absolute path,
    sys.argv[0] left as set (`runpy.run_path` would make it the path it is given)."""
    with io.open_code(str(path)) as source:
        code = pkgutil.read_code(source)  # a compiled script, as runpy reads one
    if code is None:
        with io.open_code(str(path)) as source:
            code = compile(source.read(), str(path), "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=str(path), __cached__=None, __loader__=None, __package__=None, __spec__=None
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)  # noqa: S102 - the user's script, as python would run it
    finally:
        if saved is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = saved


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` from the first frame of the user's code on (all of it if there is none)."""
    first = tb
    while first is not None and first.tb_frame.f_globals.get("__name__") in _HIDDEN:
        first = first.tb_next
    return first if first is not None else tb


@contextlib.contextmanager
def driver_main(fn: Callable[..., Any]) -> Iterator[None]:
    """While `fn` runs, `__main__` is the driver's script that `fn` was defined in.

    multiprocessing pickles the functions and classes of `__main__` by name (the
    function of `mp.Pool.map`, a spawned data loader's dataset), and a rank's own
    `__main__` is Ray's worker, where those names do not exist. A stand-in module with
    the shipped globals lets the rank pickle them; it names the script's file where this
    node has it, so a spawned (or forkserver) child runs the script as `__mp_main__` and
    finds them, as a child of a torchrun worker does.
    """
    shipped = getattr(fn, "__globals__", None)
    if not isinstance(shipped, dict) or shipped.get("__name__") != "__main__":
        yield  # a module's function (or `orchestrator run`'s, which runs its own)
        return
    stand_in = types.ModuleType("__main__")
    stand_in.__dict__.update(shipped)
    stand_in.__spec__ = None  # what a script run by path has: children load it by path
    file = shipped.get("__file__")
    if not (isinstance(file, str) and os.path.isabs(file) and os.path.isfile(file)):
        vars(stand_in).pop("__file__", None)  # a notebook's, or not on this node
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = saved
