"""Two real hosts on one machine: a Ray node in each of two network namespaces.

Each namespace has its own address on a private bridge, and there the machine's
hostname resolves to loopback, as /etc/hosts makes it do on many machines. `boot()`
starts a Ray head in the first and a worker node in the second, each node's `ray start`
run by the Python given for it (this venv's, or one that lacks this package), with or
without the repository on PYTHONPATH. Drivers then run inside the first namespace.

A third namespace on the bridge is a laptop: no Ray node, and its own /tmp, /dev/shm and
HOME (empty tmpfs mounts), so that a driver there reaches the cluster only through the
network (Ray Client, `ray://HEAD:10001`), never by reading the nodes' files.

Everything `boot()` creates (namespaces, links, /etc/netns/<ns>, a temp dir holding the
Ray nodes' temp dirs, processes) is removed when it exits. Not collected: no tests.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GCS_PORT = 6379  # each namespace has its own port space
CLIENT_PORT = 10001  # Ray Client's server on the head (`ray start --head`'s default)
LAPTOP = 2
"""The laptop's index in Hosts.namespaces."""
CPUS_PER_NODE = 4
START_TIMEOUT_S = 45.0
STOP_TIMEOUT_S = 10.0
NETNS_DIR = Path("/etc/netns")
RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


@dataclass
class Hosts:
    """The two namespaces and the Ray cluster across them."""

    namespaces: list[str]
    """The head's, the worker node's, then the laptop's."""
    ips: list[str]
    interfaces: list[str]
    address: str
    env: dict[str, str]
    """The nodes' environment, and the drivers' (token, private HOME and temp dirs)."""
    tmp: Path

    def temp_dir(self, host: int) -> Path:
        """Ray's --temp-dir of `host`."""
        return self.tmp / f"h{host}"

    def argv(self, argv: Sequence[str], host: int = 0) -> list[str]:
        """`argv` as run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run(
        self, argv: Sequence[str], *, cwd: Path, timeout: float, host: int = 0
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host`'s namespace with the hosts' environment; fail the test with
        its output and the nodes' logs if it runs past `timeout`."""
        try:
            return subprocess.run(
                self.argv(argv, host),
                cwd=cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(
                f"`{' '.join(map(str, argv))}` timed out after {timeout:g} s\n"
                f"stdout:\n{_text(exc.stdout)[-4000:]}\n"
                f"stderr:\n{_text(exc.stderr)[-8000:]}\n{self.ray_logs()}"
            )

    def report(self, proc: subprocess.CompletedProcess[str]) -> str:
        """For a failure: a finished process's status and output, and the nodes' logs."""
        return (
            f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-8000:]}\n{self.ray_logs()}"
        )

    @property
    def node_ips(self) -> list[str]:
        """The Ray nodes' addresses: the head's, then the worker node's."""
        return self.ips[:LAPTOP]

    @property
    def client_address(self) -> str:
        """The head's Ray Client server, as a laptop names it."""
        return f"ray://{self.ips[0]}:{CLIENT_PORT}"

    def laptop_argv(self, argv: Sequence[str], folder: Path) -> list[str]:
        """`argv` as run on the laptop, in `folder` (seen there as /mnt): empty /tmp,
        /dev/shm and HOME (/tmp/home) of its own; the nodes' files out of sight. The
        repository and this venv stay where they are (a clone in /tmp too: the laptop has
        the package installed)."""
        keep = laptop_kept()
        private = (
            "set -e; "
            "mount -t tmpfs laptop-hold /media; "
            'mount --bind "$1" /mnt; shift; '
            'i=0; while [ "$1" != -- ]; do mkdir /media/$i; mount --bind "$1" /media/$i; '
            'eval "k$i=\\$1"; i=$((i + 1)); shift; done; shift; '
            "mount -t tmpfs -o mode=1777 laptop-tmp /tmp; "
            "mount -t tmpfs -o mode=1777 laptop-shm /dev/shm; "
            'j=0; while [ $j -lt $i ]; do eval "p=\\$k$j"; mkdir -p "$p"; '
            'mount --bind /media/$j "$p"; j=$((j + 1)); done; '
            'mkdir -m 700 /tmp/home; cd /mnt; exec "$@"'
        )
        carried = [str(p) for p in keep]
        return self.argv(
            ["sh", "-c", private, "laptop", str(folder), *carried, "--", *argv], LAPTOP
        )

    def laptop_env(self, **more: str) -> dict[str, str]:
        """The laptop's environment: the token, and nothing that names the nodes' folders."""
        env = {k: v for k, v in self.env.items() if k not in ("RAY_TMPDIR", "PYTHONPATH")}
        return {
            **env,
            "HOME": "/tmp/home",
            "TMPDIR": "/tmp",
            "RAY_ADDRESS": self.client_address,
            **more,
        }

    def link(self, host: int, up: bool) -> None:
        """Bring `host`'s link to the bridge up or down."""
        state = "up" if up else "down"
        _run("ip", "-n", self.namespaces[host], "link", "set", self.interfaces[host], state)

    def ray_logs(self) -> str:
        """The end of `ray start`'s output and of Ray's non-empty .err logs."""
        return _ray_logs(self.tmp)


def laptop_kept() -> list[Path]:
    """What the laptop keeps of this machine's /tmp: the repository and this venv where
    they are under it (a clone in /tmp: the laptop has the package installed), none
    inside another."""
    tmp = Path("/tmp")
    paths = [REPO.resolve(), Path(sys.prefix).resolve()]
    found = sorted({p for p in paths if p.is_relative_to(tmp)})
    return [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def skip_unless_netns_possible() -> None:
    """Skip the test where network namespaces cannot be made."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces need Linux")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command is missing (install iproute2)")


def _ray_start(ns: str, python: str | Path) -> list[str]:
    """`ray start --block` in namespace `ns`, run by `python`: the `ray` console script
    beside it, else the module."""
    ray = Path(python).parent / "ray"
    command = [str(ray)] if ray.exists() else [str(python), "-m", "ray.scripts.scripts"]
    return ["ip", "netns", "exec", ns, *command, "start", "--block"]


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()  # fails, as it should, if another user of /etc/netns left files


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in `ns` (only processes this test started can)."""
    for _ in range(50):
        listed = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        pids = [int(p) for p in listed if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a `ray start --block` (it stops its node), then SIGKILL its group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
    # Started with start_new_session=True: the group is this test's alone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_TIMEOUT_S)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} unreadable)"
    return "\n".join(text.splitlines()[-lines:])


def _ray_logs(tmp: Path) -> str:
    logs = [*sorted(tmp.glob("h*.log")), *sorted(tmp.glob("h*/session_latest/logs/*.err"))]
    return "\n".join(
        f"--- {log.relative_to(tmp)}\n{_tail(log, 15)}"
        for log in logs
        if log.is_file() and log.stat().st_size
    )


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _wait_started(proc: subprocess.Popen[bytes], marker: Path, log: Path) -> None:
    """Wait for `ray start` to write its address file: its node is registered by then."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"`ray start` exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"`ray start` not up after {START_TIMEOUT_S:g} s:\n{_tail(log)}")
        time.sleep(0.1)


def _make_network(
    stack: contextlib.ExitStack, suffix: str
) -> tuple[list[str], list[str], list[str]]:
    """Three host namespaces (two nodes and a laptop) on a bridge in a fourth one;
    (namespaces, ips, interfaces)."""
    subnet = f"10.213.{secrets.randbelow(250) + 2}"
    bridge_ns = f"orch-br-{suffix}"
    hosts = [f"orch-h{i}-{suffix}" for i in range(3)]
    ips = [f"{subnet}.{i + 1}" for i in range(3)]
    interfaces = [f"h{i}-{suffix}" for i in range(3)]
    hostname = socket.gethostname()

    try:
        if not NETNS_DIR.exists():
            NETNS_DIR.mkdir()
            stack.callback(_remove_if_empty, NETNS_DIR)
        for ns in hosts:
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: there the
            # hostname resolves to loopback, the trap the product must avoid.
            (NETNS_DIR / ns).mkdir()
            stack.callback(shutil.rmtree, NETNS_DIR / ns, ignore_errors=True)
            (NETNS_DIR / ns / "hosts").write_text(f"127.0.0.1 localhost\n127.0.0.1 {hostname}\n")
    except OSError as exc:
        pytest.skip(f"cannot write {NETNS_DIR} for the namespaces' /etc/hosts: {exc}")
    for ns in [bridge_ns, *hosts]:
        proc = _run("ip", "netns", "add", ns, check=False)
        if proc.returncode:
            pytest.skip(f"cannot create a network namespace: {proc.stderr.strip()}")
        stack.callback(_run, "ip", "netns", "delete", ns, check=False)
        stack.callback(_kill_namespace_processes, ns)
    try:
        for ns in [bridge_ns, *hosts]:
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(hosts):
            _run(
                "ip",
                "-n",
                bridge_ns,
                "link",
                "add",
                f"p{i}",
                "type",
                "veth",
                "peer",
                "name",
                interfaces[i],
                "netns",
                ns,
            )
            _run("ip", "-n", bridge_ns, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", bridge_ns, "link", "set", f"p{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{ips[i]}/24", "dev", interfaces[i])
            _run("ip", "-n", ns, "link", "set", interfaces[i], "up")
        for ns in hosts:
            _run("ip", "netns", "exec", ns, "true")  # needs a mount namespace too
    except RuntimeError as exc:
        pytest.skip(f"cannot build the two hosts' network: {exc}")
    return hosts, ips, interfaces


def _start_ray(
    stack: contextlib.ExitStack, argv: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """Run `argv` (a `ray start --block` in a namespace) until the stack closes."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    stack.callback(_stop, proc)
    return proc


def _env(tmp: Path, *, repo_on_path: bool) -> dict[str, str]:
    """The nodes' and drivers' environment: this one's, minus Ray's, gloo's and NCCL's
    variables and HOME, with a fresh token and private dirs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "GLOO_", "NCCL_")) and k not in ("HOME", "PYTHONPATH")
    }
    if repo_on_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(
        # Token authentication stays on; every node and the driver get the token.
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        # No ~/.ray/auth_token or other state of the real home is read or written.
        HOME=str(tmp / "home"),
        # Ray's default temp dir (used where no --temp-dir applies): private too.
        RAY_TMPDIR=str(tmp),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # SIGTERM stops a node at once
        PYTHONUNBUFFERED="1",
    )
    return env


@contextlib.contextmanager
def boot(pythons: Sequence[str | Path], *, repo_on_path: bool) -> Iterator[Hosts]:
    """A Ray head in one namespace, a worker node in the other; all torn down after.

    `pythons`: for each host, the Python its `ray start` runs from (Ray's workers run with
    the raylet's interpreter). `repo_on_path`: whether PYTHONPATH leads to this repository
    (without it, any PYTHONPATH inherited is dropped too).
    """
    skip_unless_netns_possible()
    suffix = secrets.token_hex(3)
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="o2h", dir="/tmp"))  # short: unix socket paths
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        namespaces, ips, interfaces = _make_network(stack, suffix)
        (tmp / "home").mkdir()
        env = _env(tmp, repo_on_path=repo_on_path)
        common = [
            f"--num-cpus={CPUS_PER_NODE}",
            "--num-gpus=0",
            f"--object-store-memory={100 * 1024 * 1024}",
            "--disable-usage-stats",
        ]
        address = f"{ips[0]}:{GCS_PORT}"
        logs = [tmp / "h0.log", tmp / "h1.log"]
        head = _start_ray(
            stack,
            [
                *_ray_start(namespaces[0], pythons[0]),
                "--head",
                f"--port={GCS_PORT}",
                "--include-dashboard=false",
                f"--node-ip-address={ips[0]}",
                f"--temp-dir={tmp / 'h0'}",
                *common,
            ],
            env,
            logs[0],
        )
        _wait_started(head, tmp / "h0" / "ray_current_cluster", logs[0])
        worker = _start_ray(
            stack,
            [
                *_ray_start(namespaces[1], pythons[1]),
                f"--address={address}",
                f"--node-ip-address={ips[1]}",
                f"--temp-dir={tmp / 'h1'}",
                *common,
            ],
            env,
            logs[1],
        )
        _wait_started(worker, tmp / "h1" / "ray_current_cluster", logs[1])
        yield Hosts(namespaces, ips, interfaces, address, env, tmp)
