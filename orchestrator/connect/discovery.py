"""Find a Ray already running on this machine, believing only what this user started.

Two things name one. The local runtime's record (`orchestrator local start` writes it, 0600,
in this user's state folder) names its address, its `ray start` pid and Ray's temp folder.
Ray's address file (`$RAY_TMPDIR/ray/ray_current_cluster`, in a folder any user may write
in) names a plain `ray start`. Neither is believed on its word: a runtime counts while its
pid is this user's `ray start --head --block` for that port, and an address of this
machine counts while the socket listening there is this user's (or root's). A head found
dead has its record and address file removed, so no stale name outlives it for another
user to squat its port.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.show import messages
from orchestrator_workers import private

ADDRESS_FILE = "ray_current_cluster"


@dataclass(frozen=True)
class RuntimeRecord:
    """What `orchestrator local start` wrote about its runtime."""

    path: Path
    address: str
    pid: int
    auth: str
    temp_dir: str | None
    """Ray's temp folder for that runtime; None where an earlier version left it Ray's."""

    def address_files(self) -> list[Path]:
        """Where its `ray start` wrote the address: its temp folder, or Ray's default."""
        return [Path(self.temp_dir or ray_root()) / ADDRESS_FILE]


def ray_root() -> Path:
    """The folder where Ray keeps this machine's sessions by default (RAY_TMPDIR/ray)."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()
    return Path(base) / "ray"


def record_path(port: int | str) -> Path:
    """Where `orchestrator local start` records its runtime on `port`: this user's state folder."""
    return private.state_folder() / f"local-runtime-{port}.json"


def _legacy_record_path(port: int | str) -> Path | None:
    """Where earlier versions wrote it (orchestrator-UID in the temp dir), if that is safe."""
    try:
        return private.folder(lasting=True) / f"local-runtime-{port}.json"
    except OSError:
        return None


def runtime_record(address: str) -> RuntimeRecord | None:
    """The record of the runtime at `address`, if this user wrote one."""
    port = address.rpartition(":")[2]
    for path in (record_path(port), _legacy_record_path(port)):
        record = _read_record(path) if path is not None else None
        if record is not None and record.address == address:
            return record
    return None


def runtime_records() -> list[RuntimeRecord]:
    """Every runtime record this user has, the current folder's first."""
    folders = [private.state_folder()]
    legacy = _legacy_record_path(0)
    if legacy is not None:
        folders.append(legacy.parent)
    found = []
    for folder in folders:
        for path in sorted(folder.glob("local-runtime-*.json")):
            record = _read_record(path)
            if record is not None:
                found.append(record)
    return found


def _read_record(path: Path) -> RuntimeRecord | None:
    try:
        data = json.loads(private.read_trusted(path))
        return RuntimeRecord(
            path, str(data["address"]), int(data["pid"]), str(data["auth"]), data.get("temp_dir")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget(record: RuntimeRecord) -> None:
    """Remove a stopped runtime's record and the address file its `ray start` left."""
    for path in record.address_files():
        remove_address_file(path, record.address)
    record.path.unlink(missing_ok=True)


def remove_address_file(path: Path, address: str) -> None:
    """Remove Ray's address file at `path` if it is this user's and names `address`."""
    with contextlib.suppress(OSError):
        if private.read_trusted(path).strip() == address and path.lstat().st_uid == os.getuid():
            path.unlink()


def local_cluster() -> tuple[str | None, Path | None]:
    """(address of a live Ray of this user's on this machine, a stale record it removed).

    The local runtime's records first, then Ray's address file of a plain `ray start`.
    """
    stale = None
    for record in runtime_records():
        if runtime_not_ours(record.pid, record.address) is None:
            return record.address, None
        forget(record)
        stale = record.path
    live, gone = _plain_ray_start()
    return live, gone or stale


def _plain_ray_start() -> tuple[str | None, Path | None]:
    """(address, None) of a user's own live `ray start` named in Ray's address file, or
    (None, the file) where its head is gone (removed if it was this user's)."""
    path = ray_root() / ADDRESS_FILE
    address = _read_address(path)
    if address is None:
        return None, None
    host, _, port = address.rpartition(":")
    if is_this_machine(host):
        owners = listener_uids(host, int(port))
        if not owners:  # nobody listens: the head is gone
            remove_address_file(path, address)
            return None, path
        others = sorted(owners - {os.getuid(), 0, -1})
        if others:  # every address the name has must be ours: Ray may take any of them
            uids = ", ".join(map(str, others))
            _ignore(
                path,
                f"it names {address}, where a process of uid {uids} listens, not this user "
                f"(uid {os.getuid()}): that is not the Ray this file's writer started",
            )
            return None, None
        return address, None
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return address, None
    except OSError:
        return None, path


def _read_address(path: Path) -> str | None:
    """The `host:port` in Ray's address file at `path`, if it is there and trusted."""
    try:
        address = private.read_trusted(path).strip()
    except private.UntrustedFileError as exc:
        _ignore(path, str(exc))
        return None
    except OSError:
        return None
    return address if address.rpartition(":")[2].isdigit() else None


def cluster_address(address: str | None) -> str | None:
    """The cluster to join: `address`, RAY_ADDRESS, a live Ray of this user's here; or None."""
    return address or os.environ.get("RAY_ADDRESS") or local_cluster()[0]


def is_this_machine(host: str) -> bool:
    """Whether `host` is an address of this machine (one a socket here can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                return True  # e.g. EACCES: the address is ours all the same
            return True
    return False


def listener_uids(host: str, port: int) -> set[int]:
    """The uids owning the sockets that listen on `port` at any address of `host` here.

    Empty if none listens; {-1} where it cannot be known. Read from /proc/net/tcp and tcp6
    (Linux). A socket on the wildcard address counts.
    """
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return {-1}  # not Linux: the record check above is all there is
    wanted = {a for info in socket.getaddrinfo(host, None) for a in _hex_addresses(info)}
    owners = set()
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                local, state, uid = fields[1], fields[3], fields[7]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port and address in wanted:
                    owners.add(int(uid))
    return owners


def _hex_addresses(info: tuple) -> set[str]:
    """`info`'s address and the wildcard, as /proc/net/tcp* spell them."""
    family, ip = info[0], info[4][0]
    if family == socket.AF_INET:
        packed = socket.inet_pton(socket.AF_INET, ip)
        words = [packed]
        wild = b"\0" * 4
        mapped = [b"\0" * 10 + b"\xff\xff" + packed]  # an IPv6 socket taking IPv4 too
        return {_proc_hex(w) for w in [*words, wild, *mapped, b"\0" * 16]}
    packed = socket.inet_pton(socket.AF_INET6, ip)
    return {_proc_hex(packed), _proc_hex(b"\0" * 16)}


def _proc_hex(packed: bytes) -> str:
    """An address as /proc/net/tcp* writes it: each 32-bit word in host (little-endian) order."""
    return "".join(packed[i : i + 4][::-1].hex().upper() for i in range(0, len(packed), 4))


def runtime_not_ours(pid: int, address: str) -> str | None:
    """Why process `pid` is not this user's live `ray start --head --block` for `address`."""
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # not Linux: nothing to check it with
        return None if alive(pid) else "no such process"
    try:
        owner = proc.stat().st_uid
        argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "no such process"
    if not alive(pid):
        return "it has exited"
    if owner != os.getuid():
        return f"it belongs to uid {owner}, not to this user (uid {os.getuid()})"
    wanted = ("start", "--head", "--block", f"--port={address.rpartition(':')[2]}")
    if not all(part in argv for part in wanted):
        return f"its command line is not `ray {' '.join(wanted)}`: {' '.join(argv).strip()}"
    return None


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (an orphan whose reaper has not run yet)."""
    if not Path("/proc/self/stat").exists():  # not Linux: no zombie check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_ignored: set[str] = set()
"""Untrusted address files already reported by this process."""


def _ignore(path: Path, why: str) -> None:
    if why not in _ignored:
        _ignored.add(why)
        messages.warn(
            f"not using the Ray cluster named in {path}: {why}. Starting this script's own; "
            "give the address (address= or RAY_ADDRESS) if you trust that cluster"
        )
