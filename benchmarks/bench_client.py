"""A warm call from a laptop through Ray Client (`ray://`), beside plain Ray actors doing the
same work over the same connection; and the same from a node through the cluster's address.

    python -m benchmarks.bench_client [--repeats 40] [--ranks 4 16]

Starts its own head (`ray.cluster_utils.Cluster`, logical CPUs for the three ways' ranks side
by side, Ray Client's server on a free port, token authentication on, its own temp dir),
then one driver process per way in: the cluster's address (a driver on a node) and
`ray://` (a driver that is no node). Each
driver alternates, per size: plain actors (one per rank, each called once, all awaited),
a warm call of `distribute` and one of `distribute(detach=True)`, all no-ops. Prints one
table of medians. Goal: ours at most 1.5x plain actors, both ways in.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_detach import _alternated

ROOT = Path(__file__).resolve().parent.parent


def _noop() -> None:
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _drive(ranks_list: list[int], repeats: int) -> dict[str, Any]:
    """In a driver process (RAY_ADDRESS set): each way's warm call seconds, by size."""
    import ray

    from orchestrator import distribute

    ray.init(log_to_driver=False)

    @ray.remote(num_cpus=1)
    class Plain:
        def call(self) -> None:
            return None

    found: dict[str, Any] = {}
    for ranks in ranks_list:
        actors = [Plain.remote() for _ in range(ranks)]  # type: ignore[attr-defined]
        live = distribute(_noop, num_replicas=ranks, log_dir=False, name=f"live{ranks}")
        detached = distribute(
            _noop, num_replicas=ranks, log_dir=False, name=f"detached{ranks}", detach=True
        )
        ways = {
            "plain": lambda actors=actors: ray.get([a.call.remote() for a in actors]),
            "ours": live,
            "detached": detached,
        }
        try:
            times = _alternated(ways, repeats)
        finally:
            live.shutdown()
            detached.shutdown()
            for actor in actors:
                ray.kill(actor)
        found[str(ranks)] = {way: statistics.median(t) for way, t in times.items()}
    return found


def _driver(address: str, ranks: list[int], repeats: int, env: dict[str, str]) -> dict:
    """Run `_drive` in a process of its own, connected to `address`."""
    code = (
        "import json, sys; from benchmarks.bench_client import _drive; "
        f"print('RESULT', json.dumps(_drive({ranks!r}, {repeats})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line.removeprefix("RESULT ")))
    raise RuntimeError(f"the driver at {address} failed:\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bc", dir="/tmp"))
    token = secrets.token_hex(32)
    os.environ.update(RAY_TMPDIR=str(work), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    os.environ.pop("RAY_ADDRESS", None)
    from orchestrator import _ray_compat

    _ray_compat.reload_auth_mode()  # Ray read them at import (bench_detach's imports load it)
    from ray.cluster_utils import Cluster

    client_port = _free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3 * max(args.ranks) + 4, "ray_client_server_port": client_port},
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    results = {}
    try:
        for way, address in (
            ("node (cluster address)", cluster.address),
            ("laptop (ray://)", f"ray://127.0.0.1:{client_port}"),
        ):
            results[way] = _driver(address, args.ranks, args.repeats, env)
    finally:
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nA warm no-op call, by way in: medians of {args.repeats} alternated calls (ms)")
    print(
        f"  {'way in':<24}{'ranks':>6}{'plain actors':>14}{'ours':>9}{'ratio':>8}"
        f"{'detached':>10}{'ratio':>8}  goal"
    )
    for way, sizes in results.items():
        for ranks, found in sizes.items():
            plain, ours, detached = found["plain"], found["ours"], found["detached"]
            print(
                f"  {way:<24}{ranks:>6}{plain * 1000:>14.2f}{ours * 1000:>9.2f}"
                f"{ours / plain:>7.2f}x{detached * 1000:>10.2f}{detached / plain:>7.2f}x"
                "  ours <= 1.5x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
