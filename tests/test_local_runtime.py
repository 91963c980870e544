"""`orchestrator local start|status|stop`: a Ray here that outlives scripts, with warm ranks.

Everything runs in subprocesses with a private RAY_TMPDIR and port: the test
process keeps its own session cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator_workers import private
from tests.helpers import needs_namespaces, readable_by_other_user, sibling_attacks, stop_head

ROOT = Path(__file__).resolve().parent.parent

DRIVER = textwrap.dedent("""\
    import json, os, sys, time
    import torch, torch.distributed as dist
    from orchestrator import distribute

    def job(hold):
        import sibling  # on the rank: needs the script's folder on sys.path
        with open("data.txt") as f:  # relative to the script's working directory
            data = f.read().strip()
        dist.init_process_group(backend="gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        if hold:
            with open(hold, "a") as out:
                out.write(f"{os.getpid()}\\n")
            time.sleep(120)
        return [os.getpid(), int(os.environ["RANK"]), t.item(), sibling.WHO, data]

    hold = sys.argv[1] if len(sys.argv) > 1 else ""
    print("RESULTS", json.dumps(distribute(job, num_replicas=2, replicas_per_node=1)(hold)))
""")

CRASH_ONCE = textwrap.dedent("""\
    import json, os, signal
    from orchestrator import distribute

    def job():
        if os.environ["RANK"] == "1" and os.environ["RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return [os.getpid(), int(os.environ["RESTART_COUNT"])]

    fn = distribute(job, num_replicas=2, replicas_per_node=1, max_restarts=1)
    print("RESULTS", json.dumps(fn()))
""")


DETACHED = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    from orchestrator import distribute, get_job

    def job(go):
        Path(go + ".pid").write_text(str(os.getpid()))
        while not os.path.exists(go):
            time.sleep(0.1)
        return os.getpid()

    fn = distribute(job, num_replicas=1, detach=True, name="kept")
    if sys.argv[1] == "submit":
        print("JOB", fn.submit(sys.argv[2]).id, flush=True)
        time.sleep(600)  # killed meanwhile
    else:
        back = get_job(sys.argv[2], show=False)
        print("BACK", back.result(timeout=60), flush=True)
        again = fn.submit(sys.argv[3])  # on the warm pool its killed driver left
        print("AGAIN", again.result(timeout=60), flush=True)
        back.release()
        again.release()
        fn.shutdown()
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
        self.record: dict = {}
        """What `local start` recorded: address, pid, auth, temp_dir."""

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

    def wait_ready(self, count: int, cpus: str | None = None, timeout: float = 90) -> None:
        """Wait until `count` spares are ready, none is claimed and (if given) the CPU line
        reads `cpus`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, (ready, _), claims, free = self.status()
            if ready >= count and not claims and cpus in (None, free):
                return
            time.sleep(1)
        wanted = f"{count} ready spares" + (f" and {cpus} CPUs free" if cpus else "")
        pytest.fail(f"the runtime did not get back to {wanted}: {self.status()}")

    def driver(self, *args: str, script: str = DRIVER) -> subprocess.Popen[str]:
        """The driver script, in its own folder beside a module; run from self.tmp."""
        folder = self.tmp / "scripts"
        folder.mkdir(exist_ok=True)
        (folder / "driver.py").write_text(script)
        (folder / "sibling.py").write_text("WHO = 'sibling'\n")
        (self.tmp / "data.txt").write_text("data\n")
        return subprocess.Popen(
            [sys.executable, str(folder / "driver.py"), *args],
            cwd=self.tmp,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def _spare_pids(ray_tmpdir: Path | None = None) -> set[int]:
    """Pids of spare processes (of the runtime in `ray_tmpdir` only, when given)."""
    found = set()
    want = f"RAY_TMPDIR={ray_tmpdir}".encode() if ray_tmpdir else None
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            if not (entry / "cmdline").read_bytes().startswith(b"ray::Spare"):
                continue
            if want is None or want in (entry / "environ").read_bytes().split(b"\0"):
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
    """A local runtime with 3 spares in a private Ray temp dir; stopped at the end.

    HOME is empty, as on a fresh machine: no Ray token exists until `local start` makes one.
    """
    tmp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    tmp.chmod(0o755)  # other users may enter it, as they may a home folder
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT), HOME=str(tmp / "home"))
    rt = Runtime(env, tmp)
    port = _free_port()
    started = rt.cli("start", "--spares", "3", "--port", str(port), "--cpus", "8", timeout=420)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "3 warm rank processes" in started.stdout, started.stdout
    token = tmp / "home" / ".ray" / "auth_token"
    assert token.exists()  # token auth stays on
    # Whoever reads the token can join this user's clusters: this user's alone.
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    if os.getuid() == 0:
        assert not readable_by_other_user(token)
    # Its record (trusted for the auth mode and the pid `stop` signals) and its log are in
    # this user's own state folder, not in Ray's, where every user may write. So are Ray's
    # files: this RAY_TMPDIR is open to others (0755), and Ray makes its folders 0777.
    assert not list((tmp / "ray").glob("orchestrator*"))
    state = tmp / "home" / ".local" / "state" / "orchestrator"
    for made in (f"local-runtime-{port}.json", f"local-runtime-{port}.log"):
        assert stat.S_IMODE((state / made).lstat().st_mode) == 0o600, state / made
    record = json.loads((state / f"local-runtime-{port}.json").read_text())
    assert record["temp_dir"] == str(private.folder(lasting=True) / f"ray-{port}"), record
    assert (Path(record["temp_dir"]) / "ray_current_cluster").read_text() == record["address"]
    assert not (tmp / "ray" / "ray_current_cluster").exists()
    rt.record = record
    yield rt
    # A failed test may have left it running, and a loaded machine may leave `status` and
    # `stop` without an answer: stop our own pid, from its record, whatever they say.
    stop_head(int(record["pid"]))
    for spare in _spare_pids(tmp):
        os.kill(spare, signal.SIGKILL)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(private.folder(lasting=True) / f"ray-{port}", ignore_errors=True)


def test_a_fresh_script_runs_its_ranks_in_warm_spares(runtime: Runtime) -> None:
    """No address: the script finds the runtime, and its 2 ranks are the 2 ready spares."""
    runtime.wait_ready(2)
    spares = _spare_pids(runtime.tmp)
    assert len(spares) >= 2
    assert runtime.cli("start").returncode != 0  # a second start refuses
    proc = runtime.driver()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    results = json.loads(next(x for x in out.splitlines() if x.startswith("RESULTS"))[8:])
    # Rank order, the right all_reduce, a sibling module and a relative path as in the script.
    assert [r[1:] for r in results] == [[0, 3.0, "sibling", "data"], [1, 3.0, "sibling", "data"]]
    pids = {r[0] for r in results}
    assert pids <= spares, (pids, spares)  # torch was imported before the script began
    assert "embedded" not in err  # no Ray of its own
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "each spare serves one script only"
    runtime.wait_ready(2, cpus="8 of 8")  # replaced in the background


def _doors_of(pids: set[int]) -> set[str]:
    """The abstract socket names the processes `pids` listen on, as /proc/net/unix has them."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("@orchestrator-"):
            names.add(fields[7][1:])
    return names


@needs_namespaces
def test_a_sibling_container_runs_nothing_in_an_idle_spare(runtime: Runtime) -> None:
    """A spare's door is open from its start, before any driver claims it: a sibling
    container on the node's network sends it a call, and nothing runs; the spares then
    serve a script as before."""
    runtime.wait_ready(2)
    spares = _spare_pids(runtime.tmp)
    doors = _doors_of(spares)
    assert len(doors) >= 2, spares
    marker = runtime.tmp / "planted"
    said = sibling_attacks(marker)
    attacked = [line for line in said.splitlines() if line.split()[0] in doors]
    assert len(attacked) == len(doors), (said, doors)  # every ready spare's door was tried
    assert all(line.endswith(" hung up") for line in attacked), said
    assert not marker.exists()
    proc = runtime.driver()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    results = json.loads(next(x for x in out.splitlines() if x.startswith("RESULTS"))[8:])
    assert [r[2] for r in results] == [3.0, 3.0] and {r[0] for r in results} <= spares
    assert not marker.exists()


def test_a_rank_replaced_at_a_restart_is_a_warm_spare_too(runtime: Runtime) -> None:
    """Rank 1 dies; rank 0, finished, is kept; rank 1's place goes to the third spare."""
    runtime.wait_ready(3)
    spares = _spare_pids(runtime.tmp)
    proc = runtime.driver(script=CRASH_ONCE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    results = json.loads(next(x for x in out.splitlines() if x.startswith("RESULTS"))[8:])
    assert [r[1] for r in results] == [1, 1]  # both ran the second attempt
    assert {r[0] for r in results} <= spares, (results, spares)  # the new rank 1 too
    assert "attempt 1 failed: rank 1" in err, err


# The tests below start runtimes of their own. They run here, while the module's runtime
# starts the spares the tests above used again (one at a time, each importing torch),
# so that the two overlap; the tests after them find their spares ready.


@pytest.fixture
def private_env() -> Iterator[tuple[dict[str, str], Path]]:
    """An environment whose RAY_TMPDIR no Ray has used, with a state folder of its own (no
    other test's driver finds the runtime it starts)."""
    tmp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT), XDG_STATE_HOME=str(tmp / "state"))
    yield env, tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_bad_input_and_nothing_to_stop(private_env: tuple[dict[str, str], Path]) -> None:
    """Bad values are named before anything starts; stop without a runtime says so."""
    rt = Runtime(*private_env)
    bad = rt.cli("start", "--spares", "-1")
    assert bad.returncode == 2 and "--spares=-1" in bad.stderr, bad.stderr
    assert not (private_env[1] / "ray").exists()  # nothing was started
    stop = rt.cli("stop")
    assert stop.returncode != 0 and "no local runtime is running" in stop.stderr, stop.stderr


IDLE_S = 5
"""The idle timeout of `test_an_idle_runtime_stops_itself`'s runtime."""


def test_an_idle_runtime_stops_itself(private_env: tuple[dict[str, str], Path]) -> None:
    """--idle-timeout: with no script connected for that long, every process ends; not
    while a detached job's supervisor lives, and that job's rank, a spare, outlives its
    SIGKILLed driver, and serves the next driver's call as a warm pool."""
    rt = Runtime(*private_env)
    # Long enough for the next driver to connect on a busy machine; shorter than a spare's
    # start there (its torch import), which must not count as idle time.
    started = rt.cli(
        "start",
        "--spares",
        "1",
        "--port",
        str(_free_port()),
        "--idle-timeout",
        str(IDLE_S),
        timeout=180,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    runtime_pid = int(re.search(r"\(pid (\d+)\)", started.stdout)[1])
    spares = _spare_pids(private_env[1])
    assert len(spares) == 1, (spares, rt.status())
    try:
        _detached_job_outlives_its_driver(rt, spares)
    except BaseException:  # else the runtime must stop itself, as checked below
        if _alive(runtime_pid):
            os.kill(runtime_pid, signal.SIGTERM)
        raise
    deadline = time.monotonic() + 60
    while _alive(runtime_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        assert not _alive(runtime_pid), "the idle runtime kept running"
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in spares) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in spares)
        assert rt.cli("status").returncode == 3
    finally:
        if _alive(runtime_pid):
            os.kill(runtime_pid, signal.SIGTERM)


def _detached_job_outlives_its_driver(rt: Runtime, spares: set[int]) -> None:
    """A detached job on the runtime's spare: its driver SIGKILLed, the rank and the runtime
    live on past the idle timeout; a new driver gets the result, and a call on the same
    rank; once it releases everything, the runtime may go idle."""
    go = rt.tmp / "go"
    folder = rt.tmp / "scripts"
    folder.mkdir(exist_ok=True)
    (folder / "detached.py").write_text(DETACHED)
    driver = [sys.executable, str(folder / "detached.py")]
    first = subprocess.Popen(
        [*driver, "submit", str(go)],
        cwd=rt.tmp,
        env=rt.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = first.stdout.readline()
        assert line.startswith("JOB "), line + first.stderr.read()
        job_id = line.split()[1]
        deadline = time.monotonic() + 60
        while not Path(f"{go}.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        rank_pid = int(Path(f"{go}.pid").read_text())
        assert rank_pid in spares, (rank_pid, spares)  # the case: a spare owned by no script
    finally:
        first.kill()
        first.communicate()
    runtime_pid, *_ = rt.status()
    time.sleep(IDLE_S + 2)  # past the idle timeout, and a spare's look at its owner (1 s)
    assert _alive(runtime_pid), "the runtime stopped under a detached job"
    assert _alive(rank_pid), "the detached job's rank ended with its driver"
    go.touch()
    (rt.tmp / "go2").touch()
    second = subprocess.run(
        [*driver, "back", job_id, str(rt.tmp / "go2")],
        cwd=rt.tmp,
        env=rt.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"BACK [{rank_pid}]\n" in second.stdout, second.stdout + second.stderr
    assert f"AGAIN [{rank_pid}]\n" in second.stdout, second.stdout + second.stderr
    assert "using the warm ranks an earlier driver left" in second.stderr, second.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_a_private_folder_another_user_made_first_is_not_used(
    private_env: tuple[dict[str, str], Path],
) -> None:
    """Another user pre-creates orchestrator-UID in the temp dir: `local start` neither
    uses it nor dies with a traceback; its lasting files are in the user's state folder."""
    env, tmp = private_env
    shared = Path(tempfile.mkdtemp(prefix="sq", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        squat = shared / f"orchestrator-{os.getuid()}"
        squat.mkdir(mode=0o777)
        os.chown(squat, 65534, 65534)
        env = {k: v for k, v in env.items() if k != "RAY_TMPDIR"}
        env.update(TMPDIR=str(shared), XDG_STATE_HOME=str(tmp / "state"), HOME=str(tmp / "home"))
        rt = Runtime(env, tmp)
        port = _free_port()
        started = rt.cli("start", "--spares", "0", "--port", str(port), timeout=420)
        record = tmp / "state" / "orchestrator" / f"local-runtime-{port}.json"
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            assert "Traceback" not in started.stderr, started.stderr
            assert f"{squat} is not this user's private folder" in started.stderr, started.stderr
            temp_dir = json.loads(record.read_text())["temp_dir"]
            assert Path(temp_dir).parent == shared and not Path(temp_dir).is_relative_to(squat)
            assert not list(squat.iterdir())
        finally:
            stopped = rt.cli("stop")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not record.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_killed_script_frees_its_spares_and_cpus(runtime: Runtime) -> None:
    """SIGKILL the driver while its ranks run: the spares exit, the CPUs come back."""
    runtime.wait_ready(2)
    hold = runtime.tmp / "hold.txt"
    proc = runtime.driver(str(hold))
    deadline = time.monotonic() + 60
    while (not hold.exists() or len(hold.read_text().split()) < 2) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert hold.exists(), "the ranks never started"
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
    same = "--- ranks 0-1 (2 ranks, the same stacks) ---"  # shown once
    assert same in stacks.stdout and "time.sleep(120)" in stacks.stdout, stacks.stdout
    # First, where the functions are, grouped by place as a call's stall report has them.
    places = stacks.stdout.splitlines()[0]
    assert places.startswith("[job] where the functions are: 2 ranks (r0-1) are at "), places
    assert "(`time.sleep(120)`), for 0:" in places, places
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "spares outlived their killed driver"
    runtime.wait_ready(2, cpus="8 of 8")


def test_orchestrator_run_uses_spares_and_ships_nothing(runtime: Runtime) -> None:
    """`orchestrator run` on the one-node runtime here: files read in place, spares used.

    4 ranks, 3 spares: three ranks start in them, the fourth in a new process.
    """
    runtime.wait_ready(3)
    spares = _spare_pids(runtime.tmp)
    (runtime.tmp / "helper.py").write_text("WHO = 'helper beside the script'\n")
    (runtime.tmp / "script.py").write_text(
        "import os\nfrom helper import WHO\n"
        "print('PID', os.getpid(), os.getcwd(), os.getpriority(os.PRIO_PROCESS, 0), WHO)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", "--nproc", "4", "script.py"],
        env=runtime.env,
        cwd=runtime.tmp,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split("PID ", 1)[1] for line in proc.stdout.splitlines() if "PID " in line]
    assert len(lines) == 4, proc.stdout
    pids = {int(line.split()[0]) for line in lines}
    assert len(pids & spares) == 3, (pids, spares)
    for line in lines:
        assert line.split()[1] == str(runtime.tmp)  # the folder itself, not a shipped copy
        # Spares and new ranks alike run at the niceness of whoever started the runtime.
        assert line.split()[2] == str(os.getpriority(os.PRIO_PROCESS, 0)), line


def test_stop_ends_every_process(runtime: Runtime) -> None:
    """`local stop` ends Ray and the spares; status then says none runs."""
    runtime_pid, *_ = runtime.status()
    spares = _spare_pids(runtime.tmp)
    stopped = runtime.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(runtime_pid)
    deadline = time.monotonic() + 10
    while spares & _spare_pids(runtime.tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not spares & _spare_pids(runtime.tmp)
    after = runtime.cli("status")
    assert after.returncode == 3 and "no local runtime" in after.stdout
    # No name of it is left for another user to squat its port under.
    assert not (Path(runtime.record["temp_dir"]) / "ray_current_cluster").exists()
    state = runtime.tmp / "home" / ".local" / "state" / "orchestrator"
    assert not list(state.glob("local-runtime-*.json"))
