"""A real Jupyter kernel: rank output lands in the cell that made the call."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom orchestrator import distribute",
    "def greet(word):\n"
    "    import torch.distributed as dist\n"
    "    dist.init_process_group('gloo')\n"
    "    print(f'{word} from rank {dist.get_rank()}')\n"
    "    return dist.get_rank()\n"
    "train = distribute(greet, num_replicas=2, replicas_per_node=1)",
    "print(train('hello'))",
    "print('a cell in between')",
    # Redefined in a later cell: the warm pool runs the new code.
    "def greet(word):\n"
    "    print(f'{word.upper()} again from rank {os.environ[\"RANK\"]}')\n"
    "    return -1\n"
    "print(train('bye'))",
    # Submitted: the cell returns at once, and the ranks' lines still land in it.
    "def slow(word):\n"
    "    import time\n"
    "    time.sleep(2)\n"
    "    print(f'{word} from rank {os.environ[\"RANK\"]}', flush=True)\n"
    "    return int(os.environ['RANK'])\n"
    "train = distribute(slow, num_replicas=2, replicas_per_node=1, name='bg')\n"
    "job = train.submit('later')\n"
    "print('submitted')",
    "print('working meanwhile')",
    "print(job.result())\ntrain.shutdown()",
    # The stop button (nbclient interrupts the kernel when this cell's time is up).
    "def stuck():\n"
    "    import time\n"
    "    time.sleep(300)\n"
    "stuck_fn = distribute(stuck, num_replicas=2, replicas_per_node=1, name='stuck')\n"
    "stuck_fn()",
    "stuck_fn.fn = os.getpid\nprint(len(stuck_fn()))\nstuck_fn.shutdown()",
    # A driver message from the runner thread (through logging) lands in the calling cell.
    "def flaky():\n"
    "    if os.environ['RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
    "        raise RuntimeError('first attempt fails')\n"
    "    return 1\n"
    "print(distribute(flaky, num_replicas=2, replicas_per_node=1, max_restarts=1)())",
    # A submitted job that fails: its table marks the rank and puts the root cause first;
    # a Job shown as a cell's value renders as the same table.
    "def boom():\n"
    "    print('about to fail', flush=True)\n"
    "    if os.environ['RANK'] == '1':\n"
    "        raise ValueError('bad shard 7')\n"
    "    return 0\n"
    "failing = distribute(boom, num_replicas=2, replicas_per_node=1, name='boom').submit()\n"
    "failing.exception(timeout=120)\n"
    "failing",
]
INTERRUPTED = 8
"""The cell nbclient interrupts after INTERRUPT_AFTER_S, as the stop button would."""
INTERRUPT_AFTER_S = 12


@pytest.fixture
def fresh_ray_dir():
    """A private Ray temp dir, so the kernel starts its own embedded Ray."""
    tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ADDRESS")}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.pop("RAY_ADDRESS", None)
    yield tmp
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(tmp, ignore_errors=True)


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(
        out.get("text", "") for out in cell.outputs if out.get("output_type") == "stream"
    )


def _displayed(cell: nbformat.NotebookNode, kind: str = "text/plain") -> str:
    return "".join(
        out.get("data", {}).get(kind, "")
        for out in cell.outputs
        if out.get("output_type") == "display_data"
    )


def _value(cell: nbformat.NotebookNode, kind: str) -> str:
    return "".join(
        out.get("data", {}).get(kind, "")
        for out in cell.outputs
        if out.get("output_type") == "execute_result"
    )


def test_rank_output_lands_in_the_calling_cell(fresh_ray_dir):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.cells[INTERRUPTED].metadata["tags"] = ["raises-exception"]
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout_func=lambda cell: INTERRUPT_AFTER_S if cell is nb.cells[INTERRUPTED] else 180,
        interrupt_on_timeout=True,
    ).execute()
    first, between, second = (_text(nb.cells[i]) for i in (2, 3, 4))
    assert "[orchestrator] running locally on an embedded Ray instance" in first
    assert "[greet r0] hello from rank 0" in first
    assert "[greet r1] hello from rank 1" in first
    assert "[0, 1]" in first
    assert between == "a cell in between\n"
    assert "[greet r0] BYE again from rank 0" in second
    assert "[greet r1] BYE again from rank 1" in second
    assert "[-1, -1]" in second
    submitting, meanwhile, waiting = nb.cells[5], nb.cells[6], nb.cells[7]
    assert _text(submitting) == "submitted\n"
    shown = _displayed(submitting)
    assert "[bg r0] later from rank 0" in shown, submitting.outputs
    assert "[bg r1] later from rank 1" in shown
    assert shown.startswith("[bg] finished")
    # Above the output, the ranks' table (live while it ran), as text and as HTML.
    assert re.search(r"r0 +\S+ +finished +0:0[2-9] +0 +later from rank 0", shown), shown
    table = _displayed(submitting, "text/html")
    assert "<table>" in table and table.index("<table>") < table.index("later from rank 1")
    assert _text(meanwhile) == "working meanwhile\n"
    assert _text(waiting) == "[0, 1]\n"
    assert not _displayed(waiting) and not _displayed(meanwhile)
    errors = [o for o in nb.cells[INTERRUPTED].outputs if o.get("output_type") == "error"]
    assert [e["ename"] for e in errors] == ["KeyboardInterrupt"]
    assert "all 2 ranks of stuck were stopped" in errors[0]["evalue"]
    assert _text(nb.cells[INTERRUPTED + 1]) == "2\n"  # fresh ranks, same function
    restarted = _text(nb.cells[INTERRUPTED + 2])
    assert "[flaky] attempt 1 failed: rank 1" in restarted and "[1, 1]" in restarted, restarted
    failing = nb.cells[INTERRUPTED + 3]
    shown = _displayed(failing, "text/html")
    assert shown.index("root cause:</b> rank 1") < shown.index("<table>"), shown
    assert shown.index("failed (root cause)") < shown.index("<td>r0</td>"), shown  # first
    assert 'style="color:#b00020;font-weight:bold"><td>r1</td>' in shown, shown
    value = _value(failing, "text/html")
    assert "<table>" in value and "bad shard 7" in value and "about to fail" in value, value
