"""The rank side brought to nodes keeps the user's own runtime_env: the job's (ray.init's)
and distribute()'s `py_modules` and variables reach the ranks beside ours, and bringing it
says nothing.

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
from pathlib import Path
import ray
from orchestrator import _ray_compat, distribute, testing

job_module, call_module = sys.argv[2], sys.argv[3]
ray.init(address=sys.argv[1], runtime_env={"py_modules": [job_module]}, log_to_driver=False)
# An actor's runtime_env takes URIs only: the call's module is uploaded first.
call_uri = _ray_compat.upload_module(Path(call_module))

def where():
    import os
    import from_the_job, from_the_call, orchestrator_workers
    return {
        "ours": orchestrator_workers.__file__,
        "job": from_the_job.WHO,
        "call": from_the_call.WHO,
        "variable": os.environ.get("FROM_THE_CALL"),
    }

with testing.ship_rank_side():
    found = distribute(
        where, num_replicas=2, replicas_per_node=1, log_dir=False,
        runtime_env={"py_modules": [call_uri], "env_vars": {"FROM_THE_CALL": "yes"}},
    )()
print("FOUND " + json.dumps(found), flush=True)
print("READ", testing.nodes_read(), flush=True)
"""


def test_the_user_s_runtime_env_and_ours_reach_every_rank(cluster, tmp_path: Path):
    """Ours and the user's py_modules reach every rank; a second driver asks no node what
    it has, since the first kept it in the cluster."""
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    rankside.check_nodes(nodes, "first-driver")  # this process is the first driver here
    for node in nodes:
        kept = json.loads(_ray_compat.kv_get(f"node-facts/{node}") or b"{}")
        assert kept.get("node_id") == node and kept.get("rank_side") == rankside.content(), kept
    job = write(tmp_path / "job", {"from_the_job.py": "WHO = 'job'\n"}) / "from_the_job.py"
    call = write(tmp_path / "call", {"from_the_call/__init__.py": "WHO = 'call'\n"})
    call = call / "from_the_call"
    write(tmp_path / "project", {"driver.py": DRIVER})
    proc = subprocess.run(
        [sys.executable, "driver.py", cluster.address, str(job), str(call)],
        cwd=tmp_path / "project", env=cli_env(tmp_path), capture_output=True, text=True,
        timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert "orchestrator_workers" not in proc.stderr, show(proc)  # brought without a word
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("FOUND ")]
    found = json.loads(line.removeprefix("FOUND "))
    assert len(found) == 2, found
    for rank in found:
        assert rank["job"] == "job" and rank["call"] == "call", rank
        assert rank["variable"] == "yes", rank
        shipped = Path(rank["ours"])
        assert "py_modules_files" in shipped.parts, rank  # the driver's copy, as shipped
        assert shipped.parent.name == "orchestrator_workers", rank
    assert "READ 0" in proc.stdout.splitlines(), show(proc)
