"""Ray's token authentication: the token this user's clusters need, for this user alone."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from orchestrator import _ray_compat
from orchestrator.connect import discovery


def ensure_token(error: type[Exception]) -> None:
    """Make the token Ray's token mode needs (~/.ray/auth_token) where none is set up.

    For this user alone (0600, in a 0700 ~/.ray when it makes that too): whoever reads it
    can join this user's clusters. Ray would make it 0644. `error` is raised where the
    configured token file does not exist.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    custom = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if custom:
        if not Path(custom).expanduser().exists():
            raise error(
                f"RAY_AUTH_TOKEN_PATH={custom} does not exist: create the token there "
                "(`ray get-auth-token --generate`), or unset RAY_AUTH_TOKEN_PATH"
            )
        return
    folder = Path.home() / ".ray"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    made = folder / "auth_token"
    with (
        contextlib.suppress(FileExistsError),  # the user's own, as it is
        os.fdopen(os.open(made, flags, 0o600), "w") as token,
    ):
        token.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate`


def local_token(address: str) -> None:
    """Send the token if `address` is the local runtime and it runs with token auth.

    Ray's drivers send it only in token mode (RAY_AUTH_MODE=token); without it they
    retry for 20 s, then fail with InvalidAuthToken. Other clusters are left to Ray.
    """
    record = discovery.runtime_record(address)
    if record is not None and record.auth == "token" and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        _ray_compat.reload_auth_mode()  # Ray read its config at import


_sent_at_hand = False
"""Whether `send_token_at_hand` turned Ray's token mode on in this process."""


def send_token_at_hand() -> bool:
    """Send this user's token from now on, where one is at hand and Ray's token mode was
    not chosen: True if Ray now finds one to send.

    A cluster started with `ray start --head` where ~/.ray/auth_token exists runs with
    token authentication, but Ray's drivers send the token only in token mode
    (RAY_AUTH_MODE=token): without it they retry for 20 s, then fail. Ray's own loader
    looks where it would in that mode: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token. A mode the user set (`disabled` too) is left as it is.
    """
    global _sent_at_hand  # noqa: PLW0603 - Ray's mode is one per process
    if os.environ.get("RAY_AUTH_MODE"):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    if _ray_compat.reload_auth_mode() and _ray_compat.auth_headers():
        _sent_at_hand = True
        return True
    del os.environ["RAY_AUTH_MODE"]
    _ray_compat.reload_auth_mode()
    return False


def withdraw_token() -> None:
    """Undo `send_token_at_hand` (the cluster refused that token too)."""
    global _sent_at_hand  # noqa: PLW0603 - Ray's mode is one per process
    if _sent_at_hand and os.environ.get("RAY_AUTH_MODE") == "token":
        del os.environ["RAY_AUTH_MODE"]
        _ray_compat.reload_auth_mode()
    _sent_at_hand = False


def where_from() -> str:
    """Where Ray took this process's token from, as a user would look for it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if custom := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={custom}"
    return "~/.ray/auth_token"
