"""Secrets never show in a repr (docs/trust.md): the job's secret, lease tokens and the
doors' keys, in every type that holds them, pickled peers included."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import pkgutil
import re
from collections.abc import Callable

import pytest

import orchestrator
import orchestrator_workers
from orchestrator.hook import Start, Started
from orchestrator.runner import _Entry
from orchestrator.supervise import direct
from orchestrator_workers.protocol import (
    NO_LEASE,
    CallSpec,
    Lease,
    NodeInfo,
    Peer,
    RemoteNode,
    Used,
)

SECRET = b"\xde\xad\xbe\xef-secret-0123456789"
"""A known secret: its bytes, their escapes and its hex are looked for in every repr."""


def _shown(text: str, secret: bytes = SECRET) -> bool:
    """Whether `text` shows `secret` in any form a repr or a log line would."""
    forms = (repr(secret)[2:-1], secret.hex(), secret.decode("latin-1"), "secret-0123456789")
    return any(form in text for form in forms)


def _peers() -> bytes:
    """Every rank's Peer, pickled as a pool's node carries them: the door keys inside."""
    return pickle.dumps([Peer(0, "orchestrator-door", 1234, b"spec", key=SECRET)])


def _call() -> direct.DirectCall:
    return direct.DirectCall(b"call-id", SECRET, 29500, token=SECRET, lend=SECRET)


HOLDERS: dict[str, Callable[[], object]] = {
    "DirectCall": _call,
    "Loan": lambda: direct.Loan("pool", SECRET, 29500, False, peers=_peers()),
    "Lease": lambda: Lease(SECRET, SECRET),
    "Used": lambda: Used(b"call-id", SECRET),
    "Started": lambda: Started(b"call-id", SECRET, 29500),
    "Start": lambda: Start(SECRET),
    "runner._Entry": lambda: _Entry(None, None, None, None, None, _call(), SECRET),  # type: ignore[arg-type]
    "RemoteNode": lambda: RemoteNode(None, (2, 3), _peers()),
    "Peer": lambda: Peer(0, "orchestrator-door", 1234, b"spec", key=SECRET),
    "NodeInfo": lambda: NodeInfo("node", "10.0.0.1", "host", 1234, (), None, door_key=SECRET),
    "CallSpec": lambda: CallSpec(29500, 0, 0, "share", False, job_secret=SECRET),
}
"""Every type that holds a secret, made with SECRET in each such field."""


@pytest.mark.parametrize("make", HOLDERS.values(), ids=HOLDERS.keys())
def test_no_secret_shows_in_a_repr_or_str(make: Callable[[], object]) -> None:
    holder = make()
    assert _shown(repr(SECRET)) and _shown(repr(_peers()))  # the check sees them where shown
    assert not _shown(repr(holder)), repr(holder)
    assert not _shown(str(holder)), str(holder)
    assert not _shown(f"{[holder]} {(holder,)} {dict(held=holder)}")  # inside containers too


def test_a_start_s_lease_still_compares_and_reads_as_before() -> None:
    assert Lease() == NO_LEASE and Lease(None, SECRET) != NO_LEASE
    sent = pickle.dumps(Lease(SECRET, b"next"))  # as Ray sends it to rank 0
    assert pickle.loads(sent) == Lease(SECRET, b"next")  # noqa: S301 - our own


_SECRET_NAME = re.compile(r"secret|token|lend|key|peers|password|auth_", re.IGNORECASE)
_NOT_SECRET = {
    ("CallSpec", "share_key"),
    ("RankSpec", "share_key"),  # names a call's /dev/shm buffers
    ("CallView", "key"),  # the call's id, as share_key
    ("Notice", "key"),  # what a notice is about
}
"""Fields whose names look secret and are not."""


def test_every_dataclass_field_named_as_a_secret_is_kept_out_of_its_repr() -> None:
    """A guard for types to come: a field named like a secret is `repr=False`."""
    shown = []
    for package in (orchestrator, orchestrator_workers):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if module.name.endswith("__main__"):
                continue
            for value in vars(importlib.import_module(module.name)).values():
                if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
                    continue
                for each in dataclasses.fields(value):
                    name = (value.__name__, each.name)
                    if _SECRET_NAME.search(each.name) and each.repr and name not in _NOT_SECRET:
                        shown.append(f"{value.__module__}.{value.__qualname__}.{each.name}")
    assert not shown, f"shown in a repr: {sorted(set(shown))}; use field(repr=False)"
