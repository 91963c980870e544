"""A rank loads torch only when its job uses it: a rank-only job costs what a Ray actor does.

The driver looks at what it ships: a function or arguments that name torch (or tensors, or
a torchrun script) have the ranks import torch as they start, ahead of need; others never
import it, and the rendezvous store is made only when a rank connects to it.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

from orchestrator import distribute, testing
from tests.helpers import wait_resources_back


def TORCH() -> str:
    """torch's name, spelled so that no pickle of a function using it holds the name."""
    return "".join(["tor", "ch"])


def test_a_job_that_does_not_use_torch_never_loads_it(cluster):
    def where() -> tuple[bool, int]:
        return TORCH() in sys.modules, os.getpid()

    fn = distribute(where, num_replicas=2, replicas_per_node=1, gpus_per_replica=0)
    try:
        first, again = fn(), fn()
        assert [loaded for loaded, _ in first + again] == [False] * 4, (first, again)
        assert [pid for _, pid in first] == [pid for _, pid in again]  # the same warm ranks
    finally:
        fn.shutdown()
    wait_resources_back()


def test_a_job_that_reaches_torch_unseen_still_rendezvous(cluster):
    """The driver cannot see torch here (no name of it in the pickle): the ranks load it in
    the call, and rank 0's store is made when the first rank connects."""

    def all_reduce() -> tuple[bool, float]:
        loaded = TORCH() in sys.modules
        tor = importlib.import_module(TORCH())
        dist = importlib.import_module(TORCH() + ".distributed")
        dist.init_process_group("gloo")
        value = tor.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(value)
        dist.destroy_process_group()
        return loaded, float(value)

    fn = distribute(all_reduce, num_replicas=2, replicas_per_node=1, gpus_per_replica=0)
    try:
        assert fn() == [(False, 3.0), (False, 3.0)]
        assert [total for _, total in fn()] == [3.0, 3.0]  # and again, with a new store
    finally:
        fn.shutdown()
    wait_resources_back()


def test_a_job_that_names_torch_loads_it_as_its_ranks_start(cluster):
    """...and keeps what the import made out of the ranks' garbage collections, which
    stay on for the user's objects. Still, a call that never rendezvous makes no store:
    made at each call, torch's client (the store's own) waited 5 s to connect in every ~25
    made quickly in one process, so a loop of quick calls paid 5 s every ~28 calls."""

    def started_loading() -> tuple[bool, bool, int]:
        loaded = "torch" in sys.modules  # before this function's own import below
        import torch

        loaded = loaded and torch.ones(1).item() == 1.0
        return loaded, gc.isenabled(), gc.get_freeze_count()

    fn = distribute(started_loading, num_replicas=2, replicas_per_node=1, gpus_per_replica=0)
    try:
        outcomes = fn()
        assert [(loaded, collecting) for loaded, collecting, _ in outcomes] == [(True, True)] * 2
        assert min(frozen for *_, frozen in outcomes) > 100_000, outcomes
        job = fn.submit()
        job.result(timeout=60)
        assert testing.store_open(job) is False  # rank 0 made no store
    finally:
        fn.shutdown()
    wait_resources_back()


def test_what_the_driver_counts_as_using_torch():
    """What ships decides it: torch's own objects, code that imports it, an installed
    library's function that imported it, tensors, a torchrun script; nothing else."""
    import torch
    import torchvision

    from orchestrator import shipping
    from orchestrator_workers.script import Script

    def plain(x: int) -> int:
        return x + 1

    def imports_it() -> int:
        import torch as t

        return int(t.ones(1).item())

    def nested() -> int:
        def inner() -> float:
            return torch.zeros(1).sum().item()

        return int(inner())

    def uses(fn, *args) -> bool:
        return shipping.pack(fn, args, {})[1]

    assert not uses(plain, 1)
    assert not uses(os.getpid)
    assert uses(imports_it)
    assert uses(nested)
    assert uses(plain, torch.ones(3))  # a tensor argument
    assert uses(len, [torch.nn.Linear(2, 2)])  # a module of torch's, by reference
    assert uses(torchvision.models.resnet18)  # an installed library that imported torch
    assert uses(print, Script("train.py"))  # orchestrator run's torchrun scripts
