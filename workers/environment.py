"""A rank's environment, all of its policy: our defaults, the user's `env`, what torch reads
on import, the shared-buffer switch, the network interface and GPU visibility."""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator_workers import elastic, sharing
from orchestrator_workers.protocol import RankSpec

_SIOCGIFADDR = 0x8915
READ_ON_IMPORT = ("TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "CUDA", "NCCL", "LD_")
"""Prefixes of variables that torch, or the libraries it loads, may read only on import."""
RECORDER_VAR, NCCL_RECORDER_VAR = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"
"""torch's flight recorder: how many collectives each rank keeps (NCCL's name: older torch)."""
RECORDER_SIZE = "2000"
INIT_BARRIER_VAR = "TORCH_DIST_INIT_BARRIER"
"""torch's switch for a store barrier at the end of init_process_group and new_group."""


def user_env(env: Mapping[str, str], runtime_env: Mapping[str, Any] | None) -> dict[str, str]:
    """The user's variables for every rank: `env`, and OMP_NUM_THREADS set through
    `runtime_env`'s env_vars (our default would hide it otherwise); `env` wins."""
    chosen = dict(env)
    given = (runtime_env or {}).get("env_vars") or {}
    if "OMP_NUM_THREADS" in given:
        chosen.setdefault("OMP_NUM_THREADS", str(given["OMP_NUM_THREADS"]))
    return chosen


def read_on_import(env: Mapping[str, str]) -> list[str]:
    """The variables of `env` that must be set before torch is imported to take effect."""
    return sorted(name for name in env if name.startswith(READ_ON_IMPORT))


def preset(env: Mapping[str, str]) -> None:
    """Set the user's variables as a rank's process starts, before it imports torch."""
    os.environ.update(env)


def shares_buffers(spec: RankSpec) -> bool:
    """Whether the ranks of a node read one copy of a call's large buffers (see sharing)."""
    return spec.env.get(sharing.SWITCH, os.environ.get(sharing.SWITCH)) != "0"


def interface_for_ip(ip: str) -> str | None:
    """Name of the network interface whose IPv4 address is `ip`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == ip:
                return name
    return None


def order_devices(per_local_rank: list[tuple[str, ...]]) -> tuple[str, ...]:
    """All GPU ids of one node, each local rank's first GPU at index `local_rank`."""
    firsts = [ids[0] for ids in per_local_rank if ids]
    rest = [gpu for ids in per_local_rank for gpu in ids[1:]]
    return tuple(firsts + rest)


def default_threads(spec: RankSpec) -> int:
    """Threads torch computes on in this rank, unless the user sets OMP_NUM_THREADS.

    torchrun's choice, or the CPUs reserved for the rank (`cpus_per_replica`) where
    those are more: a rank alone on its node gets torch's own default, one thread per
    physical core it may run on; each of several ranks on a node gets one (torchrun's
    guard against oversubscribing the node).
    """
    reserved = max(1, int(spec.cpus))
    return reserved if spec.ranks_on_node > 1 else max(reserved, physical_cores())


@functools.cache
def physical_cores() -> int:
    """Cores this process may run on, hyperthreads of one core counted once (as torch does).

    Read once per process: every call builds the rank's environment, and a big machine
    has hundreds of topology files.
    """
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:  # no topology (some containers): count the logical CPU
            package, core = "cpu", str(cpu)
        cores.add((package, core))
    return max(1, len(cores))


def rank_env(spec: RankSpec, error_file: str = "") -> dict[str, str]:
    """The variables torchrun would give this rank, plus the user's `env`.

    `error_file`: TORCHELASTIC_ERROR_FILE, where torch's `record` writes an uncaught error.
    """
    env = {
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "NODE_RANK": str(spec.node_rank),
        "GROUP_RANK": str(spec.node_rank),
        "GROUP_WORLD_SIZE": str(spec.num_nodes),
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        # Rank 0's actor already serves the rendezvous store on MASTER_PORT, as
        # torchrun's agent does; with this flag every rank connects as a client,
        # so the port cannot be taken between choosing and binding it.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": spec.job_name,
        "TORCHELASTIC_RESTART_COUNT": str(spec.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "RESTART_COUNT": str(spec.restart_count),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # as torchrun's agent sets it
        # torchrun's launcher leaves its default in every worker's environment.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "OMP_NUM_THREADS": str(default_threads(spec)),
        "ORCHESTRATOR_NODE_IP": spec.node_ip,
        # torch's flight recorder, on unless set otherwise: the last collective of a rank
        # that stopped moving is in a stall's report (see probes). A ring of small
        # entries, read only then; no cost measured (benchmarks/bench_diagnose.py).
        RECORDER_VAR: os.environ.get(RECORDER_VAR, RECORDER_SIZE),
        # init_process_group returns on no rank before every rank's group is built: a rank
        # that returns at once (and so leaves its group) can no longer break a slower
        # peer's gloo connectFullMesh ("Connection closed by peer": 3 calls in 250 of an
        # init-and-return function on a loaded 2-core machine, none in 300 with it; no
        # cost measured). torchrun leaves it off (torch's default).
        INIT_BARRIER_VAR: os.environ.get(INIT_BARRIER_VAR, "1"),
    }
    if spec.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.cuda_visible_devices)
    if spec.interface:
        env["GLOO_SOCKET_IFNAME"] = spec.interface
        env["NCCL_SOCKET_IFNAME"] = spec.interface
    env.update(spec.env)
    return env


_ENCODED: dict[str, bytes] = {}
"""Names and values as os.environ encodes them: a warm call sets the same few dozen."""


def _update_environ(env: dict[str, str]) -> None:
    """Set `env` in os.environ, skipping what holds its value already (a warm call changes
    one or two; each os.environ read or write encodes, and a write calls putenv)."""
    environ: Any = os.environ
    raw = getattr(environ, "_data", None)  # CPython's: encoded, as the OS has it
    encode = getattr(environ, "encodevalue", None)
    if not isinstance(raw, dict) or encode is None or environ.encodekey is not encode:
        environ.update(env)
        return
    if len(_ENCODED) > 4096:  # ports and paths of many calls: start over
        _ENCODED.clear()
    for name, value in env.items():
        key = _ENCODED.get(name) or _ENCODED.setdefault(name, encode(name))
        encoded = _ENCODED.get(value) or _ENCODED.setdefault(value, encode(value))
        if raw.get(key) != encoded:
            environ[name] = value


def apply(spec: RankSpec) -> int | None:
    """Set this process's environment for `spec` and bind its GPU, before user code; the
    CUDA device bound to the calling thread, if one was."""
    _update_environ(rank_env(spec, elastic.error_file()))
    if spec.workdir and os.path.isdir(spec.workdir):
        os.chdir(spec.workdir)
    # breakpoint() opens a pdb the driver's machine can attach to (Ray installs its
    # own hook in workers); PYTHONBREAKPOINT in the user's env= still wins.
    if "PYTHONBREAKPOINT" in spec.env:
        sys.breakpointhook = sys.__breakpointhook__
    else:
        from orchestrator_workers import debugger

        sys.breakpointhook = debugger.set_trace
    if "torch" not in sys.modules and not spec.uses_torch:
        return None  # it reads OMP_NUM_THREADS when the function imports it, if it does
    import torch  # late: CUDA must see CUDA_VISIBLE_DEVICES before it initializes

    c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is not None and not hasattr(c10d, "_dump_fr_trace"):  # an older torch's name
        os.environ.setdefault(NCCL_RECORDER_VAR, os.environ[RECORDER_VAR])
    threads = os.environ["OMP_NUM_THREADS"]
    if threads.isdigit() and 0 < int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))
    has_gpu = spec.cuda_visible_devices and torch.cuda.is_available()
    if has_gpu and spec.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(spec.local_rank)
        return spec.local_rank
    return None
