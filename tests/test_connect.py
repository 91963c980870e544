"""Connecting to a cluster that is not there: a clear error within seconds, in fresh processes."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.connect import cluster, probe, refusals
from orchestrator.errors import ClusterUnreachableError
from tests.helpers import http2_server

ROOT = Path(__file__).resolve().parent.parent

UNREACHABLE = textwrap.dedent("""\
    import os, socket, sys, threading, time
    from orchestrator import ClusterUnreachableError, distribute

    def f():
        return 1

    silent = socket.socket()  # accepts, then says nothing
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    other = socket.socket()  # answers, but not as Ray
    other.bind(("127.0.0.1", 0))
    other.listen()

    def answer():
        conn, _ = other.accept()
        conn.recv(100)
        conn.sendall(b"HTTP/1.1 400 Bad Request\\r\\n\\r\\n")

    greeter = socket.socket()  # speaks HTTP/2's greeting, then nothing: not a gRPC server
    greeter.bind(("127.0.0.1", 0))
    greeter.listen()

    def greet():
        conn, _ = greeter.accept()
        conn.recv(100)
        conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an empty SETTINGS frame
        time.sleep(60)

    threading.Thread(target=answer, daemon=True).start()
    threading.Thread(target=greet, daemon=True).start()
    addresses = ["127.0.0.1:1", f"127.0.0.1:{silent.getsockname()[1]}",
                 f"127.0.0.1:{other.getsockname()[1]}", f"127.0.0.1:{greeter.getsockname()[1]}",
                 "ray://127.0.0.1:1", sys.argv[1], "env"]
    for address in addresses:
        if address == "env":
            os.environ["RAY_ADDRESS"] = "127.0.0.1:1"
        started = time.monotonic()
        try:
            distribute(f, num_replicas=1, address=None if address == "env" else address)()
        except ClusterUnreachableError as exc:
            print(f"{time.monotonic() - started:.1f}", exc, flush=True)
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_an_address_where_no_ray_answers_fails_within_seconds(processes, tmp_path):
    script = tmp_path / "unreachable.py"
    script.write_text(UNREACHABLE)
    with http2_server("404", "text/html") as web:
        proc = subprocess.run(
            [sys.executable, str(script), web],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 7, proc.stdout + proc.stderr
    took = [float(line.split()[0]) for line in lines]
    assert max(took) < 30, lines  # seconds (the silent one's 5), where Ray's took minutes
    refused, silent, other, greeter, client, web, env = lines
    assert "address='127.0.0.1:1'" in refused and "Connection refused" in refused
    assert "did not answer within 5 s" in silent
    assert "does not answer as a Ray GCS" in other
    assert "does not answer as a Ray GCS" in greeter  # Ray's connect would hang for minutes
    assert "address='ray://127.0.0.1:1'" in client
    assert "does not answer as a Ray GCS" in web
    assert "HTTP status 404, content-type text/html" in web
    assert "RAY_ADDRESS='127.0.0.1:1'" in env
    for line in lines:
        assert "`ray start --head`" in line or "head" in line  # says what to do


def test_the_command_line_fails_fast_on_an_unreachable_address(processes, tmp_path):
    (tmp_path / "train.py").write_text("print('never')\n")
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "run",
            "--address",
            "127.0.0.1:1",
            "--nproc",
            "1",
            "train.py",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert time.monotonic() - started < 60  # no hang; the probe's words below: no Ray retries
    assert proc.returncode == 1, proc.stderr
    assert "no Ray cluster at" in proc.stderr and "127.0.0.1:1" in proc.stderr, proc.stderr
    assert "never" not in proc.stdout


@pytest.mark.parametrize(
    ("status", "content_type", "answers"),
    [
        ("200", "application/grpc", True),  # any gRPC status: UNIMPLEMENTED here
        ("200", "application/grpc+proto", True),
        ("404", "text/html", False),  # a web server that speaks HTTP/2
        ("200", "text/html", False),
        ("503", "application/grpc", False),
    ],
)
def test_only_a_grpc_answer_counts_as_ray(status: str, content_type: str, answers: bool) -> None:
    """A server that answers a gRPC call with HTTP/2 but not as gRPC is not Ray's: Ray's own
    connect would wait on it for minutes."""
    with http2_server(status, content_type) as address:
        found = probe.problem(address)
        if answers:
            assert found is None
            probe.check_reachable(address, "address")
            return
        assert found == (
            f"{address} accepts connections but does not answer as a Ray GCS (`ray start "
            f"--head --port`) would (it answered a gRPC call with HTTP status {status}, "
            f"content-type {content_type})"
        )
        with pytest.raises(ClusterUnreachableError, match="give the address of the cluster's"):
            probe.check_reachable(address, "address")


@pytest.mark.parametrize(
    ("scheme", "token", "said"),
    [
        ("ray://", "", "refused a driver without its token"),
        ("ray://", "t0", "refused this driver's Ray token"),
        ("", "t0", "refused this driver's Ray token"),
        ("", "", "refused a driver without its token"),  # a GCS: Ray would retry for 20 s
    ],
)
def test_a_server_that_refuses_the_token_is_said_so_at_once(
    monkeypatch, scheme: str, token: str, said: str
) -> None:
    """gRPC's UNAUTHENTICATED: Ray's own connect would wait 30 s, then say "connection
    timeout" (through ray://), or retry for 20 s and fail with its raw ConnectionError."""
    from orchestrator import _ray_compat

    headers = {"authorization": f"Bearer {token}"} if token else {}
    monkeypatch.setattr(_ray_compat, "auth_headers", lambda: headers)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # chosen: no token at hand is looked for
    with http2_server("200", "application/grpc", grpc_status="16") as address:
        found = probe.problem(scheme + address)
        assert found is not None and found.startswith(said), found
        with pytest.raises(ClusterUnreachableError, match="the cluster's token") as raised:
            probe.check_reachable(scheme + address, "address")
    assert str(raised.value).startswith(f"the Ray cluster at address='{scheme}{address}'")


def test_a_long_token_goes_into_the_probe_s_headers_whole() -> None:
    """HPACK lengths of 127 and more take more than one byte."""
    import hpack

    for size in (1, 126, 127, 128, 300, 20_000):
        value = b"Bearer " + b"t" * size
        block = probe._request_headers(b"/a/b", "h:1", {"authorization": value.decode()})
        assert hpack.Decoder().decode(block)[-1] == ("authorization", value.decode())


def test_ray_s_refusal_of_another_ray_or_python_is_said_in_one_line():
    """Ray's own refusal (its check, given a cluster of another Ray and Python), wrapped."""
    from ray._private.utils import check_version_info

    with pytest.raises(RuntimeError) as refused:
        check_version_info({"ray_version": "2.59.0", "python_version": "3.10.14"}, "node 10.0.0.9")
    error = refusals.version_mismatch(str(refused.value), "10.0.0.1:6379")
    assert error is not None
    here = ".".join(map(str, sys.version_info[:3]))
    import ray

    assert str(error) == (
        f"the Ray cluster at 10.0.0.1:6379 runs Ray 2.59.0 on Python 3.10.14, this driver "
        f"Ray {ray.__version__} on Python {here}: Python and Ray must be the same. Use "
        "a venv made with Python 3.10.14 with ray==2.59.0 in it here, or start the cluster "
        "with this driver's"
    )
    assert "\n" not in str(error)
    with pytest.raises(RuntimeError) as refused:
        check_version_info({"ray_version": "2.59.0", "python_version": here}, "node 10.0.0.9")
    error = refusals.version_mismatch(str(refused.value), "10.0.0.1:6379")
    assert str(error).endswith(
        "Ray must be the same. Use ray==2.59.0 here, or start the cluster with this driver's"
    )
    assert refusals.version_mismatch("some other RuntimeError", "10.0.0.1:6379") is None


def test_a_client_server_that_died_at_birth_is_asked_for_again():
    """Ray's proxier reports its session server's death in its own words, or (a race of its
    own) as the traceback of psutil's ZombieProcess from its check of that process."""
    said = "Initialization failure from server:\nTraceback (most recent call last):\n"
    own = ConnectionAbortedError(said + "RuntimeError: Starting Ray client server failed.")
    zombie = ConnectionAbortedError(
        said + '  File "proxier.py", line 396, in start_specific_server\n'
        "    cmd = psutil_proc.cmdline()\npsutil.ZombieProcess: PID still exists but it's a "
        "zombie (pid=16794)\n"
    )
    assert refusals.server_died(own) and refusals.server_died(zombie)
    assert not refusals.server_died(ConnectionAbortedError(said + "PermissionError: token"))
    assert not refusals.server_died(RuntimeError("Starting Ray client server failed"))


def test_a_call_between_two_ray_client_sessions_counts_as_a_lost_session(monkeypatch):
    """Through Ray Client, what Ray raises between the lost session and the next one sends
    a follower to `rejoin` (which waits for the thread making it), not to an error."""
    monkeypatch.setattr(cluster, "_joined", "ray://head:10001")
    monkeypatch.setattr(cluster, "_broken", False)
    for words in (
        "Ray Client is not connected. Please connect by calling `ray.init`.",
        "Ray has not been started yet. You can start Ray with 'ray.init()'.",
    ):
        assert cluster.lost_session(Exception(words)), words
    assert not cluster.lost_session(RuntimeError("the rank's own error"))
    monkeypatch.setattr(cluster, "_joined", "10.0.0.1:6379")  # a node: no sessions
    assert not cluster.lost_session(Exception("Ray Client is not connected"))
    # A handle from before another thread's new session: void, found again by name (not a
    # lost session, which would make yet another one).
    void = Exception("Can't run an actor the server doesn't have a handle for")
    assert cluster.void_handle(void) and not cluster.lost_session(void)
    assert not cluster.void_handle(RuntimeError("the rank's own error"))


TOKEN_AT_HAND = textwrap.dedent("""\
    import sys, time
    from orchestrator import ClusterUnreachableError, distribute

    def rank():
        import os
        return int(os.environ["RANK"])

    started = time.monotonic()
    try:
        print("ranks", distribute(rank, num_replicas=2, address=sys.argv[1])(), flush=True)
    except ClusterUnreachableError as exc:
        print("unreachable", exc, flush=True)
    print(f"took {time.monotonic() - started:.1f}", flush=True)
""")


def test_ray_start_head_then_an_address_just_works_with_the_token_at_hand(processes, tmp_path):
    """`ray start --head` where ~/.ray/auth_token exists turns token authentication on;
    Ray's driver sends the token only with RAY_AUTH_MODE=token, and without it retries for
    20 s, then fails with Ray's raw ConnectionError. The user's own token is sent; a driver
    without one is told what to set, from the probe's answer, not Ray's retries."""
    home, empty = tmp_path / "home", tmp_path / "empty"
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths: 107 bytes
    for folder in (home / ".ray", empty):
        folder.mkdir(parents=True, mode=0o700)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in _env().items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=str(temp), ORCHESTRATOR_LOG_DIR=str(tmp_path / "logs"))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env={**env, "RAY_AUTH_MODE": "token"},  # its own drain at SIGTERM needs it too
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "head.log").open("w"),
    )
    script = tmp_path / "driver.py"
    script.write_text(TOKEN_AT_HAND)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (temp / "ray" / "ray_current_cluster").exists():  # written once all is up
            assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
            time.sleep(0.2)
        runs = {
            who: subprocess.run(
                [sys.executable, str(script), address],
                env={**env, "HOME": str(where)},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            for who, where in (("owner", home), ("stranger", empty))
        }
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    owner, stranger = runs["owner"], runs["stranger"]
    assert "ranks [0, 1]" in owner.stdout, owner.stdout + owner.stderr
    assert "InvalidAuthToken" not in owner.stderr, owner.stderr
    said = stranger.stdout.splitlines()[0]
    assert said.startswith(
        f"unreachable the Ray cluster at address='{address}' refused a driver without its token"
    ), stranger.stdout + stranger.stderr
    assert "~/.ray/auth_token" in said and "RAY_AUTH_TOKEN" in said
    assert "gcs_client.cc" not in stranger.stderr, stranger.stderr  # none of Ray's retries
