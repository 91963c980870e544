"""The public API: its names, distribute()'s keyword options, and bad arguments reported
before anything starts. No Ray."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import orchestrator
from orchestrator import ConfigError, distribute
from orchestrator.options import Options


def test_every_public_name_is_itself_once_its_modules_are_imported():
    """The package imports its names on first use; a submodule of the same name would
    shadow one once imported (`from orchestrator import distribute` gave the module)."""
    for module in set(orchestrator._MODULE_OF.values()):
        importlib.import_module(module)
    package = Path(orchestrator.__file__).parent
    for name in orchestrator.__all__:
        assert not (package / f"{name}.py").exists() and not (package / name).is_dir(), name
        assert getattr(orchestrator, name) is getattr(
            importlib.import_module(orchestrator._MODULE_OF[name]), name
        )
    assert callable(orchestrator.distribute)


def test_public_api_is_small_and_stable():
    assert sorted(orchestrator.__all__) == [
        "BusyError",
        "CallOptions",
        "ClusterMismatchError",
        "ClusterUnreachableError",
        "ConfigError",
        "DistributedError",
        "DistributedFunction",
        "FollowedJob",
        "Job",
        "JobInfo",
        "JobStatus",
        "JobTimeoutError",
        "OrchestratorError",
        "PlacementError",
        "PlacementTimeoutError",
        "RankFailure",
        "RankStatus",
        "StallError",
        "State",
        "SupervisorLostError",
        "default_log_dir",
        "distribute",
        "get_job",
        "list_jobs",
        "report",
    ]
    # One spelling per state: the enum compares equal to the words the API shows.
    assert orchestrator.State.WAITING == "waiting for a debugger"
    assert str(orchestrator.State.RUNNING) == "running"
    # Every public name a user's type checker can follow: a typed package (py.typed).
    for package in ("orchestrator", "orchestrator_workers"):
        assert (Path(importlib.import_module(package).__file__).parent / "py.typed").exists()


def test_every_exception_the_driver_side_defines_is_in_one_tree():
    """orchestrator/errors.py defines them all (and draws them at its top); the rank side's
    snapshot errors are reached from there and from orchestrator.snapshot alike."""
    import ast
    import builtins

    from orchestrator import errors, snapshot

    package = Path(orchestrator.__file__).parent
    elsewhere = []
    for path in package.rglob("*.py"):
        if path.name == "errors.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases]
            built = [getattr(builtins, b, None) for b in bases]
            if any(b.endswith(("Error", "Exception")) for b in bases) or any(
                isinstance(b, type) and issubclass(b, BaseException) for b in built
            ):
                elsewhere.append(f"{path.relative_to(package)}: {node.name}")
    assert not elsewhere, elsewhere
    tree = errors.__doc__ or ""
    for name, value in vars(errors).items():
        if isinstance(value, type) and issubclass(value, BaseException):
            assert name in tree, f"{name} is not drawn in errors.py's tree"
    assert errors.SnapshotError is snapshot.SnapshotError
    assert errors.SnapshotMemoryError is snapshot.SnapshotMemoryError
    assert issubclass(errors.SnapshotMemoryError, errors.SnapshotError)
    assert issubclass(errors.SnapshotError, RuntimeError)


def test_a_snapshot_s_memory_error_carries_its_numbers_to_the_driver():
    """Raised in a rank, pickled to the driver: the DistributedError is a
    SnapshotMemoryError too, and the rank's own error keeps its fields."""
    import pickle

    import cloudpickle

    from orchestrator import errors
    from orchestrator_workers.protocol import RankFailure

    raised = errors.SnapshotMemoryError(29, [2, 3], 5 * 2**30, 2**30)
    assert "step 29 needs 5.00 GiB more memory on the node of ranks 2, 3" in str(raised)
    again = pickle.loads(pickle.dumps(raised))  # noqa: S301 - our own
    fields = (again.step, again.ranks, again.needed, again.available)
    assert fields == (29, (2, 3), 5 << 30, 1 << 30)
    assert str(again) == str(raised)
    failure = RankFailure(
        rank=2,
        local_rank=0,
        node_ip="10.0.0.2",
        hostname="h",
        pid=7,
        time=1.0,
        exc_type="orchestrator_workers.errors.SnapshotMemoryError",
        message=str(raised),
        traceback="",
        exception=cloudpickle.dumps(raised),
    )
    error = errors.distributed_error([failure])
    assert isinstance(error, errors.SnapshotMemoryError)
    assert isinstance(error, errors.DistributedError)
    assert "raised orchestrator_workers.errors.SnapshotMemoryError: the in-memory" in str(error)


def test_distribute_s_keywords_are_the_options_dataclass():
    """Options is the one definition: distribute() spells out the same names, defaults
    and types for editors and type checkers, and with_options takes the per-call ones."""
    import dataclasses
    import inspect

    from orchestrator.options import PER_CALL, Options

    params = inspect.signature(distribute).parameters
    fields = {f.name: f for f in dataclasses.fields(Options)}
    assert list(params)[1:] == list(fields)
    for name, field in fields.items():
        param = params[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert param.default == default, name
        assert param.annotation == field.type, name
    assert set(fields) >= PER_CALL


def _locked_hook() -> Callable[[], None]:
    """A setup hook that holds a lock: it cannot be pickled."""
    lock = threading.Lock()

    def hook() -> None:
        with lock:
            pass

    return hook


_LOCKED_HOOK = _locked_hook()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_replicas": 0}, "num_replicas=0: must be an int >= 1"),
        ({"num_replicas": 2.5}, "num_replicas=2.5"),
        (
            {"num_replicas": 4, "replicas_per_node": 3},
            "replicas_per_node=3 does not divide num_replicas=4; valid: 1, 2, 4",
        ),
        ({"num_replicas": 4, "replicas_per_node": 0}, "replicas_per_node=0"),
        ({"num_replicas": 2, "cpus_per_replica": -1}, "cpus_per_replica=-1"),
        ({"num_replicas": 2, "resources_per_replica": {"GPU": 1}}, "use gpus_per_replica"),
        ({"num_replicas": 2, "name": "has space"}, "name='has space'"),
        ({"num_replicas": 2, "env": {"A": 1}}, "env['A']=1"),
        ({"num_replicas": 2, "cpus_per_replica": float("nan")}, "cpus_per_replica=nan"),
        ({"num_replicas": 2, "gpus_per_replica": float("inf")}, "gpus_per_replica=inf"),
        ({"num_replicas": 2, "timeout": float("inf")}, "timeout=inf"),
        ({"num_replicas": 2, "stall_after": 0}, "stall_after=0: must be a number of seconds"),
        ({"num_replicas": 2, "on_stall": "kill"}, "on_stall='kill': must be 'report'"),
        ({"num_replicas": 2, "spares_per_node": -1}, "spares_per_node=-1: must be an int >= 0"),
        ({"num_replicas": 2, "spares_per_node": 1.5}, "spares_per_node=1.5: must be an int"),
        (
            {"num_replicas": 2, "detach": True, "retention": 0},
            "retention=0: must be a number of seconds > 0, or math.inf",
        ),
        ({"num_replicas": 2, "retention": 60}, "retention=60: only a detached job is kept"),
        ({"num_replicas": 2, "log_dir": 123}, "log_dir=123: must be True"),
        (
            {"num_replicas": 2, "runtime_env": {"py_modules": ["gs://b/x.zip", "./no/such"]}},
            "runtime_env['py_modules'][1]='./no/such': no such file or folder in",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"working_dir": "/no/such/dir"}},
            "runtime_env['working_dir']='/no/such/dir': no such file or folder",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"env_var": {"A": "1"}}},
            "runtime_env['env_var']: not a field Ray knows; did you mean 'env_vars'? (valid: ",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"env_vars": ["A=1"]}},
            "runtime_env['env_vars']=['A=1']: must be a dict of names to values",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"env_vars": {"A": 1}}},
            "runtime_env['env_vars']['A']=1: names and values must be strings",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"worker_process_setup_hook": _LOCKED_HOOK}},
            "cannot be pickled to reach the ranks (TypeError: cannot pickle '_thread.lock'",
        ),
        (
            {"num_replicas": 2, "runtime_env": {"worker_process_setup_hook": 3}},
            "runtime_env['worker_process_setup_hook']=3: must be a function, or a module's",
        ),
        # A huge count: a few divisors, found at once, in a short message.
        (
            {"num_replicas": 10**12, "replicas_per_node": 7},
            "valid: 1, 2, 4, 5, 8, 10, 16, ... 1000000000000 (169 in all)",
        ),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_valid(kwargs, fragment):
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        distribute(len, **kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    # At once: this lane refuses a Ray start, and 10**12's divisors one by one would take
    # hours (10 s: a loaded machine's room).
    assert time.monotonic() - started < 10


def test_a_runtime_env_plugin_s_fields_and_ray_s_own_spellings_pass():
    """Ray passes a field it does not know to a runtime_env plugin of that name: only a near
    miss of one of Ray's own is refused (and `nsight`, which Ray takes as `_nsight`, is one
    of its own)."""
    for env in ({"my_plugin": {"a": 1}}, {"nsight": "default"}, {"env_vars": {"A": "1"}}):
        assert Options.create(len, num_replicas=2, runtime_env=env).runtime_env == env


def test_retention_is_a_detached_call_s_option():
    """How long a detached job is kept: set for the function or per call, never for a live
    function (whose results come back to its driver)."""
    import math

    detached = distribute(len, num_replicas=2, detach=True, retention=math.inf)
    assert detached.options.retention == math.inf
    assert detached.with_options(retention=60).options.retention == 60
    with pytest.raises(ConfigError, match="retention=-1: must be a number of seconds"):
        detached.with_options(retention=-1)
    with pytest.raises(ConfigError, match="retention=60: only a detached job is kept"):
        distribute(len, num_replicas=2).with_options(retention=60)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        distribute("not a function", num_replicas=0, name="")  # type: ignore[arg-type]
    text = str(info.value)
    assert "is not callable" in text
    assert "num_replicas=0" in text
    assert "name=''" in text


def test_every_package_folder_is_installed_by_a_non_editable_install():
    """pyproject lists packages one by one: a new subpackage missing there works in the
    editable install and is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = config["package-dir"]
    found = set()
    for name in ("orchestrator", "orchestrator_workers"):
        top = root / dirs.get(name, name)
        for init in top.rglob("__init__.py"):
            parts = init.parent.relative_to(top).parts
            found.add(".".join((name, *parts)))
    assert found == listed, f"pyproject: {sorted(listed)}; folders: {sorted(found)}"
