"""The current Python stack of each thread of a rank, for hangs and on demand."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType

import ray

_HERE = os.path.dirname(os.path.abspath(__file__))
"""This package's folder as its code names it, unresolved: a shipped copy is reached
through a descriptor where its folder's name is not safe (/proc/PID/fd/N, see bootstrap)."""
_OURS = (str(Path(__file__).resolve().parent), _HERE)
_RAY = str(Path(ray.__file__).resolve().parent)
_ACTOR = (str(Path(__file__).resolve().with_name("actor.py")), os.path.join(_HERE, "actor.py"))
"""The rank actor's module, whose `_run` calls the function (in whichever thread)."""


def current_stacks(entry: str = "_run") -> str:
    """Each user-visible thread's stack, innermost call last.

    The thread running the rank's function is shown from the function down (the
    actor's own frames are cut); threads that belong to Ray or to this package are left out.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    blocks = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = frames_of(frame)
        user = after_entry(frames, entry)
        if user is not None:
            title = f"Thread {names.get(ident, ident)} (running the function)"
        elif any(_is_ours(f) for f in frames):
            continue
        else:
            user = frames
            title = f"Thread {names.get(ident, ident)}"
        summary = traceback.StackSummary.extract(
            ((f, f.f_lineno) for f in user), capture_locals=False
        )
        blocks.append(f"{title}:\n{''.join(summary.format()).rstrip()}")
    return "\n\n".join(blocks) or "(no thread is running Python code)"


def frames_of(frame: FrameType | None) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]  # outermost first


def after_entry(frames: list[FrameType], entry: str) -> list[FrameType] | None:
    for i, f in enumerate(frames):
        if f.f_code.co_name == entry and f.f_code.co_filename in _ACTOR:
            after = frames[i + 1 :]
            # A launched script runs under our runner and runpy: start at the user's code.
            start = 0
            while start < len(after) - 1 and (_is_ours(after[start]) or _is_runpy(after[start])):
                start += 1
            return after[start:]
    return None


def _is_runpy(frame: FrameType) -> bool:
    return frame.f_code.co_filename.endswith(("runpy.py", "<frozen runpy>"))


def _is_ours(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    return name.startswith((*_OURS, _RAY)) or "concurrent/futures" in name
