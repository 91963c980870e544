"""The `orchestrator` command: `main` parses its arguments and runs the subcommand."""

from orchestrator.cli.main import main

__all__ = ["main"]
