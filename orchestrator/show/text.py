"""The driver's text helpers, one place for all: durations, rank ranges, sizes,
resources, and where a rank ran."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def clock(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rank_label(ranks: Collection[int]) -> str:
    """`ranks` as runs: [0, 1, 2, 3, 5] -> "0-3,5"."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_rank(rank: int, local_rank: int, node_ip: str, hostname: str, pid: int) -> str:
    """'rank 2 (local rank 0) on 10.0.0.2 (host h, pid 123)'; no pid before it had one."""
    process = f", pid {pid}" if pid else ""
    return f"rank {rank} (local rank {local_rank}) on {node_ip} (host {hostname}{process})"


def format_resources(resources: Mapping[str, float]) -> str:
    """CPU/GPU/custom resources as 'CPU: 2, GPU: 1' (no memory or node markers)."""
    keys = sorted(
        k for k in resources if not k.startswith(("node:", "bundle_group_")) and "memory" not in k
    )
    return ", ".join(f"{k}: {resources[k]:g}" for k in keys)


def format_size(size: float) -> str:
    """'1.5 GB', '12 MB', '640 B' (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return (
                f"{size:.0f} {unit}"
                if unit == "B"
                else f"{size:.1f}".removesuffix(".0") + f" {unit}"
            )
        size /= 1024
    return f"{size:.1f} TB"


def printable(text: str) -> str:
    """`text` with each character a terminal acts on or hides (control and format
    characters, lone surrogates) escaped as Python writes it: ESC as \\x1b. For what the
    cluster records (a job's id, name, BY, nodes, state, supervisor), which any token
    holder may write, never for a rank's own output."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(ord(char)) for char in text)


def _escaped(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
