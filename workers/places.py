"""Where a stack is: its frames, the place of the user's code it shows, and its phase.

A place is the innermost frame of the user's code and what it called (a collective, a
library function); a phase says what kind of work the stack is in (a collective,
autograd's backward, a DataLoader, anything else). The sampler (`sampler`) classifies
each look with these; the driver groups and compares ranks by them.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

COLLECTIVE, BACKWARD, DATA, COMPUTE = "collective", "backward", "data loading", "compute"
"""A look's phase: in a torch.distributed collective, in autograd's backward (DDP's
all-reduce waits there too), in a DataLoader, or anything else."""
_C10D = "torch/distributed/distributed_c10d.py"
_LIBRARY = tuple(
    {
        str(Path(p).resolve())
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's function thread."""

    file: str
    line: int
    function: str
    code: str
    """The line's source text, stripped ('' where the source is not at hand)."""
    library: bool
    """Whether the file is Python's or an installed package's (not the user's code)."""


@dataclass(frozen=True)
class Place:
    """Where a rank's function is: its innermost frame of the user's code, and what
    that frame called (a collective, a library function), if any."""

    file: str
    line: int
    function: str
    code: str = ""
    calls: str = ""
    """The collective ('all_reduce') or library function ('torch.serialization.save')."""
    collective: bool = False

    def __str__(self) -> str:
        """'in all_reduce at train.py:42', 'at loader.py:88 in __getitem__ (`x = f()`)'."""
        if not self.line:
            return "in no Python frame"
        at = f"{os.path.basename(self.file)}:{self.line}"
        if self.calls:
            return f"in {self.calls} at {at}"
        code = f" (`{self.code}`)" if self.code else ""
        return f"at {at} in {self.function}{code}"


_IN_COLLECTIVE = re.compile(r"in \w+ at .+:\d+")
"""A collective's place as `Place.__str__` writes it: a library call's name has a dot."""


def in_collective(place: str) -> bool:
    """Whether `place` (a `Place` as text, as the counts have it) is in a collective."""
    return _IN_COLLECTIVE.fullmatch(place) is not None


UNSEEN = Place("?", 0, "?")
"""The place of a rank whose function thread shows no Python frame."""


def frame_at(file: str, line: int, function: str) -> Frame:
    """The frame at `file`:`line` in `function`, with its source line and whose it is."""
    code = linecache.getline(file, line).strip()
    library = file.startswith("<") or file.startswith(_LIBRARY) or "-packages/" in file
    return Frame(file, line, function, code[:200], library)


def place_of(frames: tuple[Frame, ...] | list[Frame]) -> Place:
    """The place of a stack (outermost frame first)."""
    if not frames:
        return UNSEEN
    user = [i for i, f in enumerate(frames) if not f.library]
    at = user[-1] if user else len(frames) - 1
    here, inner = frames[at], frames[at + 1 :]
    for f in inner:  # the collective itself, not the wrapper that logs it
        if f.file.endswith(_C10D) and not f.function.startswith("_"):
            return Place(here.file, here.line, here.function, here.code, f.function, True)
    calls = f"{_module(inner[0].file)}.{inner[0].function}" if inner else ""
    return Place(here.file, here.line, here.function, here.code, calls)


def phase_of(frames: tuple[Frame, ...] | list[Frame]) -> str:
    """The phase a stack is in (COLLECTIVE, BACKWARD, DATA or COMPUTE)."""
    for f in frames:
        if f.file.endswith(_C10D) and not f.function.startswith("_"):
            return COLLECTIVE
    for f in frames:
        autograd = "torch/autograd/" in f.file or f.file.endswith("torch/_tensor.py")
        if autograd and f.function == "backward":
            return BACKWARD
        if "torch/utils/data/" in f.file:
            return DATA
    return COMPUTE


def _module(file: str) -> str:
    """'torch.serialization' for .../site-packages/torch/serialization.py."""
    path = file.removesuffix(".py")
    for marker in ("-packages/", "/lib/python"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            if marker == "/lib/python":  # 3.11/threading
                path = path.split("/", 1)[-1]
            break
    else:
        path = os.path.basename(path)
    return path.removesuffix("/__init__").replace("/", ".")
