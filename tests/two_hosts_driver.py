"""Driver for test_two_hosts.py, run inside host 0's network namespace.

Usage: python two_hosts_driver.py RAY_ADDRESS RESULT_JSON

The test starts it once both Ray nodes are up. distribute() connects to Ray through
`address` and makes two calls on the same warm pool:

1. `probe()`: every rank joins a gloo process group through init_process_group and
   all-reduces its rank; each reports where it ran and what it was told.
2. `probe(drop_interface=True)`: the same with GLOO_SOCKET_IFNAME removed, so gloo
   falls back to the hostname, which resolves to loopback on these hosts. It must
   fail: that proves the setup reproduces the failure the interface variable fixes.

Writes {"ranks": [...], "control": "<error report or null>", "seconds": {...}}.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

from orchestrator import distribute

GLOO_TIMEOUT = timedelta(seconds=20)
"""Far below gloo's 30 min default: a wrong address must fail the test, not hang it."""
CONTROL_TIMEOUT = timedelta(seconds=6)


def probe(*, drop_interface: bool = False) -> dict[str, Any]:
    """One rank: init gloo from the environment, all-reduce the rank, report."""
    import os
    import socket

    import ray
    import torch
    import torch.distributed as dist

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if drop_interface:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    dist.init_process_group("gloo", timeout=CONTROL_TIMEOUT if drop_interface else GLOO_TIMEOUT)
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total)
    hostname = socket.gethostname()
    return {
        "rank": dist.get_rank(),
        "env_rank": int(os.environ["RANK"]),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["NODE_RANK"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "node_ip": ray.util.get_node_ip_address(),
        "sum": int(total.item()),
        "gloo_socket_ifname": interface,
        "hostname": hostname,
        "hostname_ip": socket.gethostbyname(hostname),
    }


def main() -> None:
    """Run both calls on one warm pool and write the JSON result."""
    address, out = sys.argv[1], sys.argv[2]
    seconds: dict[str, float] = {}
    control = None
    with distribute(
        probe, num_replicas=4, replicas_per_node=2, address=address, name="two-hosts"
    ) as fn:
        start = time.monotonic()
        ranks = fn()
        seconds["call"] = time.monotonic() - start

        start = time.monotonic()
        try:
            fn(drop_interface=True)
        except Exception as exc:  # noqa: BLE001 - the report is the result
            control = f"{type(exc).__name__}: {exc}"
        seconds["control_call"] = time.monotonic() - start

    with open(out, "w") as f:
        json.dump({"ranks": ranks, "control": control, "seconds": seconds}, f)


if __name__ == "__main__":
    main()
