"""A real Jupyter kernel: rank output lands in the cell that made the call."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    "import os, sys\n"
    f"sys.path.insert(0, {str(ROOT)!r})\n"
    "from orchestrator import distribute",
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
    "print(train('bye'))\n"
    "train.shutdown()",
]


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


def test_rank_output_lands_in_the_calling_cell(fresh_ray_dir):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=180, kernel_name="python3").execute()
    first, between, second = (_text(nb.cells[i]) for i in (2, 3, 4))
    assert "[greet r0] hello from rank 0" in first
    assert "[greet r1] hello from rank 1" in first
    assert "[0, 1]" in first
    assert between == "a cell in between\n"
    assert "[greet r0] BYE again from rank 0" in second
    assert "[greet r1] BYE again from rank 1" in second
    assert "[-1, -1]" in second
