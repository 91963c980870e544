"""A driver's own page: its live jobs, served from the first submit of a live distributed
function on, its address said once (`[orchestrator] dashboard: http://127.0.0.1:PORT/?token=...`)
and shown in a notebook job's cell.

`distribute()`'s function calls `submitted` with each live job; nothing else of the page
is imported until then, and after the first call a submit costs a list append. The page
lists the jobs this program still holds (weakly: a job the program let go leaves the
page, with its pool). `ORCHESTRATOR_DASHBOARD=0` serves no page.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from orchestrator.job import JobControl
from orchestrator.show import messages

if TYPE_CHECKING:
    from orchestrator.job import Job
    from orchestrator.observe.page import Page
    from orchestrator.observe.reading import Reader

ENV = "ORCHESTRATOR_DASHBOARD"
"""Set to 0 to serve no page."""
LISTED = 64
"""Jobs listed at most (the newest)."""

_lock = threading.Lock()
_page: Page | None = None
_tried = False
_jobs: dict[str, weakref.ref[Job[Any]]] = {}
_keys: weakref.WeakKeyDictionary[Job[Any], str] = weakref.WeakKeyDictionary()
_numbers = itertools.count(1)


def submitted(job: Job[Any]) -> None:
    """List live `job` on this driver's page (started now, the first time)."""
    page = _page if _tried else _start()
    if page is None:
        return
    key = str(next(_numbers))
    with _lock:
        _jobs[key] = weakref.ref(job)
        _keys[job] = key
        if len(_jobs) > LISTED:
            del _jobs[next(iter(_jobs))]
    sink = JobControl(job).sink  # a notebook job's cell: its page's link below its title
    if sink is not None:
        sink("stderr", f"[{job.name}] dashboard: {page.url}#job={key}\n")


def url() -> str | None:
    """This driver's page address, with its token (None: not started)."""
    return _page.url if _page is not None else None


def link(job: Job[Any]) -> str | None:
    """The address of `job`'s page on this driver's (None: not on it)."""
    with _lock:
        key = _keys.get(job)
    return f"{_page.url}#job={key}" if _page is not None and key is not None else None


def _start() -> Page | None:
    """The page, started once per process (None: turned off, or it could not start)."""
    global _page, _tried  # noqa: PLW0603 - one page per process
    with _lock:
        if _tried:
            return _page
        _tried = True
        if os.environ.get(ENV, "1").strip() == "0":
            return None
        from orchestrator.observe.page import Page

        try:
            _page = Page(_Driver())
        except OSError as exc:
            messages.warn(f"no dashboard: {exc} (set {ENV}=0 to not try)")
            return None
    messages.say(f"dashboard: {_page.url}")
    return _page


class _Driver:
    """This process's live jobs, as the page reads them."""

    title = f"orchestrator: pid {os.getpid()}"

    def listing(self) -> dict[str, Any]:
        """The jobs this program holds, newest first."""
        return {"jobs": [reader.summary() for reader in reversed(self._readers())], "pools": []}

    def reader(self, key: str) -> Reader | None:
        """Job `key`, while this program holds it."""
        with _lock:
            ref = _jobs.get(key)
        job = ref() if ref is not None else None
        return _reader(key, job) if job is not None else None

    def running(self) -> list[Reader]:
        """The jobs not done."""
        return [reader for reader in self._readers() if not reader.job.done()]

    def _readers(self) -> list[Reader]:
        with _lock:
            held = [(key, ref()) for key, ref in _jobs.items()]
        return [_reader(key, job) for key, job in held if job is not None]


def _reader(key: str, job: Job[Any]) -> Reader:
    from orchestrator.observe.reading import Reader

    return Reader(key, job)
