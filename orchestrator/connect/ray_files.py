"""Where a Ray head this product starts keeps its files: private, and short enough for sockets."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from orchestrator.show import messages
from orchestrator_workers import private

SOCKET_PATH_ROOM = 107 - len("/session_2026-12-01_15-45-14_123456_4194304/sockets/plasma_store")
"""How long Ray's temp folder may be: its sockets' paths must fit in 107 bytes."""


def head_temp_dir(*, lasting: bool, name: str = "ray") -> str | None:
    """Ray's temp folder for a head this product starts; None: Ray's own ($RAY_TMPDIR/ray).

    Ray makes its folders open to every user (0777, not sticky): in its default, /tmp/ray,
    another user could swap its address file for a link, or read and plant session files.
    A RAY_TMPDIR that no other user can enter is kept; otherwise the head's files go in
    this user's private folder, as `name` (`lasting`: one that outlives the login session).
    """
    chosen = os.environ.get("RAY_TMPDIR")
    if chosen:
        why = private.unsafe(Path(chosen), closed=True)
        if why is None:
            return None
        messages.say(
            f"not putting Ray's files in RAY_TMPDIR={chosen}, as {why} and Ray makes its "
            "folders writable by all; using a private folder (make RAY_TMPDIR 0700 to keep it)"
        )
    try:
        folder = private.folder(lasting=lasting)
        if len(str(folder / name)) > SOCKET_PATH_ROOM:
            folder = private.folder(lasting=True)  # a long XDG_RUNTIME_DIR: the temp dir
        if len(str(folder / name)) > SOCKET_PATH_ROOM:  # a long TMPDIR (a Slurm job's): /tmp
            long = folder
            folder = private.folder(short=True)
            messages.say(
                f"Ray's files go in {folder / name}, not {long / name}: Ray's socket paths "
                f"must fit in 107 bytes, which leaves {SOCKET_PATH_ROOM} characters for its "
                "folder (set TMPDIR or RAY_TMPDIR to a shorter folder of your own to choose)"
            )
    except private.UnsafeFolderError as exc:
        short = len(tempfile.gettempdir()) + 25 <= SOCKET_PATH_ROOM
        # 0700, a name nobody can guess
        made = tempfile.mkdtemp(prefix="orchestrator-ray-", dir=None if short else "/tmp")  # noqa: S108
        messages.say(f"{exc}. Ray's files go in {made} instead")
        return made
    path = folder / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return str(path)
