"""`orchestrator local start`'s head process: started again where Ray gave up on a busy
machine (its raylet missed Ray's fixed 30 s to register), never where it failed otherwise.

Ray's own start cannot be made to miss its deadline on demand, so a small script stands in
for `ray start --head --block`: it fails with Ray's words, or comes up as Ray does (its
address file written, its `--block` notice printed), as the test tells it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from orchestrator.connect import head
from orchestrator.errors import LocalRuntimeError

RAY_GAVE_UP = (
    "INFO node.py:438 -- Failed to get node info b'RPC error: Deadline Exceeded'\n"
    "Exception: The current node timed out during startup. This could happen because some "
    "of the raylet failed to startup or the GCS has become overloaded."
)
STANDIN = """
import sys, time
from pathlib import Path
tries, failures, address_file, words = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if len(tries.read_text()) <= failures:
    print(words, flush=True)
    sys.exit(1)
Path(address_file).write_text("127.0.0.1:6379")
print("Ray runtime started. ... --block ...", flush=True)
time.sleep(600)
"""


def _start(tmp_path: Path, failures: int, words: str = RAY_GAVE_UP):
    os.chmod(tmp_path, 0o700)
    tries = tmp_path / "tries"
    address_file = tmp_path / "ray_current_cluster"
    command = [sys.executable, "-c", STANDIN, str(tries), str(failures), str(address_file), words]
    log = tmp_path / "head.log"
    return head.start(command, dict(os.environ), tmp_path, log, address_file), tries


def test_a_head_ray_gave_up_on_is_started_again(tmp_path: Path, processes: None) -> None:
    (process, address), tries = _start(tmp_path, failures=2)
    try:
        assert address == "127.0.0.1:6379"
        assert tries.read_text() == "xxx"  # twice given up on, up the third time
        assert process.poll() is None
    finally:
        head.end(process)
    assert process.poll() is not None


def test_a_head_ray_gives_up_on_every_time_is_reported_once(
    tmp_path: Path, processes: None
) -> None:
    with pytest.raises(LocalRuntimeError, match="Ray gave up 3 times on this machine's load"):
        _start(tmp_path, failures=5)
    assert (tmp_path / "tries").read_text() == "xxx"


def test_a_head_that_failed_otherwise_is_not_started_again(tmp_path: Path, processes: None) -> None:
    with pytest.raises(LocalRuntimeError, match="exited with 1:\nport 6379 is in use"):
        _start(tmp_path, failures=1, words="port 6379 is in use")
    assert (tmp_path / "tries").read_text() == "x"
