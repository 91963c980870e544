"""Every touch of a private Ray, cloudpickle or torch part works on the installed versions.

Each touch falls back quietly at run time; here a fallback fails loudly, so that a Ray
upgrade that breaks one is seen before users see the degraded mode.
"""

from __future__ import annotations

import os
import time
import types
from pathlib import Path

import ray

from orchestrator import _ray_compat as compat
from orchestrator import distribute
from orchestrator_workers import _compat as rank_compat
from tests.helpers import wait_resources_back


def test_the_installed_ray_is_within_the_tested_range():
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2])

    oldest, newest = (version(v) for v in compat.TESTED_RAY)
    assert oldest <= version(ray.__version__) <= newest, ray.__version__


def test_log_printer_wrap_filters_lines():
    from ray._private import worker

    before = worker.print_to_stdstream  # wrapped already where a pool started before
    original = getattr(before, "__wrapped__", before)
    worker.print_to_stdstream = original
    try:
        assert compat.wrap_log_printer(lambda batch: None)
        assert worker.print_to_stdstream.__wrapped__ is original  # type: ignore[attr-defined]
        worker.print_to_stdstream({"pid": "raylet", "lines": ["x"]}, False)  # dropped
    finally:
        worker.print_to_stdstream = before


def test_lean_head_replaces_and_restores_the_head_s_extra_processes():
    from ray._private import utils
    from ray._private.node import Node

    saved = {name: Node.__dict__[name] for name in compat.LEAN_HEAD}
    asks = utils.get_dashboard_dependency_error
    with compat.lean_head():
        assert all(Node.__dict__[name] is compat._not_started for name in compat.LEAN_HEAD)
        # The node's agent runs minimal, decided without importing the dashboard's packages.
        assert isinstance(utils.get_dashboard_dependency_error(), ImportError)
    assert {name: Node.__dict__[name] for name in compat.LEAN_HEAD} == saved
    assert utils.get_dashboard_dependency_error is asks


def test_a_lean_head_finds_its_registered_raylet_as_ray_does(cluster):
    from ray._private import services

    get_node = services.get_node
    node_id = ray.get_runtime_context().get_node_id()
    gcs_address = ray.get_runtime_context().gcs_address
    with compat.lean_head():
        assert services.get_node is not get_node
        asked = time.monotonic()
        found = services.get_node(gcs_address, node_id)
        waited = time.monotonic() - asked
    assert services.get_node is get_node
    assert waited < 5, f"the registered node was not seen: {waited:.1f} s (10 s: not found)"
    assert found == get_node(gcs_address, node_id) and found["node_id"] == node_id, found
    assert "lean_head" not in compat.degraded()


def test_auth_reload_niceness_and_upload_helpers(tmp_path: Path, monkeypatch):
    assert compat.reload_auth_mode()
    monkeypatch.delenv(compat.NICENESS_VAR, raising=False)
    assert compat.same_niceness() == {"worker_niceness": 0}
    assert {".git", "__pycache__"} <= set(compat.upload_default_excludes())
    (tmp_path / "keep.py").write_text("x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    seen: list[str] = []
    assert compat.walk_upload(tmp_path, [".git"], lambda p: seen.append(p.name))
    assert "keep.py" in seen and "HEAD" not in seen


def test_code_reduce_keeps_what_cloudpickle_needs():
    def f() -> int:
        return 1

    reduced = compat.code_reduce(f.__code__)
    assert reduced is not None
    rebuild, args = reduced
    assert isinstance(rebuild(*args), types.CodeType)


def test_untyped_storage_without_a_warning():
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # making one warns; reading it must not
        typed = torch.zeros(4).storage()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.untyped_storage(typed).nbytes() == 16


def test_alive_nodes_and_job_states_on_a_real_cluster(cluster):
    assert compat.alive_nodes(cluster.address) == len(cluster.list_all_nodes())
    states = rank_compat.job_states()
    assert states is not None and ray.get_runtime_context().get_job_id() in states


def test_a_function_shipped_by_value_runs_where_its_package_is_not(cluster):
    from orchestrator.connect import inventory

    read = ray.remote(num_cpus=0)(compat.by_value(inventory.read))
    assert ray.get(read.remote())["ray"] == ray.__version__
    assert "by_value" not in compat.degraded()


def test_a_runtime_env_s_local_folders_are_uploaded_as_ray_init_does(cluster, tmp_path):
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("X = 1\n")
    given = {"py_modules": [str(tmp_path / "mylib")], "env_vars": {"A": "1"}}
    uploaded = compat.upload_runtime_env(given)
    [uri] = uploaded["py_modules"]
    assert uri.startswith("gcs://_ray_pkg_") and uploaded["env_vars"] == {"A": "1"}, uploaded
    assert compat.upload_runtime_env(given) == uploaded  # content-addressed: the same URI
    assert given["py_modules"] == [str(tmp_path / "mylib")]  # the caller's is left alone
    assert "upload_runtime_env" not in compat.degraded()


def set_up_by_hook() -> None:
    """A setup hook in a module of the user's own folder (here, the tests')."""
    os.environ["SET_UP_BY"] = "the hook"


def test_a_runtime_env_s_setup_hook_runs_in_every_rank(cluster):
    """A function as `worker_process_setup_hook` (Ray takes it only in ray.init's
    runtime_env: in an actor's, its json encoder raised TypeError), from a module the
    ranks cannot import: it goes by value, as the call's function does (by name, Ray's
    worker failed to load it and died)."""
    given = {"worker_process_setup_hook": set_up_by_hook, "env_vars": {"A": "1"}}
    fn = distribute(
        lambda: (os.environ.get("SET_UP_BY"), os.environ.get("A")),
        num_replicas=2,
        log_dir=False,
        runtime_env=given,
    )
    try:
        assert fn() == [("the hook", "1")] * 2
    finally:
        fn.shutdown()
    assert given["env_vars"] == {"A": "1"}  # the caller's is left alone
    assert "upload_runtime_env" not in compat.degraded()
    wait_resources_back()


def test_the_cluster_keeps_what_a_driver_puts(cluster):
    key = f"test-key-{os.getpid()}"
    assert compat.kv_get(key) is None
    compat.kv_put(key, b"kept")
    assert compat.kv_get(key) == b"kept"
    compat.kv_put(key, b"again")  # overwritten, not kept first
    assert compat.kv_get(key) == b"again"
    assert "kv" not in compat.degraded()


def test_torch_group_counter_is_where_the_reset_expects_it():
    rank_compat.reset_group_counter()
    assert "reset_group_counter" not in rank_compat.degraded()


def test_the_resource_tracker_can_be_started_in_its_own_session():
    from multiprocessing import util

    before = util.spawnv_passfds
    try:
        rank_compat.tracker_in_own_session()
        assert util.spawnv_passfds.__wrapped__ is before  # type: ignore[attr-defined]
    finally:
        util.spawnv_passfds = before


def test_no_touch_fell_back_in_this_process():
    """Whatever the other tests and the suite's calls touched, nothing fell back."""
    assert compat.degraded() == {}
    assert rank_compat.degraded() == {}
    assert os.environ.get("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES") is None


def test_nvml_bindings_and_the_flight_recorder_are_where_the_probes_expect_them(processes):
    assert rank_compat.nvml() is not None  # not initialized: no GPU needed
    assert rank_compat.flight_recorder() is not None  # torch starts a process on import
    assert not {"nvml", "flight_recorder"} & set(rank_compat.degraded())
