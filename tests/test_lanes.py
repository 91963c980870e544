"""The two lanes: a test outside the `ray` lane cannot start Ray or a process."""

from __future__ import annotations

import os
import subprocess

import pytest
import ray


def test_a_pure_test_that_starts_a_process_or_ray_fails() -> None:
    """`pytest -m "not ray"` stays pure: the guard in tests/conftest.py fails such a test."""
    for start in (
        lambda: subprocess.run(["true"], check=True),
        lambda: os.fork(),  # noqa: PLW0108 - looked up when called, as a user would
        lambda: ray.init(address="local"),
    ):
        with pytest.raises(pytest.fail.Exception, match="not in the `ray` lane"):
            start()


def test_a_test_that_asks_for_processes_is_in_the_ray_lane(
    processes: None, request: pytest.FixtureRequest
) -> None:
    """The `processes` fixture marks the test `ray`, and lets it start what it needs."""
    assert request.node.get_closest_marker("ray") is not None
    assert subprocess.run(["true"], check=False).returncode == 0
