"""Helpers several test files share: `python -m orchestrator` in a fresh process, a project's
files, waiting for a condition. Not collected: it holds no tests."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180
_INHERITED = ("RAY_ADDRESS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli_env(tmp: Path) -> dict[str, str]:
    """This process's environment (RAY_TMPDIR of the session cluster) minus launcher leftovers."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["ORCHESTRATOR_LOG_DIR"] = str(tmp / "logs")
    env.pop("PYTHONUNBUFFERED", None)
    return env


def cli(command: str, *, cwd: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """`python -m orchestrator COMMAND` in `cwd`; its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *shlex.split(command)],
        cwd=cwd,
        env=cli_env(tmp),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def show(proc: subprocess.CompletedProcess[str]) -> str:
    """Everything a failed assertion should show."""
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


def write(folder: Path, files: dict[str, str]) -> Path:
    """Create `files` (relative path -> text, dedented) under `folder`; return `folder`."""
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until `condition()` holds, or fail the test saying what did not happen."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {timeout} s")
        time.sleep(0.05)
