"""Where a rank's function is, sampled in the rank once a second and read per node.

While a call runs, a thread of the rank looks at the function thread's stack (no
signal, no pause: `sys._current_frames`) and writes a small record to this user's
private folder on the node: the stack, since when it has not changed, and when it
looked. Any rank of the node reads its peers' records in one call (`read`), so the
driver asks one rank per node. A rank that cannot run Python (a C call that holds the
GIL, a stopped process) stops writing: its record ages, and that says so.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import pickle
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator_workers import private
from orchestrator_workers.stacks import after_entry, frames_of

SAMPLE_S = 1.0
"""How often a running rank looks at where its function is."""
RECORDER_AFTER_S = 2.0
"""How long a stack stays the same before the rank reads torch's flight recorder."""
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
class Where:
    """Where one rank's function was when it last looked, as read on its node."""

    rank: int
    frames: tuple[Frame, ...]
    """The function thread's stack from the function down, outermost first."""
    running: bool
    """Whether a call's function runs on the rank (False: between calls, or not begun)."""
    still_s: float
    """How long the stack has stayed the same, as of the reading."""
    age_s: float | None
    """How long ago the rank last looked (None: it never has); a rank that cannot run
    Python stops looking."""
    collective: str = ""
    """The last collective in torch's flight recorder, once the stack stayed the same
    RECORDER_AFTER_S: 'gloo:all_reduce #42, not done'."""


class Sampler:
    """A rank's look at its function thread, once a second while a call runs."""

    def __init__(self) -> None:
        """Nothing sampled until `begin`; the thread starts with the first call."""
        self._ident: int | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._written = 0
        self._writing = threading.Lock()
        self._key: tuple[object, ...] | None = None
        self._since = 0.0
        self._frames: list[list[object]] = []
        self._collective = ""

    def begin(self) -> None:
        """The calling thread runs a call's function from now on: watch it.

        Said at once, not by the sampler: a function that takes the GIL for good at its
        first line would leave the last call's end as this rank's word.
        """
        now = time.time()
        self._key, self._since, self._frames, self._collective = None, now, [], ""
        self._ident = threading.get_ident()
        if self._thread is None:
            folder = _folder()
            _remove_dead(folder)
            self._fd = private.create(folder / str(os.getpid()))
            self._thread = threading.Thread(target=self._loop, name="where", daemon=True)
            self._thread.start()
        self._write(now, running=True)
        self._wake.set()

    def end(self) -> None:
        """The function returned: say so, and stop looking until the next call."""
        self._ident = None
        self._wake.clear()
        self._write(time.time(), running=False)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            ident = self._ident
            if ident is not None:
                with contextlib.suppress(Exception):  # a record missed is the next one's
                    self._sample(ident)
            time.sleep(SAMPLE_S)

    def _sample(self, ident: int) -> None:
        now = time.time()
        frame = sys._current_frames().get(ident)
        stack = after_entry(frames_of(frame), "run") or []
        key = tuple((f.f_code, f.f_lineno) for f in stack)
        if key != self._key:
            self._key, self._since, self._collective = key, now, ""
            self._frames = [
                _frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in stack
            ]
        elif not self._collective and now - self._since >= RECORDER_AFTER_S:
            self._collective = last_collective() or " "  # read once per stuck stack
        if self._ident == ident:  # not ended meanwhile
            self._write(now, running=True)

    def _write(self, now: float, *, running: bool) -> None:
        """One write in place (padded to the longest yet), not a new file per look: a
        call writes twice, and a write must cost it next to nothing."""
        record = {
            "sampled": now,
            "since": self._since,
            "running": running,
            "frames": self._frames if running else [],
            "collective": self._collective.strip(),
        }
        data = json.dumps(record).encode()
        with self._writing, contextlib.suppress(OSError):
            if self._fd is None:
                return
            self._written = max(self._written, len(data))
            os.pwrite(self._fd, data.ljust(self._written), 0)


def read(pids: dict[int, int]) -> list[Where]:
    """Where each rank of this node (rank -> pid) was when it last looked."""
    folder = _folder()
    now = time.time()
    found = []
    for rank, pid in sorted(pids.items()):
        record = _record(folder / str(pid))
        if record is None:
            found.append(Where(rank, (), running=True, still_s=0.0, age_s=None))
            continue
        frames = tuple(
            Frame(str(f[0]), int(f[1]), str(f[2]), str(f[3]), bool(f[4])) for f in record["frames"]
        )
        found.append(
            Where(
                rank,
                frames,
                running=bool(record["running"]),
                still_s=max(0.0, now - float(record["since"])),
                age_s=max(0.0, now - float(record["sampled"])),
                collective=str(record.get("collective", "")),
            )
        )
    return found


def last_collective() -> str:
    """The last collective this process began, from torch's flight recorder:
    'gloo:all_reduce #42, not done'; '' where there is none (no torch, no group).

    A recent torch records gloo's and NCCL's collectives (`_dump_fr_trace`), older ones
    NCCL's only (`_dump_nccl_trace`); the ranks' environment turns the recorder on.
    """
    if "torch.distributed" not in sys.modules:
        return ""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return ""
        dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace  # type: ignore[attr-defined]
        entries = pickle.loads(dump(True, False, False)).get("entries") or []  # noqa: S301 - torch's own
    except Exception:  # noqa: BLE001 - an older torch, or no recorder: nothing to add
        return ""
    if not entries:
        return ""
    last = entries[-1]
    done = last.get("retired") or last.get("state") == "completed"
    name = last.get("profiling_name", "?")
    return f"{name} #{last.get('collective_seq_id', '?')}, {'done' if done else 'not done'}"


def _record(path: Path) -> dict[str, Any] | None:
    """A rank's record; None where there is none. Read again if it was caught mid-write."""
    for _ in range(3):
        try:
            record = json.loads(private.read_trusted(path))
        except OSError:
            return None
        except ValueError:
            continue
        return record if isinstance(record, dict) else None
    return None


def _frame(file: str, line: int, function: str) -> list[object]:
    code = linecache.getline(file, line).strip()
    library = file.startswith("<") or file.startswith(_LIBRARY) or "-packages/" in file
    return [file, line, function, code[:200], library]


def _folder() -> Path:
    path = private.folder() / "where"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return path


def _remove_dead(folder: Path) -> None:
    """Remove the records of rank processes that are gone (a killed actor leaves its own)."""
    for path in folder.iterdir():
        pid = path.name.removesuffix(".part")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass
