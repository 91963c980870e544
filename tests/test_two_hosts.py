"""Two real hosts on one machine: a Ray node in each of two network namespaces
(tests/hosts.py), every node run by this venv's Python with the repository on PYTHONPATH.

There the machine's hostname resolves to loopback, as /etc/hosts makes it do on many
machines. Without GLOO_SOCKET_IFNAME gloo would then advertise 127.0.0.1 to its peers and
fail (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`); the test never sets the
variable itself, distribute() must.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hosts import RAY_ADDRESS_FILE, REPO, Hosts, boot

DRIVER = Path(__file__).resolve().parent / "two_hosts_driver.py"
DRIVER_TIMEOUT_S = 90.0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    """A Ray head in one namespace, a worker node in the other; all torn down after."""
    with boot([sys.executable, sys.executable], repo_on_path=True) as hosts:
        yield hosts


@pytest.mark.slow
def test_two_hosts_gloo_all_reduce(two_hosts: Hosts) -> None:
    """4 ranks, 2 per namespace: rank 0 on the driver's host, gloo across the bridge."""
    h = two_hosts
    result_file = h.tmp / "result.json"
    driver_env = h.env
    proc = h.run(
        [sys.executable, str(DRIVER), h.address, str(result_file)],
        cwd=REPO,
        timeout=DRIVER_TIMEOUT_S,
    )
    if proc.returncode or not result_file.exists():
        pytest.fail(f"driver failed\n{h.report(proc)}")
    result = json.loads(result_file.read_text())
    ranks = result["ranks"]
    print(f"\ntwo hosts: driver phases {result['seconds']}")

    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["env_rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 for r in ranks)
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["master_addr"] for r in ranks] == [h.ips[0]] * 4
    assert [r["node_ip"] for r in ranks] == [h.ips[0], h.ips[0], h.ips[1], h.ips[1]]
    assert [r["sum"] for r in ranks] == [6] * 4
    # Found by distribute(), never set by this test: the interface carrying each node's IP.
    assert "GLOO_SOCKET_IFNAME" not in driver_env
    expected = [h.interfaces[0]] * 2 + [h.interfaces[1]] * 2
    assert [r["gloo_socket_ifname"] for r in ranks] == expected
    # The trap is real: on these hosts the hostname resolves to loopback ...
    assert all(r["hostname_ip"].startswith("127.") for r in ranks), ranks
    # ... and without the interface gloo fails across hosts.
    assert result["control"] is not None, "gloo worked without GLOO_SOCKET_IFNAME"
    assert "127.0.0.1" in result["control"], result["control"]

    # `ray start --temp-dir` put each node's address file in its private temp dir,
    # not in the machine-wide one that other tests and ray.init() would read.
    for host in (0, 1):
        recorded = (h.temp_dir(host) / "ray_current_cluster").read_text().strip()
        assert recorded == h.address
    assert h.address not in _read(RAY_ADDRESS_FILE), f"{RAY_ADDRESS_FILE} was written"
