"""How much memory this process holds; imports nothing heavy (usable in a bare Ray actor)."""

from __future__ import annotations

import resource


def memory() -> dict[str, float]:
    """This process's peak RSS and its current anonymous and file-backed RSS, in MiB.

    File-backed pages (shared libraries) are shared between processes and how many of
    them count varies with the page cache; anonymous pages are this process's own.
    """
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    fields = {"RssAnon": "anon_mb", "RssFile": "file_mb", "RssShmem": "shmem_mb"}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in fields:
                out[fields[name]] = int(rest.split()[0]) / 1024
    return out


def memory_after_torch() -> dict[str, float]:
    """`memory()` after `import torch, torch.distributed`."""
    import torch.distributed

    del torch
    return memory()
