"""Recover at the same step, from memory: an FSDP2 loop whose lost rank resumes from its
peers' copy of its shards, with no disk.

    python examples/fsdp_snapshot.py --steps 50 --every 10 --crash-at-step 37

Every `--every` steps each rank snapshots its shards, its optimizer's and its RNG states
with `dcp.save(..., storage_writer=snapshot.writer(step))`: into its own memory and into a
buddy rank's, on another node where there is one. `--crash-at-step S` makes the last rank
SIGKILL itself at step S on the first attempt; distribute(..., max_restarts=1) replaces
it and keeps the other ranks' processes, and every rank resumes from step 29's snapshot
(`dcp.load(..., storage_reader=snapshot.reader())`), the replaced rank from its buddy's
copy. The run ends with exactly the weights of one that never failed. Each batch is made
from its step number; dropout draws from the global RNG, which the snapshot sets back.
FSDP2 on gloo runs on CPUs; on GPUs pass --backend nccl.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful


class AppState(Stateful):
    """The model and its optimizer as one sharded state dict, as dcp's tutorials write it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        """The model's and the optimizer's state dicts, each rank's shards."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load both back, in their sharding."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


def train(
    steps: int = 50, every: int = 10, crash_at_step: int | None = None, backend: str = "gloo"
) -> dict[str, Any]:
    """Train for `steps` steps, from the newest snapshot if there is one: this rank's
    full weights at the end, where it resumed, and its process id."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orchestrator import snapshot

    rank, attempt = int(os.environ["RANK"]), int(os.environ["RESTART_COUNT"])
    dist.init_process_group(backend)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    ).to(device)
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"app": AppState(model, optimizer)}
    torch.manual_seed(100 + rank)  # each rank's own dropout
    reader = snapshot.reader()  # None on a fresh start
    if reader is not None:
        dcp.load(state, storage_reader=reader)
    start = 0 if reader is None else reader.data
    for step in range(start, steps):
        if attempt == 0 and rank == dist.get_world_size() - 1 and step == crash_at_step:
            print(f"rank {rank}: crashing at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        data = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 8, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % every == 0:
            dcp.save(state, storage_writer=snapshot.writer(step, data=step + 1))
    weights = {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}
    dist.destroy_process_group()
    resumed = None if reader is None else (reader.step, reader.data, reader.source)
    return {"resumed": resumed, "weights": weights, "pid": os.getpid(), "loss": loss.item()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run `train` on every rank with max_restarts and say where each rank resumed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--replicas-per-node", type=int, default=1)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--address", default=None, help="Ray address; default: local")
    args = parser.parse_args(argv)

    from orchestrator import distribute

    fn = distribute(
        train,
        num_replicas=args.num_replicas,
        replicas_per_node=args.replicas_per_node,
        gpus_per_replica=1 if args.backend == "nccl" else 0,
        max_restarts=1,
        address=args.address,
    )
    with fn:
        results = fn(args.steps, args.every, args.crash_at_step, args.backend)
    for rank, result in enumerate(results):
        resumed = result["resumed"]
        where = (
            "a fresh start"
            if resumed is None
            else (
                f"step {resumed[0]} from "
                + ("its own copy" if resumed[2] == "own" else f"{resumed[2]}'s copy")
            )
        )
        print(f"rank {rank}: {where}, final loss {result['loss']:.6f}")
    return results


if __name__ == "__main__":
    main()
