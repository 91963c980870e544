"""`python -m orchestrator.run ...`: `orchestrator run`, as `python -m torch.distributed.run`
is torchrun."""

from __future__ import annotations

import sys

from orchestrator.cli import main as _main


def main(argv: list[str] | None = None) -> int:
    """`orchestrator run` with these arguments (default: this process's); the exit status."""
    return _main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
