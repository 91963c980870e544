"""The rank side's uses of Ray's and torch's private parts, in one place.

As in `orchestrator/_ray_compat.py`: each touch checks the private part's shape first,
falls back to a named degraded mode, and records why in `degraded()`;
`tests/test_compat.py` fails when an upgrade makes one fall back.
"""

from __future__ import annotations

import contextlib
from typing import Any

_degraded: dict[str, str] = {}


def degraded() -> dict[str, str]:
    """The touches that fell back in this process, with why: {} when all work."""
    return dict(_degraded)


def job_states() -> dict[str, bool] | None:
    """Every Ray job of the cluster: hex id -> still running; None when Ray cannot tell.

    Asked of this worker's GCS client (no public API tells it). Degraded (None): the
    local runtime's spares end with their pool only, not also when their driver's job is
    gone.
    """
    try:
        import ray

        gcs: Any = ray._private.worker.global_worker.gcs_client
        get_all = gcs.get_all_job_info
    except AttributeError as exc:
        _degraded.setdefault("job_states", str(exc))
        return None
    try:
        try:  # without these, the GCS asks every running driver about its tasks each time
            jobs = get_all(skip_submission_job_info_field=True, skip_is_running_tasks_field=True)
        except TypeError:
            jobs = get_all()
        return {job_id.hex(): not info.is_dead for job_id, info in jobs.items()}
    except Exception:  # noqa: BLE001 - the GCS did not answer this time
        return None


def reset_group_counter() -> None:
    """After the default process group is gone, have torch name the next unnamed group "0".

    torch names an unnamed group after a counter that only destroying the default group
    resets. An init_process_group that failed half-way (a peer died while the group
    connected) leaves it advanced: this process would name its next group "1" while a
    fresh peer names it "0", and both would wait for each other for ever. Degraded: a
    restart that reuses this process after such a failure may hang until its timeout.
    """
    import torch.distributed as dist

    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    if world is None or not hasattr(world, "group_count"):
        _degraded.setdefault("reset_group_counter", "torch's _world.group_count is gone")
        return
    if not dist.is_initialized():
        with contextlib.suppress(Exception):
            world.group_count = 0
