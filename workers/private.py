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


SHORT_TEMP = "/tmp"  # noqa: S108 - a folder of this user's alone is made there, and checked
"""Where `folder(short=True)` goes: a TMPDIR may be too long for Ray's socket paths."""


def folder(*, lasting: bool = False, short: bool = False) -> Path:
    """This user's own folder for the product's files: made 0700, else checked.

    $XDG_RUNTIME_DIR/orchestrator where the session has one (and `lasting` is False),
    else orchestrator-UID in the temp dir. `lasting` files outlive the login session
    (the XDG folder is removed at logout) and must be found from any session. A folder
    that another user made, that others may write in, or a symlink is refused: its
    files could be read, planted or redirected by them.
    `short`: in /tmp, whatever TMPDIR says, for paths that must stay short.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime) and not lasting and not short:
        path = Path(runtime) / "orchestrator"
    else:  # the shared temp dir: the uid in the name keeps users apart
        temp = SHORT_TEMP if short else tempfile.gettempdir()
        path = Path(temp) / f"orchestrator-{os.getuid()}"
    fix = "set TMPDIR to a folder of your own" if lasting or not runtime else "remove it"
    return _own(path, fix)


def state_folder() -> Path:
    """This user's folder for files that last (the local runtime's record and log): 0700.

    $XDG_STATE_HOME/orchestrator, else ~/.local/state/orchestrator: in the user's home,
    where no other user can have made it first.
    """
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    Path(base).mkdir(mode=0o700, parents=True, exist_ok=True)
    return _own(Path(base) / "orchestrator", "set XDG_STATE_HOME to a folder of your own")


def _own(path: Path, fix: str) -> Path:
    """`path`, made 0700 if missing; UnsafeFolderError, saying `fix`, if it is not ours alone."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(found.st_mode) else "not this user's private folder"
        raise UnsafeFolderError(
            f"{path} is {kind} (owner uid {found.st_uid}, mode {stat.S_IMODE(found.st_mode):o}): "
            f"another user may have made it to read or plant this user's files; {fix}"
        )
    return path


def unsafe(path: Path, *, closed: bool = False) -> str | None:
    """Why another user could replace what is made under `path`, or None.

    From the root down, while others can reach a folder: it must be this user's or root's,
    and others may not write in it unless it is sticky (as /tmp). A folder others cannot
    enter ends the walk; missing folders will be made 0700. `closed`: others must not be
    able to enter `path` at all (for a tool that makes its own folders there open to all).
    Symlinks are followed (`path` is resolved first), so the result is about
    `os.path.realpath(path)`, which callers should use from then on.
    """
    resolved = Path(os.path.realpath(path))
    for part in [*reversed(resolved.parents), resolved]:
        try:
            found = os.stat(part)
        except FileNotFoundError:
            break
        if found.st_uid not in (os.getuid(), 0):
            return f"{part} belongs to another user (uid {found.st_uid})"
        mode = stat.S_IMODE(found.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            return f"other users may write in {part} (mode {mode:o}) and replace what is in it"
        if not mode & 0o011:
            return None  # nobody else can enter: what lies below is ours
    if closed:
        return f"other users may enter {resolved}"
    return None


def pin(path: Path) -> int:
    """A descriptor of the folder `path`, opened without following a link, once it is
    checked to be this user's alone (0700): what is made or read through it stays in that
    folder, even if the name is removed and another user makes one of the same name."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    found = os.fstat(fd)
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        os.close(fd)
        raise UnsafeFolderError(
            f"{path} is not this user's private folder (owner uid {found.st_uid}, mode "
            f"{stat.S_IMODE(found.st_mode):o}): another user may have made it anew to read "
            "or plant this user's files"
        )
    return fd


def create(path: Path) -> int:
    """A new file at `path` (one already there is replaced), 0600, not through a symlink: its fd.

    Only for paths in a folder of this user's alone: the folder is checked again now
    (UnsafeFolderError if another user made it anew), and the file made through it.
    """
    folder = pin(path.parent)
    try:
        return _create(folder, path.name)
    finally:
        os.close(folder)


def _create(folder: int, name: str) -> int:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, 0o600, dir_fd=folder)


def write(path: Path, text: str) -> None:
    """Replace `path`'s content with `text` at once: readers see the old file or the new one.

    The folder is checked again, as by `create`.
    """
    folder = pin(path.parent)
    try:
        partial = path.name + ".part"
        with os.fdopen(_create(folder, partial), "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


def remove(path: Path) -> None:
    """Remove `path` if it is there, from a folder of this user's alone (checked again)."""
    with contextlib.suppress(OSError):
        folder = pin(path.parent)
        try:
            os.unlink(path.name, dir_fd=folder)
        finally:
            os.close(folder)


def read_private(path: Path) -> str:
    """`path`'s text, read as `read_trusted` does, from a folder checked again to be this
    user's alone: a folder another user made anew yields UnsafeFolderError, never a read."""
    folder = pin(path.parent)
    try:
        return _read(path, folder)
    finally:
        os.close(folder)


def read_trusted(path: Path) -> str:
    """`path`'s text, if only this user (or root) can have written it; else UntrustedFileError.

    FileNotFoundError where there is none. The checks are made on the opened file, so
    the file cannot be swapped between check and read.
    """
    return _read(path, None)


def _read(path: Path, folder: int | None) -> str:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks
    try:
        fd = os.open(path if folder is None else path.name, flags, dir_fd=folder)
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
