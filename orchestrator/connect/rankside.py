"""The rank side on every node: what each node has, read once, and ours brought where it lacks.

A node of a cluster reached by address needs only Ray, torch and cloudpickle, and the
driver's Python. The first time a pool is placed on a node, a task shipped by value
(`inventory.read`) says what the node has. Where it has no `orchestrator_workers`, or
another content of it (an older install), every actor and task the product starts there
carries the driver's copy (`carried`): an archive of both sides (`from orchestrator import
snapshot` in a rank needs the driver side's `__init__`, which imports nothing until asked)
put once in Ray's object store, unpacked once per content on each node and put ahead of
anything installed there (see `bootstrap`). The user's own `runtime_env` is left as given.
The embedded instance and the local runtime run on this machine from this interpreter:
nothing is read or added there.

What a node said is kept in the cluster's key-value store under its node id, so a second
driver (another script, the notebook after a restart) starts no task to learn it again. A
node's id is new each time its Ray starts, so what is kept goes with the node.

A node whose torch differs from the driver's (the local build tag aside: a CPU laptop
drives CUDA nodes) is named in one warning, once per node.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import ipaddress
import json
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator import _ray_compat
from orchestrator.connect import bootstrap, cluster, inventory
from orchestrator.errors import ClusterMismatchError
from orchestrator.show import messages
from orchestrator_workers.actor import CONCURRENCY_GROUPS, RankActor

READ_TIMEOUT_S = 120.0
"""How long a node may take to answer what it has (a fresh node starts a worker first)."""


@dataclass(frozen=True)
class NodeFacts:
    """What one node has, as its `inventory.read` said."""

    node_id: str
    ip: str
    python: str
    ray: str | None
    torch: str | None
    cloudpickle: str | None
    rank_side: str | None
    """Its own `orchestrator_workers`' content id; None where it has none."""
    driver_side: str | None = None
    """Its own `orchestrator`'s content id (a supervisor runs it); None where it has none."""


# Both run on nodes that may have nothing of ours: Ray's pickler ships them by value.
_ray_compat.by_value(bootstrap.call)
_ray_compat.by_value(inventory.read)

_RemoteRank = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)  # type: ignore[call-overload]  # Ray's stubs omit this documented option
_RemoteShell = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(bootstrap.shell(RankActor))  # type: ignore[call-overload]
"""A rank on a node that lacks our rank side, or has another: it brings the driver's first."""

_lock = threading.Lock()
_facts: dict[str, NodeFacts] = {}
"""By node id: every node read so far (nodes join later: each is read when first used)."""
_asked = 0
"""How many nodes this process read by a task (not from what an earlier driver kept)."""
_archive_put: tuple[str, ray.ObjectRef] | None = None
"""Our archive in the object store, with the driver's connection (its node and Ray job)
that put it there: a new connection puts it again."""
_driver_torch: str | None = None
"""The torch version the driver compares with; None: its installed one (a test hook)."""
_always = False
"""Ship ours to every node read, even one that has it (a hook for benchmarks)."""


@functools.cache
def _folder() -> Path:
    """The driver's own rank side (its `orchestrator_workers` package folder)."""
    spec = importlib.util.find_spec(inventory.RANK_SIDE)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def content() -> str:
    """The driver's rank side's content id (`inventory.content_id` of its folder)."""
    return inventory.content_id(str(_folder()))


@functools.cache
def _driver_folder() -> Path:
    """The driver's own `orchestrator` package folder."""
    return Path(__file__).resolve().parent.parent


@functools.cache
def _driver_content() -> str:
    """The driver side's content id."""
    return inventory.content_id(str(_driver_folder()))


@functools.cache
def both_content() -> str:
    """The content id of both sides together (what a supervisor's archive holds)."""
    return f"{content()[:8]}{_driver_content()[:8]}"


@functools.cache
def _here() -> dict[str, str | None]:
    """What this driver has, as `inventory.read` says of a node (read once)."""
    return inventory.read()


def driver_torch() -> str | None:
    """The torch version this driver has, as compared with the nodes'."""
    return _driver_torch if _driver_torch is not None else _here()["torch"]


def set_driver_torch(version: str | None) -> None:
    """Compare the nodes' torch with `version` instead of the installed one (None: that)."""
    global _driver_torch  # noqa: PLW0603 - one driver per process
    _driver_torch = version


def set_always(always: bool) -> None:
    """Bring our rank side to every node read from now on, even one that has it."""
    global _always  # noqa: PLW0603 - one driver per process
    _always = always


def nodes_read() -> int:
    """How many nodes this process has read by a task (a test hook's count)."""
    return _asked


def needs_nothing() -> bool:
    """Whether every node has this driver's rank side: Ray runs from this interpreter."""
    return cluster.is_embedded() or cluster.is_local_runtime()


def check_nodes(node_ids: Collection[str], job: str) -> None:
    """Read what each of `node_ids` has, once per node; before any rank starts there.

    Raises ClusterMismatchError where a node lacks torch or cloudpickle (Ray itself refuses
    another Python or Ray); warns (once per node) where its torch differs from the driver's.
    """
    global _asked  # noqa: PLW0603 - one driver per process
    if needs_nothing():
        return
    with _lock:
        unread = sorted(set(node_ids) - _facts.keys())
        found = _kept(unread)
        read = _read([node for node in unread if node not in found])
        _asked += len(read)
        for facts in read.values():
            _ray_compat.kv_put(_key(facts.node_id), json.dumps(dataclasses.asdict(facts)).encode())
        found.update(read)
        _facts.update(found)
    _check(list(found.values()), job)


def _key(node_id: str) -> str:
    """Where a node's facts are kept in the cluster's key-value store."""
    return f"node-facts/{node_id}"


def _kept(node_ids: list[str]) -> dict[str, NodeFacts]:
    """What an earlier driver read of `node_ids` and kept in the cluster (where it did)."""
    kept = {}
    for node in node_ids:
        value = _ray_compat.kv_get(_key(node))
        try:
            facts = NodeFacts(**json.loads(value)) if value else None
        except (ValueError, TypeError):  # another version's record: read the node again
            facts = None
        if facts is not None and facts.node_id == node:
            kept[node] = facts
    return kept


def _read(node_ids: list[str]) -> dict[str, NodeFacts]:
    if not node_ids:
        return {}
    ips = {node.node_id: node.ip for node in cluster.nodes()}
    read = ray.remote(num_cpus=0, max_retries=0)(inventory.read)
    refs = {
        node: read.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in node_ids
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=READ_TIMEOUT_S)
    if len(ready) < len(refs):
        late = [ips.get(node, node) for node, ref in refs.items() if ref not in ready]
        raise ClusterMismatchError(
            f"no answer within {READ_TIMEOUT_S:g} s from node {', '.join(late)} to what "
            "Python, Ray and torch it has: see `ray status` and the node's raylet log"
        )
    said: dict[str, dict[str, Any]] = {node: ray.get(ref) for node, ref in refs.items()}
    return {node: NodeFacts(node_id=node, ip=ips.get(node, node), **said[node]) for node in said}


def _check(found: list[NodeFacts], job: str) -> None:
    """Raise where a node cannot run ranks; warn where its torch differs from ours."""
    here = _here()
    for facts in found:
        missing = [name for name in ("torch", "cloudpickle") if getattr(facts, name) is None]
        if missing:
            want = " and ".join(f"{name}=={here[name]}" for name in missing)
            raise ClusterMismatchError(
                f"node {facts.ip} has no {' and no '.join(missing)}, which the ranks import: "
                f"install {want} in the Python that runs Ray there ({facts.python})"
            )
    ours = driver_torch()
    if ours is None:
        return
    other: dict[str, list[str]] = {}
    for facts in found:
        if facts.torch is not None and _release(facts.torch) != _release(ours):
            other.setdefault(facts.torch, []).append(facts.ip)
    for version, ips in sorted(other.items()):
        ips.sort(key=_ip_order)
        messages.warn(
            f"nodes run another torch than this driver ({ours}): {version} on "
            f"{', '.join(ips)}; install torch=={_release(ours)} there, or "
            f"torch=={_release(version)} here",
            job=job,
        )


def _ip_order(ip: str) -> tuple[int, int, str]:
    """Addresses in numeric order (10.0.0.2 before 10.0.0.10), IPv4 first; names after."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (7, 0, ip)
    return (address.version, int(address), ip)


def _release(version: str) -> str:
    """'2.5.1' of '2.5.1+cu124': builds of one release differ only in their local tag."""
    return version.split("+", 1)[0]


@functools.cache
def _archive() -> tuple[bytes, str]:
    """What a node that lacks ours gets: both sides (a rank may import `orchestrator.snapshot`,
    a supervisor runs the driver side), and the archive's content id."""
    package = bootstrap.archive(str(_folder()), (str(_driver_folder()), inventory.DRIVER_SIDE))
    return package, bootstrap.archive_id(package)


def carried(node_id: str) -> tuple[Any, ...]:
    """What an actor's or task's arguments start with on `node_id`: nothing where the node
    has our rank side; else our archive and its content id, for `bootstrap` to unpack."""
    facts = _facts.get(node_id)
    if facts is None or not _lacks(facts):
        return ()
    return _carry()


def carried_both(node_id: str) -> tuple[Any, ...]:
    """As `carried`, for an actor that runs the driver side too (a supervisor): nothing
    where the node has both sides at the driver's content."""
    facts = _facts.get(node_id)
    if facts is None or not (_lacks(facts) or facts.driver_side != _driver_content()):
        return ()
    return _carry()


def _carry() -> tuple[ray.ObjectRef, str]:
    """Our archive in the object store, put once per connection of this driver; its id."""
    global _archive_put  # noqa: PLW0603 - one driver per process
    package, content_id = _archive()
    with _lock:
        here = ray.get_runtime_context()
        job = f"{here.get_node_id()}/{here.get_job_id()}"  # job ids start anew per cluster
        if _archive_put is None or _archive_put[0] != job:
            _archive_put = (job, ray.put(package))
        return _archive_put[1], content_id


def rank_actor(node_id: str) -> tuple[Any, tuple[Any, ...]]:
    """The actor class of a rank on `node_id`, and what its arguments start with: the rank
    itself where the node has our rank side; else a shell that brings ours first."""
    carry = carried(node_id)
    return (_RemoteShell if carry else _RemoteRank), carry


def task(node_id: str, function: Callable[..., Any], *args: Any) -> ray.ObjectRef:
    """`function(*args)`, a function of our rank side, as a task on `node_id` (carrying our
    rank side there where the node lacks it)."""
    affinity = NodeAffinitySchedulingStrategy(node_id, soft=False)
    carry = carried(node_id)
    if not carry:
        return _remote(function).options(scheduling_strategy=affinity).remote(*args)
    return (
        _remote(bootstrap.call)
        .options(scheduling_strategy=affinity)
        .remote(*carry, function.__module__, function.__name__, *args)
    )


@functools.cache
def _remote(function: Callable[..., Any]) -> Any:
    """`function` as a Ray task that takes no CPU (made once: Ray exports it once)."""
    return ray.remote(num_cpus=0)(function)


def _lacks(facts: NodeFacts) -> bool:
    """Whether a node needs ours brought: it has none, or another content."""
    return facts.rank_side != content() or _always
