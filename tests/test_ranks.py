"""Where ranks run and what they see: the layout over nodes and GPUs, what a cluster cannot
hold, torchrun's environment variables, and the results in rank order."""

from __future__ import annotations

import os
import time

import pytest
import ray

from orchestrator import PlacementError, distribute, placement
from orchestrator_workers import environment
from orchestrator_workers.protocol import RankSpec
from tests.helpers import GPUS_PER_NODE, wait_resources_back

# --- the layout, without Ray -------------------------------------------------------------


def test_layout_is_contiguous_per_node():
    slots = placement.layout(6, 3)
    assert [(s.rank, s.node_rank, s.local_rank) for s in slots] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 0),
        (4, 1, 1),
        (5, 1, 2),
    ]


def test_bundles_ordered_with_driver_node_first():
    assert placement.order_bundles({0: "b", 1: "a", 2: "c"}, "a") == [1, 0, 2]
    assert placement.order_bundles({0: "b", 1: "c"}, "elsewhere") == [0, 1]


def test_default_replicas_per_node_follows_gpus():
    nodes = [{"GPU": 8.0}, {"GPU": 8.0}]
    assert placement.default_replicas_per_node(16, 1, nodes) == 8
    assert placement.default_replicas_per_node(12, 1, nodes) == 6  # largest divisor that fits
    assert placement.default_replicas_per_node(4, 2, nodes) == 4
    assert placement.default_replicas_per_node(4, 0, [{"CPU": 2.0}]) == 4  # CPU-only: one node


def test_request_bundle_scales_per_node():
    req = placement.Request(
        4, 2, cpus_per_replica=1, gpus_per_replica=1, resources_per_replica={"nvlink": 1}
    )
    assert req.num_nodes == 2
    assert req.per_replica() == {"CPU": 1, "GPU": 1, "nvlink": 1}
    assert req.bundle() == {"CPU": 2, "GPU": 2, "nvlink": 2}


def test_infeasible_request_lists_the_nodes_and_what_is_valid():
    req = placement.Request(6, 3, cpus_per_replica=1, gpus_per_replica=1)
    nodes = [("10.0.0.1", {"CPU": 8.0, "GPU": 2.0}), ("10.0.0.2", {"CPU": 8.0, "GPU": 2.0})]
    with pytest.raises(PlacementError) as info:
        placement.check_feasible(req, nodes, one_node=False)
    text = str(info.value)
    assert "10.0.0.1: {CPU: 8, GPU: 2}" in text
    assert "10.0.0.2: {CPU: 8, GPU: 2}" in text
    assert "replicas_per_node <= 2" in text
    placement.check_feasible(placement.Request(4, 2, 1, 1), nodes, one_node=False)


def test_simulated_nodes_must_fit_on_one_node():
    nodes = [("127.0.0.1", {"CPU": 4.0})]
    placement.check_feasible(placement.Request(4, 2, 1, 0), nodes, one_node=True)
    with pytest.raises(PlacementError, match="simulated"):
        placement.check_feasible(placement.Request(8, 2, 1, 0), nodes, one_node=True)


# --- a rank's environment, without Ray ----------------------------------------------------


def _spec(**kw):
    base = dict(
        job_name="j",
        rank=3,
        local_rank=1,
        node_rank=1,
        world_size=4,
        local_world_size=2,
        num_nodes=2,
        master_addr="10.1.2.3",
        master_port=29500,
        ranks_on_node=2,
    )
    base.update(kw)
    return RankSpec(**base)


def test_rank_env_matches_torchrun():
    env = environment.rank_env(_spec(interface="eth7", cuda_visible_devices=("4", "6")))
    assert env["RANK"] == "3"
    assert env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.1.2.3"
    assert env["MASTER_PORT"] == "29500"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth7"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # No rank returns from init_process_group before every rank's group is built (a rank
    # leaving its group at once broke a slower peer's gloo mesh); the user's env= wins.
    assert env["TORCH_DIST_INIT_BARRIER"] == "1"
    mine = environment.rank_env(_spec(env={"TORCH_DIST_INIT_BARRIER": "0"}))
    assert mine["TORCH_DIST_INIT_BARRIER"] == "0"


def test_threads_follow_torchrun_unless_the_rank_reserved_more_cpus():
    cores = environment.physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    # Several ranks on a node: one thread each (torchrun), or the CPUs each reserved.
    assert environment.default_threads(_spec(ranks_on_node=2)) == 1
    assert environment.default_threads(_spec(ranks_on_node=2, cpus=4)) == 4
    assert environment.default_threads(_spec(ranks_on_node=2, cpus=0.5)) == 1
    # Alone on its node: torch's own default, one per physical core (more if reserved).
    assert environment.default_threads(_spec(ranks_on_node=1)) == cores
    assert environment.default_threads(_spec(ranks_on_node=1, cpus=cores + 3)) == cores + 3
    assert environment.rank_env(_spec(ranks_on_node=1))["OMP_NUM_THREADS"] == str(cores)


def test_user_env_wins_over_defaults():
    env = environment.rank_env(
        _spec(interface="eth0", env={"OMP_NUM_THREADS": "8", "GLOO_SOCKET_IFNAME": "ib0"})
    )
    assert env["OMP_NUM_THREADS"] == "8"
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_devices_put_each_local_rank_first_gpu_at_its_index():
    assert environment.order_devices([("3",), ("1",)]) == ("3", "1")
    assert environment.order_devices([("0", "1"), ("2", "3")]) == ("0", "2", "1", "3")
    assert environment.order_devices([(), ()]) == ()


def test_interface_for_loopback():
    assert environment.interface_for_ip("127.0.0.1") == "lo"
    assert environment.interface_for_ip("203.0.113.254") is None


# --- on the session's two-node cluster ----------------------------------------------------


def _report(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says {tag}")
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "GLOO_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "EXTRA",
    )
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]],
        "pid": os.getpid(),
        "sum": total.item(),
    }


def test_ranks_laid_out_by_node_with_torchrun_environment(cluster, capfd):
    with distribute(_report, num_replicas=4, replicas_per_node=2, env={"EXTRA": "x"}) as fn:
        first = fn("hello")
        second = fn("again")
        assert fn.pids() == [r["pid"] for r in first]
    out = capfd.readouterr().out

    assert [r["sum"] for r in first] == [6.0] * 4
    assert [r["env"]["RANK"] for r in first] == ["0", "1", "2", "3"]
    assert [r["env"]["LOCAL_RANK"] for r in first] == ["0", "1", "0", "1"]
    assert [r["env"]["NODE_RANK"] for r in first] == ["0", "0", "1", "1"]
    assert all(r["env"]["GROUP_RANK"] == r["env"]["NODE_RANK"] for r in first)
    assert {r["env"]["WORLD_SIZE"] for r in first} == {"4"}
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in first} == {"2"}
    assert {r["env"]["EXTRA"] for r in first} == {"x"}
    assert {r["env"]["OMP_NUM_THREADS"] for r in first} == {"1"}
    assert all(r["env"]["GLOO_SOCKET_IFNAME"] for r in first)

    # Two ranks per node, contiguous, and rank 0 on the driver's node.
    assert first[0]["node"] == first[1]["node"] != first[2]["node"] == first[3]["node"]
    assert first[0]["node"] == ray.get_runtime_context().get_node_id()
    master = {r["env"]["MASTER_ADDR"] for r in first}
    assert master == {ray.util.get_node_ip_address()}

    # Each node's ranks see all the node's GPUs of the job, their own at LOCAL_RANK.
    for r in first:
        visible = r["env"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == GPUS_PER_NODE
        assert visible[int(r["env"]["LOCAL_RANK"])] == r["gpus"][0]

    # The warm call reuses the same processes and picks a new port.
    assert [r["pid"] for r in second] == [r["pid"] for r in first]
    assert second[0]["env"]["MASTER_PORT"] != first[0]["env"]["MASTER_PORT"]
    assert [r["sum"] for r in second] == [6.0] * 4

    for rank in range(4):
        assert f"[report r{rank}] rank {rank} says hello" in out
        assert f"[report r{rank}] rank {rank} says again" in out
    wait_resources_back()


def test_gpus_per_replica_defaults_to_one_on_a_gpu_cluster(cluster):
    with distribute(lambda: os.environ["CUDA_VISIBLE_DEVICES"], num_replicas=2) as fn:
        # replicas_per_node=None: as many as a node has GPUs.
        assert fn() == ["0,1", "0,1"] or sorted(fn()[0].split(",")) == ["0", "1"]
    wait_resources_back()


def test_results_in_rank_order_even_when_ranks_finish_out_of_order(cluster):
    def slow_low_ranks() -> int:
        rank = int(os.environ["RANK"])
        time.sleep(0.3 * (3 - rank))
        return rank * 10

    with distribute(slow_low_ranks, num_replicas=4, replicas_per_node=2) as fn:
        assert fn() == [0, 10, 20, 30]


def test_infeasible_request_fails_fast_with_the_cluster_resources(cluster):
    started = time.monotonic()
    fn = distribute(lambda: 0, num_replicas=6, replicas_per_node=3, gpus_per_replica=1)
    with pytest.raises(PlacementError) as info:
        fn()
    assert time.monotonic() - started < 30  # fast: it waited for no placement
    text = str(info.value)
    assert "GPU: 2" in text
    assert "replicas_per_node <= 2" in text
    wait_resources_back()


def test_env_is_set_before_torch_is_imported(cluster):
    def debug_level() -> str:
        import torch.distributed as dist

        return str(dist.get_debug_level())  # read from the environment on import only

    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    with distribute(debug_level, num_replicas=2, replicas_per_node=1, env=env) as fn:
        assert fn() == ["DebugLevel.DETAIL"] * 2
