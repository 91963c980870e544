"""Where a rank's function is and where its time goes, looked at from inside the rank.

While a call runs, a thread of the rank looks at the function thread's stack five
times a second (no signal, no pause: `sys._current_frames`), counts the looks per place
and phase (`places`), and once a second writes its rank's record (`where`): the stack,
since when it has not changed, when it looked, the counts, and the process's CPU and
memory (`probes`). A rank that cannot run Python (a C call that holds the GIL, a
stopped process) stops writing: its record ages, and that says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time

from orchestrator_workers import probes
from orchestrator_workers.places import COMPUTE, UNSEEN, Frame, frame_at, phase_of, place_of
from orchestrator_workers.progress import PROGRESS
from orchestrator_workers.raymetrics import RayMetrics
from orchestrator_workers.stacks import after_entry, frames_of
from orchestrator_workers.where import MAX_PLACES, OTHER_FUNCTIONS, OTHER_PLACES, Where, Writer

SAMPLE_S = 0.2
"""How often a running rank looks at where its function is."""
IDLE_S = 0.5
"""Between calls, how often the looking thread sees whether a call began."""
WRITE_EVERY = 5
"""Looks per record written (once a second)."""
RECORDER_AFTER_S = 2.0
"""How long a stack stays the same before the rank reads torch's flight recorder."""
RECORDER_EVERY_S = 5.0
"""While it stays the same, how often the recorder is read again."""
QUIET_FROM_S = 1.0
"""How long a stack stays the same before the process's CPU and I/O are read (from then
on, at each record): a stopped rank is named after 10 s at the soonest."""
IDLE_CORES = 0.1
IDLE_BYTES_S = 100_000
"""A process (with its children) that, while its stack stays the same, uses less CPU and
I/O than these on average is quiet: a rank that stopped, not one that saves a
checkpoint, evaluates, or waits for its data loader's workers."""


class Sampler:
    """A rank's look at its function thread, five times a second while a call runs."""

    def __init__(self, node: str = "") -> None:
        """Nothing sampled until `begin`; the thread starts with the first call. Its
        figures go to Ray's metrics too, labelled with `node` (see raymetrics)."""
        self._metrics = RayMetrics(node)
        self._ident: int | None = None
        self._native: int | None = None
        """The function thread's native id: its run-queue waits count as use (see probes)."""
        self._thread: threading.Thread | None = None
        self._record: Writer | None = None
        self._writing = threading.Lock()
        self._key: tuple[object, ...] | None = None
        self._since = 0.0
        self._frames: tuple[Frame, ...] = ()
        self._place = ""
        self._function = ""
        self._phase = COMPUTE
        self._collective = ""
        self._call = ""
        self._clock = time.CLOCK_THREAD_CPUTIME_ID
        """The function thread's CPU clock (readable from the looking thread)."""
        self._device: int | None = None
        """The CUDA device the function thread was given (its GPU's memory and use)."""
        self._cpu = 0.0
        self._last_cpu: tuple[float, float] | None = None
        """When the function thread's CPU was last read, and what it was (None: not in this
        call yet; its first look reads it, so that `begin` costs next to nothing)."""
        self._last_process = (0.0, 0.0)
        self._process_cpu = 0.0
        self._activity: tuple[float, int] | None = None
        """The process's CPU and I/O once its stack stayed (None: not read since it moved)."""
        self._since_activity = 0.0
        self._looks = 0
        self._sampler_s = 0.0
        self._broken = False
        self._recorded = ("", 0.0)
        self._places: dict[str, int] = {}
        self._functions: dict[str, int] = {}
        self._phases: dict[str, list[float]] = {}

    def begin(self, device: int | None = None, call: str = "", job: str = "") -> None:
        """The calling thread runs a call's function from now on: watch it (`device`: the
        CUDA device it was given; the looking thread's own current device is the first;
        `call`: the call's key, which its records carry; `job`: its job's name).

        Said at once, not by the sampler: a function that takes the GIL for good at its
        first line would leave the last call's end as this rank's word. Never raises: a
        rank that cannot keep its record (an unsafe folder) is not watched, and says so.
        """
        if self._broken or not self._started():
            return
        now = time.time()
        with self._writing:
            self._key, self._since, self._frames, self._collective = None, now, (), ""
            self._call = call
            self._metrics.begin(job)
            self._recorded, self._device = ("", 0.0), device
            self._place, self._function, self._phase = str(UNSEEN), "", COMPUTE
            self._clock, self._cpu = probes.cpu_clock(), 0.0
            self._last_cpu = None
            self._last_process, self._process_cpu = (now, time.process_time()), 0.0
            self._activity = None
            self._looks, self._places, self._functions, self._phases = 0, {}, {}, {}
            self._ident, self._native = threading.get_ident(), threading.get_native_id()
            PROGRESS.begin()
            self._write(now, running=True)

    def end(self) -> None:
        """The function returned: say so, and stop looking until the next call."""
        if self._thread is None:
            return
        with self._writing:
            self._ident = None
            PROGRESS.end()
            self._metrics.flush()
            self._write(time.time(), running=False)

    def _started(self) -> bool:
        """The record's file and the looking thread, made on the first call."""
        if self._thread is not None:
            return True
        try:
            self._record = Writer()
            thread = threading.Thread(target=self._loop, name="where", daemon=True)
            thread.start()
        except (OSError, RuntimeError) as exc:
            self._broken = True
            print(
                f"[orchestrator] this rank cannot say where it is (stall_after): {exc}",
                file=sys.stderr,
                flush=True,
            )
            return False
        self._thread = thread
        return True

    def _loop(self) -> None:
        """Look while a call runs; between calls, only see whether one began (a call's
        start wakes nobody: waking a thread costs a busy node milliseconds)."""
        while True:
            if self._ident is None:
                time.sleep(IDLE_S)
                continue
            # Jittered: looks at a fixed period could keep meeting one part of a periodic step.
            time.sleep(SAMPLE_S * random.uniform(0.5, 1.5))  # noqa: S311 - not for secrets
            began = time.thread_time()
            with contextlib.suppress(Exception):  # a record missed is the next one's
                self._sample()
            self._sampler_s += time.thread_time() - began

    def _sample(self) -> None:
        """One look, counted and (the first, then every WRITE_EVERY) written, unless the
        call it began in has ended meanwhile (`begin` and `end` hold the same lock)."""
        with self._writing:
            ident = self._ident
            if ident is None:
                return
            now = time.time()
            frame = sys._current_frames().get(ident)
            stack = after_entry(frames_of(frame), "_run") or []
            key = tuple((f.f_code, f.f_lineno) for f in stack)
            del frame
            if key != self._key:  # progress; the recorder's last reading is of before
                self._key, self._since, self._collective, self._activity = key, now, "", None
                self._recorded = ("", 0.0)
                self._frames = tuple(
                    frame_at(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in stack
                )
                where = place_of(self._frames)
                self._place, self._phase = str(where), phase_of(self._frames)
                self._function = f"in {where.function} at {os.path.basename(where.file)}"
            del stack
            self._count(now)
            PROGRESS.hook()  # torch's optimizers may have loaded since
            if self._looks % WRITE_EVERY and self._looks > 1 and not PROGRESS.changed:
                return  # the first look is written at once, a step or a report at its next
            used = probes.cpu_s(self._clock)
            was, self._last_cpu = self._last_cpu, (now, used)
            if was is not None:
                self._cpu = max(0.0, used - was[1]) / max(now - was[0], 1e-3)
            self._recorder(now)
            self._write(now, running=True)

    def _count(self, now: float) -> None:
        process = time.process_time()
        was_at, was_used = self._last_process
        rate = max(0.0, process - was_used) / max(now - was_at, 1e-3)
        self._last_process, self._process_cpu = (now, process), rate
        self._looks += 1
        for counts, seen, other in (
            (self._places, self._place, OTHER_PLACES),
            (self._functions, self._function, OTHER_FUNCTIONS),
        ):
            key = seen if seen in counts or len(counts) < MAX_PLACES else other
            counts[key] = counts.get(key, 0) + 1
        phase = self._phases.setdefault(self._phase, [0, 0.0])
        phase[0] += 1
        phase[1] += rate

    def _quiet(self, now: float) -> float:
        """How long the process (and its children) has kept quiet: its stack's stillness
        where, over it, it used under IDLE_CORES and IDLE_BYTES_S on average; else 0."""
        if now - self._since < QUIET_FROM_S:  # moving: nothing to read (a look's third)
            return 0.0
        used, moved = probes.activity(waits_of=self._native)
        used -= self._sampler_s  # its own looks (the flight recorder's reading) are not the rank's
        if self._activity is None:  # read first once the stack stays: from then on
            self._activity, self._since_activity = (used, moved), now
            return 0.0
        span = max(now - self._since_activity, 1e-3)
        was_used, was_moved = self._activity
        if (used - was_used) / span >= IDLE_CORES or (moved - was_moved) / span >= IDLE_BYTES_S:
            return 0.0
        return now - self._since

    def _recorder(self, now: float) -> None:
        """While the stack stays the same, read torch's flight recorder now and then: a
        collective that moved on is progress (a GPU loop that waits on one line for its
        kernels, its collectives going by), one that did not is named in the report."""
        last, read_at = self._recorded
        if now - self._since < RECORDER_AFTER_S or now - read_at < RECORDER_EVERY_S:
            return
        seen = probes.last_collective()
        self._recorded = (seen, now)
        if seen and last and seen != last:
            self._since, self._activity = now, None
        self._collective = seen

    def _write(self, now: float, *, running: bool) -> None:
        """This rank's record as of `now`, written over the last. Under `_writing`."""
        if self._record is None:
            return
        if not running or not self._looks:  # a call's start or end: only that, cheaply
            steps = ""
            if PROGRESS.steps or PROGRESS.reported_at:  # a call's end: what it did
                count, recent, scalars, reported_at, samples = PROGRESS.taken()
                steps = (
                    f', "steps": {count}, "recent_steps": {json.dumps(recent)}, '
                    f'"scalars": {json.dumps(scalars)}, "reported_at": {reported_at!r}, '
                    f'"samples_total": {samples!r}'
                )
            self._record.write_brief(
                now,
                running=running,
                still_s=now - self._since,
                samples=self._looks,
                sampler_s=self._sampler_s,
                collective=self._collective,
                call=self._call,
                steps=steps,
            )
            return
        count, recent, scalars, reported_at, samples = PROGRESS.taken()
        where = Where(
            -1,
            self._frames,
            running,
            now - self._since,
            0.0,
            cpu=round(self._cpu, 2),
            collective=self._collective,
            samples=self._looks,
            places=self._places,
            functions=self._functions,
            phases={k: (int(looks), cpu) for k, (looks, cpu) in self._phases.items()},
            process_cpu=round(self._process_cpu, 2),
            rss_mb=round(probes.rss_mb(), 1),
            sampler_s=round(self._sampler_s, 4),
            gpu_mb=probes.gpu_mb(self._device),
            gpu_busy=probes.gpu_busy(self._device),
            sampled=time.monotonic(),
            call=self._call,
            steps=count,
            recent_steps=recent,
            scalars=scalars,
            reported_at=reported_at,
            samples_total=samples,
            quiet_s=round(self._quiet(now), 2),
        )
        self._record.write(where, now)
        self._metrics.record(where)
