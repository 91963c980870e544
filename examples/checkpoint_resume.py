"""Checkpoint and resume: a DDP training loop that survives a crash through max_restarts.

    python examples/checkpoint_resume.py --checkpoint-dir /tmp/ckpt --steps 20 --every 5 \
        --crash-at-step 13

Rank 0 saves a checkpoint (model, optimizer, step) every `--every` steps, atomically (a
temporary file, then os.replace). On start, every rank loads the latest checkpoint in the
folder, if there is one, and continues from its step. `--crash-at-step S` makes the last
rank SIGKILL itself before step S on the first attempt only (RESTART_COUNT == "0"):
distribute(..., max_restarts=1) then restarts every rank, which resume from the last
checkpoint and end with exactly the model an uninterrupted run ends with.

Determinism: every random number comes from a generator seeded with (seed, step, rank),
so a resumed run sees the same batches as an uninterrupted one and no global RNG state
needs saving. The folder must be shared by all nodes (one machine, NFS, a mounted bucket).
Without a Ray cluster (no --address, no RAY_ADDRESS) the ranks run on an embedded local
Ray instance.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

_CHECKPOINT = re.compile(r"^step-(\d{8})\.pt$")
_IN, _HIDDEN = 10, 16


def make_model(seed: int) -> torch.nn.Module:
    """A small MLP, initialised from `seed` (the same on every rank and every attempt)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(_IN, _HIDDEN), torch.nn.ReLU(), torch.nn.Linear(_HIDDEN, 1)
    )


def batch(seed: int, step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `rank` at `step`: a function of (seed, step, rank) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_000_007 + rank * 1_000_003 + step)
    x = torch.randn(size, _IN, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(size, 1, generator=gen)
    return x, y


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step in `folder`, or None."""
    found = [
        (int(m.group(1)), entry)
        for entry in Path(folder).glob("step-*.pt")
        if (m := _CHECKPOINT.match(entry.name))
    ]
    return max(found)[1] if found else None


def save_checkpoint(folder: str | os.PathLike[str], state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as step-NNNNNNNN.pt atomically (temporary file, then os.replace)."""
    final = Path(folder) / f"step-{state['step']:08d}.pt"
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, final)  # readers see the old set of files or the complete new one
    old = sorted(p for p in Path(folder).glob("step-*.pt") if _CHECKPOINT.match(p.name))
    for stale in old[:-keep]:
        stale.unlink(missing_ok=True)
    return final


def train(
    checkpoint_dir: str,
    *,
    steps: int = 20,
    every: int = 5,
    crash_at_step: int | None = None,
    seed: int = 0,
    backend: str | None = None,
) -> dict[str, Any]:
    """Train for `steps` steps from the latest checkpoint; return this rank's final state."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("RESTART_COUNT", "0"))
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    base = make_model(seed).to(device)
    optimizer = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)

    # Resume: rank 0 picks the checkpoint, so that every rank loads the same one.
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    chosen = [str(latest_checkpoint(checkpoint_dir) or "") if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    start = 0
    if chosen[0]:
        state = torch.load(chosen[0], map_location=device, weights_only=True)
        base.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"rank {rank} attempt {attempt}: resumed from {chosen[0]} (step {start})")
    # DDP regroups its gradient buckets after its first iteration, which changes the order
    # of the sums in the all-reduce: a resumed run (first iteration at its resume step)
    # would drift from an uninterrupted one in the last bits. find_unused_parameters=True
    # keeps the first layout for good, so both runs compute bit for bit the same thing.
    model = DDP(
        base,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=True,
    )

    loss = torch.zeros((), device=device)
    for step in range(start, steps):
        if crash_at_step == step and attempt == 0 and rank == world - 1:
            print(f"rank {rank}: crashing at step {step} (attempt {attempt})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = (t.to(device) for t in batch(seed, step, rank))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP averages the gradients of all ranks here
        optimizer.step()
        done = step + 1
        if rank == 0 and (done % every == 0 or done == steps):
            state = {"model": base.state_dict(), "optimizer": optimizer.state_dict(), "step": done}
            path = save_checkpoint(checkpoint_dir, state)
            print(f"step {done}: loss {loss.item():.6f}, saved {path.name}")

    dist.destroy_process_group()
    params = {name: t.detach().cpu().clone() for name, t in base.state_dict().items()}
    return {
        "rank": rank,
        "restart_count": attempt,
        "resumed_from": start,
        "loss": loss.item(),
        "params": params,
        "digest": digest(params),
    }


def digest(params: dict[str, torch.Tensor]) -> str:
    """A short hash of the parameters' exact bytes: equal digests, equal models."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run `train` on every rank with max_restarts and print where each rank resumed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-replicas", type=int, default=4)
    parser.add_argument("--replicas-per-node", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--address", default=None, help="Ray address; default: local")
    args = parser.parse_args(argv)

    from orchestrator import distribute

    job = distribute(
        train,
        num_replicas=args.num_replicas,
        replicas_per_node=args.replicas_per_node,
        max_restarts=args.max_restarts,
        address=args.address,
    )
    with job:
        results = job(
            args.checkpoint_dir,
            steps=args.steps,
            every=args.every,
            crash_at_step=args.crash_at_step,
            seed=args.seed,
        )
    for r in results:
        print(
            f"rank {r['rank']}: attempt {r['restart_count']}, resumed from step "
            f"{r['resumed_from']}, final loss {r['loss']:.6f}, params {r['digest']}"
        )
    return results


if __name__ == "__main__":
    main()
