"""DDP ResNet training (the multi-node guide's ResNet example) on synthetic data or CIFAR10.

From one plain process, each rank an actor of a Ray cluster (embedded locally when
there is none):

    python examples/resnet.py --arch resnet18 --batch_size 8 --steps 3 --num-replicas 2

Under a launcher (RANK set in the environment) the same `train()` runs in place:

    torchrun --standalone --nproc_per_node=2 examples/resnet.py --batch_size 8 --steps 3

Synthetic images are the default; `--data DIR` trains on the CIFAR10 copy already in
DIR (nothing is downloaded). Rank 0 prints the job's images/s; every rank returns it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ARCHS = ("resnet18", "resnet50", "resnet101", "resnet152")
CIFAR10_SIZE = 50_000


class SyntheticImages(Dataset):
    """Random images and labels, each made from its index, so every rank agrees on them."""

    def __init__(self, size: int, image_size: int, num_classes: int) -> None:
        """`size` samples of shape (3, image_size, image_size), labels below `num_classes`."""
        self.size = size
        self.image_size = image_size
        self.num_classes = num_classes

    def __len__(self) -> int:
        """Number of samples."""
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index`: the same tensor and label on every call."""
        gen = torch.Generator().manual_seed(index)
        image = torch.randn(3, self.image_size, self.image_size, generator=gen)
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        return image, label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; underscore and dash spellings of each option are both accepted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18", choices=ARCHS)
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on GPU")
    parser.add_argument(
        "--use_syn", "--use-syn", action="store_true", help="synthetic data (the default)"
    )
    parser.add_argument("--data", default=None, help="folder holding CIFAR10 (not downloaded)")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=None, help="cap on steps per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of timing")
    parser.add_argument("--image-size", "--image_size", type=int, default=32)
    parser.add_argument("--num-classes", "--num_classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=0, help="data loader processes per rank")
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, help="set by torch.distributed.launch"
    )
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--replicas-per-node", type=int, default=None)
    parser.add_argument("--address", default=None, help="Ray address; default: local")
    args = parser.parse_args(argv)
    if args.data and args.use_syn:
        parser.error("--use_syn and --data exclude each other")
    for name in ("batch_size", "epochs", "image_size", "num_classes", "num_replicas"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps}: must be >= 1")
    return args


def dataset(args: argparse.Namespace, world_size: int) -> Dataset:
    """CIFAR10's training set from `args.data`, else synthetic images."""
    if args.data:
        steps = [torchvision.transforms.ToTensor()]
        if args.image_size != 32:
            steps.insert(0, torchvision.transforms.Resize(args.image_size))
        steps.append(
            torchvision.transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        )
        return torchvision.datasets.CIFAR10(
            root=args.data,
            train=True,
            download=False,
            transform=torchvision.transforms.Compose(steps),
        )
    size = CIFAR10_SIZE
    if args.steps is not None:  # no more samples than the capped epoch uses
        size = min(size, args.steps * args.batch_size * world_size)
    return SyntheticImages(size, args.image_size, args.num_classes)


def train(args: argparse.Namespace) -> float:
    """Train `args.arch` with DDP on this rank; return the job's images/s (every rank)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    dist.init_process_group(backend=backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    model = torchvision.models.get_model(args.arch, weights=None, num_classes=args.num_classes)
    model = model.to(device)
    if use_cuda:
        ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    else:
        ddp_model = DDP(model)

    train_set = dataset(args, world_size)
    sampler = DistributedSampler(dataset=train_set)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=use_cuda,
        drop_last=True,
    )
    steps = len(loader) if args.steps is None else min(args.steps, len(loader))
    if rank == 0:
        print(
            f"{args.arch}: {world_size} rank(s), {backend}, batch {args.batch_size} per rank, "
            f"{steps} step(s) x {args.epochs} epoch(s), "
            f"{'CIFAR10' if args.data else 'synthetic'} {args.image_size}px",
            flush=True,
        )
    images, elapsed = fit(ddp_model, loader, steps, args, device)

    # The job's throughput: every rank's images over the slowest rank's time.
    images_sum = torch.tensor([float(images)], dtype=torch.float64, device=device)
    dist.all_reduce(images_sum, op=dist.ReduceOp.SUM)
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    images_per_s = images_sum.item() / max(slowest.item(), 1e-9)
    if rank == 0:
        print(
            f"Throughput: {images_per_s:.1f} images/s "
            f"({images_per_s / world_size:.1f} per rank, {int(images_sum.item())} images "
            f"in {slowest.item():.2f} s)",
            flush=True,
        )
    dist.destroy_process_group()
    return images_per_s


def fit(
    model: torch.nn.Module,
    loader: DataLoader,
    steps: int,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[int, float]:
    """Train for `args.epochs` epochs of `steps` steps; (images timed, seconds) on this rank.

    The first `args.warmup` steps (allocation, first collectives) are not timed.
    """
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    model.train()
    step = timed = 0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss = torch.zeros((), device=device)
        for i, (cpu_images, cpu_labels) in enumerate(loader):
            if i >= steps:
                break
            if step == args.warmup:
                _synchronize(device)
                started, timed = time.perf_counter(), 0
            images = cpu_images.to(device, non_blocking=True)
            labels = cpu_labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            timed += images.shape[0]
        if dist.get_rank() == 0:
            print(f"Epoch {epoch}: loss {loss.item():.4f}", flush=True)
    _synchronize(device)
    return timed, time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> list[float]:
    """Train under a launcher when RANK is set, else through distribute()."""
    args = parse_args(argv)
    if "RANK" in os.environ:
        if args.local_rank is not None:  # torch.distributed.launch without --use-env
            os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
        return [train(args)]

    from orchestrator import distribute

    with distribute(
        train,
        num_replicas=args.num_replicas,
        replicas_per_node=args.replicas_per_node,
        address=args.address,
        name="resnet",
    ) as run:
        results = run(args)
    print(f"images/s by rank: {', '.join(f'{r:.1f}' for r in results)}")
    return results


if __name__ == "__main__":
    main()
