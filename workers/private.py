"""Files for this user's eyes alone: a checked 0700 folder, 0600 files, trusted reads.

Everything the product writes on a machine it does not own (a rank's last words, the
local runtime's record and log) goes in `folder()`. A file another user could have
made, replaced or linked is not believed: `read_trusted` says why instead.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class UnsafeFolderError(OSError):
    """A folder this user's files would go in is another user's, or others may write in it."""


class UntrustedFileError(OSError):
    """A file that another user may have written: its owner, mode or type is wrong."""


def folder(*, lasting: bool = False) -> Path:
    """This user's own folder for the product's files: made 0700, else checked.

    $XDG_RUNTIME_DIR/orchestrator where the session has one (and `lasting` is False),
    else orchestrator-UID in the temp dir. `lasting` files outlive the login session
    (the XDG folder is removed at logout) and must be found from any session. A folder
    that another user made, that others may write in, or a symlink is refused: its
    files could be read, planted or redirected by them.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime) and not lasting:
        path = Path(runtime) / "orchestrator"
    else:  # the shared temp dir: the uid in the name keeps users apart
        path = Path(tempfile.gettempdir()) / f"orchestrator-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise UnsafeFolderError(
            f"{path} is not this user's private folder (owner uid {found.st_uid}, mode "
            f"{stat.S_IMODE(found.st_mode):o}); remove it, or set XDG_RUNTIME_DIR"
        )
    return path


def create(path: Path) -> int:
    """A new file at `path` (one already there is replaced), 0600, not through a symlink: its fd.

    Only for paths in `folder()`, where nobody else can have put anything.
    """
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def write(path: Path, text: str) -> None:
    """Replace `path`'s content with `text` at once: readers see the old file or the new one."""
    partial = path.with_name(path.name + ".part")
    with os.fdopen(create(partial), "w", encoding="utf-8") as out:
        out.write(text)
    partial.replace(path)


def read_trusted(path: Path) -> str:
    """`path`'s text, if only this user (or root) can have written it; else UntrustedFileError.

    FileNotFoundError where there is none. The checks are made on the opened file, so
    the file cannot be swapped between check and read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedFileError(f"{path} is a symlink") from exc
        raise
    with os.fdopen(fd, encoding="utf-8", errors="replace") as file:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise UntrustedFileError(f"{path} is not a regular file")
        if found.st_uid not in (os.getuid(), 0):
            raise UntrustedFileError(
                f"{path} belongs to another user (uid {found.st_uid}), not to this one "
                f"(uid {os.getuid()}) or root"
            )
        if found.st_mode & 0o022:
            raise UntrustedFileError(
                f"{path} may be written by other users (mode {stat.S_IMODE(found.st_mode):o})"
            )
        return file.read()
