"""The page server alone (pure: a real server on 127.0.0.1, a job that never ran): the token
on every request, the headers that keep a page safe, no action taken, and /metrics as
Prometheus's own parser reads it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.job import Job, JobControl
from orchestrator.observe import exposition
from orchestrator.observe.page import POLICY, Page
from orchestrator.observe.reading import RankFigures, Reader
from orchestrator_workers.figures import Figures

HOSTILE = '<img src=x onerror=alert(1)>"\\\n'


class _Jobs:
    """One job that never ran, named "a" in the page's addresses."""

    title = "tests"

    def __init__(self) -> None:
        self.job: Job[Any] = Job("train", 2, lambda job: None)
        self.job._discard()  # not one of this process's live jobs

    def listing(self) -> dict[str, Any]:
        return {"jobs": [Reader("a", self.job).summary()], "pools": []}

    def reader(self, key: str) -> Reader | None:
        return Reader(key, self.job) if key == "a" else None

    def running(self) -> list[Reader]:
        return []


@pytest.fixture
def page() -> Iterator[Page]:
    served = Page(_Jobs())
    yield served
    served.close()


def _get(page: Page, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{page.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - ours
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_every_request_must_show_the_token(page):
    for path in ("/", "/static/page.js", "/api/jobs", "/metrics", "/api/table?job=a"):
        status, headers, body = _get(page, path)
        assert status == 401, path
        assert "token" in json.loads(body)["error"]
        assert headers["Content-Security-Policy"] == POLICY
    assert _get(page, "/api/jobs?token=wrong" + page.token[5:])[0] == 401
    assert _get(page, "/api/jobs", {"Authorization": "Bearer nope"})[0] == 401
    status, headers, body = _get(page, f"/?token={page.token}")
    assert status == 200 and b'<script type="module" src="/static/page.js">' in body
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    cookie = headers["Set-Cookie"].split(";")[0]
    assert _get(page, "/static/page.js", {"Cookie": cookie})[0] == 200  # the page's own asks
    assert _get(page, "/api/jobs", {"Authorization": f"Bearer {page.token}"})[0] == 200


def test_answers_are_safe_to_show_and_take_no_action(page):
    status, headers, body = _get(page, f"/?token={page.token}")
    policy = headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert b"<script>" not in body  # no inline script: the policy would refuse it anyway
    auth = {"Authorization": f"Bearer {page.token}"}
    status, _, body = _get(page, "/api/jobs", auth)
    assert json.loads(body)["jobs"] == [{"id": "a", "name": "train", "state": "queued", "ranks": 2}]
    status, _, body = _get(page, "/api/table?job=a", auth)
    table = json.loads(body)
    assert status == 200 and [row["rank"] for row in table["rows"]] == [0, 1]
    assert _get(page, "/api/table?job=nope", auth)[0] == 404
    assert _get(page, "/static/../page.py", auth)[0] == 404
    assert _get(page, "/static/nothing.js", auth)[0] == 404
    assert _get(page, "/api/jobs", {**auth, "Host": "evil.example:80"})[0] == 403  # rebinding
    request = urllib.request.Request(
        f"http://127.0.0.1:{page.port}/api/jobs", data=b"{}", headers=auth, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 - ours
    assert refused.value.code == 501  # no POST route: the page takes no action


def test_metrics_as_prometheus_reads_them():
    figures = Figures(
        at=1000.5,
        step=12,
        last_step_at=1000.0,
        step_s=0.25,
        samples_per_s=32.0,
        cpu=1.5,
        rss_mb=512.0,
        gpu_mb=None,
        gpu_busy=None,
    )
    ranks = [
        RankFigures(0, "10.0.0.1", 41, figures, slow=False, stalled=False),
        RankFigures(1, HOSTILE, 42, figures, slow=True, stalled=False),
    ]
    text = exposition.text([(HOSTILE, ranks)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {g.name for g in exposition.GAUGES} <= set(families)
    steps = families["orchestrator_rank_step"].samples
    assert [(s.labels["rank"], s.value) for s in steps] == [("0", 12.0), ("1", 12.0)]
    assert steps[1].labels == {"job": HOSTILE, "rank": "1", "node": HOSTILE, "pid": "42"}
    memory = families["orchestrator_rank_memory_bytes"].samples[0]
    assert memory.value == 512 * 2**20
    assert families["orchestrator_rank_step_seconds"].samples[0].value == 0.25
    assert not families["orchestrator_rank_gpu_memory_bytes"].samples  # no GPU: no sample
    assert [s.value for s in families["orchestrator_rank_slow"].samples] == [0.0, 1.0]
    assert all(family.type == "gauge" for family in families.values())


def test_a_job_s_failures_and_restarts_reach_its_page_with_their_times():
    job: Job[Any] = Job("train", 2, lambda job: None)
    job._discard()  # not one of this process's live jobs
    control = JobControl(job)
    began = time.time()
    control.restarted(RuntimeError("rank 1 crashed (SIGKILL)\nits traceback"))
    control.finish(error=RuntimeError("rank 0 raised ValueError"))
    status = job.status()
    assert status.restarts == 1 and status.failed_attempts == ("rank 1 crashed (SIGKILL)",)
    events = Reader("a", job).table()["events"]
    assert [(e["kind"], e["text"]) for e in events] == [
        ("restart", "rank 1 crashed (SIGKILL)"),
        ("failed", "rank 0 raised ValueError"),
    ]
    assert began <= events[0]["at"] <= events[1]["at"] <= time.time()
    assert "events" not in repr(status)  # the status line stays one line
