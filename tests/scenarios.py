"""What the batched drivers (tests/bare_nodes_driver.py, tests/laptop_driver.py) share: their
scenarios run one after another, each under a time limit, into a report written after each.

Copied beside a driver into its project folder (the drivers import nothing of the
repository but the package): not collected, no tests.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from orchestrator import DistributedError


class ScenarioTimeout(Exception):
    """A scenario ran past its limit."""


def failure_of(exc: BaseException) -> dict[str, Any]:
    """What the tests check of an exception that reached the driver."""
    root = getattr(exc, "root_cause", None)
    return {
        "type": type(exc).__name__,
        "text": str(exc),
        "distributed": isinstance(exc, DistributedError),
        "value_error": isinstance(exc, ValueError),
        "root_rank": getattr(root, "rank", None),
        "root_exc_type": getattr(root, "exc_type", None),
    }


@contextlib.contextmanager
def _limit(seconds: int) -> Iterator[None]:
    def alarm(_signum: int, _frame: object) -> None:
        raise ScenarioTimeout(f"the scenario ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_all(
    scenarios: Iterable[tuple[str, Callable[[], dict[str, Any]]]],
    out: Path,
    limit_s: int,
    report: dict[str, Any] | None = None,
    after_error: Callable[[], None] = lambda: None,
) -> None:
    """Run each (name, scenario) under `limit_s`, its result or its error (then
    `after_error()`) and its seconds into `report` under its name, written to `out` after
    each."""
    report = {} if report is None else report
    for name, scenario in scenarios:
        print(f"=== {name} ===", flush=True)
        print(f"=== {name} ===", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            with _limit(limit_s):
                entry = scenario()
        except Exception as exc:  # noqa: BLE001 - a scenario's failure is its result
            entry = {"error": "".join(traceback.format_exception(exc))}
            after_error()
        entry["seconds"] = round(time.monotonic() - started, 2)
        report[name] = entry
        out.write_text(json.dumps(report, indent=1, default=repr))
    sys.stdout.flush()
