"""Time from a rank's failure to the error on the driver, ours vs torchrun.

    python -m benchmarks.bench_failures [--repeats 3]

Rank 1 of 4 fails (raises, or SIGKILLs itself) while the others wait in a collective.
Ours: until distribute() raises on the driver. torchrun: until the torchrun process exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator import DistributedError, distribute

_SCRIPT = """
import os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(1.0)
    with open(sys.argv[2], "w") as f:
        f.write(repr(time.time()))
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("boom")
dist.all_reduce(torch.ones(1))
"""


def _fail(how: str, stamp: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1.0)
        Path(stamp).write_text(repr(time.time()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


def ours(how: str, stamp: str) -> float:
    """Seconds from rank 1's failure to the driver's exception (warm pool)."""
    fn = distribute(_fail, num_replicas=4, replicas_per_node=2, log_dir=False)
    fn.fn = lambda how, stamp: None  # start the pool first: only the failure is timed
    fn(how, stamp)
    fn.fn = _fail
    try:
        fn(how, stamp)
    except DistributedError:
        caught = time.time()
    else:
        raise AssertionError("the call did not fail")
    finally:
        fn.shutdown()
    return caught - float(Path(stamp).read_text())


def torchrun(how: str, stamp: str, script: Path) -> float:
    """Seconds from rank 1's failure to torchrun's exit."""
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun_bin), "--standalone", "--nproc_per_node=4", str(script), how, stamp]
    subprocess.run(argv, capture_output=True, check=False, timeout=600)
    return time.time() - float(Path(stamp).read_text())


def main(argv: list[str] | None = None) -> int:
    """Measure both launchers for both kinds of failure and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rf", dir="/tmp"))
    os.environ.setdefault("RAY_TMPDIR", str(tmp))
    os.environ.pop("RAY_ADDRESS", None)
    script = tmp / "fail.py"
    script.write_text(_SCRIPT)
    stamp = str(tmp / "stamp")
    rows = []
    for how in ("raise", "kill"):
        mine = [ours(how, stamp) for _ in range(args.repeats)]
        theirs = [torchrun(how, stamp, script) for _ in range(args.repeats)]
        rows.append((how, statistics.median(mine), statistics.median(theirs)))
    print(f"\nFirst failure on rank 1 of 4 -> error on the driver (median of {args.repeats})")
    print(f"{'failure':<10}{'distribute':>12}{'torchrun':>12}   target")
    for how, mine_s, theirs_s in rows:
        print(f"{how:<10}{mine_s:>11.3f}s{theirs_s:>11.3f}s   < 1 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
