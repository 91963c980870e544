"""The rank side brought to nodes leaves the user's own runtime_env alone: the job's
(ray.init's) `py_modules` and distribute()'s variables reach the ranks beside ours, and
bringing it says nothing.

The session cluster's nodes have this package; `testing.ship_rank_side()` makes the driver
bring its copy all the same, as it does to nodes that lack it (tests/test_bare_nodes.py
runs on such nodes). What arrives where is the same either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ray

from orchestrator import _ray_compat
from orchestrator.connect import rankside
from tests.helpers import cli_env, show, write

DRIVER = """\
import json, sys
import ray
from orchestrator import distribute, testing

ray.init(address=sys.argv[1], runtime_env={"py_modules": [sys.argv[2]]}, log_to_driver=False)

def where():
    import os, subprocess
    import from_the_job, orchestrator_workers
    child = subprocess.run(  # a data loader's worker, a tool the rank starts: the same copy
        [sys.executable, "-c", "import orchestrator_workers; print(orchestrator_workers.__file__)"],
        capture_output=True, text=True, check=True,
    )
    return {
        "ours": orchestrator_workers.__file__,
        "child": child.stdout.strip(),
        "job": from_the_job.WHO,
        "variable": os.environ.get("FROM_THE_CALL"),
    }

with testing.ship_rank_side():
    found = distribute(
        where, num_replicas=2, replicas_per_node=1, log_dir=False,
        runtime_env={"env_vars": {"FROM_THE_CALL": "yes"}},
    )()
print("FOUND " + json.dumps(found), flush=True)
print("READ", testing.nodes_read(), flush=True)
"""


def test_the_user_s_runtime_env_and_ours_reach_every_rank(cluster, tmp_path: Path):
    """Ours and the user's runtime_env reach every rank; a second driver asks no node what
    it has, since the first kept it in the cluster."""
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    rankside.check_nodes(nodes, "first-driver")  # this process is the first driver here
    for node in nodes:
        kept = json.loads(_ray_compat.kv_get(f"node-facts/{node}") or b"{}")
        assert kept.get("node_id") == node and kept.get("rank_side") == rankside.content(), kept
    job = write(tmp_path / "job", {"from_the_job.py": "WHO = 'job'\n"}) / "from_the_job.py"
    write(tmp_path / "project", {"driver.py": DRIVER})
    proc = subprocess.run(
        [sys.executable, "driver.py", cluster.address, str(job)],
        cwd=tmp_path / "project",
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, show(proc)
    assert "orchestrator_workers" not in proc.stderr, show(proc)  # brought without a word
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("FOUND ")]
    found = json.loads(line.removeprefix("FOUND "))
    assert len(found) == 2, found
    for rank in found:
        assert rank["job"] == "job", rank
        assert rank["variable"] == "yes", rank
        shipped = Path(rank["ours"])
        assert shipped.parent.parent.name.startswith("rank-side-"), rank  # the driver's copy
        assert rank["child"] == rank["ours"], rank
        assert shipped.parent.name == "orchestrator_workers", rank
    assert "READ 0" in proc.stdout.splitlines(), show(proc)


def test_local_folders_in_distribute_s_runtime_env_reach_the_ranks(cluster, tmp_path: Path):
    """py_modules and working_dir given as local folders, as ray.init takes them: uploaded,
    not refused (Ray takes only URIs in an actor's own runtime_env)."""
    from orchestrator import distribute

    modules = write(tmp_path / "lib", {"mylib/__init__.py": "WHO = 'mylib'\n"})
    project = write(tmp_path / "project", {"data.txt": "from the working dir\n"})

    def where() -> tuple[str, str]:
        import mylib  # type: ignore[import-not-found]

        return mylib.WHO, Path("data.txt").read_text()

    fn = distribute(
        where,
        num_replicas=2,
        replicas_per_node=1,
        log_dir=False,
        runtime_env={"py_modules": [str(modules / "mylib")], "working_dir": str(project)},
    )
    try:
        assert fn() == [("mylib", "from the working dir\n")] * 2
    finally:
        fn.shutdown()
