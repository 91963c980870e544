"""A user's own modules keep their names: nothing the product imports can be shadowed.

A script's folder comes first on sys.path, in the driver and in every rank. A user project
holds its own `workers` (a module, or a package) and a module named after every module of
ours (each fails loudly if imported); it runs through `distribute()` from a script and
through `orchestrator run`, on this machine and on the session's 2-node cluster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import cli, cli_env, show, write

ROOT = Path(__file__).resolve().parent.parent
OURS = sorted(
    (
        {p.stem for folder in ("orchestrator", "workers") for p in (ROOT / folder).rglob("*.py")}
        | {d.name for d in (ROOT / "orchestrator").iterdir() if (d / "__init__.py").exists()}
    )
    - {"__init__", "__main__"}
)
"""Every module and subpackage name of ours, as a user's top-level module could be named."""

REPORT = """\
import json, os, sys
import workers

def report(where):
    ours = sys.modules.get("orchestrator_workers")
    return {
        "where": where,
        "rank": os.environ.get("RANK"),
        "workers": workers.WHO,
        "made": workers.make(3),
        "ours": getattr(ours, "__file__", None),
        "shadows": sorted(
            n for n, m in sys.modules.items() if getattr(m, "__dict__", {}).get("SHADOW") is True
        ),
    }
"""


def project(folder: Path, *, package: bool) -> Path:
    """A user project: its own `workers`, a decoy for each module of ours, report.py."""
    theirs = "WHO = 'user'\ndef make(n): return list(range(n))\n"
    files = {"workers/__init__.py" if package else "workers.py": theirs, "report.py": REPORT}
    for name in OURS:  # imported by anything but the user's code, it breaks the run
        files[f"{name}.py"] = f"SHADOW = True\nraise ImportError('user module {name} imported')\n"
    return write(folder, files)


def reports(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if "REPORT " in line]
    return [json.loads(line.split("REPORT ", 1)[1]) for line in lines]


def check(found: list[dict], ranks: int) -> None:
    ranks_seen = sorted(r["rank"] for r in found if r["where"] == "rank")
    assert ranks_seen == [str(n) for n in range(ranks)], found
    for r in found:
        assert r["workers"] == "user" and r["made"] == [0, 1, 2], r
        assert r["shadows"] == [], r
        if r["ours"] is not None:  # the driver of `orchestrator run` loads it, a script too
            assert Path(r["ours"]).resolve().is_relative_to(ROOT / "workers"), r


SCRIPT = """\
import json, sys
import workers                      # theirs, before ours is imported
from orchestrator import distribute
from report import report

def train():
    from report import report
    return report("rank")

address = sys.argv[1] if len(sys.argv) > 1 else None
results = distribute(train, num_replicas=2, replicas_per_node=1, address=address)()
for r in [report("driver"), *results]:
    print("REPORT " + json.dumps(r), flush=True)
"""


def _script(folder: Path, address: str | None, tmp: Path) -> None:
    import subprocess

    write(folder, {"train.py": SCRIPT})
    proc = subprocess.run(
        [sys.executable, "train.py", *([address] if address else [])],
        cwd=folder,
        env=cli_env(tmp),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, show(proc)
    found = reports(proc.stdout)
    assert any(r["where"] == "driver" for r in found), show(proc)
    check(found, 2)


TORCHRUN_SCRIPT = """\
import json
import workers
from report import report
print("REPORT " + json.dumps(report("rank")), flush=True)
"""


def _run(folder: Path, address: str | None, tmp: Path) -> None:
    write(folder, {"train.py": TORCHRUN_SCRIPT})
    where = "--nproc-per-node 2"
    if address:
        where = f"--address {address} --nnodes 2 --nproc-per-node 1"
    proc = cli(f"run {where} train.py", cwd=folder, tmp=tmp)
    assert proc.returncode == 0, show(proc)
    check(reports(proc.stdout), 2)


@pytest.mark.slow
@pytest.mark.parametrize("package", [False, True], ids=["workers.py", "workers-package"])
def test_a_user_s_own_workers_on_this_machine(processes, tmp_path, package):
    """distribute() from a script and `orchestrator run`, each on the embedded default."""
    _script(project(tmp_path / "script", package=package), None, tmp_path)
    _run(project(tmp_path / "run", package=package), None, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("package", [False, True], ids=["workers.py", "workers-package"])
def test_a_user_s_own_workers_on_the_two_node_cluster(cluster, tmp_path, package):
    """The same project, its code shipped to ranks on two nodes."""
    _script(project(tmp_path / "script", package=package), cluster.address, tmp_path)
    _run(project(tmp_path / "run", package=package), cluster.address, tmp_path)
