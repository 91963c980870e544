"""A driver's page in a real browser (Debian's chromium, driven by Selenium): a running
4-rank job's table moves, a rank's output and the stacks open on a click, what the ranks
print is shown as text, /metrics answers the page's token as a bearer token, a rank that
stops is marked, and when it is killed, its attempt's failure (the root cause) and the
restart are said with their times and marked on the timeline.

`ORCHESTRATOR_SCREENSHOT=docs/dashboard.png` saves the page there (the README's picture).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import distribute, testing
from orchestrator.observe import dashboard
from tests.helpers import wait_for

CHROMEDRIVER = Path("/usr/bin/chromedriver")
HOSTILE = "<img src=x onerror=alert(1)>"


def work(steps: int, pause: float, stop: str) -> int:
    """A DDP loop on gloo that prints a line no page may take as HTML; once `stop` exists,
    rank 3 stops (sleeps: no progress, CPU or I/O) while its peers wait in all_reduce."""
    import torch
    import torch.distributed as dist

    import orchestrator

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        optimizer.step()
        orchestrator.report(loss=loss.item(), samples=8 * (1 + rank))
        print(f"step {step} loss {loss.item():.3f} {HOSTILE}", flush=True)
        time.sleep(pause * (1 + rank % 2))
        if rank == 3 and os.path.exists(stop):
            time.sleep(120)
    dist.destroy_process_group()
    return steps


def _chromedriver() -> Path:
    """Debian's chromedriver, installed now where it is missing and this may (root, apt)."""
    if CHROMEDRIVER.exists():
        return CHROMEDRIVER
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "needs Debian's chromium and chromium-driver (/usr/bin/chromedriver): "
            "`sudo apt-get install -y chromium chromium-driver`"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0 or not CHROMEDRIVER.exists():
        pytest.skip(f"apt-get install chromium chromium-driver failed: {done.stderr[-500:]}")
    return CHROMEDRIVER


@pytest.fixture
def browser(processes: None) -> Iterator[Any]:
    """Headless chromium, 1440 x 1100."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = _chromedriver()
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1440,1100")
    chrome = webdriver.Chrome(service=Service(str(driver_path)), options=options)
    chrome.set_page_load_timeout(30)
    try:
        yield chrome
    finally:
        chrome.quit()


def _text(chrome: Any, css: str) -> str:
    """The text of the element `css` selects now ('' for none), read in the page."""
    found = chrome.execute_script(f"return document.querySelector('{css}')?.textContent", [])
    return str(found or "")


def _class(chrome: Any, css: str) -> str:
    """The class of the element `css` selects now ('' for none)."""
    found = chrome.execute_script(f"return document.querySelector('{css}')?.className", [])
    return str(found or "")


def _step(chrome: Any, rank: int) -> int:
    text = _text(chrome, f'#ranks tr[data-rank="{rank}"] td.step')
    return int(text) if text.isdigit() else -1


def test_a_running_job_s_page_in_a_browser(cluster, browser, tmp_path):
    from selenium.webdriver.common.by import By

    stop = tmp_path / "stop"
    with distribute(work, num_replicas=4, stall_after=60, max_restarts=1, name="page") as fn:
        job = fn.submit(1000, 0.1, str(stop))
        address = dashboard.link(job)
        assert address is not None and "?token=" in address
        browser.get(address)
        wait_for(lambda: _step(browser, 1) > 0, 120, "rank 1's step on the page")
        first = _step(browser, 1)
        wait_for(lambda: _step(browser, 1) > first, 30, "rank 1's row to move on")

        # What the ranks print is shown as text: no element made of it.
        wait_for(lambda: HOSTILE in browser.find_element(By.ID, "output").text, 30, "output")
        assert HOSTILE in _text(browser, '#ranks tr[data-rank="0"] td.line')  # its last line
        assert not browser.find_elements(By.TAG_NAME, "img")

        browser.find_element(
            By.CSS_SELECTOR, '#ranks tr[data-rank="1"] button[data-action=log]'
        ).click()
        panel = browser.find_element(By.ID, "panel-body")
        wait_for(lambda: "step 1 loss" in panel.text, 30, "rank 1's whole output")
        assert "step 0 loss" in panel.text and HOSTILE in panel.text
        browser.find_element(By.ID, "panel-close").click()
        browser.find_element(By.ID, "all-stacks").click()
        wait_for(lambda: "in work" in panel.text, 30, "the ranks' stacks")
        assert not browser.find_elements(By.TAG_NAME, "img")
        browser.find_element(By.ID, "panel-close").click()

        token = address.split("?token=")[1].split("#")[0]
        scrape = urllib.request.Request(  # noqa: S310 - the page's own address
            address.split("?")[0] + "metrics", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(scrape, timeout=10) as answer:  # noqa: S310 - the same
            families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
        steps = families["orchestrator_rank_step"].samples
        ours = sorted(s.labels["rank"] for s in steps if s.labels["pid"] in map(str, fn.pids()))
        assert ours == ["0", "1", "2", "3"]

        # Rank 3 stops: marked on its row (and on the timeline) within its 10 s and a reading.
        if os.environ.get("ORCHESTRATOR_SCREENSHOT"):
            time.sleep(10)  # the plots fill a little
        stop.touch()
        row = '#ranks tr[data-rank="3"]'
        try:
            wait_for(lambda: "stopped" in _class(browser, row), 60, "rank 3 marked stopped")
        except pytest.fail.Exception as missed:  # what the driver and the page saw (a flake)
            seen = testing.view(job)
            where = (
                [(r.rank, r.state, r.silent_s, r.last_line[-60:]) for r in seen.ranks]
                if seen
                else None
            )
            stopped, stall = (seen.stopped, seen.stall) if seen else (None, None)
            findings = browser.find_element(By.ID, "findings").text
            raise AssertionError(
                f"{missed}; {job.status()}; ranks: {where}; stopped: {stopped}; stall: {stall}; "
                f"page: {findings}"
            ) from None
        assert "stopped" in _text(browser, f"{row} td:nth-child(2)")
        findings = browser.find_element(By.ID, "findings")
        wait_for(lambda: "rank 3 stopped: no progress" in findings.text, 10, "the finding")
        assert not any(
            "stopped" in _class(browser, f'#ranks tr[data-rank="{r}"]') for r in (0, 1, 2)
        )

        # Rank 3 is killed: its attempt fails and a restart has the ranks running again. The
        # page says when and why (the root cause), and marks both on the timeline.
        stop.unlink()
        os.kill(fn.pids()[3], signal.SIGKILL)
        restarted = "attempt failed, restarted: rank 3"
        wait_for(lambda: restarted in findings.text, 120, "the failed attempt and its cause")
        assert "crashed" in findings.text, findings.text
        wait_for(lambda: "restarted 1x" in _text(browser, "#job-restarts"), 30, "the restart")
        wait_for(lambda: job.status().state == "running", 120, "the restart running")
        if os.environ.get("ORCHESTRATOR_SCREENSHOT"):
            time.sleep(10)  # its steps on the plots
            browser.save_screenshot(os.environ["ORCHESTRATOR_SCREENSHOT"])
        job.cancel()


def talk(lines: int, pause: float) -> int:
    """Print numbered lines (one no page may take as HTML) for a while."""
    for n in range(lines):
        print(f"line {n} {HOSTILE}", flush=True)
        time.sleep(pause)
    return lines


def test_a_detached_job_s_live_output_on_the_cluster_s_page(cluster, browser):
    """`orchestrator dashboard`'s page (its source and server, in this process) shows a
    detached job's output as it comes, read from its supervisor's journal."""
    from selenium.webdriver.common.by import By

    from orchestrator.cli.dashboard import Cluster
    from orchestrator.observe.page import Page

    fn = distribute(
        talk,
        num_replicas=2,
        replicas_per_node=1,
        detach=True,
        name="talker",
        address=cluster.address,
    )
    job = fn.submit(3000, 0.1)
    page = Page(Cluster(cluster.address))
    try:
        wait_for(job.running, 60, "the detached job running")
        browser.get(f"{page.url}#job={job.id}")
        output = browser.find_element(By.ID, "output")
        wait_for(lambda: "[talker r1] line" in output.text, 60, "the detached job's output")
        seen = _newest_line(output.text)
        wait_for(lambda: _newest_line(output.text) > seen, 30, "its output to move on")
        assert HOSTILE in output.text and not browser.find_elements(By.TAG_NAME, "img")
    finally:
        page.close()
        job.cancel()
        job.release()
        fn.shutdown()


def _newest_line(text: str) -> int:
    """The highest line number `talk` printed that the page shows."""
    return max((int(n) for n in re.findall(r"\] line (\d+) ", text)), default=-1)
