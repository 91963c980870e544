"""One cold start through `distribute`, as a user's fresh script does it; timed by bench_core.

    python -m benchmarks._cold_ours RESULT.json     (from the repository root)

Imports torch and orchestrator, runs the trivial job on 4 ranks of the embedded local Ray
instance (started here: bench_core gives this process a fresh RAY_TMPDIR and no
RAY_ADDRESS), writes the result, then exits the way a user's script does (Ray's
own exit hook shuts the embedded instance down). Ray is started by an explicit
`cluster.connect()`, the call the first `fn()` makes anyway, only to time it apart.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

STARTED = time.time()

from benchmarks._jobs import trivial  # noqa: E402 - after the clock starts
from orchestrator import distribute  # noqa: E402
from orchestrator.connect import cluster  # noqa: E402

IMPORTED = time.time()


def main() -> None:
    """Run the trivial job once on 4 ranks and write the timings as JSON."""
    # What the first call does first anyway, done apart to time it: start the embedded Ray.
    cluster.connect(None, min_cpus=4)
    ray_up = time.time()
    fn = distribute(trivial, num_replicas=4)
    ranks = fn()
    result_at = time.time()
    pids = fn.pids()
    fn.shutdown()
    Path(sys.argv[1]).write_text(
        json.dumps(
            {
                "started": STARTED,
                "imported": IMPORTED,
                "ray_up": ray_up,
                "result_at": result_at,
                "ranks": ranks,
                "pids": pids,
                "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
