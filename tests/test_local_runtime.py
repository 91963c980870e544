"""`orchestrator local start|status|stop`: a Ray here that outlives scripts, with warm ranks.

Everything runs in subprocesses with a private RAY_TMPDIR and port: the test
process keeps its own session cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DRIVER = textwrap.dedent("""\
    import json, os, sys, time
    import torch, torch.distributed as dist
    from orchestrator import distribute

    def job(hold):
        dist.init_process_group(backend="gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        if hold:
            with open(hold, "a") as out:
                out.write(f"{os.getpid()}\\n")
            time.sleep(120)
        return [os.getpid(), int(os.environ["RANK"]), t.item()]

    hold = sys.argv[1] if len(sys.argv) > 1 else ""
    print("RESULTS", json.dumps(distribute(job, num_replicas=2, replicas_per_node=1)(hold)))
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class Runtime:
    """The runtime under test: its environment and helpers to drive it."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "local", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def status(self) -> tuple[int, list[int], list[str], str]:
        """(runtime pid, pids of ready spares... as counts), claims and CPU line."""
        out = self.cli("status")
        assert out.returncode == 0, out.stdout + out.stderr
        head = re.search(r"\(pid (\d+),.*: (\d+) of (\d+) warm", out.stdout)
        assert head, out.stdout
        claims = re.findall(r"in use: .*", out.stdout)
        cpus = re.search(r"CPUs free: (.*)", out.stdout)
        assert cpus, out.stdout
        return int(head[1]), [int(head[2]), int(head[3])], claims, cpus[1]

    def wait_ready(self, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, (ready, _), claims, _ = self.status()
            if ready >= count and not claims:
                return
            time.sleep(1)
        pytest.fail(f"the runtime did not get back to {count} ready spares: {self.status()}")

    def driver(self, *args: str) -> subprocess.Popen[str]:
        script = self.tmp / "driver.py"
        script.write_text(DRIVER)
        return subprocess.Popen(
            [sys.executable, str(script), *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def _spare_pids() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::Spare"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (an orphan whose reaper has not run yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    """A local runtime with 2 spares in a private Ray temp dir; stopped at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    rt = Runtime(env, tmp)
    before = _spare_pids()
    started = rt.cli(
        "start", "--spares", "2", "--port", str(_free_port()), "--cpus", "8", timeout=180
    )
    assert started.returncode == 0, started.stdout + started.stderr
    assert "2 warm rank processes" in started.stdout, started.stdout
    yield rt
    leftover = rt.cli("status")
    pid = re.search(r"\(pid (\d+)", leftover.stdout)
    if pid and _alive(int(pid[1])):  # a failed test left it running: stop our own pid only
        os.kill(int(pid[1]), signal.SIGTERM)
    for spare in _spare_pids() - before:
        os.kill(spare, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_fresh_script_runs_its_ranks_in_warm_spares(runtime: Runtime) -> None:
    """No address: the script finds the runtime, and its 2 ranks are the 2 ready spares."""
    runtime.wait_ready(2)
    spares = _spare_pids()
    assert len(spares) >= 2
    assert runtime.cli("start").returncode != 0  # a second start refuses
    proc = runtime.driver()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    results = json.loads(next(x for x in out.splitlines() if x.startswith("RESULTS"))[8:])
    assert [r[1:] for r in results] == [[0, 3.0], [1, 3.0]]  # rank order, right all_reduce
    pids = {r[0] for r in results}
    assert pids <= spares, (pids, spares)  # torch was imported before the script began
    assert "embedded" not in err  # no Ray of its own
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "each spare serves one script only"
    runtime.wait_ready(2)  # replaced in the background
    *_, cpus = runtime.status()
    assert cpus == "8 of 8"


def test_a_killed_script_frees_its_spares_and_cpus(runtime: Runtime) -> None:
    """SIGKILL the driver while its ranks run: the spares exit, the CPUs come back."""
    runtime.wait_ready(2)
    hold = runtime.tmp / "hold.txt"
    proc = runtime.driver(str(hold))
    deadline = time.monotonic() + 60
    while (not hold.exists() or len(hold.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(pid) for pid in hold.read_text().split()]
    _, _, claims, cpus = runtime.status()
    assert len(claims) == 2, claims
    assert cpus == "6 of 8"
    stacks = subprocess.run(
        [sys.executable, "-m", "orchestrator", "stacks", "job"],
        env=runtime.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert stacks.returncode == 0, stacks.stderr
    assert "--- rank 1 ---" in stacks.stdout and "time.sleep(120)" in stacks.stdout, stacks.stdout
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "spares outlived their killed driver"
    runtime.wait_ready(2)
    *_, cpus = runtime.status()
    assert cpus == "8 of 8"


def test_orchestrator_run_uses_spares_and_ships_nothing(runtime: Runtime) -> None:
    """`orchestrator run` on the one-node runtime here: ranks in spares, files read in place."""
    runtime.wait_ready(2)
    spares = _spare_pids()
    (runtime.tmp / "helper.py").write_text("WHO = 'helper beside the script'\n")
    (runtime.tmp / "script.py").write_text(
        "import os\nfrom helper import WHO\n"
        "print('PID', os.getpid(), os.getcwd(), WHO, flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", "--nproc", "2", "script.py"],
        env=runtime.env,
        cwd=runtime.tmp,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split("PID ", 1)[1] for line in proc.stdout.splitlines() if "PID " in line]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        pid, cwd, *_ = line.split()
        assert int(pid) in spares
        assert cwd == str(runtime.tmp)  # the folder itself, not a shipped copy
    runtime.wait_ready(2)


def test_stop_ends_every_process(runtime: Runtime) -> None:
    """`local stop` ends Ray and the spares; status then says none runs."""
    runtime_pid, *_ = runtime.status()
    spares = _spare_pids()
    stopped = runtime.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(runtime_pid)
    deadline = time.monotonic() + 10
    while spares & _spare_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not spares & _spare_pids()
    after = runtime.cli("status")
    assert after.returncode == 3 and "no local runtime" in after.stdout
