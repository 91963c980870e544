"""Helpers several test files share: `python -m orchestrator` in a fresh process, a project's
files, waiting for a condition. Not collected: it holds no tests."""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180
# Variables a launcher or an enclosing Ray session would leave; what a test starts starts fresh.
_INHERITED = (
    "RAY_ADDRESS",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


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


_STARTS = (
    (subprocess.Popen, "__init__", "a subprocess"),
    (os, "fork", "a process (fork)"),
    (os, "posix_spawn", "a process (posix_spawn)"),
    (ray, "init", "Ray (ray.init)"),
    (Cluster, "__init__", "a Ray cluster"),
)
"""What starts Ray or a process, and its name in a refusal."""


@contextlib.contextmanager
def starting_nothing(why: str) -> Iterator[None]:
    """Within: starting Ray, a Ray cluster or any process fails the test ("this test starts
    a subprocess " and `why` it must not)."""
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in _STARTS:
            refusal = _refuse(f"this test starts {what} {why}", getattr(owner, name))
            patch.setattr(owner, name, refusal)
        yield


def _refuse(message: str, instead_of: Callable[..., object]) -> Callable[..., None]:
    @functools.wraps(instead_of)  # its signature stays readable (compat checks read it)
    def refuse(*_args: object, **_kwargs: object) -> None:
        pytest.fail(message, pytrace=False)

    return refuse


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until `condition()` holds, or fail the test saying what did not happen.

    `timeout` is in the machine's seconds (`MachineClock`): longer on a loaded machine.
    """
    clock = MachineClock()
    while not condition():
        if clock.seconds() > timeout:
            pytest.fail(f"not {what} within {timeout} s of machine time ({clock})")
        time.sleep(0.05)


class MachineClock:
    """Seconds as much of this machine as a quiet one gives: a wall second counts for less
    while more processes want its cores (the 1-minute load average over the cores), down
    to 1/`slowest` of a second. A wait for what takes N seconds of work (a detection, a
    step) then fails on a slow machine no sooner than on a quiet one, but still ends.
    """

    def __init__(self, slowest: float = 5.0) -> None:
        self.slowest = slowest
        self._last = self._start = time.monotonic()
        self._seconds = 0.0

    def seconds(self) -> float:
        """Machine seconds since this clock started."""
        now = time.monotonic()
        self._seconds += (now - self._last) / self.pace()
        self._last = now
        return self._seconds

    def pace(self) -> float:
        """How many times slower than a quiet machine this one runs now (1 to `slowest`)."""
        busy = os.getloadavg()[0] / len(os.sched_getaffinity(0))
        return min(max(busy, 1.0), self.slowest)

    def __str__(self) -> str:
        return f"{time.monotonic() - self._start:.0f} s of wall time, load x{self.pace():.1f}"


@contextlib.contextmanager
def http2_server(status: str, content_type: str, grpc_status: str = "12") -> Iterator[str]:
    """An HTTP/2 server on 127.0.0.1 answering every call with `status` and `content_type`
    (and `grpc_status`, by default UNIMPLEMENTED): its address. A web or gRPC server that is
    not Ray's (or, with UNAUTHENTICATED, one that refuses the caller's token)."""
    import hpack

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    fields = [(":status", status), ("content-type", content_type)]
    if content_type.startswith("application/grpc"):
        fields.append(("grpc-status", grpc_status))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(10)
            received, greeted = b"", False
            while not _has_headers(received[24:]):  # the preface, SETTINGS, then a call
                chunk = conn.recv(4096)
                if not chunk:
                    return
                received += chunk
                if len(received) >= 24 and not greeted:
                    conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # SETTINGS
                    greeted = True
            block = hpack.Encoder().encode(fields)
            conn.sendall(len(block).to_bytes(3, "big") + bytes([1, 5, 0, 0, 0, 1]) + block)
            stop.wait(10)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


def _has_headers(data: bytes) -> bool:
    """Whether the HTTP/2 frames at the start of `data` hold a whole HEADERS frame."""
    at = 0
    while at + 9 <= len(data):
        end = at + 9 + int.from_bytes(data[at : at + 3], "big")
        if end > len(data):
            return False
        if data[at + 3] == 1:
            return True
        at = end
    return False


OTHER = 65534
"""Another user: nobody, who needs no account to be made."""


def readable_by_other_user(path: Path) -> bool:
    """Whether uid 65534 can read `path` (its folders included)."""
    probe = subprocess.run(
        ["cat", str(path)],
        user=OTHER,
        group=OTHER,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


SIBLING = [
    "unshare",
    "--pid",
    "--mount",
    "--fork",
    "--mount-proc",
    "setpriv",
    "--bounding-set=-all",
    "--inh-caps=-all",
    "--no-new-privs",
]
"""A root container with host networking, as far as one process can be: its own pid and
mount namespaces, every capability dropped, the same uid and network."""
needs_namespaces = pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="needs root, unshare and setpriv to act as a sibling container",
)


def sibling_attacks(marker: Path, for_s: float = 0) -> str:
    """What tests/sibling_attack.py, run as a sibling container, printed (`for_s`: attack
    every door it finds again and again for that long)."""
    script = Path(__file__).with_name("sibling_attack.py")
    done = subprocess.run(
        [*SIBLING, sys.executable, str(script), str(marker), "2", str(for_s)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, show(done)
    return done.stdout


TORCHRUN = Path(sys.executable).parent / "torchrun"
EXAMPLE_TIMEOUT_S = 240  # generous: a 2-core machine may be busy with other tests' clusters


def run_example(*argv: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run `examples/<argv>` from the repository root; fail with its output if it fails."""
    ray_tmp = tempfile.mkdtemp(prefix="rx", dir="/tmp")  # short: Ray's socket paths live here
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["RAY_TMPDIR"] = ray_tmp
    # Unbuffered, print() writes text and newline apart: torchrun ranks sharing one pipe
    # would interleave their lines.
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [*launcher] if launcher else [sys.executable]
    cmd += [f"examples/{argv[0]}", *argv[1:]]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a hung run can be stopped with everything it started
    )
    try:
        try:
            out, err = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{cmd} did not finish in {EXAMPLE_TIMEOUT_S} s\n{_out_err(out, err)}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode != 0:
        pytest.fail(f"{cmd} exited with {proc.returncode}\n{_out_err(out, err)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _out_err(out: str, err: str) -> str:
    return f"--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"


def message_lines(prefix: str = "") -> list[str]:
    """What the message passing example prints on 4 ranks, each line after `prefix`."""
    rank0 = [f"{prefix.format(0)}worker_0 sent data to Rank {n}" for n in range(1, 4)]
    others = [f"{prefix.format(n)}worker_{n} has received data from rank 0" for n in range(1, 4)]
    return sorted(rank0 + others)


NODES = 2
GPUS_PER_NODE = 2
CPUS_PER_NODE = 4
"""The session cluster's shape (tests/conftest.py): 2 nodes x 2 logical GPUs, 4 CPUs each."""


def wait_resources_back(timeout: float = 20.0) -> None:
    """Wait until every CPU and GPU of the cluster is available again, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        total = ray.cluster_resources()
        free = ray.available_resources()
        if all(free.get(k, 0) == total.get(k, 0) for k in ("CPU", "GPU")):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"resources not released: total {total}, available {free}")
        time.sleep(0.1)


def default_sigint(argv: list[str]) -> list[str]:
    """`argv`, run with SIGINT's (SIGQUIT's, SIGHUP's) default disposition, as from a terminal.

    Under nohup, or `cmd &` in a script, the suite starts with SIGINT and SIGQUIT (SIGHUP)
    ignored, and every child would inherit that (a rank too, where a torchrun worker gets the
    default: its agent catches SIGQUIT, and exec resets a caught signal): a test that
    interrupts one, or compares what a process inherits, runs it as a user's terminal would.
    (A disposition set to the default survives exec; preexec_fn would be unsafe beside Ray's
    threads.)
    """
    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "signal.signal(signal.SIGQUIT, signal.SIG_DFL); "  # so does `cmd &` in a script
        "signal.signal(signal.SIGHUP, signal.SIG_DFL); "  # nohup ignores SIGHUP
    )
    return [sys.executable, "-c", reset + "os.execv(sys.argv[1], sys.argv[1:])", *argv]


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """In this process: SIGINT raises KeyboardInterrupt while inside, even if it was ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_head(pid: int, wait_s: float = 60.0) -> None:
    """Stop a `ray start --block` this test started (pid `pid`), loaded machine or not: told
    (SIGTERM), then, where it is still there after `wait_s`, its whole session killed (as
    `orchestrator local start` starts it: GCS, raylet and workers with it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        if _running(pid) and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` runs (neither gone nor a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
