"""A user's `runtime_env`, checked before anything starts: what Ray would take and then
fail on at the pool's start, or silently ignore.

Ray checks some of it itself, late (its TypeError once the cluster was reached), and takes
a field it does not know as a runtime_env plugin's, ignored where the cluster has no such
plugin: a misspelt `env_var` set nothing, and said nothing.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Mapping
from typing import Any

import cloudpickle

SETUP_HOOK = "worker_process_setup_hook"
"""The field of the function each rank's process runs as it starts."""


def problems(runtime_env: Mapping[str, Any]) -> list[str]:
    """What is wrong with `runtime_env`, each naming the value and what would be valid."""
    checks = (_misspelt, _env_vars, _missing_folders, _hook)
    return [problem for check in checks for problem in check(runtime_env)]


def _misspelt(runtime_env: Mapping[str, Any]) -> list[str]:
    """Fields Ray does not know that look like one it does (a plugin's own field is
    passed on: only Ray's near misses are refused)."""
    try:
        from ray.runtime_env import RuntimeEnv

        given_as = set(inspect.signature(RuntimeEnv).parameters) - {"kwargs", "_validate"}
        known = {*RuntimeEnv.known_fields, *RuntimeEnv.extensions_fields, *given_as}
    except (ImportError, AttributeError, TypeError, ValueError):  # another Ray: it alone checks
        return []
    found = []
    for key in runtime_env:
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
        if key not in known and close:
            found.append(
                f"runtime_env[{key!r}]: not a field Ray knows; did you mean {close[0]!r}? "
                f"(valid: {', '.join(sorted(k for k in known if not k.startswith('_')))})"
            )
    return found


def _env_vars(runtime_env: Mapping[str, Any]) -> list[str]:
    given = runtime_env.get("env_vars")
    if given is None:
        return []
    if not isinstance(given, Mapping):
        return [f"runtime_env['env_vars']={given!r}: must be a dict of names to values"]
    return [
        f"runtime_env['env_vars'][{name!r}]={value!r}: names and values must be strings"
        for name, value in given.items()
        if not isinstance(name, str) or not isinstance(value, str)
    ]


def _missing_folders(runtime_env: Mapping[str, Any]) -> list[str]:
    """The local paths of `runtime_env` (uploaded from here: see pool) that are not here."""
    modules = runtime_env.get("py_modules")
    named = [("['working_dir']", runtime_env.get("working_dir"))]
    if isinstance(modules, list | tuple):
        named += [(f"['py_modules'][{i}]", entry) for i, entry in enumerate(modules)]
    return [
        f"runtime_env{key}={path!r}: no such file or folder in {os.getcwd()}; give a "
        "folder, a .py or .whl file here, or a URI"
        for key, path in named
        if isinstance(path, str | os.PathLike)
        and "://" not in str(path)
        and not os.path.exists(path)
    ]


def _hook(runtime_env: Mapping[str, Any]) -> list[str]:
    """A setup hook that cannot reach the ranks: neither a function's name nor a function
    that pickles (Ray's word was only "Failed to export the setup function", at the
    pool's start)."""
    hook = runtime_env.get(SETUP_HOOK)
    if hook is None or isinstance(hook, str):
        return []
    key = f"runtime_env[{SETUP_HOOK!r}]={hook!r}"
    by_name = "a module's function by name ('package.module.function')"
    if not callable(hook):
        return [f"{key}: must be a function, or {by_name}"]
    try:
        cloudpickle.dumps(hook)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises is the problem
        return [
            f"{key}: cannot be pickled to reach the ranks ({type(exc).__name__}: {exc}); "
            f"make such objects inside the hook, or give {by_name}"
        ]
    return []
