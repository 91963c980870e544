"""Nodes without this package: two hosts in network namespaces (tests/hosts.py) whose Ray
runs from environments that have ray, torch and cloudpickle but not `orchestrator_workers`
(host 0), or an older copy of it (host 1). The driver, which has the package, must ship
its rank side to them.

Each node's environment is a venv without pip, made from this venv's base interpreter,
whose site-packages holds a `.pth` file naming this venv's site-packages: the `.pth` files
there (the editable install's finder among them) are not processed, so neither
`orchestrator` nor `orchestrator_workers` imports; no PYTHONPATH leads to the repository.
Host 1's venv also holds a copy of workers/ as `orchestrator_workers`, marked OLDER_COPY.

In the namespaces the machine's hostname resolves to loopback, as /etc/hosts makes it do
on many machines. Without GLOO_SOCKET_IFNAME gloo would then advertise 127.0.0.1 to its
peers and fail (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`); the tests never set
the variable themselves, distribute() must, and a control call without it must fail. Each
node's `ray start --temp-dir` keeps its address file there, never in /tmp/ray.

One cluster for the module. tests/bare_nodes_driver.py runs the in-process scenarios in
one driver, from a project folder inside host 0's namespace, and writes a report that the
tests read; `orchestrator run` and `orchestrator stacks` run as processes of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator_workers import sharing
from tests.helpers import write
from tests.hosts import LAPTOP, RAY_ADDRESS_FILE, REPO, Hosts, boot, laptop_kept

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DRIVER = Path(__file__).resolve().parent / "bare_nodes_driver.py"
SCENARIOS = DRIVER.parent / "scenarios.py"
"""What both drivers share, copied beside each."""
DRIVER_TIMEOUT_S = 480
CLI_READY_S = 120
CLI_TIMEOUT_S = 60
FAKE_TORCH = "2.0.0"  # bare_nodes_driver.FAKE_TORCH
SHIPPED = "/rank-side-"
"""Where the driver's rank side is unpacked on a node (bootstrap): in every such path. On
these nodes HOME is in /tmp, where a cleaner may remove a name and another user make it
again: a rank reaches its copy through a descriptor (/proc/PID/fd/N), never by name."""
CHECK = """\
import importlib, json
found = {}
for name in ("ray", "torch", "cloudpickle", "orchestrator_workers", "orchestrator"):
    try:
        module = importlib.import_module(name)
    except ImportError:
        found[name] = None
        continue
    found[name] = getattr(module, "__file__", None) or "(namespace)"
    if name == "orchestrator_workers":
        found["older_copy"] = hasattr(module, "OLDER_COPY")
print(json.dumps(found))
"""
"""Run by each node's Python: what it imports, and from where."""


@dataclass
class NodeEnvs:
    """The Python each host's Ray runs from."""

    bare: Path
    older: Path

    @property
    def pythons(self) -> list[Path]:
        """Host 0's, then host 1's."""
        return [self.bare / "bin" / "python", self.older / "bin" / "python"]


@dataclass
class Report:
    """What the batched driver wrote and printed."""

    scenarios: dict[str, Any]
    stdout: str
    stderr: str
    returncode: int | None
    hosts: Hosts

    def section(self, name: str) -> dict[str, Any]:
        """Scenario `name`'s entry; fail with the driver's output if it raised or is missing."""
        entry = self.scenarios.get(name)
        if entry is None:
            pytest.fail(f"scenario {name} did not run\n{self.show()}")
        if "error" in entry:
            rest = {k: v for k, v in entry.items() if k != "error"}
            pytest.fail(f"scenario {name}: {entry['error']}\n{rest}\n{self.show()}")
        return entry

    def show(self) -> str:
        """For a failed assertion: the driver's status and output, and the nodes' logs."""
        return (
            f"driver exit {self.returncode}\nstdout:\n{self.stdout[-6000:]}\n"
            f"stderr:\n{self.stderr[-10000:]}\n{self.hosts.ray_logs()}"
        )


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _make_node_env(folder: Path, *, older: bool) -> None:
    """A venv without pip that reaches this venv's site-packages through a `.pth` file;
    `older`: with a marked copy of workers/ installed as `orchestrator_workers`."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run(
        [base, "-m", "venv", "--without-pip", str(folder)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    site = _site_packages(folder)
    assert site.is_dir(), site
    ours = sysconfig.get_paths()
    (site / "test-venv.pth").write_text(
        "".join(f"{p}\n" for p in sorted({ours["purelib"], ours["platlib"]}))
    )
    if older:
        copy = site / "orchestrator_workers"
        shutil.copytree(REPO / "workers", copy, ignore=shutil.ignore_patterns("__pycache__"))
        with (copy / "__init__.py").open("a") as init:
            init.write("\nOLDER_COPY = True  # tests/test_bare_nodes.py: not the driver's copy\n")


def _start_checks(envs: NodeEnvs) -> list[subprocess.Popen[str]]:
    """Run CHECK by each node's Python, host 0's first."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return [
        subprocess.Popen(
            [str(python), "-c", CHECK],
            env=env,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for python in envs.pythons
    ]


def _check_node_envs(envs: NodeEnvs, checks: list[subprocess.Popen[str]]) -> None:
    """Each node's Python imports ray, torch and cloudpickle; neither imports `orchestrator`;
    only host 1's has `orchestrator_workers`, its older copy."""
    found = []
    for check in checks:
        out, err = check.communicate(timeout=120)
        assert check.returncode == 0, err
        found.append(json.loads(out))
    bare, older = found
    for name in ("ray", "torch", "cloudpickle"):
        assert bare[name] and older[name], (name, found)
    assert bare["orchestrator_workers"] is None, bare
    assert bare["orchestrator"] is None and older["orchestrator"] is None, found
    assert older["orchestrator_workers"] == str(
        _site_packages(envs.older) / "orchestrator_workers" / "__init__.py"
    ), older
    assert older["older_copy"] is True, older


@pytest.fixture(scope="module")
def node_envs() -> Iterator[NodeEnvs]:
    """The two nodes' environments, made here (checked while the cluster boots)."""
    tmp = Path(tempfile.mkdtemp(prefix="obn", dir="/tmp"))
    try:
        started = time.monotonic()
        envs = NodeEnvs(tmp / "bare", tmp / "older")
        _make_node_env(envs.bare, older=False)
        _make_node_env(envs.older, older=True)
        print(f"\nbare nodes: envs made in {time.monotonic() - started:.1f} s")
        yield envs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def two_hosts(node_envs: NodeEnvs) -> Iterator[Hosts]:
    """The cluster: host 0's Ray from the bare venv, host 1's from the older copy's; the
    venvs are checked while it boots (each takes seconds: together, hardly more than one)."""
    started = time.monotonic()
    checks = _start_checks(node_envs)
    try:
        with boot(node_envs.pythons, repo_on_path=False) as hosts:
            up = time.monotonic() - started
            _check_node_envs(node_envs, checks)
            checked = time.monotonic() - started
            print(f"bare nodes: cluster up in {up:.1f} s, envs checked by {checked:.1f} s")
            yield hosts
    finally:
        for check in checks:  # where the boot failed or skipped before they were read
            if check.poll() is None:
                check.kill()
            check.communicate()


@pytest.fixture(scope="module")
def project(two_hosts: Hosts) -> Path:
    """The user's project folder (not the repository): the driver, the README's example."""
    readme = (REPO / "README.md").read_text()
    example = re.search(r"## Example\n+```python\n(.*?)```", readme, re.S)
    assert example, "README.md: no ```python block under ## Example"
    folder = two_hosts.tmp / "project"
    folder.mkdir()
    shutil.copy(DRIVER, folder / DRIVER.name)
    shutil.copy(SCENARIOS, folder / SCENARIOS.name)
    (folder / "readme_example.py").write_text(example.group(1))
    return folder


@pytest.fixture(scope="module")
def report(two_hosts: Hosts, project: Path) -> Report:
    """tests/bare_nodes_driver.py, run once; what it reported and printed."""
    h = two_hosts
    out = project / "report.json"
    argv = [sys.executable, str(project / DRIVER.name), h.address, str(out), str(project)]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            h.argv(argv),
            cwd=project,
            env={**h.env, "RAY_ADDRESS": h.address},  # the README's example gives none
            capture_output=True,
            text=True,
            timeout=DRIVER_TIMEOUT_S,
            check=False,
        )
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, returncode = _text(exc.stdout), _text(exc.stderr), None
        stderr += f"\n(the driver was killed after {DRIVER_TIMEOUT_S} s)"
    print(f"\nbare nodes: driver {time.monotonic() - started:.1f} s")
    scenarios = json.loads(out.read_text()) if out.exists() else {}
    print({name: entry.get("seconds") for name, entry in scenarios.items()})
    print(scenarios.get("mismatch_then_readme", {}).get("steps"))
    return Report(scenarios, stdout, stderr, returncode, h)


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# --- the environment ------------------------------------------------------------------------


def test_each_node_s_ray_runs_its_own_environment(two_hosts, node_envs, report):
    nodes = report.section("environment")["nodes"]
    executables = {n["node_ip"]: n["executable"] for n in nodes}
    assert executables == dict(zip(two_hosts.node_ips, map(str, node_envs.pythons), strict=True))


# --- the batched driver's scenarios ----------------------------------------------------------


def test_gloo_runs_across_the_hosts_on_the_interface_distribute_found(two_hosts, report):
    """4 ranks, 2 per host: rank 0 on the driver's host, gloo across the bridge."""
    scenario = report.section("mismatch_then_readme")
    assert "gloo" in scenario, f"{scenario.get('where_error')}\n{report.show()}"
    ranks = scenario["gloo"]
    h = two_hosts
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["env_rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 for r in ranks)
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["master_addr"] for r in ranks] == [h.ips[0]] * 4
    assert [r["node_ip"] for r in ranks] == [h.ips[0], h.ips[0], h.ips[1], h.ips[1]]
    assert [r["sum"] for r in ranks] == [6] * 4
    # Found by distribute(), never set by this test: the interface carrying each node's IP.
    assert "GLOO_SOCKET_IFNAME" not in h.env
    expected = [h.interfaces[0]] * 2 + [h.interfaces[1]] * 2
    assert [r["gloo_socket_ifname"] for r in ranks] == expected
    # The trap is real: on these hosts the hostname resolves to loopback ...
    assert all(r["hostname_ip"].startswith("127.") for r in ranks), ranks


def test_without_the_interface_gloo_fails_on_loopback(report):
    """... and without the interface, gloo fails across the hosts."""
    scenario = report.section("mismatch_then_readme")
    assert "control" in scenario, f"{scenario.get('where_error')}\n{report.show()}"
    assert scenario["control"] is not None, "gloo worked without GLOO_SOCKET_IFNAME"
    assert "127.0.0.1" in scenario["control"], scenario["control"]


def test_the_readme_example_trains_on_both_hosts(report):
    readme = report.section("mismatch_then_readme")["readme"]
    assert "error" not in readme, f"{readme['error']}\n{report.show()}"
    losses = readme["losses"]
    assert isinstance(losses, list) and len(losses) == 4, losses
    assert all(isinstance(loss, float) for loss in losses), losses
    lines = report.stdout.splitlines()
    for rank in range(4):
        epochs = [
            int(m.group(1))
            for line in lines
            if (
                m := re.fullmatch(
                    rf"\[train_loop r{rank}\] Rank {rank}: Epoch (\d+), Loss \S+", line
                )
            )
        ]
        assert epochs == [*range(10), *range(5)], (rank, report.show())


def test_each_rank_s_output_reaches_the_driver_labelled(report):
    report.section("mismatch_then_readme")
    for rank in range(4):
        assert f"[where r{rank}] stdout line of rank {rank}" in report.stdout, report.show()
        assert f"[where r{rank}] stderr line of rank {rank}" in report.stderr, report.show()
        assert f"stderr line of rank {rank}" not in report.stdout


def test_every_rank_runs_the_driver_s_shipped_rank_side(two_hosts, node_envs, report):
    scenario = report.section("mismatch_then_readme")
    assert "where" in scenario, f"{scenario.get('where_error')}\n{report.show()}"
    ranks = scenario["where"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    h = two_hosts
    assert [r["node_ip"] for r in ranks] == [h.ips[0], h.ips[0], h.ips[1], h.ips[1]]
    pythons = [str(p) for p in node_envs.pythons]
    assert [r["executable"] for r in ranks] == [pythons[0]] * 2 + [pythons[1]] * 2
    for r in ranks:  # the bare host's and the older copy's alike
        assert r["workers_file"].startswith("/proc/"), r
        assert SHIPPED in r["workers_real"], r
        assert r["workers_file"].endswith("orchestrator_workers/__init__.py"), r
        assert not r["older_copy"], r


def test_a_rank_imports_the_snapshot_api_without_the_driver_s_machinery(report):
    """`from orchestrator import snapshot` in a rank on a node that lacks the package: the
    rank-side API, from the driver's copy; the driver's package is never imported by the
    rank itself, and the import brings none of its machinery."""
    scenario = report.section("mismatch_then_readme")
    assert "where" in scenario, f"{scenario.get('where_error')}\n{report.show()}"
    for r in scenario["where"]:
        assert r["snapshot"].get("save") == "orchestrator_workers.snapshot", r
        assert r["snapshot"]["restore"] == "orchestrator_workers.snapshot", r
        assert SHIPPED in r["snapshot"]["file"], r
        assert r["snapshot"]["file"].endswith("orchestrator/snapshot.py"), r
        assert not r["driver_side_before"] and r["machinery"] == [], r


def test_a_torch_mismatch_warns_once_per_node(two_hosts, report):
    scenario = report.section("mismatch_then_readme")
    assert scenario["hook"], "orchestrator.testing.driver_torch_version is missing"
    assert "where" in scenario, f"{scenario.get('where_error')}\n{report.show()}"
    nodes_torch = torch.__version__.split("+")[0]
    assert {r["torch"].split("+")[0] for r in scenario["where"]} == {nodes_torch}
    ips = ", ".join(two_hosts.node_ips)
    expected = (
        f"[where] nodes run another torch than this driver ({FAKE_TORCH}): {nodes_torch} on "
        f"{ips}; install torch=={FAKE_TORCH} there, or torch=={nodes_torch} here"
    )
    warnings = [
        line
        for line in report.stderr.splitlines()
        if "nodes run another torch than this driver" in line
    ]
    # Once: the README's example, a second pool on the same nodes under the same hook,
    # ran without warning again (and no later pool did).
    assert "error" not in scenario["readme"], report.show()
    assert warnings == [expected], report.show()


def test_a_rank_s_exception_arrives_with_its_traceback(report):
    raised = report.section("raises")
    assert raised["type"] is not None, "the call did not fail"
    assert raised["distributed"] and raised["value_error"], raised
    assert raised["root_rank"] == 1, raised
    text = raised["text"]
    assert text.startswith("rank 1 (local rank 0)"), text
    assert "raised ValueError: boom on a bare node" in text, text
    assert 'raise ValueError("boom on a bare node")' in text, text  # the rank's traceback
    assert "bare_nodes_driver.py" in text, text
    assert "[pair r1] rank 1 about to fail" in report.stdout, report.show()
    assert raised["again"] == [0, 1]  # the pool was replaced: the next call works
    warm, again = raised["pids"]
    assert len(warm) == 2 and not set(warm) & set(again), raised  # the warm one, by a new one


def test_a_crashed_rank_s_last_words_are_shown(report):
    crashed = report.section("crash")
    assert crashed["type"] is not None, "the call did not fail"
    assert crashed["distributed"] and crashed["root_rank"] == 1, crashed
    assert crashed["root_exc_type"] == "crash", crashed
    assert crashed["text"].startswith("rank 1 (local rank 0)"), crashed["text"]
    assert "killed by a signal" in crashed["text"], crashed["text"]
    assert "[pair r1] last words of rank 1" in report.stdout, report.show()


def test_a_failed_call_s_buffers_are_removed_from_dev_shm(report):
    shm = report.section("shm")
    assert "failure" in shm, shm
    assert shm["failure"]["root_rank"] == 1, shm
    assert "rank 1 fails (1.04858e+06)" in shm["failure"]["text"], shm  # the shared table
    assert shm["left"] == [], shm  # the planted leftover too


def test_a_detached_job_is_supervised_on_the_head_that_lacks_our_code(report):
    detached = report.section("detached")
    assert detached.get("result") == ["0", "1"], detached  # its supervisor carried both sides
    assert detached["again"] == ["0", "1"], detached  # got back by its id
    assert detached["logs"] == ["hello from rank 0\n", "hello from rank 1\n"], detached
    assert [detached["id"], "finished"] in detached["listed"], detached


def test_a_crashed_rank_restarts_the_job(two_hosts, report):
    restarted = report.section("restarts")
    assert "result" in restarted, restarted
    assert [tuple(r) for r in restarted["result"]] == [
        ("1", two_hosts.ips[0], 2.0),
        ("1", two_hosts.ips[1], 2.0),
    ]
    assert restarted["restarts"] == 1, restarted
    assert "rank 1" in restarted["failed_attempts"][0], restarted
    assert "crashed" in restarted["failed_attempts"][0], restarted
    assert "[pair] attempt 1 failed: rank 1 (local rank 0)" in report.stderr, report.show()
    assert "restarting all 2 ranks" in report.stderr, report.show()


def test_a_stall_names_the_rank_that_holds_the_others_back(report):
    stalled = report.section("stall")
    line = stalled["report"]
    assert line and "rank 1 is at bare_nodes_driver.py" in line, stalled
    assert "in held_back (`time.sleep(0.1)`)" in line, line
    assert "rank 0 waits in all_reduce at bare_nodes_driver.py" in line, line
    assert stalled.get("result") == [0, 1], stalled  # a report, not a failure


# --- `orchestrator run` and `orchestrator stacks`, processes of their own --------------------


@dataclass
class CliJob:
    """`orchestrator run` of a torchrun script, and `orchestrator stacks` while it waited."""

    run: subprocess.CompletedProcess[str]
    stacks: subprocess.CompletedProcess[str] | None
    hosts: Hosts

    def show(self) -> str:
        """For a failed assertion: both commands' status and output, and the nodes' logs."""
        shown = [("run", self.run), ("stacks", self.stacks)]
        return (
            "\n".join(
                f"--- orchestrator {name}: exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                f"stderr:\n{p.stderr[-6000:]}"
                for name, p in shown
                if p is not None
            )
            + f"\n{self.hosts.ray_logs()}"
        )


TRAIN = """\
import os, sys, time
import torch
import torch.distributed as dist

import orchestrator_workers


def wait_for_go():
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)


def wait_for_rank_0():
    dist.barrier()


dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"rank={os.environ['RANK']} local_rank={os.environ['LOCAL_RANK']} "
      f"world={os.environ['WORLD_SIZE']} sum={total.item():g} "
      f"shipped={'/rank-side-' in os.path.realpath(orchestrator_workers.__file__)}", flush=True)
print("ready", flush=True)
if dist.get_rank() == 0:
    wait_for_go()
wait_for_rank_0()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cli_job(two_hosts: Hosts, project: Path) -> Iterator[CliJob]:
    """`orchestrator run --nnodes 2 --nproc-per-node 1 train.py`, from a folder of the
    project; once both ranks wait, `orchestrator stacks` from another process."""
    h = two_hosts
    folder = write(project / "cli", {"train.py": TRAIN})
    go = project / "cli-go"
    run = [
        sys.executable,
        "-m",
        "orchestrator",
        "run",
        "--address",
        h.address,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--name",
        "clijob",
        "train.py",
        str(go),
    ]
    proc = subprocess.Popen(
        h.argv(run),
        cwd=folder,
        env=h.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out: list[str] = []
    err: list[str] = []
    ready = threading.Event()

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if sum(seen.rstrip("\n").endswith(" ready") for seen in out) == 2:
                ready.set()

    def read_err() -> None:
        assert proc.stderr is not None
        err.extend(proc.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for reader in readers:
        reader.start()
    stacks = None
    started = time.monotonic()
    seconds: dict[str, float] = {}
    try:
        if ready.wait(CLI_READY_S):
            seconds["ready"] = time.monotonic() - started
            stacks = h.run(
                [sys.executable, "-m", "orchestrator", "stacks", "clijob", "--address", h.address],
                cwd=project,
                timeout=CLI_TIMEOUT_S,
            )
            seconds["stacks"] = time.monotonic() - started
        go.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(CLI_TIMEOUT_S)
        seconds["done"] = time.monotonic() - started
        shown = {k: round(v, 1) for k, v in seconds.items()}
        print(f"\nbare nodes: orchestrator run, and stacks while it waits: {shown} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for reader in readers:
            reader.join(10)
    done = subprocess.CompletedProcess(run, proc.returncode, "".join(out), "".join(err))
    yield CliJob(done, stacks, h)


def test_orchestrator_run_runs_a_torchrun_script_on_both_hosts(cli_job):
    run = cli_job.run
    assert run.returncode == 0, cli_job.show()
    found = re.findall(
        r"^\[clijob r(\d)\] rank=(\d) local_rank=0 world=2 sum=3 shipped=True$", run.stdout, re.M
    )
    assert sorted(found) == [("0", "0"), ("1", "1")], cli_job.show()


def test_orchestrator_stacks_shows_a_running_job_s_ranks(cli_job):
    stacks = cli_job.stacks
    assert stacks is not None, f"the ranks never said ready\n{cli_job.show()}"
    assert stacks.returncode == 0, cli_job.show()
    rank0, rank1 = stacks.stdout.split("--- rank 1 ---")
    assert "--- rank 0 ---" in rank0, cli_job.show()
    assert "in wait_for_go" in rank0 and "time.sleep(0.1)" in rank0, cli_job.show()
    assert "in wait_for_rank_0" in rank1 and "dist.barrier()" in rank1, cli_job.show()


# --- after every driver ---------------------------------------------------------------------


def test_each_node_s_address_file_stays_in_its_private_temp_dir(two_hosts, report, cli_job):
    """`ray start --temp-dir` put each node's address file in its private temp dir, not in
    the machine-wide one that other tests and ray.init() would read."""
    h = two_hosts
    for host in (0, 1):
        recorded = (h.temp_dir(host) / "ray_current_cluster").read_text().strip()
        assert recorded == h.address
    assert h.address not in _read(RAY_ADDRESS_FILE), f"{RAY_ADDRESS_FILE} was written"


# --- the laptop: a driver that is no Ray node, through Ray Client ---------------------------

LAPTOP_DRIVER = Path(__file__).resolve().parent / "laptop_driver.py"
LAPTOP_TIMEOUT_S = 600
GRACE_S = 5
"""Ray Client's reconnect grace period, which the laptop asks for (Ray's default is 30 s):
once its link is down longer, the cluster lets the session go. Shortened to keep the test
short; the link stays down well past it."""
LINK_DOWN_S = 12


@dataclass
class LaptopReport(Report):
    """What the laptop's driver wrote and printed, and when its link was down."""

    link: dict[str, Any]

    def show(self) -> str:
        """For a failed assertion: the laptop's status and output, the link, the nodes' logs."""
        return f"laptop's link {self.link}\n{super().show()}"


def _cut_link(hosts: Hosts, link: dict[str, Any], folder: Path) -> None:
    """Take the laptop's link down for LINK_DOWN_S, and close both ends of its connections
    to the head, as a sleeping laptop's are closed in the end (by keepalives, or a new
    network's address): the cluster then counts the grace period down. `link-down` in
    `folder` says so to the ranks."""
    laptop, head = hosts.ips[LAPTOP], hosts.ips[0]
    link["down_at"] = time.monotonic()
    hosts.link(LAPTOP, up=False)
    (folder / "link-down").touch()
    for host, peer in ((0, laptop), (LAPTOP, head)):
        killed = subprocess.run(
            hosts.argv(["ss", "-K", "dst", peer], host),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        link.setdefault("closed", []).append(max(0, killed.stdout.count("\n") - 1))
    time.sleep(LINK_DOWN_S)
    hosts.link(LAPTOP, up=True)
    link["down_s"] = round(time.monotonic() - link["down_at"], 1)


@pytest.fixture(scope="module")
def laptop(two_hosts: Hosts, project: Path, report: Report) -> LaptopReport:
    """tests/laptop_driver.py, run once on the laptop (after the node-side driver: they would
    share the nodes' CPUs); its link taken down while its detached job runs."""
    h = two_hosts
    folder = h.tmp / "laptop"
    folder.mkdir()
    shutil.copy(LAPTOP_DRIVER, folder / LAPTOP_DRIVER.name)
    shutil.copy(SCENARIOS, folder / SCENARIOS.name)
    shutil.copy(project / "readme_example.py", folder / "readme_example.py")
    argv = h.laptop_argv([sys.executable, LAPTOP_DRIVER.name, "/mnt/report.json"], folder)
    env = h.laptop_env(
        RAY_CLIENT_RECONNECT_GRACE_PERIOD=str(GRACE_S), LAPTOP_HOST_FOLDER=str(folder)
    )
    link: dict[str, Any] = {}
    started = time.monotonic()
    with (folder / "out.log").open("w") as out, (folder / "err.log").open("w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True)
        try:
            deadline = started + LAPTOP_TIMEOUT_S
            while not (folder / "started").exists() and proc.poll() is None:
                assert time.monotonic() < deadline, "the laptop's detached job never started"
                time.sleep(0.1)
            if proc.poll() is None:
                time.sleep(1)  # some lines first
                _cut_link(h, link, folder)
            returncode: int | None = proc.wait(max(1, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, AssertionError):
            proc.kill()
            proc.wait()
            returncode = None
        finally:
            h.link(LAPTOP, up=True)
    print(f"\nlaptop: driver {time.monotonic() - started:.1f} s, link {link}")
    path = folder / "report.json"
    scenarios = json.loads(path.read_text()) if path.exists() else {}
    print({name: e.get("seconds") for name, e in scenarios.items() if isinstance(e, dict)})
    return LaptopReport(
        scenarios, _read(folder / "out.log"), _read(folder / "err.log"), returncode, h, link
    )


def test_the_laptop_sees_none_of_the_nodes_files(laptop):
    kept = {p.relative_to("/tmp").parts[0] for p in laptop_kept()}  # a clone in /tmp, say
    assert laptop.scenarios.get("tmp") == sorted({"home", *kept}), laptop.show()  # its own
    assert laptop.scenarios.get("home") == "/tmp/home"


def test_a_laptop_without_the_cluster_s_token_is_refused_at_once_and_told_why(laptop):
    found = laptop.section("tokens")
    none, wrong = found["none"], found["wrong"]
    assert none["exit"] != 0 and wrong["exit"] != 0, found
    assert "refused a driver without its token" in none["last"], found
    assert "~/.ray/auth_token" in none["last"] and "RAY_AUTH_TOKEN" in none["last"], found
    assert "refused this driver's Ray token" in wrong["last"], found
    assert none["seconds"] < 15 and wrong["seconds"] < 15, found  # Ray's own: 30 s, unclear


def test_the_readme_example_runs_from_the_laptop(laptop):
    laptop.section("readme")
    for rank in range(4):
        for epoch in range(5):
            assert f"[train_loop r{rank}] Rank {rank}: Epoch {epoch}, Loss" in laptop.stdout, (
                laptop.show()
            )


def test_a_rank_s_exception_reaches_the_laptop_with_its_traceback(laptop):
    raised = laptop.section("raises")
    assert raised["distributed"] and raised["root_rank"] == 1, raised
    assert raised["root_exc_type"].endswith("ValueError"), raised
    assert "boom, seen from a laptop" in raised["text"], raised
    assert 'laptop_driver.py", line' in raised["text"], raised  # the rank's own traceback


def test_a_crashed_rank_s_last_words_reach_the_laptop(laptop):
    """Shown live, or read on its node after its death (never on the laptop's disk)."""
    crashed = laptop.section("crash")
    assert crashed["root_rank"] == 1 and crashed["root_exc_type"] == "crash", crashed
    assert "killed by a signal" in crashed["text"], crashed
    assert "[pair r1] last words of rank 1" in laptop.stdout, laptop.show()


def test_the_laptop_attaches_to_a_rank_s_breakpoint(two_hosts, laptop):
    found = laptop.section("debugger")
    assert found["result"] == [42, 42], found
    assert found["host"] in two_hosts.node_ips, found  # a node, reached over the network
    assert found["attach_exit"] == 0 and "43" in found["transcript"], found


def test_a_detached_job_outlives_the_laptop_s_lost_session_and_nothing_is_lost(laptop):
    """The link down past Ray Client's grace period: the cluster let the laptop's session go
    (and the ranks ran on); the follower made a new one, found the supervisor again, and
    showed every line once, in order; other processes get the job back whole."""
    found = laptop.section("detached")
    assert laptop.link.get("down_s", 0) >= LINK_DOWN_S > GRACE_S, laptop.link
    assert found["result"] == [0, 1], found
    assert "lost this driver's Ray Client session" in laptop.stderr, laptop.show()
    assert f"reached the supervisor of {found['id']} again" in laptop.stderr, laptop.show()
    lines = 200  # laptop_driver.DETACHED_LINES
    for rank in (0, 1):
        shown = re.findall(rf"^\[count r{rank}\] line (\d+)$", laptop.stdout, re.M)
        assert [int(n) for n in shown] == list(range(lines)), (rank, laptop.show())
        logged = re.findall(rf"^\[count r{rank}\] line (\d+)$", found["logs"], re.M)
        assert [int(n) for n in logged] == list(range(lines)), (rank, found["logs"][-2000:])
    assert found["logs_exit"] == 0, found
    assert found["again"] == ["[0, 1]"], found  # a new process on the laptop
    assert found["in_process"] == [0, 1], found


def test_a_supervisor_lost_while_the_laptop_was_away_is_said_clearly_on_its_return(laptop):
    """Its rank killed the supervisor while the link was down: the follower, in its new
    session, finds it gone and says so; getting the job back says so too."""
    found = laptop.section("detached")
    doomed, again = found["doomed"], found["doomed_again"]
    assert doomed["type"] == "SupervisorLostError", doomed
    assert "its supervisor is gone" in doomed["text"], doomed
    assert "Ray Client session was lost" in doomed["text"], doomed
    assert again["type"] == "SupervisorLostError", again
    assert "so the job is lost" in again["text"], again


def test_a_failed_call_s_buffers_are_removed_from_the_nodes_dev_shm_by_the_laptop(laptop):
    """The laptop is no node: each node's /dev/shm is cleaned by a task on that node."""
    failed = laptop.section("shm")
    assert failed["root_rank"] == 1 and failed["value_error"], failed
    planted = re.search(r"planted (\S+)", failed["text"])
    assert planted is not None, failed
    key = planted.group(1).removesuffix("-lost")
    left = sorted(sharing.SHM.glob(f"{key}*"))  # long after the call: no waiting
    for path in left:
        path.unlink()
    assert not left, (left, failed)


def test_a_live_call_fails_clearly_when_the_session_ends_and_the_next_call_works(laptop):
    """A call that is not detached belongs to the session: the cluster ended both."""
    found = laptop.section("detached")
    live = found["live"]
    assert live["type"] == "ClusterUnreachableError", live
    assert "lost its Ray Client session" in live["text"], live
    assert "detach=True" in live["text"], live
    assert found["live_again"] == [0, 1], found
