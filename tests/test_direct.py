"""A detached function's warm calls started on the ranks by the driver itself, while the
supervisor watches (orchestrator.supervise.direct): each is kept as any detached job,
whatever becomes of its driver, and no call replaces or runs beside another."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from orchestrator import distribute, get_job, testing
from tests.detached_work import LAYOUT, rank_and, warm
from tests.helpers import ROOT, wait_resources_back


def test_a_warm_call_goes_to_the_ranks_directly_and_is_kept_as_any_detached_job(cluster, tmp_path):
    """queue=False: a call's notice may come while the supervisor still files the last
    call's results; it is never refused as busy (the call runs already)."""
    with distribute(rank_and, **LAYOUT, address=cluster.address, max_restarts=1, queue=False) as fn:
        warm(fn)
        with testing.sent_to_supervisor(fn) as sent:
            ids = []
            for x in range(10, 15):
                assert fn(x) == [(0, x), (1, x)]
                ids.append(testing.last_job(fn).id)
            assert not sent  # none went through the supervisor
            got = get_job(ids[-1], show=False)  # the supervisor keeps each, as any job
            assert got.result(timeout=30) == [(0, 14), (1, 14)]
            assert str(got.status().state) == "finished"
            # A failed direct call is taken over by the supervisor: restarted, reported.
            assert fn(20, str(tmp_path / "failed")) == [(0, 20), (1, 20)]
            assert not sent
        status = testing.last_job(fn).status()
        assert len(status.failed_attempts) == 1, status
        assert "the first attempt breaks" in status.failed_attempts[0], status
        assert fn(21) == [(0, 21), (1, 21)]  # and the next call works
    wait_resources_back(timeout=30)


TWO = """\
from tests.detached_work import LAYOUT, rank_and
from orchestrator import distribute, testing
fn = distribute(rank_and, **LAYOUT, address={address!r},
                name="shared", queue=True)
for x in range(100, 140):
    assert fn(x) == [(0, x), (1, x)], (x, testing.last_job(fn).id)
print("OK", flush=True)
"""


def test_two_drivers_on_one_warm_pool_each_get_their_own_calls(cluster):
    """The supervisor lends the pool to one driver at a time: a driver's call never
    replaces another's or runs beside it, whichever driver holds the lease."""
    with distribute(rank_and, **LAYOUT, address=cluster.address, name="shared", queue=True) as fn:
        warm(fn)
        other = subprocess.Popen(
            [sys.executable, "-c", TWO.format(address=cluster.address)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            mine = 0
            while other.poll() is None or mine < 20:
                assert fn(mine) == [(0, mine), (1, mine)], mine
                mine += 1
            out, err = other.communicate(timeout=120)
        finally:
            other.kill()
        assert other.returncode == 0 and "OK" in out, err
        assert "using the warm ranks" in err, err  # one pool, shared
    wait_resources_back(timeout=30)


KILLED = """\
import os
from tests.detached_work import LAYOUT, rank_and, warm
from orchestrator import distribute
fn = distribute(rank_and, **LAYOUT, address={address!r},
                name="killed", idle_timeout=2)
warm(fn)
print("JOB", flush=True)
fn(7, kill=os.getpid())
"""


def test_a_driver_killed_during_its_direct_call_leaves_the_job_to_the_supervisor(cluster):
    """Killed before it could say how its call went: the supervisor looks at rank 0's hand
    after a while, takes the call over, and keeps its result for whoever asks."""
    driver = subprocess.Popen(
        [sys.executable, "-c", KILLED.format(address=cluster.address)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == -signal.SIGKILL and "JOB" in out, out
    job = get_job("killed", show=False)  # the newest of that name: the killed driver's
    assert job.result(timeout=60) == [(0, 7), (1, 7)]
    assert str(job.status().state) == "finished"
    job.release()  # its warm pool goes after idle_timeout (2 s), and then its supervisor
    wait_resources_back(timeout=60)


def test_a_lease_on_a_pool_released_meanwhile_costs_only_a_new_start(cluster):
    """The driver holds a lease when the pool goes idle (and then its supervisor, with no
    job kept): the next call starts a pool anew, as any first call."""
    with distribute(rank_and, **LAYOUT, address=cluster.address, idle_timeout=1, retention=1) as fn:
        warm(fn)
        testing.last_job(fn).release()
        wait_resources_back(timeout=30)  # the ranks went idle, then the supervisor
        time.sleep(2)
        assert fn(5) == [(0, 5), (1, 5)]
        assert fn(6) == [(0, 6), (1, 6)]
    wait_resources_back(timeout=30)
