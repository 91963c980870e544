"""A call's large buffers: one copy per node, which each rank maps copy-on-write.

Tensors and arrays of at least a megabyte travel beside the pickled function, out of
band, and reach a rank as bytes in Ray's object store. Every rank must get a private,
writable copy (a rank writing in place must not change its neighbours' tensors). Eight
ranks copying 200 MB each is slow and uses eight times the memory; instead, the first
rank of a call on a node writes the bytes once to a file in /dev/shm, and every rank of
that node maps the file privately (MAP_PRIVATE): reading costs nothing, and a page is
copied only for the rank that writes to it. The last rank to map the file removes its
name; the memory goes when the last mapping does. Where /dev/shm is missing or small,
where `ORCHESTRATOR_SHARED_BUFFERS=0`, or where a rank is alone on its node, each rank
copies the bytes itself. Storages over a shared copy cannot grow (`resize_`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")  # noqa: S108 - names hold a random key, files are 0600, no symlinks
PREFIX = "orchestrator-buffers-"
"""Every file this module creates starts so, followed by the call's key."""
SWITCH = "ORCHESTRATOR_SHARED_BUFFERS"
"""Set to 0 in a rank's environment (`env=`) for private copies only, no /dev/shm."""
_HEADER = struct.Struct("<qq")
"""At the file's start: how many readers have mapped it, and whether it holds the data."""
STALE_S = 600.0
"""A file untouched this long lost a reader (a rank killed while loading): remove it.

Its readers touch it only while they arrive, within moments of each other."""
_MAX_SHARE = 0.2
"""Use at most this share of /dev/shm's free space: Ray's object store, DataLoader
workers and NCCL may need /dev/shm too, and Ray's reservation does not show as used."""
_MIN_LEFT = 1 << 30
"""And leave at least this much free (a small /dev/shm, as Docker's, is never used)."""


def typed_storage(holder: tuple[Any], dtype: Any) -> Any:
    """A torch TypedStorage over `holder[0]`'s memory, without a copy (unpickling helper)."""
    import torch

    untyped = untyped_storage(holder)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def untyped_storage(holder: tuple[Any]) -> Any:
    """A torch UntypedStorage over `holder[0]`'s memory, without a copy (unpickling helper)."""
    import torch

    return torch.frombuffer(holder[0], dtype=torch.uint8).untyped_storage()


def private_buffers(
    views: Sequence[Any], readonly: Sequence[bool], key: str, readers: int
) -> list[Any]:
    """Private copies of `views` for this rank, shared on this node until written.

    `key` names this call on this node and `readers` is how many ranks of the call run
    here: each must call this exactly once, so the last one can remove the file's name.
    """
    if not views:
        return []
    copies: list[Any] | None = None
    if readers > 1 and SHM.is_dir():
        with contextlib.suppress(Exception):  # no shared copy: each rank copies for itself
            copies = _map_shared([memoryview(v).cast("B") for v in views], key, readers)
    if copies is None:
        copies = [bytearray(memoryview(v).cast("B")) for v in views]
    return [memoryview(c).toreadonly() if ro else c for c, ro in zip(copies, readonly, strict=True)]


def remove(key_prefix: str, older_than: float = 0.0) -> None:
    """Remove the files of calls whose key starts with `key_prefix`, untouched that long."""
    cutoff = time.time() - older_than
    for path in SHM.glob(f"{PREFIX}{key_prefix}*"):
        with contextlib.suppress(OSError):
            found = path.lstat()
            if found.st_uid == os.getuid() and (not older_than or found.st_mtime < cutoff):
                path.unlink()  # another user's files are theirs to remove


def _map_shared(views: list[memoryview], key: str, readers: int) -> list[memoryview] | None:
    """Map this node's copy of `views`, writing it first if no rank has; None: no room."""
    offsets, end = _layout([v.nbytes for v in views])
    path = SHM / f"{PREFIX}{key}"
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        header = os.pread(fd, _HEADER.size, 0)
        count, filled = _HEADER.unpack(header) if len(header) == _HEADER.size else (0, 0)
        if count == 0:
            remove("", older_than=STALE_S)
            filled = _fill(fd, views, offsets, end)
        count += 1
        os.pwrite(fd, _HEADER.pack(count, filled), 0)
        if count >= readers:
            path.unlink()
        if not filled:
            return None
        # One map for all (each map holds a file descriptor open while it lives).
        whole = memoryview(mmap.mmap(fd, end, access=mmap.ACCESS_COPY))
        return [whole[o : o + v.nbytes] for v, o in zip(views, offsets, strict=True)]
    finally:  # unlock first: the maps hold duplicates of `fd`, which would keep the lock
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _open(path: Path) -> int:
    """The call's file: made new (O_EXCL) by the node's first rank; the others open it
    without creating, and only if it is this user's alone (a planted file's bytes would
    become a rank's tensors)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:  # its last reader removed the name meanwhile
            continue
        found = os.fstat(fd)
        if (
            stat.S_ISREG(found.st_mode)
            and found.st_uid == os.getuid()
            and not (found.st_mode & 0o077)
        ):
            return fd
        os.close(fd)
        raise PermissionError(f"{path} is not this user's alone: not used")
    raise FileNotFoundError(path)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of each buffer in the file (after a header page, aligned for mmap); its end."""
    grain = mmap.ALLOCATIONGRANULARITY
    offsets, end = [], grain
    for size in sizes:
        offsets.append(end)
        end += -(-size // grain) * grain
    return offsets, end


def _fill(fd: int, views: list[memoryview], offsets: list[int], end: int) -> int:
    """Write the buffers at their offsets; 0 where /dev/shm has no room to spare."""
    stats = os.statvfs(SHM)
    free = stats.f_bavail * stats.f_frsize
    if end > _MAX_SHARE * free or free - end < _MIN_LEFT:
        return 0
    try:
        os.ftruncate(fd, end)
        for view, offset in zip(views, offsets, strict=True):
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], offset + done)
    except OSError:  # full after all: give the memory back, every rank copies instead
        os.ftruncate(fd, _HEADER.size)
        return 0
    return 1
