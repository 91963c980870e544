"""torch in a rank's process: imported ahead of need, and no process group left between calls."""

from __future__ import annotations

import contextlib
import gc
import sys

from orchestrator_workers import _compat, snapshot


def import_torch() -> None:
    """Import torch.distributed ahead of need (CUDA is not initialized by the import).

    Before any call runs (the pool's start waits for it): without garbage collections,
    which cost ~15% of its CPU and find little (~7,000 objects, under a megabyte, that
    now stay); then what it made is kept out of every later collection (`gc.freeze`:
    torch's objects live as long as the rank), so the user's function pays for its own
    objects only, and the data loader workers it forks do not copy the pages that
    collections would touch.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        with contextlib.suppress(BaseException):  # the first call imports it again, reports
            import torch.distributed  # noqa: F401
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def leave() -> None:
    """Leave no process group behind, so that the next call's init matches its peers'."""
    snapshot.leave()
    if "torch.distributed" not in sys.modules:
        return  # never imported: no group to leave (and no torch to load for nothing)
    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a broken group is discarded either way
            dist.destroy_process_group()
    _compat.reset_group_counter()
