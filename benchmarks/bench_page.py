"""The page's first load for a 128-rank job that has run an hour: what each of the page's
first requests costs the server (median of repeats, with the answer's size), and the
page in Debian's chromium from its address to its table's 128 rows and its plots drawn.

    python -m benchmarks.bench_page [--ranks 128] [--hours 1] [--repeats 7]

The job's numbers are a real `observe.series.Series` fed `--hours` of synthetic readings
at the real rate (one per rank a second, a step a second, two reported scalars), as
`bench_series` feeds it; the page's server, its readers and its files are the product's.
The browser part needs /usr/bin/chromedriver (`apt-get install chromium chromium-driver`)
and Selenium (the test extra); without them it is left out. Goal: under 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_series import node_infos, reading
from orchestrator.jobstatus import JobStatus, RankStatus
from orchestrator.observe.page import Page
from orchestrator.observe.reading import Reader
from orchestrator.observe.series import JobMetrics, Series
from orchestrator.show.notebook import Table, rank_table
from orchestrator_workers.states import State

CHROMEDRIVER = Path("/usr/bin/chromedriver")


class Recorded:
    """A running job of `ranks` ranks whose numbers are `series`, as a page reads it."""

    name = "bench"

    def __init__(self, ranks: int, series: Series) -> None:
        """The job; its ranks on nodes of 8."""
        self.num_ranks = ranks
        self.series = series
        self.ranks = tuple(
            RankStatus(r, State.RUNNING, f"10.0.{r // 8}.1", 1000 + r) for r in range(ranks)
        )

    def running(self) -> bool:
        """It runs."""
        return True

    def cancelled(self) -> bool:
        """It was not cancelled."""
        return False

    def status(self) -> JobStatus:
        """Every rank running."""
        return JobStatus(self.name, State.RUNNING, self.ranks)

    def table(self) -> Table:
        """The rank table, as a job without a live call of this process makes it."""
        ranks = [(r.rank, r.node_ip, r.state) for r in self.ranks]
        return rank_table(
            self.name, "running", ranks, None, running=True, elapsed=3600.0, restarts=0, root=None
        )

    def metrics(self) -> JobMetrics:
        """Its numbers over time."""
        return self.series.metrics()

    def stacks(self) -> dict[int, str]:
        """No stacks (not asked on a first load)."""
        return {}

    def logs(self, rank: int) -> str:
        """No logs (not asked on a first load)."""
        return ""


class OneJob:
    """A page's source listing one job."""

    title = "bench"

    def __init__(self, reader: Reader) -> None:
        """List `reader`'s job."""
        self.one = reader

    def listing(self) -> dict[str, Any]:
        """The one job."""
        return {"jobs": [self.one.summary()], "pools": []}

    def reader(self, key: str) -> Reader | None:
        """The one job, by its key."""
        return self.one if key == self.one.key else None

    def running(self) -> list[Reader]:
        """The one job."""
        return [self.one]


def fed(ranks: int, hours: float) -> Series:
    """A series fed `hours` of readings of `ranks` ranks, ending now (as bench_series)."""
    start = time.time() - hours * 3600
    infos = node_infos(ranks)
    kept = Series()
    clock = start
    with mock.patch("orchestrator.observe.series.time.time", lambda: clock):
        for second in range(int(hours * 3600)):
            clock = start + second
            for rank in range(ranks):
                kept.add(rank, infos[rank], reading(rank, second, clock), "c")
    return kept


def requests(page: Page, repeats: int) -> list[tuple[str, float, int]]:
    """Each first-load request: its path, median seconds, bytes."""
    base, token = page.url.split("?token=")
    found = []
    for path in ("", "static/page.js", "api/jobs", "api/table?job=1", "api/metrics?job=1"):
        times, size = [], 0
        for _ in range(repeats):
            ask = urllib.request.Request(  # noqa: S310 - our own page on 127.0.0.1
                base + path, headers={"Authorization": f"Bearer {token}"}
            )
            began = time.perf_counter()
            with urllib.request.urlopen(ask, timeout=60) as answer:  # noqa: S310 - the same
                size = len(answer.read())
            times.append(time.perf_counter() - began)
        found.append(("/" + path, statistics.median(times), size))
    return found


def in_browser(page: Page, ranks: int, repeats: int) -> list[float] | None:
    """Seconds from the page's address to its table's rows and its plots drawn, each
    load in a new browser; None without chromium."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if not CHROMEDRIVER.exists():
        return None
    drawn = f"""
        const rows = document.querySelectorAll('#ranks tbody tr').length;
        const metrics = performance.getEntriesByType('resource')
            .filter((e) => e.name.includes('/api/metrics')).length;
        return rows >= {ranks} && metrics > 0;
    """
    times = []
    for _ in range(repeats):
        options = webdriver.ChromeOptions()
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
            options.add_argument(flag)
        chrome = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            chrome.get("about:blank")
            began = time.perf_counter()
            chrome.get(page.url + "#job=1")
            while not chrome.execute_script(drawn):
                time.sleep(0.005)
            # the plots are drawn in the frame after the metrics came
            chrome.execute_async_script(
                "requestAnimationFrame(() => requestAnimationFrame(arguments[0]))"
            )
            times.append(time.perf_counter() - began)
        finally:
            chrome.quit()
    return times


def main() -> None:
    """Feed the series, serve the page, time its first load; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=128)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    series = fed(args.ranks, args.hours)
    page = Page(OneJob(Reader("1", Recorded(args.ranks, series))))  # type: ignore[arg-type]
    try:
        print(f"{args.ranks} ranks, {args.hours:g} h of readings; median of {args.repeats}")
        print(f"{'request':<22} {'median ms':>10} {'KB':>8}")
        for path, seconds, size in requests(page, args.repeats):
            print(f"{path:<22} {seconds * 1000:>10.1f} {size / 1000:>8.1f}")
        loads = in_browser(page, args.ranks, args.repeats)
        if loads is None:
            print("browser: left out (no chromium/chromedriver or selenium)")
        else:
            median, spread = statistics.median(loads), f"{min(loads):.2f}..{max(loads):.2f}"
            print(f"first load in chromium: median {median:.2f} s ({spread}); goal < 1 s")
    finally:
        page.close()


if __name__ == "__main__":
    main()
