"""`orchestrator attach HOST:PORT`: this terminal, relayed to the pdb a rank serves.

The rank serves pdb only after the client's first line is its one-time secret, which
comes in ORCHESTRATOR_DEBUG_TOKEN (never argv, which `ps` shows every user).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading

from orchestrator_workers import debugger


def attach(address: str) -> int:
    """Relay this terminal to the pdb a rank serves at HOST:PORT until it hangs up."""
    token = os.environ.get(debugger.TOKEN_VAR, "").strip()
    if not token:
        print(
            f"cannot attach to {address!r} without the rank's secret: copy the whole line the "
            f"rank printed, {debugger.TOKEN_VAR}=... included",
            file=sys.stderr,
        )
        return 2
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.sendall(token.encode() + b"\n")
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
