"""The Runhouse multi-node example: a Linear(10, 1) trained with DDP on every rank.

    python examples/linear_ddp.py --num-replicas 4 --replicas-per-node 2 --epochs 10

Without a Ray cluster (no --address, no RAY_ADDRESS) the ranks run on an embedded
local Ray instance, laid out as simulated nodes.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def train_loop(epochs: int) -> float:
    """Train a DDP-wrapped Linear(10, 1) for `epochs` steps; return this rank's last loss."""
    # Initialize the distributed training environment (RANK, WORLD_SIZE, MASTER_ADDR
    # and MASTER_PORT come from the environment), per
    # https://pytorch.org/docs/stable/distributed.html#initialization
    use_cuda = torch.cuda.is_available()
    torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = torch.distributed.get_rank()
    print(f"Rank {rank} of {torch.distributed.get_world_size()} initialized")

    # Create a simple model and optimizer
    if use_cuda:
        device_id = rank % torch.cuda.device_count()
        device = torch.device("cuda", device_id)
        model = DDP(torch.nn.Linear(10, 1).to(device), device_ids=[device_id])
    else:
        device = torch.device("cpu")
        model = DDP(torch.nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    # Perform a simple training loop
    loss = torch.zeros(())
    for epoch in range(epochs):
        optimizer.zero_grad()
        output = model(torch.randn(10, device=device))
        loss = output.sum()
        loss.backward()
        optimizer.step()

        print(f"Rank {rank}: Epoch {epoch}, Loss {loss.item()}")

    # Clean up the distributed training environment
    torch.distributed.destroy_process_group()
    return loss.item()


def main(argv: list[str] | None = None) -> list[float]:
    """Run `train_loop` on every rank and print each rank's final loss."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-replicas", type=int, default=4)
    parser.add_argument("--replicas-per-node", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--address", default=None, help="Ray address; default: local")
    args = parser.parse_args(argv)

    from orchestrator import distribute

    train_ddp = distribute(
        train_loop,
        num_replicas=args.num_replicas,
        replicas_per_node=args.replicas_per_node,
        address=args.address,
    )
    with train_ddp:
        losses = train_ddp(epochs=args.epochs)
    for rank, loss in enumerate(losses):
        print(f"rank {rank}: final loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
