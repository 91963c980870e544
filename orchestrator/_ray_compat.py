"""Every use the driver makes of Ray's, cloudpickle's and torch's private parts, in one place.

Ray has no public API for these. Each touch first checks that the private part is
there in the shape it was written for (the version guard: what matters is the shape,
since a Ray upgrade may keep or change it); where it is not, the touch falls back to
Ray's public behaviour or to the degraded mode its docstring names, and records why in
`degraded()`. `tests/test_compat.py` fails when the installed Ray or cloudpickle makes
any touch fall back. pyproject.toml caps `ray` at the newest version the tests pass on.

The rank side's touches (a worker's GCS client, torch's process-group counter) are in
`workers/_compat.py`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

TESTED_RAY = ("2.40", "2.60")
"""The oldest and newest Ray these touches were checked against (see pyproject.toml)."""

_degraded: dict[str, str] = {}


def degraded() -> dict[str, str]:
    """The touches that fell back in this process, with why: {} when all work."""
    return dict(_degraded)


def _fell_back(touch: str, why: object) -> None:
    if touch not in _degraded:
        _degraded[touch] = str(why)
        logging.getLogger("orchestrator").debug("Ray compat: %s falls back (%s)", touch, why)


def _raylet() -> Any:
    """Ray's compiled core module: its Python stubs leave out the private parts we touch."""
    return importlib.import_module("ray._raylet")


def _has_parameters(function: object, *names: str) -> bool:
    if not callable(function):
        return False
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in names)


def _takes(function: Any, keyword: str) -> bool:
    """Whether `function` takes `keyword`: a parameter, or read from its **kwargs."""
    if _has_parameters(function, keyword):
        return True
    try:
        return f'"{keyword}"' in inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False


def wrap_log_printer(keep: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
    """Pass every batch of worker log lines the driver prints through `keep` first.

    `keep(batch)` returns the batch to print (perhaps with fewer lines) or None.
    Degraded: Ray's own notices about our ranks (a crashed rank's "(raylet) A worker
    died", "N PYTHON worker processes have been started") are printed as Ray prints them.
    """
    try:
        from ray._private import worker

        original = worker.print_to_stdstream
        if not _has_parameters(original, "data", "ignore_prefix"):
            raise AttributeError("print_to_stdstream(data, ignore_prefix) changed")
    except (ImportError, AttributeError) as exc:
        _fell_back("wrap_log_printer", exc)
        return False
    if getattr(original, "__wrapped__", None) is not None:
        return True  # wrapped already, by an earlier call

    @functools.wraps(original)
    def filtered(data: dict[str, Any], ignore_prefix: bool) -> None:
        kept = keep(data)
        if kept is not None:
            original(kept, ignore_prefix)

    worker.print_to_stdstream = filtered
    return True


LEAN_HEAD = ("start_api_server", "start_monitor", "start_log_monitor")
"""Ray head processes the embedded instance does without (Ray has no switch for them): the
API server (Ray waits ~1 s for it even without the dashboard), the autoscaler monitor and the
log monitor (log_to_driver=False). ~1.8 s of CPU at start, and most of Ray's shutdown. The
node agent runs minimal: Ray decides so by importing the dashboard's dependencies first
(0.1-0.3 s of a cold start), for a dashboard the embedded instance has none of."""


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """While inside, a Ray head started in this process skips the `LEAN_HEAD` processes and
    sees its raylet registered within 20 ms (Ray itself looks again only a second later).

    Degraded: they start, as with `ray start` (~1.8 s more CPU at start, a slower shutdown),
    and the start waits for Ray's second look (~0.4 s).
    """
    try:
        from ray._private import services, utils
        from ray._private.node import Node

        saved = {name: Node.__dict__[name] for name in LEAN_HEAD}
        asks, get_node, raylet = utils.get_dashboard_dependency_error, services.get_node, _raylet()
        if not _has_parameters(get_node, "gcs_address", "node_id"):
            raise AttributeError("services.get_node(gcs_address, node_id) changed")
    except (ImportError, KeyError, AttributeError) as exc:
        _fell_back("lean_head", exc)
        yield
        return

    def registered_first(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + 10  # then Ray's own wait, and its errors, take over
        try:
            client = raylet.GcsClient(address=gcs_address)
            while time.monotonic() < deadline and node_id not in _alive_ids(client, 1):
                time.sleep(0.02)
        except (AttributeError, TypeError) as exc:
            _fell_back("lean_head", exc)
        except Exception:  # noqa: BLE001, S110 - the GCS did not answer: Ray's own wait decides
            pass
        return get_node(gcs_address, node_id)

    try:
        for name in saved:
            setattr(Node, name, _not_started)
        utils.get_dashboard_dependency_error, services.get_node = _no_dashboard, registered_first
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)
        utils.get_dashboard_dependency_error, services.get_node = asks, get_node


def _not_started(self: object, *args: object, **kwargs: object) -> None:
    return None


def _no_dashboard() -> ImportError:
    return ImportError("the embedded instance has no dashboard")


def stop_auto_init() -> None:
    """From now on, a Ray call in this process does not start a fresh Ray or a Ray Client
    session of its own (its auto-init): it raises, as between two sessions.

    Degraded: a late call from a thread at interpreter exit may start one (and stop it); a
    call between two Ray Client sessions may start a session that races the next one.
    """
    try:
        from ray._private import auto_init_hook

        if not hasattr(auto_init_hook, "enable_auto_connect"):
            raise AttributeError("auto_init_hook.enable_auto_connect is gone")
        auto_init_hook.enable_auto_connect = False
    except (ImportError, AttributeError) as exc:
        _fell_back("stop_auto_init", exc)


def alive_nodes(address: str) -> int | None:
    """How many nodes of the cluster at `address` are alive, asked without joining it.

    Degraded: None (unknown), and callers assume a real multi-node cluster.
    """
    try:
        return len(_alive_ids(_raylet().GcsClient(address=address), 5))  # as `ray status`
    except (ImportError, AttributeError, TypeError) as exc:
        _fell_back("alive_nodes", exc)
        return None
    except Exception:  # noqa: BLE001 - the cluster did not answer: unknown
        return None


def _alive_ids(client: Any, timeout: float) -> set[str]:
    """Hex ids of the nodes that the GCS behind Ray's GcsClient `client` says are alive."""
    found = client.get_all_node_info(timeout=timeout)
    return {key.hex() for key, info in found.items() if info.state == 0}  # 0: ALIVE


def reload_auth_mode() -> bool:
    """Make this process's Ray read RAY_AUTH_MODE and its token again (it read them at import).

    Degraded (False): the user sets RAY_AUTH_MODE=token by hand to join a local runtime.
    """
    try:
        raylet = _raylet()
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as exc:
        _fell_back("reload_auth_mode", exc)
        return False
    return True


NICENESS_VAR = "RAY_worker_niceness"
"""Ray's config variable for its workers' nice level, relative to the raylet's (15)."""


def same_niceness_env() -> dict[str, str]:
    """For `ray start`'s environment: workers at its own niceness (the user's choice wins)."""
    return {} if NICENESS_VAR in os.environ else {NICENESS_VAR: "0"}


def same_niceness() -> dict[str, Any] | None:
    """ray.init's `_system_config` that starts workers at the driver's own niceness.

    Ray starts workers 15 nice levels below its raylet by default. None where the user
    set RAY_worker_niceness (theirs wins). Degraded (None): workers run niced.
    """
    if NICENESS_VAR in os.environ:
        return None
    try:
        import ray

        if not _takes(ray.init, "_system_config"):
            raise AttributeError("ray.init(_system_config=...) is gone")
    except (ImportError, AttributeError) as exc:
        _fell_back("same_niceness", exc)
        return None
    return {"worker_niceness": 0}


_RAY_DEFAULT_EXCLUDES = ".git,.venv,venv,__pycache__"


def upload_default_excludes() -> list[str]:
    """The patterns Ray itself leaves out of a working_dir upload.

    Degraded: Ray 2.60's list (and its RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES).
    """
    try:
        from ray._private import ray_constants

        return list(ray_constants.get_runtime_env_default_excludes())
    except (ImportError, AttributeError) as exc:
        _fell_back("upload_default_excludes", exc)
    value = os.environ.get("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", _RAY_DEFAULT_EXCLUDES)
    return [part.strip() for part in value.split(",") if part.strip()]


def walk_upload(root: Path, excludes: list[str], visit: Callable[[Path], None]) -> bool:
    """Call `visit` on every path of `root` that Ray would upload as a working_dir.

    Ray's own traversal, so every rule (gitignore syntax, ignore files in subfolders,
    RAY_RUNTIME_ENV_IGNORE_GITIGNORE) matches what is uploaded. Degraded (False, nothing
    visited): the size guard is skipped and Ray's own 512 MiB limit applies.
    """
    try:
        from ray._private.runtime_env import packaging

        travel, get_excludes = packaging._dir_travel, packaging._get_excludes
        if not _has_parameters(travel, "path", "excludes", "handler", "include_gitignore"):
            raise AttributeError("packaging._dir_travel(...) changed")
    except (ImportError, AttributeError) as exc:
        _fell_back("walk_upload", exc)
        return False
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    travel(
        root,
        [get_excludes(root, list(excludes))],
        visit,
        include_gitignore=include_gitignore,
        logger=logging.getLogger(__name__),
    )
    return True


def code_reduce(code: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """cloudpickle's reduction of a code object, to keep its file name; None where absent.

    Degraded (None): code shipped by value keeps cloudpickle's "<dynamic-code>" name,
    and tracebacks from it show no source lines.
    """
    try:
        from cloudpickle import cloudpickle as impl

        return impl._code_reduce(code)
    except (ImportError, AttributeError, TypeError) as exc:
        _fell_back("code_reduce", exc)
        return None


def untyped_storage(typed: Any) -> Any:
    """The UntypedStorage under a torch TypedStorage, without torch's deprecation warning.

    Degraded: torch's public `untyped()`, which warns that TypedStorage is deprecated.
    """
    untyped = getattr(typed, "_untyped_storage", None)
    if untyped is None:
        _fell_back("untyped_storage", "TypedStorage._untyped_storage is gone")
    return typed.untyped() if untyped is None else untyped


def by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, whose module Ray's pickler then ships by value: it runs on nodes without it.

    Degraded (`fn` as it is): Ray pickles it by reference, and a node without this
    package cannot run it; the caller takes that as "this node has nothing of ours".
    """
    try:
        from ray import cloudpickle as ray_cloudpickle

        ray_cloudpickle.register_pickle_by_value(importlib.import_module(fn.__module__))
    except (ImportError, AttributeError, ValueError) as exc:
        _fell_back("by_value", exc)
    return fn


KV_NAMESPACE = "orchestrator"
"""Our keys in the cluster's internal key-value store (the GCS's; Ray keeps its own apart)."""


def _kv(function: str, *args: Any) -> Any:
    """`internal_kv.<function>(*args)` in our namespace of the connected cluster's key-value
    store; None where this process is not connected. Degraded (None): see each caller."""
    try:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            return None
        return getattr(internal_kv, function)(*args, namespace=KV_NAMESPACE)
    except (ImportError, AttributeError, TypeError) as exc:
        _fell_back("kv", exc)
        return None


def kv_get(key: str) -> bytes | None:
    """The value of `key` in the connected cluster's key-value store; None where unset.
    Degraded: None (the caller works it out afresh)."""
    value = _kv("_internal_kv_get", key.encode(errors="surrogateescape"))
    return value if isinstance(value, bytes) else None


def kv_put(key: str, value: bytes) -> None:
    """Set `key` in the connected cluster's key-value store. Degraded: nothing is kept."""
    _kv("_internal_kv_put", key.encode(errors="surrogateescape"), value, True)  # overwrite


def kv_keys(prefix: str) -> list[str]:
    """The keys under `prefix` (bytes not UTF-8 as surrogates) in the KV store. Degraded: none."""
    keys = _kv("_internal_kv_list", prefix) or []
    return sorted(k.decode(errors="surrogateescape") if isinstance(k, bytes) else k for k in keys)


def kv_delete(key: str) -> None:
    """Remove `key` from the connected cluster's key-value store. Degraded: it stays."""
    _kv("_internal_kv_del", key.encode(errors="surrogateescape"))


def upload_runtime_env(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """`runtime_env` made as `ray.init` makes the job's (an actor's takes only URIs and env
    variables): local `py_modules`, `working_dir` uploaded once per content, the setup hook
    (a function, or one's name) passed in the environment. Degraded: as given."""
    try:
        from ray._private import worker
        from ray._private.runtime_env import py_modules, setup_hook, working_dir

        modules = py_modules.upload_py_modules_if_needed
        folder = working_dir.upload_working_dir_if_needed
        hook = setup_hook.upload_worker_process_setup_hook_if_needed
        for upload in (modules, folder, hook):
            takes = ("worker",) if upload is hook else ("include_gitignore", "logger")
            if not _has_parameters(upload, "runtime_env", *takes):
                raise AttributeError(f"{upload.__name__} changed")
    except (ImportError, AttributeError) as exc:
        _fell_back("upload_runtime_env", exc)
        return dict(runtime_env)
    quiet = logging.getLogger("orchestrator.upload")  # Ray's "Creating a file package" lines
    quiet.setLevel(logging.WARNING)
    env = {**runtime_env, "env_vars": dict(runtime_env.get("env_vars") or {})}  # a copy
    uploaded = modules(hook(env, worker.global_worker), include_gitignore=True, logger=quiet)
    return folder(uploaded, include_gitignore=True, logger=quiet)


def auth_headers() -> dict[str, str]:
    """The headers Ray's clients send for token authentication ({} without a token)."""
    try:
        loader = _raylet().AuthenticationTokenLoader.instance()
    except (ImportError, AttributeError) as exc:  # a Ray without token authentication
        _fell_back("auth_headers", exc)
        return {}
    try:
        return dict(loader.get_token_for_http_header()) if loader.has_token() else {}
    except Exception:  # noqa: BLE001 - Ray's "token auth is on and no token was found"
        return {}
