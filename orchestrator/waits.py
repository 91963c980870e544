"""Waiting on Ray's object refs: as Ray counts a wait's time, with no request for nothing."""

from __future__ import annotations

import math

import ray


def ready(
    refs: list[ray.ObjectRef], wait_s: float | None, more_of: list[ray.ObjectRef] | None = None
) -> list[ray.ObjectRef]:
    """Wait up to `wait_s` for one of `refs`, then take the others of `more_of` (default:
    all) ready too; no request made for nothing (through Ray Client, each is a trip)."""
    if wait_s is not None and wait_s <= 0:
        return ray.wait(refs, num_returns=len(refs), timeout=0)[0]
    done, rest = ray.wait(refs, num_returns=1, timeout=whole_ms(wait_s))
    rest = rest if more_of is None else [r for r in rest if r in more_of]
    if done and rest:
        done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
    return done


def whole_ms(wait_s: float | None) -> float | None:
    """`wait_s` rounded up to Ray's whole milliseconds: Ray drops the rest, and a loop
    waiting the 0.4 ms left to a deadline came back at once, a dozen times over."""
    return None if wait_s is None else math.ceil(wait_s * 1000 - 1e-9) / 1000 + 1e-7
