"""Every rank's figures in Ray's own metrics: a `ray start` head whose nodes have
`ray[default]` (its metrics agent) exports them, and Prometheus's parser reads them.

The test environment has Ray without its default extra (so that the suite's clusters start
no metrics agent or dashboard); this test layers `ray[default]`'s packages over it in a
venv of its own (`.venv-ray-default`, made once), whose Python runs the head, its ranks
and the driver.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from orchestrator_workers.raymetrics import HELP
from tests.helpers import MachineClock, stop_head

ROOT = Path(__file__).resolve().parent.parent
LAYERED = ROOT / ".venv-ray-default"

DRIVER = """
import sys, time
from orchestrator import distribute, report

def train(seconds):
    import torch
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        optimizer.zero_grad()
        model(torch.ones(8, 4)).sum().backward()
        optimizer.step()
        report(samples=8)
        time.sleep(0.05)
    return "trained"

fn = distribute(train, num_replicas=2, gpus_per_replica=0, name="metered", address=sys.argv[1])
print(fn(float(sys.argv[2])), flush=True)
"""


@pytest.fixture(scope="module")
def ray_default() -> Path:
    """The Python of a venv that adds `ray[default]`'s packages to this one's."""
    python = LAYERED / "bin" / "python"
    done = LAYERED / f"ray-default-{ray.__version__}"
    if done.exists():
        return python
    shutil.rmtree(LAYERED, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(LAYERED)], check=True, timeout=120)
    ours = sysconfig.get_paths()["purelib"]
    theirs = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir, not a bare path: this venv's own .pth files (the editable install) count.
    (Path(theirs) / "test-env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"ray[default]=={ray.__version__}"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if installed.returncode != 0:
        pytest.fail(f"pip install ray[default] failed: {installed.stderr[-2000:]}")
    done.touch()
    return python


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def _ranks(samples: list) -> set[str]:
    """The ranks of the job `metered` among a family's samples."""
    return {s.labels["rank"] for s in samples if s.labels.get("job") == "metered"}


def _scrape(port: int) -> dict[str, list]:
    """Ray's export on this node: each orchestrator family's samples, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        family.name: family.samples
        for family in text_string_to_metric_families(text)
        if family.name.startswith("ray_orchestrator_")
    }


def test_a_running_job_s_figures_are_in_ray_s_metrics(ray_default, processes, tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, mode=0o700)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    temp = Path(tempfile.mkdtemp(prefix="rm", dir="/tmp"))  # Ray's socket paths: 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=str(temp), RAY_AUTH_MODE="token")
    env.update(ORCHESTRATOR_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=str(ROOT))
    env["RAY_metrics_report_interval_ms"] = "1000"  # Ray's default pushes every 10 s
    port, metrics = _free_port(), _free_port()
    log = (tmp_path / "head.log").open("w")
    head = subprocess.Popen(
        [
            str(ray_default),
            "-c",
            "from ray.scripts.scripts import main; main()",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--metrics-export-port={metrics}",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = None
    try:
        clock = MachineClock()
        while not (temp / "ray" / "ray_current_cluster").exists():  # written once all is up
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            assert clock.seconds() < 90, "ray start did not come up"
            time.sleep(0.2)
        driver = subprocess.Popen(
            [str(ray_default), str(script), f"127.0.0.1:{port}", "40"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wanted = {f"ray_{name}" for name in HELP} - {
            "ray_orchestrator_rank_gpu_memory_bytes",  # no CUDA here: not known, so not recorded
            "ray_orchestrator_rank_gpu_utilization_ratio",
        }
        clock, seen = MachineClock(), {}
        while clock.seconds() < 60:
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            seen = _scrape(metrics)
            if set(seen) == wanted and all(_ranks(seen[name]) == {"0", "1"} for name in wanted):
                break
            time.sleep(1)
        else:
            pytest.fail(f"not every figure of both ranks in Ray's metrics within 60 s: {seen}")
    finally:
        if driver is not None:
            driver.kill()
            driver.communicate()
        stop_head(head.pid)
        head.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    for family, samples in seen.items():
        by_rank = {s.labels["rank"]: s for s in samples if s.labels.get("job") == "metered"}
        assert set(by_rank) == {"0", "1"}, (family, samples)
        for rank, sample in by_rank.items():
            assert ipaddress.ip_address(sample.labels["node"]) and int(sample.labels["pid"]) > 0
            assert sample.value >= 0, (family, rank, sample)
    value = {name: seen[name][0].value for name in seen}
    assert value["ray_orchestrator_rank_step"] >= 1
    assert value["ray_orchestrator_rank_memory_bytes"] > 50 * 2**20  # torch is loaded
    assert value["ray_orchestrator_rank_samples_per_second"] > 0  # report(samples=8)
    assert 0 < value["ray_orchestrator_rank_step_seconds"] < 5
    assert abs(value["ray_orchestrator_rank_last_step_timestamp_seconds"] - time.time()) < 600
