"""The libraries people train with run unchanged: Lightning's Trainer and Fabric, and Hugging
Face Accelerate, under `orchestrator run` (1 node x 2, 2 nodes x 1) and through
`distribute()`, with the same per-rank results as under torchrun.

OMP_NUM_THREADS is pinned to 1 everywhere, so that the float results match exactly.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import distribute
from tests.helpers import TORCHRUN, cli_env, show

CLIENTS = ("lightning_trainer", "fabric_loop", "accelerate_loop")
FOLDER = Path(__file__).resolve().parent / "clients"
TIMEOUT_S = 240


def _results(folder: Path) -> list[dict]:
    """What each rank wrote, by rank."""
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    return [json.loads(p.read_text()) for p in files]


def _env(results: Path) -> dict[str, str]:
    return {**cli_env(results), "OMP_NUM_THREADS": "1", "RESULT_DIR": str(results)}


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Each client's per-rank results under torchrun, 2 processes on this machine."""
    found = {}
    for client in CLIENTS:
        results = tmp_path_factory.mktemp(f"torchrun-{client}")
        proc = subprocess.run(
            [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", f"{client}.py"],
            cwd=FOLDER, env=_env(results), capture_output=True, text=True,
            timeout=TIMEOUT_S, check=False,
        )
        # torch 2.14's gloo threads sometimes abort a worker at interpreter exit, after
        # its results are written ("terminate called without an active exception"): that
        # is torchrun's baseline, not the client, so the results still count.
        aborted_at_exit = "terminate called without an active exception" in proc.stderr
        assert proc.returncode == 0 or aborted_at_exit, show(proc)
        found[client] = _results(results)
        assert [r["rank"] for r in found[client]] == [0, 1], found[client]
    return found


@pytest.mark.parametrize("client", CLIENTS)
def test_a_client_library_runs_unchanged(client, torchrun_results, cluster, tmp_path):
    expected = torchrun_results[client]
    for layout in ("--nproc-per-node 2", "--nnodes 2 --nproc-per-node 1"):
        results = tmp_path / layout.replace(" ", "")
        results.mkdir()
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator", "run", "--address", cluster.address,
             *layout.split(), "--env", "OMP_NUM_THREADS=1", "--env", f"RESULT_DIR={results}",
             f"{client}.py"],
            cwd=FOLDER, env=_env(results), capture_output=True, text=True,
            timeout=TIMEOUT_S, check=False,
        )
        assert proc.returncode == 0, show(proc)
        assert _results(results) == expected, (layout, show(proc))
    module = importlib.import_module(f"tests.clients.{client}")
    with distribute(
        module.main, num_replicas=2, replicas_per_node=1, env={"OMP_NUM_THREADS": "1"}
    ) as fn:
        assert fn() == expected
