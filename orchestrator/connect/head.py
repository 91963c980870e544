"""A `ray start --head --block` process on this machine: started until its head is up,
again where Ray gave up on a busy machine, and ended with whatever it started."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.errors import LocalRuntimeError
from orchestrator.show import messages
from orchestrator_workers import private

START_TIMEOUT_S = 300.0
"""How long a head has to come up, at most: while its `ray start` runs it is waited for
(Ray gives up on its own, its raylet after 30 s, where it cannot start), however slowly
a busy machine brings it up; this ends a start that hangs."""
STOP_WAIT_S = 60.0
"""How long `ray start --block` has to stop what it started, once told (SIGTERM); then its
whole process group is killed."""
START_ATTEMPTS = 3
"""Tries of `ray start`: on a loaded machine its raylet may miss Ray's fixed 30 s to register."""


def start(
    command: list[str], env: dict[str, str], work: Path, log: Path, address_file: Path
) -> tuple[subprocess.Popen, str]:
    """Run `ray start --block` until its head is up: again where Ray gave up on a busy machine."""
    for attempt in range(1, START_ATTEMPTS + 1):
        with os.fdopen(private.create(log), "w") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=work,  # its workers' (the spares'), never the folder this ran in: /tmp, say
                env=env,
                start_new_session=True,  # a Ctrl-C in this terminal later must not stop it
            )
        try:
            return process, _wait_for_head(process, log, address_file)
        except BaseException as error:
            end(process)
            address_file.unlink(missing_ok=True)
            if not (isinstance(error, LocalRuntimeError) and overloaded(log.read_text())):
                raise
            if attempt == START_ATTEMPTS:
                raise LocalRuntimeError(
                    f"{error}\nRay gave up {attempt} times on this machine's load; "
                    "start the runtime again once it is less busy"
                ) from None
            messages.say(
                f"`ray start` timed out registering its node on a busy machine "
                f"(attempt {attempt} of {START_ATTEMPTS}); starting it again"
            )
    raise AssertionError("unreachable")


def overloaded(output: str) -> bool:
    """Whether `ray start` failed because its raylet did not register in Ray's fixed 30 s."""
    return "timed out during startup" in output


def end(process: subprocess.Popen) -> None:
    """Stop a `ray start` and whatever it started (its own session: its GCS and raylet too)."""
    if process.poll() is None:
        process.terminate()  # `ray start --block` stops what it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_WAIT_S)
    with contextlib.suppress(ProcessLookupError):  # what a failed start left behind
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def _wait_for_head(process: subprocess.Popen, log: Path, address_file: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-2000:]
            raise LocalRuntimeError(f"`ray start` exited with {process.returncode}:\n{tail}")
        with contextlib.suppress(OSError):
            address = private.read_trusted(address_file).strip()
            if address and "--block" in log.read_text():  # its --block notice: it is up
                return address
        time.sleep(0.2)
    raise LocalRuntimeError(f"Ray did not start within {START_TIMEOUT_S:g} s; see {log}")


def ray_command() -> list[str]:
    """The `ray` command of this Python's Ray."""
    beside = Path(sys.executable).with_name("ray")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ray")
    if found:
        return [found]
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
