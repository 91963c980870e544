"""A rank's record of where its function is: written in place by the rank, read per node.

The sampler (`sampler`) writes its rank's `Where` to this user's private folder on the
node, one file per rank process, at a call's start and end and once a second between.
Any rank of the node reads its peers' records in one call (`read`), so the driver asks
one rank per node. A rank that cannot run Python stops writing: its record ages.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator_workers import private
from orchestrator_workers.places import Frame

MAX_PLACES = 256
"""Places (and functions) counted apart per call; looks at further ones count as OTHER_*."""
OTHER_PLACES, OTHER_FUNCTIONS = "(other places)", "(other functions)"


@dataclass(frozen=True)
class Where:
    """Where one rank's function was when it last looked, as read on its node.

    As written, `rank` is -1 (the reader knows each record's rank by its pid), and
    `still_s` and `age_s` are as of the writing; `read` makes them as of the reading.
    """

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
    a while (read again now and then: one that moved on is progress; see `sampler`):
    'gloo:all_reduce #42, not done'."""
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
    steps: int = 0
    """Steps the call's function completed (see `progress`)."""
    recent_steps: tuple[tuple[int, float, float], ...] = ()
    """The newest steps: number, when it ended (wall clock), seconds it took."""
    scalars: dict[str, float] | None = None
    """What the function reported last (`report`), by name."""
    reported_at: float = 0.0
    """When it last reported (wall clock; 0: never in this call)."""
    samples_total: float = 0.0
    """The `samples` it reported in this call, in all."""
    quiet_s: float = 0.0
    """How long its stack has stayed the same with its process (and its children) using,
    on average, under a tenth of a core and under 100 KB/s of I/O (else 0), as of the
    reading (see sampler.IDLE_CORES)."""


class Writer:
    """This rank process's record, written over in place: a call writes twice (at its
    start and end), and a write must cost it next to nothing."""

    def __init__(self) -> None:
        """Make the record's file, removing those of rank processes that are gone.

        Raises OSError or RuntimeError where the private folder is not safe.
        """
        folder = _folder()
        _remove_dead(folder)
        self._fd = private.create(folder / str(os.getpid()))
        self._written = 0

    def write(self, where: Where, at: float) -> None:
        """Write `where` (as of `at`, wall clock) over the record."""
        self._put(_ENCODER.encode({"at": at, "where": vars(where)}).encode())

    def write_brief(
        self,
        at: float,
        *,
        running: bool,
        still_s: float,
        samples: int,
        sampler_s: float,
        collective: str,
        call: str,
        steps: str = "",
    ) -> None:
        """`write` of a `Where` without a look's findings (a call's start or end): no
        stack, counts, CPU, memory or GPU; its other fields as given (`steps`: the
        progress fields as JSON members, ', "steps": ...', or '' for none).

        Spelled out here rather than made a `Where` and encoded: a call's start and end
        write one each, on the function's thread. `Sampler.begin` and `end` together
        cost 16-22 us so, 100-116 us through `dataclasses.asdict` (Python 3.11: it
        deep-copies each field); a `Where` and `_ENCODER` cost 17 us a record against
        4 us here. `read` reads either as a `Where`.
        """
        self._put(
            f'{{"at": {at!r}, "where": {{"rank": -1, "frames": [], '
            f'"running": {"true" if running else "false"}, "still_s": {still_s!r}, '
            f'"age_s": 0.0, "collective": {json.dumps(collective)}, "samples": {samples}, '
            f'"places": {{}}, "functions": {{}}, "phases": {{}}, '
            f'"sampler_s": {sampler_s:.4f}, "sampled": {time.monotonic()!r}, '
            f'"call": {json.dumps(call)}{steps}}}}}'.encode()
        )

    def _put(self, data: bytes) -> None:
        """Write `data` over the record, padded with spaces to the longest one yet (a
        reader never sees the end of an older, longer one)."""
        with contextlib.suppress(OSError):
            self._written = max(self._written, len(data))
            os.pwrite(self._fd, data.ljust(self._written), 0)


_ENCODER = json.JSONEncoder(default=vars)
"""A `Where` as JSON, from the instances' own dicts (its `Frame`s through `default`),
not through `dataclasses.asdict`, which deep-copies the counts: 0.6-1 ms a record
against 0.11 ms (a 24-frame stack, 50 places and functions), once a second."""


def read(pids: dict[int, int]) -> list[Where]:
    """Where each rank of this node (rank -> pid) was when it last looked."""
    folder = _folder()
    now = time.time()
    found = []
    for rank, pid in sorted(pids.items()):
        where = _record(folder / str(pid), rank, now)
        if where is None:  # its first call has not begun its function yet
            where = Where(rank, (), running=False, still_s=0.0, age_s=None)
        found.append(where)
    return found


def _record(path: Path, rank: int, now: float) -> Where | None:
    """A rank's record as of `now`; None where there is none. Read again if it was
    caught mid-write."""
    for _ in range(3):
        try:
            data = json.loads(private.read_trusted(path))
        except OSError:
            return None
        except ValueError:
            continue
        try:
            at, fields = float(data["at"]), dict(data["where"])
            fields.update(  # what JSON cannot bring back as it was, and the reader's part
                rank=rank,
                frames=tuple(Frame(**f) for f in fields["frames"]),
                phases={k: (int(n), float(c)) for k, (n, c) in fields["phases"].items()},
                recent_steps=tuple(
                    (int(n), float(at), float(s)) for n, at, s in fields.get("recent_steps", ())
                ),
                still_s=max(0.0, float(fields["still_s"]) + now - at),
                quiet_s=max(0.0, float(fields.get("quiet_s", 0.0)) + now - at),
                age_s=max(0.0, now - at),
            )
            return Where(**fields)
        except (TypeError, KeyError, ValueError, AttributeError):  # not a record of ours
            return None
    return None


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
