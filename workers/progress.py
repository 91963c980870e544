"""A rank's progress: the steps its function completes, and what it reports.

A step is a call of `optimizer.step()`, seen by torch's hook common to all optimizers
(`register_optimizer_step_post_hook`), with no change to the user's code. Where a
function steps several optimizers (a GAN's two), the steps of the first one to step in
the call are counted. Where none steps (inference, a function that updates weights by
hand, a training loop of its own such as JAX's), no step is known: the function may say
so itself with `report(step=...)`. A step is timed at once, where it ends, and its time
goes into the next record the sampler writes (`where`), within a look (0.2 s).

This is the job's step boundary: what needs to act between two steps (the elastic resize)
listens with `on_step`.

`report(**scalars)` keeps what only the function knows (loss, tokens per second, learning
rate): the newest value of each, and a running total of `samples` (so samples per second
can be worked out). It never blocks and never raises.

Counted only while a call is watched (`stall_after` set), as the sampler is.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

RECENT = 32
"""Steps kept, the newest: a record carries them all, so a reader that missed records
still sees each step's own time."""
MAX_SCALARS = 64
"""Names `report` keeps; further new names are dropped (said once)."""

Step = tuple[int, float, float]
"""A completed step: its number in the call (from 1), when it ended (wall clock), and how
long it took (since the step before, or since the call began for the first)."""


class Progress:
    """One rank process's steps and reported scalars, for the call that runs now."""

    def __init__(self) -> None:
        """Nothing counted until `begin`."""
        self.steps = 0
        self.recent: deque[Step] = deque(maxlen=RECENT)
        self.scalars: dict[str, float] = {}
        self.reported_at = 0.0
        self.samples = 0.0
        """The `samples` reported in this call, in all."""
        self.changed = False
        """A step or a report since the sampler last wrote the record."""
        self._counting = False
        self._optimizer: int | None = None
        """The id of the optimizer whose steps are counted (the first to step)."""
        self._last = 0.0
        self._hooked = False
        self._listeners: list[Callable[[int], None]] = []
        self._warned = False
        self._lock = threading.Lock()

    def begin(self) -> None:
        """A watched call begins: count its steps from 0."""
        with self._lock:
            self.steps, self._optimizer, self._last = 0, None, time.time()
            self.recent.clear()
            self.scalars, self.reported_at, self.samples = {}, 0.0, 0.0
            self.changed, self._counting = False, True
        self.hook()

    def end(self) -> None:
        """The call's function returned: count nothing until the next."""
        self._counting = False

    def hook(self) -> None:
        """Install torch's optimizer hook, once torch's optimizers are loaded (never loads
        them: a rank that never imports torch pays nothing)."""
        if self._hooked or "torch.optim" not in sys.modules:
            return
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # a torch without it (before 2.0)
            self._hooked = True
            return
        register_optimizer_step_post_hook(self._after_step)
        self._hooked = True

    def on_step(self, listener: Callable[[int], None]) -> None:
        """Call `listener(step)` on the function's thread after each counted step."""
        self._listeners.append(listener)

    def _after_step(self, optimizer: object, *_: Any) -> None:
        """torch's post hook, on the thread that stepped."""
        if not self._counting:
            return
        if self._optimizer is None:
            self._optimizer = id(optimizer)
        elif self._optimizer != id(optimizer):
            return
        self._count(time.time())

    def _count(self, now: float, number: int | None = None) -> None:
        with self._lock:
            self.steps = number if number is not None else self.steps + 1
            self.recent.append((self.steps, now, max(0.0, now - self._last)))
            self._last, self.changed = now, True
        for listener in self._listeners:
            try:
                listener(self.steps)
            except Exception as exc:  # noqa: BLE001 - a listener never fails the step
                print(f"[orchestrator] a step listener failed: {exc!r}", file=sys.stderr)

    def report(self, scalars: dict[str, Any]) -> None:
        """Keep the newest value of each scalar; `step` sets the step where no optimizer
        is counted; `samples` adds to the total. Values that are not numbers are dropped."""
        now = time.time()
        kept = {}
        for name, value in scalars.items():
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                continue
            kept[str(name)[:64]] = number
        step = kept.pop("step", None)
        own = self._optimizer in (None, -1)  # no optimizer counted: the function counts
        if step is not None and math.isfinite(step) and self._counting and own:
            self._optimizer = -1
            self._count(now, int(step))
        with self._lock:
            self.samples += kept.get("samples", 0.0)
            for name, number in kept.items():
                if name in self.scalars or len(self.scalars) < MAX_SCALARS:
                    self.scalars[name] = number
                elif not self._warned:
                    self._warned = True
                    print(
                        f"[orchestrator] report(): more than {MAX_SCALARS} names; "
                        f"{name!r} and later new names are not kept",
                        file=sys.stderr,
                    )
            self.reported_at, self.changed = now, True

    def taken(self) -> tuple[int, tuple[Step, ...], dict[str, float], float, float]:
        """What the record carries now: steps, the newest steps, scalars, when reported,
        samples in all (and the change is taken)."""
        with self._lock:
            self.changed = False
            return (
                self.steps,
                tuple(self.recent),
                dict(self.scalars),
                self.reported_at,
                self.samples,
            )


PROGRESS = Progress()
"""This process's (one rank per process)."""


class SamplesRate:
    """Samples a second from a rank's reports as they are read: between the last two read."""

    def __init__(self) -> None:
        """No report read yet."""
        self._was: tuple[float, float] | None = None

    def reset(self) -> None:
        """Another call: its samples count from 0 again."""
        self._was = None

    def of(self, reported_at: float, samples_total: float) -> float | None:
        """Samples a second since the report read before this one (None: none reported, or
        no two reports read yet)."""
        was, rate = self._was, None
        if was is not None and reported_at > was[0]:
            rate = (samples_total - was[1]) / (reported_at - was[0])
        if reported_at and (was is None or reported_at > was[0]):
            self._was = (reported_at, samples_total)
        return rate if samples_total else None


def report(**scalars: Any) -> None:
    """Report numbers of this step from inside a distributed function (loss=..., lr=...,
    samples=batch size, step=N where no optimizer steps); shown and kept over time."""
    try:
        PROGRESS.hook()
        PROGRESS.report(scalars)
    except Exception:  # noqa: BLE001, S110 - never fails the job
        pass
