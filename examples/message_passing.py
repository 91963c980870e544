"""The multi-node guide's message passing example: rank 0 sends a tensor to every other rank.

Under a launcher (RANK, WORLD_SIZE and LOCAL_RANK set in the environment):

    torchrun --standalone --nproc_per_node=4 examples/message_passing.py --backend=gloo

Or from one plain process, each rank an actor of a Ray cluster (embedded locally
when there is none):

    python examples/message_passing.py --num-replicas 4 --replicas-per-node 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def default_backend() -> str:
    """nccl when this process sees a GPU, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_processes(backend: str) -> None:
    """Join the process group described by RANK and WORLD_SIZE (set by the launcher)."""
    dist.init_process_group(
        backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


def run(backend: str | None = None) -> float:
    """Rank 0 sends a tensor holding 1.0 to every other rank; return this rank's value.

    Joins (and afterwards leaves) the process group unless one is already initialized.
    """
    backend = backend or default_backend()
    # Read when called, not at import: under distribute() the module is imported by
    # the driver, and the variables exist only in each rank's process.
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    world_rank = int(os.environ["RANK"])
    owns_group = not dist.is_initialized()
    if owns_group:
        init_processes(backend)
    try:
        tensor = torch.zeros(1)
        # Need to put tensor on a GPU device for nccl backend
        if backend == "nccl":
            device = torch.device(f"cuda:{local_rank}")
            tensor = tensor.to(device)

        if world_rank == 0:
            tensor += 1
            for rank_recv in range(1, world_size):
                dist.send(tensor=tensor, dst=rank_recv)
                print(f"worker_0 sent data to Rank {rank_recv}", flush=True)
        else:
            dist.recv(tensor=tensor, src=0)
            print(f"worker_{world_rank} has received data from rank 0", flush=True)
        if owns_group:  # no rank leaves while a slower one still connects to it
            dist.barrier()
        return tensor.item()
    finally:
        if owns_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[float]:
    """Run the example under a launcher (RANK set) or through distribute()."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        help="Local rank. Necessary for using the torch.distributed.launch utility.",
    )
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on GPU")
    parser.add_argument(
        "--distribute",
        action="store_true",
        help="run through distribute() even if launched by torchrun (default when RANK is unset)",
    )
    parser.add_argument("--num-replicas", type=int, default=4)
    parser.add_argument("--replicas-per-node", type=int, default=2)
    parser.add_argument("--address", default=None, help="Ray address; default: local")
    args = parser.parse_args(argv)

    if args.local_rank is not None:  # torch.distributed.launch without --use-env
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if "RANK" in os.environ and not args.distribute:
        return [run(args.backend)]

    from orchestrator import distribute

    with distribute(
        run,
        num_replicas=args.num_replicas,
        replicas_per_node=args.replicas_per_node,
        address=args.address,
        name="message_passing",
    ) as send_recv:
        return send_recv(args.backend)


if __name__ == "__main__":
    main()
