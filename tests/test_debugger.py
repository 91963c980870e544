"""breakpoint() and post_mortem=True in a rank: the attach line, a pdb session for the holder
of the rank's secret alone, and the call's timeout while a rank waits for one."""

from __future__ import annotations

import os
import socket
import time

import pytest

from orchestrator import JobTimeoutError, StallError, distribute
from orchestrator.cli import main
from tests.helpers import wait_resources_back

# --- without Ray ---------------------------------------------------------------------------


def test_attach_needs_the_rank_s_secret(monkeypatch, capsys):
    monkeypatch.delenv("ORCHESTRATOR_DEBUG_TOKEN", raising=False)
    assert main(["attach", "127.0.0.1:9"]) == 2
    assert "without the rank's secret" in capsys.readouterr().err


def test_the_debugger_s_greeting_has_one_deadline_and_others_greet_meanwhile(monkeypatch) -> None:
    """A client trickling a byte at a time does not hold the port while it greets, and is
    hung up on at the greeting's deadline; bytes sent with the secret, in one packet, are
    kept for pdb."""
    import threading

    from orchestrator_workers import debugger

    def serve(listener: socket.socket) -> tuple[threading.Thread, list]:
        found: list[tuple[socket.socket, bytes]] = []
        accept = debugger._accept_with
        thread = threading.Thread(target=lambda: found.append(accept(listener, "s3")))
        thread.start()
        return thread, found

    monkeypatch.setattr(debugger, "_HELLO_TIMEOUT_S", 30.0)
    listener = socket.create_server(("127.0.0.1", 0))
    waiter, found = serve(listener)
    with socket.create_connection(listener.getsockname(), timeout=10) as trickler:
        trickler.sendall(b"0")  # and nothing more for now: it greets until its deadline
        with socket.create_connection(listener.getsockname(), timeout=10) as real:
            real.sendall(b"s3\np x\n")
            waiter.join(10)
            assert found, "the real client waited behind a greeting one"
            conn, rest = found[0]
            assert rest == b"p x\n"  # the command sent with the secret is not lost
            conn.close()
        assert trickler.recv(1) == b""  # hung up on once the secret came
    listener.close()

    monkeypatch.setattr(debugger, "_HELLO_TIMEOUT_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    waiter, found = serve(listener)
    with socket.create_connection(listener.getsockname(), timeout=10) as trickler:
        started = time.monotonic()
        trickler.settimeout(0.2)
        held = 0.0
        while held < 10:  # a byte every 0.2 s: each recv alone would never time out
            try:
                trickler.sendall(b"0")
                if trickler.recv(1) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
            held = time.monotonic() - started
        assert held < 3, f"a trickling client held the greeting for {held:.1f} s"
    with socket.create_connection(listener.getsockname(), timeout=10) as real:
        real.sendall(b"s3\n")
        waiter.join(10)
    assert found and found[0][1] == b""
    found[0][0].close()
    listener.close()


# --- on the session's two-node cluster ----------------------------------------------------


def _attach_line(capfd) -> tuple[str, str, int]:
    """(secret, host, port) from the attach line a waiting rank prints."""
    import re

    seen = ""
    deadline = time.monotonic() + 60
    line = r"DEBUG_TOKEN=([0-9a-f]{32}) python -m orchestrator attach ([\d.]+):(\d+)"
    while (match := re.search(line, seen)) is None:
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
        seen += capfd.readouterr().err
    return match.group(1), match.group(2), int(match.group(3))


def _intrude(host: str, port: int) -> None:
    """A port scan (connect, hang up), a wrong secret, and a client that says nothing:
    each is hung up on without one byte of pdb."""
    import socket

    socket.create_connection((host, port), timeout=10).close()
    for hello in (b"0" * 32 + b"\n", b""):  # a guess; and silence until hung up on
        with socket.create_connection((host, port), timeout=30) as conn:
            conn.sendall(hello)
            assert conn.recv(4096) == b""


def _rank_state(job, rank: int, wanted: str) -> None:
    """Wait until job.status() shows rank `rank` in state `wanted` (it comes with the output)."""
    deadline = time.monotonic() + 30
    while (state := job.status().ranks[rank].state) != wanted:
        assert time.monotonic() < deadline, (state, wanted)
        time.sleep(0.1)


def _talk(host: str, port: int, token: str, commands: list[str], on_prompt=None) -> str:
    """Attach with `token` and drive the rank's pdb with `commands`; the transcript."""
    import socket

    def until_prompt(conn: socket.socket) -> bytes:
        data = b""
        while not data.rstrip().endswith(b")"):  # "(Pdb rank N) "
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(token.encode() + b"\n")
        transcript = until_prompt(conn)
        if on_prompt is not None:
            on_prompt()
        for command in commands:
            conn.sendall(command.encode() + b"\n")
            transcript += until_prompt(conn)
        return transcript.decode()


def test_breakpoint_on_one_rank_opens_a_debugger_the_driver_can_attach_to(cluster, capfd):
    def stop_on_rank_1() -> int:
        secret = 6 * 7
        if os.environ["RANK"] == "1":
            breakpoint()
        return secret

    fn = distribute(stop_on_rank_1, num_replicas=2, replicas_per_node=1)
    job = fn.submit()
    token, host, port = _attach_line(capfd)
    _rank_state(job, 1, "waiting for a debugger")
    _rank_state(job, 0, "finished")  # its outcome may come after rank 1's state, under load
    status = job.status()
    assert status.state == "running" and status.ranks[0].state == "finished", status
    assert "rank 1 waits for a debugger" in str(status), status
    _intrude(host, port)  # the rank keeps waiting for the real client
    assert job.status().ranks[1].state == "waiting for a debugger" and not job.done()
    transcript = _talk(
        host,
        port,
        token,
        ["p secret + 1", "c"],
        on_prompt=lambda: _rank_state(job, 1, "in a debugger"),
    )
    assert job.result(timeout=60) == [42, 42]
    assert "43" in transcript
    assert job.status().ranks[1].state == "finished"
    fn.shutdown()


def test_a_rank_waiting_for_a_debugger_is_stopped_by_the_call_s_timeout(cluster, capfd):
    def stop_on_rank_0() -> int:
        if os.environ["RANK"] == "0":
            breakpoint()
        return 1

    # A rank at a breakpoint makes no "no progress" report, even one that would raise.
    fn = distribute(
        stop_on_rank_0,
        num_replicas=2,
        replicas_per_node=1,
        timeout=8,
        stall_after=2,
        on_stall="raise",
    )
    job = fn.submit()
    _, host, port = _attach_line(capfd)
    _rank_state(job, 0, "waiting for a debugger")
    _intrude(host, port)
    with pytest.raises(JobTimeoutError) as info:
        job.result(timeout=60)
    assert not isinstance(info.value, StallError), info.value
    assert "_accept_with" in info.value.stacks[0]  # where it was: waiting for the secret
    fn.shutdown()
    wait_resources_back()


def test_post_mortem_opens_the_failing_frame(cluster, capfd):
    import threading

    def fail_on_rank_0() -> None:
        culprit = {"lr": -1}
        if os.environ["RANK"] == "0":
            raise ValueError("negative learning rate")
        del culprit

    fn = distribute(fail_on_rank_0, num_replicas=2, replicas_per_node=1, post_mortem=True)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    token, host, port = _attach_line(capfd)
    transcript = _talk(host, port, token, ["p culprit", "c"])
    caller.join(timeout=60)
    assert "{'lr': -1}" in transcript
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    fn.shutdown()
