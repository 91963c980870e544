"""A call's log files on the driver's side: where they go, how they are made, how they are
read back. Below everything that writes or names them (the console, errors, jobs)."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from orchestrator_workers import private

_FLAGS = os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
ERROR_FILE_BYTES = 1 << 20
"""The most of torch's error file a rank sends (its JSON: message, time, traceback)."""


def log_name(rank: int) -> str:
    """The name of rank `rank`'s log file in a call's folder."""
    return f"rank-{rank}.log"


def error_name(rank: int) -> str:
    """The name, beside its log, of what torch's `record` wrote for rank `rank`."""
    return f"rank-{rank}.error.json"


def unsafe_log_dir(base: Path, why: str) -> str:
    """What to say of a log folder another user could reach into."""
    return (
        f"log_dir={str(base)!r}: {why}, so another user could read or replace the ranks' "
        "logs; give a folder of your own (the default is ~/.cache/orchestrator/logs), "
        "or log_dir=False"
    )


def call_folder(base: Path, name: str) -> Path:
    """Where one call's rank logs go, in `base`/`name`: a new name (64 random bits) that
    nobody can guess. Made on the first line written (`make_call_folder`): a call that
    prints nothing leaves no folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(os.path.realpath(base / name)) / f"{stamp}-{secrets.token_hex(8)}"


def make_call_folder(folder: Path) -> None:
    """Make a call's log folder, 0700, unless its attempt before made it already.

    Another user must not be able to pre-create it, link it elsewhere or plant files in
    it: its parent may be in a shared place (/tmp/logs), so the folders on the way are
    checked first, and one found there must be this user's and private.
    """
    why = private.unsafe(folder.parent)
    if why is not None:
        raise private.UnsafeFolderError(unsafe_log_dir(folder.parent.parent, why))
    private_dirs(folder.parent)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        found = os.lstat(folder)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
            raise private.UnsafeFolderError(f"{folder} was not made by this job") from None


def open_log(path: Path) -> int:
    """A file in a call's own folder, to append to: made new (0600), or one this user made."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o600)
    except FileExistsError:  # a restarted attempt appends to the file its first one made
        fd = os.open(path, os.O_WRONLY | _FLAGS)
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_nlink != 1:
            os.close(fd)
            raise private.UnsafeFolderError(f"{path} was not made by this job") from None
        return fd


def private_dirs(folder: Path) -> None:
    """Create `folder` and its missing parents readable by this user only (0700).

    Training output can hold data and credentials; folders that exist keep their mode.
    """
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another call
            path.mkdir(mode=0o700)


def read_log(log_dir: Path, rank: int) -> str:
    """The text rank `rank` wrote in the call whose logs are in `log_dir` ("" if none)."""
    try:
        return (log_dir / log_name(rank)).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def keep_error_file(log_dir: Path | None, rank: int, data: bytes) -> str:
    """Keep what torch's `record` wrote for rank `rank` (`data`) beside its log, as torchrun
    leaves its error file on disk; the file's path, or "" where no call folder is kept
    (`log_dir=False`) or it cannot be written."""
    if log_dir is None or not data:
        return ""
    path = log_dir / error_name(rank)
    try:
        make_call_folder(log_dir)
        fd = open_log(path)
        with os.fdopen(fd, "wb") as kept:
            kept.truncate(0)  # a restarted attempt's failure replaces the one before
            kept.write(data[:ERROR_FILE_BYTES])
    except OSError:
        return ""
    return str(path)
