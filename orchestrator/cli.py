"""The `orchestrator` command line: `attach` to a rank's debugger."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading


def attach(address: str) -> int:
    """Relay this terminal to the pdb a rank serves at HOST:PORT until it hangs up."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=10)
    except (OSError, ValueError) as exc:
        print(f"cannot attach to {address!r}: {exc}", file=sys.stderr)
        return 1
    conn.settimeout(None)

    def pump_input() -> None:
        with contextlib.suppress(OSError):
            for line in sys.stdin:
                conn.sendall(line.encode())

    threading.Thread(target=pump_input, daemon=True).start()
    with conn:
        while data := conn.recv(65536):
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand."""
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    attach_cmd = commands.add_parser(
        "attach",
        help="open the pdb session of a rank stopped at breakpoint() or post_mortem",
        description="Example: orchestrator attach 10.0.0.2:41234 (the address the rank printed)",
    )
    attach_cmd.add_argument("address", help="HOST:PORT printed by the waiting rank")
    args = parser.parse_args(argv)
    return attach(args.address)
