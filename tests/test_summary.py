"""A picture of many ranks that fits: the table and status grouped by state and node,
the ranks that differ first, every rank's row one call or one click away."""

from __future__ import annotations

import os
import time

import pytest

from orchestrator import DistributedError, distribute
from orchestrator.show.notebook import RankRow, Table
from orchestrator.show.summary import SUMMARY_FROM_RANKS, RankView, group, states_line
from tests.helpers import wait_resources_back

# --- grouping, without Ray ------------------------------------------------------------------


def _rows(n, state="running", **odd):
    return tuple(
        RankRow(
            i,
            f"10.0.0.{i // 8}",
            odd.get(f"r{i}", state),
            42.0,
            0,
            f"Rank {i}: Epoch 3, Loss {i / 100:.2f}",
            root_cause=odd.get("cause") == i,
        )
        for i in range(n)
    )


def test_many_ranks_show_as_groups_with_the_odd_ones_first():
    rows = _rows(128, "stopped", r5="failed", r9="waiting for a debugger", cause=5)
    text = Table("[train] failed", rows, "rank 5 raised ValueError").text()
    lines = text.splitlines()
    assert lines[3].startswith("r5 ") and "failed (root cause)" in lines[3], text
    assert lines[4].startswith("r9 ") and "waiting for a debugger" in lines[4], text
    assert lines[5].startswith("r0-4,6-8,10-127 ") and "16 nodes" in lines[5], text
    # The usual ranks' last lines fold into one, numbers as ranges.
    assert "Rank 0..127: Epoch 3, Loss 0.00..1.27" in lines[5], text
    assert len(lines) < 10, text
    full = Table("[train] failed", rows).text(full=True).splitlines()
    assert len(full) == 2 + 128 and full[2].startswith("r0 "), full[:3]


def test_a_few_ranks_keep_a_row_each():
    rows = _rows(SUMMARY_FROM_RANKS - 1)
    assert len(Table("[t] running", rows).text().splitlines()) == 2 + len(rows)


def test_html_keeps_every_rank_one_click_away():
    html = Table("[train] running", _rows(32, r3="failed")).html()
    summary, details = html.split("<details>")
    assert summary.count("<tr") == 1 + 2  # header, the failed rank, the rest
    assert "every rank (32 rows)" in details and details.count("<tr") == 1 + 32


def test_odd_ranks_split_by_node_and_lines_that_differ_are_counted():
    views = [
        RankView(
            i, f"n{i // 4}", "failed" if i in (1, 6) else "running", "loss 1" if i % 2 else "step 2"
        )
        for i in range(16)
    ]
    groups = group(views)
    assert [(g.state, g.ranks, g.nodes) for g in groups[:2]] == [
        ("failed", (1,), ("n0",)),
        ("failed", (6,), ("n1",)),
    ]
    usual = groups[-1]
    assert usual.ranks == tuple(i for i in range(16) if i not in (1, 6))
    assert usual.last_line.endswith("(+1 other line)"), usual.last_line


def test_a_silent_rank_is_odd_only_while_most_peers_write():
    views = [RankView(i, "n0", "running", "x", silent_s=90.0 if i == 7 else 1.0) for i in range(16)]
    assert group(views)[0].ranks == (7,) and "silent 90 s" in group(views)[0].state
    all_quiet = [RankView(i, "n0", "running", "x", silent_s=90.0) for i in range(16)]
    assert len(group(all_quiet)) == 1  # a quiet phase of the whole job is not odd


def test_states_line_puts_the_fewest_first():
    states = [(i, "failed" if i == 5 else "stopped") for i in range(128)]
    assert states_line(states) == "r5 failed, r0-4,6-127 stopped"


# --- a real job ------------------------------------------------------------------------------


def _fail_on_rank_3():
    rank = int(os.environ["RANK"])
    print(f"Rank {rank}: step 1, loss {rank / 10}", flush=True)
    if rank == 3:
        raise ValueError("bad shard")
    time.sleep(60)  # the others are stopped when rank 3 fails


@pytest.mark.usefixtures("cluster")
def test_a_failed_job_of_many_ranks_is_summarized():
    n = SUMMARY_FROM_RANKS
    job = distribute(
        _fail_on_rank_3,
        num_replicas=n,
        replicas_per_node=n // 2,
        cpus_per_replica=0.1,
        gpus_per_replica=0,
        log_dir=False,
    ).submit()
    with pytest.raises(DistributedError):
        job.result(timeout=120)
    text = job.table().text()
    lines = text.splitlines()
    assert "root cause: rank 3" in lines[1], text
    assert lines[3].startswith("r3 ") and "failed (root cause)" in lines[3], text
    assert lines[4].startswith(f"r0-2,4-{n - 1} ") and "stopped" in lines[4], text
    assert f"Rank 0..{n - 1}: step 1, loss 0.0..1.5" in lines[4], text
    assert len(job.table().text(full=True).splitlines()) == 3 + n
    assert str(job.status()).endswith(f"(r3 failed, r0-2,4-{n - 1} stopped)"), job.status()
    wait_resources_back()
