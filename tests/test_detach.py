"""Detached jobs (distribute(..., detach=True)): supervised in the cluster, they outlive
their driver, and any process gets them back whole (docs/usage.md: "Detached jobs")."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, InvalidStateError

import nbformat
import pytest
import ray
from nbclient import NotebookClient

from orchestrator import (
    ConfigError,
    DistributedError,
    PlacementError,
    SupervisorLostError,
    _ray_compat,
    distribute,
    get_job,
    list_jobs,
    testing,
)
from orchestrator.options import Options
from orchestrator.supervise import registry
from orchestrator.supervise.supervisor import NAMESPACE
from tests.detached_work import count, pid
from tests.helpers import ROOT, default_sigint, wait_for, wait_resources_back

LINES = 60


def _lines(text: str, rank: int) -> list[str]:
    """Rank `rank`'s numbered lines in `text`, in order."""
    return [line.split("] ", 1)[-1] for line in text.splitlines() if f"rank {rank} line" in line]


def _every_line_once(text: str, rank: int) -> bool:
    return _lines(text, rank) == [f"rank {rank} line {i}" for i in range(LINES)]


DRIVER = """\
import sys
from tests.detached_work import count
from orchestrator import distribute
fn = distribute(count, num_replicas=2, replicas_per_node=1, detach=True, address={address!r},
                idle_timeout=5)
job = fn.submit({lines}, 0.1)
print("JOB", job.id, flush=True)
job.result()
print("DONE", flush=True)
"""


def test_a_detached_job_outlives_its_killed_driver_and_is_got_back_whole(cluster, capfd):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(address=cluster.address, lines=LINES)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        said = first = driver.stdout.readline()
        while first and not first.startswith("JOB"):
            first = driver.stdout.readline()
            said += first
        job_id = first.split()[1]
        # Its first line says how to get the job back.
        assert f"[count] detached job {job_id}; get it back with" in said, said
        seen = ""
        while "line 5\n" not in seen:  # the ranks run, and the driver shows their lines
            seen += driver.stdout.readline()
        driver.send_signal(signal.SIGKILL)  # mid-call: no exit hook runs
        driver.wait(timeout=10)
    finally:
        driver.kill()
    capfd.readouterr()
    job = get_job(job_id)
    assert job.result(timeout=60) == [0, 10]
    shown = capfd.readouterr()
    for rank in (0, 1):  # on the console: the backlog, then live, each line once in order
        assert _every_line_once(shown.out, rank), shown.out
        assert _every_line_once(job.logs(rank), rank), job.logs(rank)
    assert shown.err.startswith("[count] running\nrank  node"), shown.err  # its table first
    assert job.status().state == "finished"
    # Its numbers over time, kept by the supervisor from the job's start: its steps in
    # order, from the first (a record carries the newest 32: no reading must be missed).
    kept = job.metrics().by_rank()
    for rank in (0, 1):
        steps = kept[rank].steps["step"]
        assert steps[0] == 1 and steps[-1] == LINES and list(steps) == sorted(set(steps)), steps
        assert kept[rank].scalars["line"]["detail"]["value"][-1] == LINES - 1
    assert job_id in {found.id for found in list_jobs()}
    job.release()
    assert job_id not in {found.id for found in list_jobs()}
    # Its warm pool waits idle_timeout (5 s) for a later driver, then goes; then it does.
    wait_for(lambda: not _supervisors(), 40, "the supervisor gone once its jobs were released")
    assert job.record.supervisor not in {name for name, _, _ in registry.supervisors()}
    wait_resources_back()


def test_cancel_from_another_process_stops_the_ranks(cluster, capfd):
    fn = distribute(
        count, num_replicas=2, replicas_per_node=1, detach=True, address=cluster.address
    )
    job = fn.submit(10_000, 0.1)
    wait_for(job.running, 60, "the detached job running")
    with pytest.raises(InvalidStateError, match=f"job {job.id} is still running"):
        job.release()  # forgets only a finished job's result and output
    stop = subprocess.run(
        [sys.executable, "-m", "orchestrator", "stop", job.id, "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert stop.returncode == 0, stop.stderr
    assert f"stopped job {job.id}" in stop.stdout
    with pytest.raises(CancelledError):
        job.result(timeout=30)
    # The driver that follows it says why it ends, not a bare CancelledError.
    assert f"job {job.id} was stopped elsewhere" in capfd.readouterr().err
    listed = subprocess.run(
        [sys.executable, "-m", "orchestrator", "jobs", "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert job.id in listed.stdout and "cancelled" in listed.stdout, listed.stdout
    job.release()
    assert not testing.following(job)  # nothing left to follow: its exit says nothing of it
    fn.shutdown()
    wait_resources_back()


def test_orchestrator_logs_prints_every_line_and_one_rank_whole(cluster, capfd):
    fn = distribute(
        count, num_replicas=2, replicas_per_node=1, detach=True, address=cluster.address
    )
    job = fn.submit(LINES, 0.0)
    assert job.result(timeout=60) == [0, 10]
    cli = [sys.executable, "-m", "orchestrator", "logs", job.id, "--address", cluster.address]
    every = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert every.returncode == 0, every.stderr
    assert _every_line_once(every.stdout, 0) and _every_line_once(every.stdout, 1), every.stdout
    one = subprocess.run(
        [*cli, "--rank", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert one.stdout == "".join(f"rank 1 line {i}\n" for i in range(LINES)), one.stdout
    # A job submitted by another version of the product says so when it is got back.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry.rankside, "both_content", lambda: "0" * 16)
        other = fn.submit(1, 0.0)
    assert other.record.code == "0" * 16
    capfd.readouterr()
    newest = get_job("count", show=False)  # a name: its newest job
    assert newest.id == other.id and newest.result(timeout=30) == [0, 10]
    assert "was started by another version of orchestrator" in capfd.readouterr().err
    get_job(job.id, show=False).release()  # this version's: said nothing
    assert "was started by another version" not in capfd.readouterr().err
    # A job of a version before 2026-12: recorded by itself, its supervisor not recorded.
    registry.forget_supervisor(other.record.supervisor)
    with pytest.raises(ConfigError, match="no detached job"):
        get_job(other.id, show=False)
    earlier = json.dumps(dataclasses.asdict(other.record)).encode()
    _ray_compat.kv_put(registry.EARLIER_JOBS + other.id, earlier)
    assert get_job(other.id, show=False).result(timeout=30) == [0, 10]
    _ray_compat.kv_delete(registry.EARLIER_JOBS + other.id)
    registry.keep_supervisor(other.record.supervisor, "count")
    other.release()
    job.release()
    fn.shutdown()
    wait_resources_back()


def fail_on_rank_1() -> int:
    """Rank 1 raises; rank 0 returns."""
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 has a bad batch")
    return 0


def test_a_rank_s_error_is_raised_with_its_root_cause_as_a_live_call_s(cluster):
    with distribute(
        fail_on_rank_1, num_replicas=2, replicas_per_node=1, detach=True, address=cluster.address
    ) as fn:
        with pytest.raises(DistributedError) as raised:
            fn()
        assert isinstance(raised.value, ValueError)  # the root cause's own type too
        assert raised.value.root_cause.rank == 1
        assert "rank 1 has a bad batch" in str(raised.value)
        assert "fail_on_rank_1" in raised.value.root_cause.traceback
        job = testing.last_job(fn)
        assert "rank 1 has a bad batch" in job.table().cause  # the table, from the supervisor
        job.release()
    wait_resources_back(timeout=30)


def _hook_setting(value: str) -> Callable[[], None]:
    """A setup hook defined where its supervisor has no module of it (a script's, say)."""

    def hook() -> None:
        os.environ["SET_UP_BY"] = value

    return hook


def set_up_by() -> str | None:
    """What this rank's setup hook set."""
    return os.environ.get("SET_UP_BY")


def test_a_setup_hook_defined_in_the_driver_runs_in_a_detached_function_s_ranks(cluster):
    """The supervisor gets the options by value (it had failed to start: "Can't pickle
    local object", or, for a script's function, "Can't get attribute 'hook' on
    __main__")."""
    env = {"worker_process_setup_hook": _hook_setting("the hook")}
    with distribute(
        set_up_by,
        num_replicas=2,
        replicas_per_node=1,
        detach=True,
        address=cluster.address,
        runtime_env=env,
    ) as fn:
        job = fn.submit()
        assert job.result() == ["the hook"] * 2
        job.release()
    wait_resources_back(timeout=30)


def test_a_warm_pool_s_key_knows_a_setup_hook_by_its_pickle_not_its_address():
    """A later driver's equal hook (a new object) asks for the same warm pool."""

    def key(value: str) -> str:
        env = {"worker_process_setup_hook": _hook_setting(value)}
        return registry.pool_key(Options.create(set_up_by, num_replicas=2, runtime_env=env))

    assert key("a") == key("a") != key("b")


def test_a_short_blocking_call_comes_back_with_its_submit(cluster, capfd, monkeypatch):
    """A blocking call that ends within the supervisor's first wait comes back whole in its
    submit's answer: one Ray call, no thread started to follow it."""
    with distribute(
        count,
        num_replicas=2,
        replicas_per_node=1,
        detach=True,
        address=cluster.address,
        fold_output=False,
    ) as fn:
        capfd.readouterr()
        assert fn(3, 0.0) == [0, 10]  # starts the ranks: longer than the first wait
        out, err = capfd.readouterr()
        assert f"detached job {testing.last_job(fn).id}" in err, err
        for rank in (0, 1):
            assert _lines(out, rank) == [f"rank {rank} line {i}" for i in range(3)], out
        testing.last_job(fn).release()
        started: list[str] = []
        start = threading.Thread.start

        def recorded(thread: threading.Thread) -> None:
            started.append(thread.name)
            start(thread)

        in_one = []
        for _ in range(5):  # on a loaded machine, a warm call may outlast the first wait
            monkeypatch.setattr(threading.Thread, "start", recorded)
            assert fn(0, 0.0) == [0, 10]
            monkeypatch.undo()
            job = testing.last_job(fn)
            in_one.append(not any(job.id in name for name in started))
            job.release()
        assert any(in_one), started
    wait_resources_back(timeout=30)


def test_a_refusal_is_raised_and_a_call_after_the_supervisor_ended_idle_starts_anew(cluster, capfd):
    """What the supervisor refuses is raised in the driver before any rank starts. A
    supervisor whose pool went idle and whose jobs were all released (here: their
    retention ran out) ends; the function's next call starts a new one, and says so."""
    never = distribute(
        pid,
        num_replicas=3,
        replicas_per_node=3,
        detach=True,
        idle_timeout=1,
        address=cluster.address,
    )
    with never, pytest.raises(PlacementError, match="GPU: 2"):
        never()
    with distribute(
        count,
        num_replicas=2,
        replicas_per_node=1,
        detach=True,
        idle_timeout=1,
        retention=1,
        address=cluster.address,
    ) as fn:
        assert fn(0, 0.0) == [0, 10]
        kept = testing.last_job(fn)  # not released: kept for its retention, 1 s
        ended = testing.supervisor(fn)
        wait_for(lambda: ended not in _supervisors(), 60, "the idle supervisor ended")
        gone = re.escape("kept until job.release() or for its retention")
        with pytest.raises(ConfigError, match=gone):
            get_job(kept.id)
        capfd.readouterr()
        assert fn(0, 0.0) == [0, 10]
        assert "its supervisor had ended" in capfd.readouterr().err
        assert testing.supervisor(fn) != ended
        testing.last_job(fn).release()
    wait_resources_back(timeout=30)
    mine = {testing.supervisor(fn), testing.supervisor(never)}
    wait_for(lambda: not mine.intersection(_supervisors()), 60, "their supervisors gone")


INTERRUPTED = """from tests.detached_work import count
from orchestrator import distribute
fn = distribute(count, num_replicas=2, replicas_per_node=1, detach=True, address={address!r},
                idle_timeout=5)
fn({lines}, 0.1)
"""


def test_ctrl_c_stops_following_not_the_job(cluster):
    driver = subprocess.Popen(
        default_sigint(
            [sys.executable, "-c", INTERRUPTED.format(address=cluster.address, lines=LINES)]
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen = ""
    while "line 3\n" not in seen:
        seen += driver.stdout.readline()
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=60)
    job_id = err.split("detached job ", 1)[1].split(";", 1)[0]
    assert f"stopped following job {job_id}; it runs on in the cluster" in err, err
    job = get_job(job_id, show=False)
    assert job.result(timeout=60) == [0, 10]  # it ran to its end
    assert _every_line_once(job.logs(0), 0)
    job.release()
    wait_resources_back(timeout=30)


def test_losing_the_supervisor_fails_the_job_clearly_and_its_ranks_go(cluster):
    fn = distribute(
        count, num_replicas=2, replicas_per_node=1, detach=True, address=cluster.address
    )
    job = fn.submit(10_000, 0.1)
    wait_for(job.running, 60, "the detached job running")
    ray.kill(ray.get_actor(job.record.supervisor, namespace=NAMESPACE))
    with pytest.raises(SupervisorLostError, match="supervisor is gone"):
        job.result(timeout=60)
    wait_resources_back(timeout=60)  # its ranks belonged to it
    with pytest.raises(SupervisorLostError, match="gone"):
        get_job(job.id)
    lost = [info for info in list_jobs() if info.id == job.record.supervisor]
    assert [info.state for info in lost] == ["lost"], list_jobs()
    cli = [sys.executable, "-m", "orchestrator"]
    listed = subprocess.run(
        [*cli, "jobs", "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert re.search(rf"^{job.record.supervisor} +lost +- ", listed.stdout, re.M), listed.stdout
    forgot = subprocess.run(
        [*cli, "stop", job.record.supervisor, "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "its record is removed" in forgot.stdout, forgot.stdout + forgot.stderr
    assert job.record.supervisor not in {info.id for info in list_jobs()}
    with pytest.raises(ConfigError, match="no detached job"):
        get_job(job.id)


def test_detach_without_a_lasting_ray_is_refused_before_anything_starts(processes, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path)
    env["HOME"] = str(tmp_path)  # no local runtime recorded
    script = textwrap.dedent("""\
        import ray
        from orchestrator import distribute
        try:
            distribute(abs, num_replicas=1, detach=True)(1)
        except Exception as exc:
            print(type(exc).__name__, exc)
        print("RAY", ray.is_initialized())
    """)
    ran = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "ConfigError detach=True needs a Ray that outlives this process" in ran.stdout
    assert "orchestrator local start" in ran.stdout
    assert "RAY False" in ran.stdout, ran.stdout + ran.stderr


def test_detach_must_be_a_bool():
    with pytest.raises(ConfigError, match="detach='yes'"):
        distribute(abs, num_replicas=1, detach="yes")  # type: ignore[arg-type]


def _supervisors() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith("supervisor-")
    ]


LATER = """\
from tests.detached_work import pid
from orchestrator import distribute
fn = distribute(pid, num_replicas=2, replicas_per_node=1, detach=True, address={address!r},
                idle_timeout=20, env={env!r})
job = fn.submit()
print("PIDS", job.result(), flush=True)
job.release()
"""


def _later_driver(address: str, env: dict[str, str]) -> tuple[list[int], str]:
    ran = subprocess.run(
        [sys.executable, "-c", LATER.format(address=address, env=env)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    pids = [int(p) for p in ran.stdout.split("PIDS [", 1)[1].split("]", 1)[0].split(",")]
    return pids, ran.stderr


def test_a_later_driver_that_asks_for_the_same_pool_gets_its_warm_ranks(cluster):
    first, _ = _later_driver(cluster.address, {})  # exits; its ranks stay warm
    again, said = _later_driver(cluster.address, {})  # the notebook after a restart, say
    assert again == first, (first, again)
    assert "using the warm ranks an earlier driver left" in said, said
    other, said = _later_driver(cluster.address, {"SEED": "1"})  # another env: its own
    assert set(other).isdisjoint(first) and "using the warm ranks" not in said
    cli = [sys.executable, "-m", "orchestrator"]
    listed = subprocess.run(
        [*cli, "jobs", "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    pools = listed.stdout.split("warm pools", 1)[-1]
    held = [line.split()[0] for line in pools.splitlines() if "2 CPU, 2 GPU" in line]
    assert len(held) == 2, listed.stdout  # what each holds while it waits
    waiting = {j.id: j for j in list_jobs() if j.is_pool}  # list_jobs lists them too
    assert set(held) <= set(waiting), (held, waiting)
    assert waiting[held[0]].holds == {"CPU": 2.0, "GPU": 2.0}, waiting[held[0]]
    assert waiting[held[0]].idle_timeout == 20 and waiting[held[0]].ranks == 2
    stopped = subprocess.run(
        [*cli, "stop", held[1], "--address", cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "releases its warm pool" in stopped.stdout, stopped.stdout + stopped.stderr
    # The other goes after its idle_timeout (20 s) without a call; then both supervisors.
    wait_resources_back(timeout=60)
    wait_for(lambda: not _supervisors(), 30, "the supervisors gone")


def _notebook(*cells: str) -> nbformat.NotebookNode:
    """Run `cells` in a fresh Jupyter kernel (shut down after); the executed notebook."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=180).execute()
    return nb


def test_a_notebook_gets_its_job_back_after_a_kernel_restart(cluster):
    setup = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.detached_work import count"
    before = _notebook(
        setup,
        "from orchestrator import distribute\n"
        "fn = distribute(count, num_replicas=2, replicas_per_node=1, detach=True, "
        f"address={cluster.address!r}, idle_timeout=5)\n"
        f"job = fn.submit({LINES}, 0.1)\n"
        "print('ID', job.id)",
    )  # ... and its kernel is gone: the job is not
    job_id = _cell_text(before.cells[1]).split("ID ", 1)[1].split()[0]
    after = _notebook(
        setup,
        "import orchestrator\n"
        f"job = orchestrator.get_job({job_id!r}, address={cluster.address!r})\n"
        "print('RESULT', job.result())",
    )
    shown = _cell_text(after.cells[1])
    assert "RESULT [0, 10]" in shown, shown
    assert _every_line_once(shown, 0) and _every_line_once(shown, 1), shown
    get_job(job_id, show=False).release()
    wait_resources_back(timeout=30)


def _cell_text(cell: nbformat.NotebookNode) -> str:
    """What the cell printed on stdout (the table goes to stderr)."""
    return "".join(
        out.get("text", "")
        for out in cell.outputs
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )
