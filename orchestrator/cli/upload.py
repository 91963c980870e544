"""What `orchestrator run` ships: the working dir after excludes, measured before upload."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator import _ray_compat
from orchestrator.errors import LaunchError
from orchestrator.show.text import format_size

DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "node_modules",
    "wandb",
    "mlruns",
    "lightning_logs",
    "checkpoints",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.safetensors",
)
"""Never shipped unless --no-default-excludes: environments, caches, checkpoints, run logs."""
DEFAULT_MAX_UPLOAD = 100 * 1024**2
"""Largest working dir shipped without --max-upload (Ray's own hard limit is 512 MiB)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Measurement:
    """What a working dir upload would hold, after excludes."""

    total: int
    files: int
    entries: list[tuple[str, int]]
    """Top-level files and folders with their sizes, biggest first."""


def parse_size(text: str) -> int:
    """Bytes in '500M', '2G', '1.5GB', '800MiB' or a plain number of bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size; e.g. 500M, 2G, 1.5GB or 1048576")
    power = " KMGT".index((match[2] or " ").upper())
    return int(float(match[1]) * 1024**power)


def measure(root: Path, excludes: Sequence[str]) -> Measurement | None:
    """The size of `root` as Ray would package it: after `excludes`, .gitignore, .rayignore.

    None where Ray's packaging cannot be asked (then Ray's own limit applies).
    """
    root = root.absolute()
    sizes: dict[str, int] = {}
    files = 0

    def count(path: Path) -> None:
        nonlocal files
        if path.is_file():
            top = path.relative_to(root).parts[0]
            label = top + "/" if (root / top).is_dir() else top
            sizes[label] = sizes.get(label, 0) + path.stat().st_size
            files += 1

    if not _ray_compat.walk_upload(root, list(excludes), count):
        return None
    entries = sorted(sizes.items(), key=lambda item: -item[1])
    return Measurement(sum(sizes.values()), files, entries)


def check_upload(root: Path, excludes: Sequence[str], limit: int) -> Measurement | None:
    """Measure `root`; raise LaunchError naming the biggest entries if it exceeds `limit`.

    None where it cannot be measured (Ray's own limit then applies).
    """
    measured = measure(root, excludes)
    if measured is None or measured.total <= limit:
        return measured
    biggest = measured.entries[:5]
    lines = [
        f"the working dir {root} holds {format_size(measured.total)} in {measured.files} "
        f"files after excludes, more than the {format_size(limit)} limit for shipping it "
        "to every node. Biggest entries:",
        *(f"  {format_size(size):>10}  {name}" for name, size in biggest),
        "Leave them out with --exclude (gitignore patterns, repeatable), e.g. "
        f"--exclude {biggest[0][0].rstrip('/')}; or list them in .gitignore or .rayignore;",
        f"or raise the limit, e.g. --max-upload {_round_up(measured.total)}; or pass "
        "--no-upload when every node sees this folder at the same path (a shared "
        "filesystem).",
    ]
    raise LaunchError("\n".join(lines))


def _round_up(size: int) -> str:
    gib = size / 1024**3
    return f"{int(gib) + 1}G" if gib >= 1 else f"{int(size / 1024**2) + 1}M"
