"""`orchestrator dashboard`: a page of a cluster's detached jobs and warm pools, served on
127.0.0.1 from any terminal that reaches the cluster, until Ctrl-C."""

from __future__ import annotations

import threading
import time
from typing import Any

from orchestrator.observe.page import Page
from orchestrator.observe.reading import Reader
from orchestrator.supervise.catalog import JobInfo, get_job, list_jobs

LIST_EVERY_S = 1.0
"""The cluster's jobs are listed at most this often (pages share the listing)."""
RUNNING = ("pending", "starting", "running")


class Cluster:
    """A cluster's detached jobs, as the page reads them: each job followed (quietly) from
    the first time a page opens it."""

    def __init__(self, address: str | None) -> None:
        """The jobs of the cluster at `address` (None: as `orchestrator jobs` finds it)."""
        self.address = address
        self.title = f"cluster {address}" if address else "cluster"
        self._lock = threading.Lock()
        self._readers: dict[str, Reader] = {}
        self._listed: tuple[float, list[JobInfo]] = (-1e9, [])

    def listing(self) -> dict[str, Any]:
        """The detached jobs, newest first, then the warm pools."""
        found = self._infos()
        jobs = [_job(info) for info in reversed(found) if not info.is_pool]
        pools = [_pool(info) for info in found if info.is_pool]
        return {"jobs": jobs, "pools": pools}

    def reader(self, key: str) -> Reader | None:
        """Job `key`, followed from here (without showing its output) once asked for."""
        with self._lock:
            reader = self._readers.get(key)
        if reader is not None:
            return reader
        if not any(info.id == key and not info.is_pool for info in self._infos()):
            return None
        reader = Reader(key, get_job(key, self.address, show=False))
        with self._lock:
            return self._readers.setdefault(key, reader)

    def running(self) -> list[Reader]:
        """The jobs that run now (for /metrics)."""
        found = [self.reader(i.id) for i in self._infos() if str(i.state) in RUNNING]
        return [reader for reader in found if reader is not None]

    def _infos(self) -> list[JobInfo]:
        with self._lock:
            at, infos = self._listed
            if time.monotonic() - at < LIST_EVERY_S:
                return infos
        infos = list_jobs(self.address)
        with self._lock:
            self._listed = (time.monotonic(), infos)
        return infos


def _job(info: JobInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "name": info.name,
        "state": str(info.state),
        "ranks": info.ranks,
        "nodes": list(info.nodes),
        "user": info.user,
        "started": info.started,
    }


def _pool(info: JobInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "name": info.name,
        "ranks": info.ranks,
        "holds": dict(info.holds),
        "idle_s": info.idle_s,
        "idle_timeout": info.idle_timeout,
    }


def dashboard(address: str | None, port: int) -> int:
    """Serve the cluster's page on 127.0.0.1:`port` (0: a free one) until Ctrl-C."""
    source = Cluster(address)
    source.listing()  # reach the cluster first: an unreachable one fails here, in words
    page = Page(source, port=port)
    print(f"orchestrator dashboard: {page.url}", flush=True)
    print("(the page lists the cluster's detached jobs and warm pools; Ctrl-C stops it)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        page.close()
    return 0
