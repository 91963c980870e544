"""What a sibling container on the node's network runs: same uid, its own pid and mount
namespaces, no capabilities. It finds every door in /proc/net/unix and sends each a call
whose pickled spec, if unpickled, writes a marker file. Run by tests/test_trust.py under
`unshare --pid --mount --fork --mount-proc setpriv --bounding-set=-all ...`.

argv: the marker's path, how many seconds to keep each connection open, and optionally for
how many seconds to go on finding and attacking doors (a rank replaced meanwhile gets a new
one). Prints how many doors it reached and what each answered ("served", "hung up", or
"no answer" from a process that never read it, such as another test's stopped rank).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
import time


class Plant:
    """Unpickled, it writes the marker: code run in the rank."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"echo planted >> {self.marker}",))


def doors() -> list[str]:
    """The abstract socket names that look like a rank's door."""
    with open("/proc/net/unix") as table:
        names = {line.split()[-1] for line in table if "@orchestrator-" in line}
    return sorted(name[1:] for name in names)


def main(marker: str, hold_s: float, for_s: float) -> None:
    evil = pickle.dumps(Plant(marker))
    parts = [b"call-id", evil, evil, evil]
    frame = struct.pack("<4Q", *map(len, parts)) + b"".join(parts)
    until = time.monotonic() + for_s
    while True:
        found = doors()
        print(f"doors {len(found)}", flush=True)
        for name in found:
            attack(name, frame, hold_s)
        if time.monotonic() >= until:
            return


def attack(name: str, frame: bytes, hold_s: float) -> None:
    """Send the door `name` a call and say whether it answered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(hold_s + 5)
        try:
            sock.connect(f"\0{name}")
        except OSError as exc:
            print(f"{name} refused {exc}", flush=True)
            return
        try:
            sock.sendall(frame)
            answer = sock.recv(1)
        except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread
            answer = b""
        except TimeoutError:  # a process that never read it: another test's, stopped
            print(f"{name} no answer", flush=True)
            return
        print(f"{name} {'served' if answer else 'hung up'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0)
