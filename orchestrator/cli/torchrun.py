"""torchrun's command line, spoken by `orchestrator run`: its options, their meaning here.

`torchrun --nnodes 2 --nproc-per-node 2 train.py` becomes `orchestrator run --nnodes 2
--nproc-per-node 2 train.py`. One invocation launches every node (torchrun runs once per
node), so the rendezvous options are accepted and said to be unneeded, and a
`--node-rank` other than 0 is refused with why.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator import placement
from orchestrator.connect.cluster import ClusterNode
from orchestrator.errors import LayoutError

SYMBOLIC = ("gpu", "cpu", "auto")
"""--nproc-per-node words, resolved against the nodes of the cluster that runs the job."""
UNNEEDED = ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf")
"""torchrun options that have no use here: rank 0's address and port are found, not given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's options, each in its dash and underscore spellings."""

    def both(name: str, **kwargs: Any) -> None:
        spellings = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
        parser.add_argument(*spellings, dest=name.replace("-", "_"), **kwargs)

    both("nnodes", metavar="N", help="nodes, as torchrun's --nnodes (N, or N:N; not a range)")
    both(
        "nproc-per-node",
        metavar="N",
        help="ranks per node: a number, or gpu (a node's GPUs), cpu (its CPUs) or auto",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="run here, on an embedded Ray instance, whatever RAY_ADDRESS says",
    )
    both("node-rank", type=int, metavar="N", help=argparse.SUPPRESS)
    for name in UNNEEDED:
        both(name.replace("_", "-"), metavar="VALUE", help=argparse.SUPPRESS)


@dataclass(frozen=True)
class Layout:
    """How many ranks, and how many per node (None: the default layout)."""

    nproc: int
    per_node: int | None


def parse_nnodes(text: str) -> int:
    """--nnodes N or N:N as N; an elastic MIN:MAX range is refused with what to use."""
    low, colon, high = text.partition(":")
    try:
        nodes = int(low)
        if colon and int(high) != nodes:
            raise LayoutError(
                f"--nnodes {text}: an elastic range of nodes is not supported (one command "
                "launches every node of the job); give a fixed count such as --nnodes "
                f"{high}, and --max-restarts N to restart the job when a rank or node fails"
            )
    except ValueError as exc:
        if isinstance(exc, LayoutError):
            raise
        raise LayoutError(f"--nnodes {text}: give a number of nodes, e.g. --nnodes 2") from None
    if nodes < 1:
        raise LayoutError(f"--nnodes {text}: must be at least 1")
    return nodes


def per_node_for(given: str, nodes: Sequence[ClusterNode], *, one_machine: bool) -> int:
    """--nproc-per-node `given` as a number, against the nodes of the cluster that runs the job.

    gpu: the GPUs of a node, as Ray reports them (the fewest, where nodes differ); cpu: its
    CPUs (this machine's cores when the job runs here); auto: gpu where there are any.
    """
    if given.isdigit():
        return int(given)
    if given not in SYMBOLIC:
        raise LayoutError(
            f"--nproc-per-node {given}: give a number of ranks per node, or gpu, cpu or auto"
        )
    gpus = [n.resources.get("GPU", 0) for n in nodes if n.resources.get("GPU", 0) >= 1]
    if given == "gpu" or (given == "auto" and gpus):
        if not gpus:
            raise LayoutError(
                "--nproc-per-node gpu: the cluster's nodes have no GPUs; give a number, or cpu"
            )
        return int(min(gpus))
    if one_machine:
        return os.cpu_count() or 1
    return max(1, int(min(n.resources.get("CPU", 0) for n in nodes)))


def layout(
    nproc: int | None, per_node: int | None, nnodes: int | None, nproc_per_node: int | None
) -> Layout:
    """The job's layout from --nproc/--per-node and torchrun's --nnodes/--nproc-per-node.

    Given together, they must agree. torchrun's defaults: one node, one rank per node.
    """
    if per_node is not None and nproc_per_node is not None and per_node != nproc_per_node:
        raise LayoutError(
            f"--per-node {per_node} and --nproc-per-node {nproc_per_node} disagree: give one"
        )
    per = per_node if per_node is not None else nproc_per_node
    if per is not None and per < 1:
        raise LayoutError(f"--nproc-per-node {per}: must be at least 1")
    if nnodes is None:
        if nproc is None:
            return Layout(per or 1, per or 1)
        return Layout(nproc, per)
    if per is None:
        if nproc is None:
            return Layout(nnodes, 1)
        if nproc % nnodes:
            raise LayoutError(
                f"--nproc {nproc} ranks cannot be spread evenly over --nnodes {nnodes}; "
                f"valid --nnodes: {placement.valid_per_node(nproc)}"
            )
        return Layout(nproc, nproc // nnodes)
    total = nnodes * per
    if nproc is not None and nproc != total:
        raise LayoutError(
            f"--nproc {nproc} disagrees with --nnodes {nnodes} x --nproc-per-node {per} "
            f"({total} ranks): give one or the other"
        )
    return Layout(total, per)


def unneeded(args: argparse.Namespace) -> list[str]:
    """The torchrun options given that have no use here, as typed (e.g. '--master-port')."""
    return [f"--{name.replace('_', '-')}" for name in UNNEEDED if getattr(args, name, None)]
