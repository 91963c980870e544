"""examples/checkpoint_resume.py: after an injected crash, max_restarts resumes from the
last checkpoint and ends with bit for bit the model of an uninterrupted run."""

from __future__ import annotations

import torch

from examples.checkpoint_resume import digest, latest_checkpoint, train
from orchestrator import distribute
from tests.helpers import wait_resources_back


def test_a_crashed_run_resumes_and_ends_with_the_uninterrupted_model(cluster, tmp_path):
    fn = distribute(
        train,
        num_replicas=4,
        replicas_per_node=2,
        gpus_per_replica=0,
        max_restarts=1,
        name="ckpt",
        log_dir=False,
    )
    try:
        plain = fn(str(tmp_path / "plain"), steps=20, every=5, backend="gloo")
        job = fn.submit(
            str(tmp_path / "crashed"), steps=20, every=5, crash_at_step=13, backend="gloo"
        )
        crashed = job.result(timeout=180)
    finally:
        fn.shutdown()

    assert [r["rank"] for r in crashed] == [0, 1, 2, 3]
    assert [(r["restart_count"], r["resumed_from"]) for r in plain] == [(0, 0)] * 4
    # Rank 3 died before step 13 on attempt 0; attempt 1 resumed from the step-10 checkpoint.
    assert [(r["restart_count"], r["resumed_from"]) for r in crashed] == [(1, 10)] * 4
    assert job.status().restarts == 1

    reference = plain[0]["params"]
    for result in [*plain, *crashed]:
        assert result["params"].keys() == reference.keys()
        for name, tensor in result["params"].items():
            assert torch.equal(tensor, reference[name]), (result["rank"], name)
        assert result["digest"] == digest(reference)
    for run in ("plain", "crashed"):
        last = latest_checkpoint(tmp_path / run)
        assert last is not None and last.name == "step-00000020.pt"
        saved = torch.load(last, weights_only=True)
        assert saved["step"] == 20
        for name, tensor in saved["model"].items():
            assert torch.equal(tensor, reference[name]), (run, name)
        assert not list((tmp_path / run).glob(".*.tmp"))  # temporary files were renamed
    wait_resources_back()
