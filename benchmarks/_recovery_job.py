"""The training loop bench_recovery times: through distribute() (`train`) and as torchrun's
script (`python -m benchmarks._recovery_job ARGS...`).

One flat parameter with Adam (params + two moments = `state_mb`), DDP-style gradient
all_reduce on gloo each step. Every `every` steps the state is kept: in memory
(orchestrator.snapshot, mode "memory"; through torch.distributed.checkpoint with
snapshot.writer and snapshot.reader, mode "dcp"), with torch.save to local disk (mode
"disk"), or not at all ("none"). On the first attempt rank `kill_rank` writes the time and SIGKILLs
itself at step `kill_step`. On a later attempt every rank writes, as JSON: when the
function started, when the state was restored (and from which step), and when its first
step after that completed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def train(  # noqa: PLR0917 - torchrun passes them as argv too
    out: str, state_mb: int, steps: int, every: int, mode: str, kill_step: int, kill_rank: int
) -> dict[str, float]:
    """The loop; returns this rank's steps/s over the steps it ran after the restore."""
    started = time.time()
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # distribute sets it too
    if not dist.is_initialized():
        _init(attempt)
    folder = Path(out)
    param = torch.nn.Parameter(torch.zeros(state_mb * 2**20 // 12))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    param.grad = torch.zeros_like(param)
    optimizer.step()  # the moments exist from the start: state_mb in all
    built = time.time()
    state = {"param": param, "optimizer": optimizer}
    first, restored_step = 0, None
    if mode == "memory":
        from orchestrator import snapshot

        restored = snapshot.restore(state)  # the parameter too, in place
        if restored is not None:
            first, restored_step = restored.data, restored.step
    elif mode == "dcp":
        first, restored_step = _dcp_restore(param, optimizer)
    elif mode == "disk" and attempt > 0:
        if rank == 0:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        dist.barrier()
        saved = torch.load(folder / f"ckpt-{rank}.pt", weights_only=True)
        with torch.no_grad():
            param.copy_(saved["param"])
        optimizer.load_state_dict(saved["optimizer"])
        first, restored_step = saved["data"], saved["step"]
    restored_at = time.time()
    ran_from = time.perf_counter()
    for step in range(first, steps):
        if attempt == 0 and rank == kill_rank and step == kill_step:
            (folder / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        param.grad = torch.full_like(param, 1e-3 * (step + 1))
        dist.all_reduce(param.grad)
        optimizer.step()
        if step == first and attempt > 0:
            record = {
                "started": started,
                "built": built,
                "restored": restored_at,
                "first_step": time.time(),
                "restored_step": restored_step,
                "first": first,
            }
            (folder / f"resumed-{rank}").write_text(json.dumps(record))
        if (step + 1) % every == 0 and mode == "memory":
            from orchestrator import snapshot

            snapshot.save(step, state, data=step + 1)
        elif (step + 1) % every == 0 and mode == "dcp":
            import torch.distributed.checkpoint as dcp

            from orchestrator import snapshot

            held = {"param": param, "optimizer": optimizer.state_dict()}
            dcp.save(held, storage_writer=snapshot.writer(step, data=step + 1))
        elif (step + 1) % every == 0 and mode == "disk":
            saved = {"param": param.detach(), "optimizer": optimizer.state_dict()}
            torch.save({**saved, "step": step, "data": step + 1}, folder / f"ckpt-{rank}.tmp")
            os.replace(folder / f"ckpt-{rank}.tmp", folder / f"ckpt-{rank}.pt")
    rate = (steps - first) / (time.perf_counter() - ran_from)
    dist.destroy_process_group()
    return {"steps_per_s": rate}


def _dcp_restore(param: Any, optimizer: Any) -> tuple[int, int | None]:
    """Load the snapshot through dcp.load, in place: (the first step to run, the step
    restored or None)."""
    import torch.distributed.checkpoint as dcp

    from orchestrator import snapshot

    reader = snapshot.reader()
    if reader is None:
        return 0, None
    held = {"param": param, "optimizer": optimizer.state_dict()}
    dcp.load(held, storage_reader=reader)
    optimizer.load_state_dict(held["optimizer"])
    return reader.data, reader.step


def _init(attempt: int) -> None:
    """torchrun's workers: a store prefix per attempt (torchrun keeps its store across
    restarts, and attempt 1's gloo would read attempt 0's dead peers' addresses)."""
    import torch.distributed as dist

    master = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    store = dist.PrefixStore(f"attempt-{attempt}", master)
    dist.init_process_group(
        "gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


if __name__ == "__main__":
    out, state_mb, steps, every, mode, kill_step, kill_rank = sys.argv[1:8]
    train(out, int(state_mb), int(steps), int(every), mode, int(kill_step), int(kill_rank))
