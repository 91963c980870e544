"""Where a rank's function is and where its time goes, sampled in the rank, read per node.

While a call runs, a thread of the rank looks at the function thread's stack five
times a second (no signal, no pause: `sys._current_frames`), counts the looks per place
and phase, and once a second writes a small record to this user's private folder on
the node: the stack, since when it has not changed, when it looked, the counts, and the
process's CPU and memory. Any rank of the node reads its peers' records in one call
(`read`), so the driver asks one rank per node. A rank that cannot run Python (a C call
that holds the GIL, a stopped process) stops writing: its record ages, and that says so.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import pickle
import random
import re
import sys
import sysconfig
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator_workers import private
from orchestrator_workers.stacks import after_entry, frames_of

SAMPLE_S = 0.2
"""How often a running rank looks at where its function is."""
IDLE_S = 0.5
"""Between calls, how often the looking thread sees whether a call began."""
WRITE_EVERY = 5
"""Looks per record written (once a second)."""
MAX_PLACES = 256
"""Places (and functions) counted apart per call; looks at further ones count as OTHER_*."""
OTHER_PLACES, OTHER_FUNCTIONS = "(other places)", "(other functions)"
COLLECTIVE, BACKWARD, DATA, COMPUTE = "collective", "backward", "data loading", "compute"
"""A look's phase: in a torch.distributed collective, in autograd's backward (DDP's
all-reduce waits there too), in a DataLoader, or anything else."""
_C10D = "torch/distributed/distributed_c10d.py"
RECORDER_AFTER_S = 2.0
"""How long a stack stays the same before the rank reads torch's flight recorder."""
RECORDER_EVERY_S = 5.0
"""While it stays the same, how often the recorder is read again."""
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
    cpu: float = 0.0
    """The share of a core the function's thread used between its last two records
    (about a second): a rank at one place that computes (a tight loop, a long kernel)
    shows here, a rank that waits does not."""
    collective: str = ""
    """The last collective in torch's flight recorder, once the stack stayed the same
    RECORDER_AFTER_S (read again every RECORDER_EVERY_S: one that moved on is
    progress): 'gloo:all_reduce #42, not done'."""
    samples: int = 0
    """Looks during this call."""
    places: dict[str, int] | None = None
    """Looks per place (str(Place)) during this call."""
    functions: dict[str, int] | None = None
    """Looks per function of the user's code ('in _spin at train.py'): a loop over
    several lines is one function."""
    phases: dict[str, tuple[int, float]] | None = None
    """Per phase: looks, and the process's CPU (cores) summed over those looks."""
    process_cpu: float = 0.0
    """Cores the whole process used between its last two looks (every thread: torch's too)."""
    rss_mb: float = 0.0
    sampler_s: float = 0.0
    """CPU seconds the rank's own looking has cost its process, in all."""
    gpu_mb: float | None = None
    """torch's CUDA memory allocated, where the rank has initialized CUDA."""
    gpu_busy: int | None = None
    """Percent of NVML's last sample period its GPU ran a kernel, where NVML is at hand."""
    sampled: float = 0.0
    """When it last looked, on its node's monotonic clock (which every process there
    shares): two readings of one rank compare by it."""
    call: str = ""
    """The key of the call the record is about: with `running` False, that call's
    function has returned on this rank."""


class Sampler:
    """A rank's look at its function thread, five times a second while a call runs."""

    def __init__(self) -> None:
        """Nothing sampled until `begin`; the thread starts with the first call."""
        self._ident: int | None = None
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._written = 0
        self._writing = threading.Lock()
        self._key: tuple[object, ...] | None = None
        self._since = 0.0
        self._frames: list[Frame] = []
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
        self._looks = 0
        self._sampler_s = 0.0
        self._broken = False
        self._recorded = ("", 0.0)
        self._places: dict[str, int] = {}
        self._functions: dict[str, int] = {}
        self._phases: dict[str, list[float]] = {}

    def begin(self, device: int | None = None, call: str = "") -> None:
        """The calling thread runs a call's function from now on: watch it (`device`: the
        CUDA device it was given; the looking thread's own current device is the first;
        `call`: the call's key, which its records carry).

        Said at once, not by the sampler: a function that takes the GIL for good at its
        first line would leave the last call's end as this rank's word. Never raises: a
        rank that cannot keep its record (an unsafe folder) is not watched, and says so.
        """
        if self._broken or not self._started():
            return
        now = time.time()
        with self._writing:
            self._key, self._since, self._frames, self._collective = None, now, [], ""
            self._call = call
            self._recorded, self._device = ("", 0.0), device
            self._place, self._function, self._phase = str(UNSEEN), "", COMPUTE
            self._clock, self._cpu = _cpu_clock(), 0.0
            self._last_cpu = None
            self._last_process, self._process_cpu = (now, time.process_time()), 0.0
            self._looks, self._places, self._functions, self._phases = 0, {}, {}, {}
            self._ident = threading.get_ident()
            self._write(now, running=True)

    def end(self) -> None:
        """The function returned: say so, and stop looking until the next call."""
        if self._thread is None:
            return
        with self._writing:
            self._ident = None
            self._write(time.time(), running=False)

    def _started(self) -> bool:
        """The record's file and the looking thread, made on the first call."""
        if self._thread is not None:
            return True
        try:
            folder = _folder()
            _remove_dead(folder)
            self._fd = private.create(folder / str(os.getpid()))
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
            if key != self._key:
                self._key, self._since, self._collective = key, now, ""
                self._frames = [
                    _frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in stack
                ]
                where = place_of(self._frames)
                self._place, self._phase = str(where), phase_of(self._frames)
                self._function = f"in {where.function} at {os.path.basename(where.file)}"
            del stack
            self._count(now)
            if self._looks % WRITE_EVERY and self._looks > 1:
                return  # the first look is written at once: a rank stuck from its start
            used = _cpu_s(self._clock)
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

    def _recorder(self, now: float) -> None:
        """While the stack stays the same, read torch's flight recorder now and then: a
        collective that moved on is progress (a GPU loop that waits on one line for its
        kernels, its collectives going by), one that did not is named in the report."""
        last, read_at = self._recorded
        if now - self._since < RECORDER_AFTER_S or now - read_at < RECORDER_EVERY_S:
            return
        seen = last_collective()
        self._recorded = (seen, now)
        if seen and last and seen != last:
            self._since = now
        self._collective = seen

    def _write(self, now: float, *, running: bool) -> None:
        """One write in place (padded to the longest yet), not a new file per look: a
        call writes twice, and a write must cost it next to nothing. Under `_writing`."""
        if self._fd is None:
            return
        if not running or not self._looks:  # a call's start or end: only that, cheaply
            flag = "true" if running else "false"
            text = (
                f'{{"sampled": {now!r}, "mono": {time.monotonic()!r}, '
                f'"since": {self._since!r}, "running": {flag}, '
                f'"samples": {self._looks}, "sampler_s": {self._sampler_s:.4f}, '
                f'"collective": {json.dumps(self._collective)}, "call": {json.dumps(self._call)}}}'
            )
            self._put(text.encode())
            return
        record = {
            "sampled": now,
            "mono": time.monotonic(),
            "since": self._since,
            "running": running,
            "cpu": round(self._cpu, 2),
            "collective": self._collective,
            "samples": self._looks,
            "sampler_s": round(self._sampler_s, 4),
            "call": self._call,
        }
        record.update(  # what a look found
            frames=[[f.file, f.line, f.function, f.code, f.library] for f in self._frames],
            places=self._places,
            functions=self._functions,
            phases=self._phases,
            process_cpu=round(self._process_cpu, 2),
            rss_mb=round(_rss_mb(), 1),
            gpu_mb=_gpu_mb(self._device),
            gpu_busy=_gpu_busy(self._device),
        )
        self._put(json.dumps(record).encode())

    def _put(self, data: bytes) -> None:
        """Write `data` over the record, padded with spaces to the longest one yet."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            self._written = max(self._written, len(data))
            os.pwrite(self._fd, data.ljust(self._written), 0)


def read(pids: dict[int, int]) -> list[Where]:
    """Where each rank of this node (rank -> pid) was when it last looked."""
    folder = _folder()
    now = time.time()
    found = []
    for rank, pid in sorted(pids.items()):
        record = _record(folder / str(pid))
        if record is None:  # its first call has not begun its function yet
            found.append(Where(rank, (), running=False, still_s=0.0, age_s=None))
            continue
        frames = tuple(
            Frame(str(f[0]), int(f[1]), str(f[2]), str(f[3]), bool(f[4]))
            for f in record.get("frames", [])
        )
        found.append(
            Where(
                rank,
                frames,
                running=bool(record["running"]),
                still_s=max(0.0, now - float(record["since"])),
                age_s=max(0.0, now - float(record["sampled"])),
                cpu=float(record.get("cpu", 0.0)),
                collective=str(record.get("collective", "")),
                samples=int(record.get("samples", 0)),
                places={str(k): int(v) for k, v in record.get("places", {}).items()},
                functions={str(k): int(v) for k, v in record.get("functions", {}).items()},
                phases={
                    str(k): (int(v[0]), float(v[1])) for k, v in record.get("phases", {}).items()
                },
                process_cpu=float(record.get("process_cpu", 0.0)),
                rss_mb=float(record.get("rss_mb", 0.0)),
                sampler_s=float(record.get("sampler_s", 0.0)),
                gpu_mb=None if record.get("gpu_mb") is None else float(record["gpu_mb"]),
                gpu_busy=None if record.get("gpu_busy") is None else int(record["gpu_busy"]),
                sampled=float(record.get("mono", 0.0)),
                call=str(record.get("call", "")),
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


def _rss_mb() -> float:
    """This process's resident memory (statm: pages)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _gpu_mb(device: int | None) -> float | None:
    """torch's CUDA memory allocated on the rank's device (None: the current one), where
    CUDA is initialized (never initialized here: that would take a GPU context)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return round(torch.cuda.memory_allocated(device) / 2**20, 1)
    except Exception:  # noqa: BLE001 - no CUDA build, or a driver problem: not shown
        return None


_nvml: dict[str, Any] = {}
"""NVML, once loaded: the module, and a handle per device (empty: not tried yet)."""


def _gpu_busy(device: int | None) -> int | None:
    """How busy the rank's GPU (None: the current device) was over NVML's last sample
    period, in percent, where CUDA is initialized and NVML can be loaded (nvidia-ml-py,
    else the copy Ray ships). The GPU is found by its UUID, as CUDA and NVML number
    GPUs differently; one NVML cannot read (a MIG slice) says nothing, once and for all."""
    torch = sys.modules.get("torch")
    if torch is None or _nvml.get("broken"):
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        if not _nvml:
            with warnings.catch_warnings():  # the old pynvml package warns on import
                warnings.simplefilter("ignore")
                try:
                    import pynvml  # nvidia-ml-py, where the user has it
                except ImportError:
                    from ray._private.thirdparty import pynvml
            pynvml.nvmlInit()
            _nvml["module"] = pynvml
        nvml = _nvml["module"]
        index = torch.cuda.current_device() if device is None else device
        handle = _nvml.get(f"handle{index}")
        if handle is None:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            )
            _nvml[f"handle{index}"] = handle
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no NVML, no driver, a MIG slice: not shown
        _nvml["broken"] = True
        return None


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


def _cpu_clock() -> int:
    """The calling thread's CPU clock, for other threads of this process to read."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not on this platform: its own clock only
        return time.CLOCK_THREAD_CPUTIME_ID


def _cpu_s(clock: int) -> float:
    """CPU seconds a thread has used, by its clock (one system call, no file)."""
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has ended
        return 0.0


def _frame(file: str, line: int, function: str) -> Frame:
    code = linecache.getline(file, line).strip()
    library = file.startswith("<") or file.startswith(_LIBRARY) or "-packages/" in file
    return Frame(file, line, function, code[:200], library)


def _folder() -> Path:
    path = private.folder() / "where"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    os.close(private.pin(path))  # this user's alone: its records are believed
    return path


def _remove_dead(folder: Path) -> None:
    """Remove the records of rank processes that are gone (a killed actor leaves its own)."""
    for path in folder.iterdir():
        pid = path.name
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass
