"""The libraries people train with run unchanged: Lightning's Trainer and Fabric, and Hugging
Face Accelerate, under `orchestrator run` (1 node x 2) and through `distribute()` (2 nodes x
1), with the same per-rank results as under torchrun. (`orchestrator run`'s 2 nodes x 1
places its ranks as `distribute()` does; tests/test_cli.py runs it so.)

OMP_NUM_THREADS is pinned to 1 everywhere, so that the float results match exactly. The
runs of one client share nothing, so they run at once.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator import distribute
from tests.helpers import TORCHRUN, cli_env, show

CLIENTS = ("lightning_trainer", "fabric_loop", "accelerate_loop")
LAYOUTS = ("--nproc-per-node 2",)
FOLDER = Path(__file__).resolve().parent / "clients"
TIMEOUT_S = 240


def _results(folder: Path) -> list[dict]:
    """What each rank wrote, by rank."""
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    return [json.loads(p.read_text()) for p in files]


def _run(argv: list[str], results: Path) -> subprocess.CompletedProcess[str]:
    """`argv` in the clients' folder, the ranks writing their results in `results`."""
    env = {**cli_env(results), "OMP_NUM_THREADS": "1", "RESULT_DIR": str(results)}
    return subprocess.run(
        argv, cwd=FOLDER, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def _under_torchrun(client: str, results: Path) -> list[dict]:
    """`client`'s per-rank results under torchrun, 2 processes on this machine."""
    proc = _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", f"{client}.py"], results)
    # torch 2.14's gloo threads sometimes abort a worker at interpreter exit, after
    # its results are written ("terminate called without an active exception"): that
    # is torchrun's baseline, not the client, so the results still count.
    aborted_at_exit = "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or aborted_at_exit, show(proc)
    found = _results(results)
    assert [r["rank"] for r in found] == [0, 1], found
    return found


@pytest.fixture(scope="module")
def torchrun_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Future[list[dict]]]]:
    """Each client's results under torchrun, run one after another in the background while
    the tests run ours."""
    pool = ThreadPoolExecutor(1)
    try:
        folders = {client: tmp_path_factory.mktemp(f"torchrun-{client}") for client in CLIENTS}
        yield {client: pool.submit(_under_torchrun, client, folders[client]) for client in CLIENTS}
    finally:
        pool.shutdown(cancel_futures=True)


STOPPED = " stopped: no progress"
"""How a stopped rank is named (diagnose.stopped): never for these clients' loops."""


@pytest.mark.parametrize("client", CLIENTS)
def test_a_client_library_runs_unchanged(client, torchrun_results, cluster, tmp_path, capfd):
    launched = {}
    with ThreadPoolExecutor(len(LAYOUTS)) as pool:
        for layout in LAYOUTS:
            results = tmp_path / layout.replace(" ", "")
            results.mkdir()
            argv = [
                sys.executable,
                "-m",
                "orchestrator",
                "run",
                "--address",
                cluster.address,
                *layout.split(),
                "--env",
                "OMP_NUM_THREADS=1",
                "--env",
                f"RESULT_DIR={results}",
                f"{client}.py",
            ]
            launched[layout] = (results, pool.submit(_run, argv, results))
        module = importlib.import_module(f"tests.clients.{client}")
        with distribute(
            module.main, num_replicas=2, replicas_per_node=1, env={"OMP_NUM_THREADS": "1"}
        ) as fn:
            distributed = fn()
    expected = torchrun_results[client].result()
    shown = capfd.readouterr()
    assert STOPPED not in shown.err + shown.out  # no false alarm (diagnose.stopped)
    for layout, (results, run) in launched.items():
        proc = run.result()
        assert proc.returncode == 0, show(proc)
        assert STOPPED not in proc.stderr + proc.stdout, show(proc)
        assert _results(results) == expected, (layout, show(proc))
    assert distributed == expected
