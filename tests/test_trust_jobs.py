"""The detached jobs' registry, listing and names against a second token holder (issue 55,
items 5-7): a record that cannot be read, a fake supervisor, a spoofed $USER, and one job
name used by several users (docs/trust.md: "Detached jobs belong to whoever holds the
token")."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from orchestrator import ConfigError, _ray_compat, distribute, get_job, list_jobs
from orchestrator.cli import main
from orchestrator.supervise import registry
from orchestrator.supervise.supervisor import NAMESPACE
from tests.helpers import ROOT, wait_for, wait_resources_back

NAME = "trustjobs"


def nap(seconds: float) -> int:
    """Sleep `seconds`; this rank's number."""
    time.sleep(seconds)
    return int(os.environ["RANK"])


@pytest.fixture(scope="module")
def fn(cluster: Any) -> Iterator[Any]:
    """One detached function of one rank for the module: its supervisor serves every test."""
    with distribute(
        nap,
        num_replicas=1,
        detach=True,
        address=cluster.address,
        name=NAME,
        idle_timeout=30,
        retention=60,
    ) as detached:
        yield detached
    wait_resources_back(timeout=30)


def _as_user(monkeypatch: pytest.MonkeyPatch, user: str) -> None:
    """This process claims to be `user` (what getpass.getuser() reads first)."""
    monkeypatch.setenv("LOGNAME", user)
    monkeypatch.setenv("USER", user)


def _cli(address: str, *commands: str) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each `orchestrator COMMAND`, run one after another
    in one fresh process (which has named no record yet)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    script = (
        "import sys\nfrom orchestrator.cli import main\n"
        f"for argv in {[[*c.split(), '--address', address] for c in commands]!r}:\n"
        "    code = main(argv)\n"
        "    print(f'\\n=== exit {code}', flush=True)\n"
        "    print('\\n=== exit', file=sys.stderr, flush=True)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    out = re.split(r"\n=== exit (-?\d+)\n", ran.stdout)
    errs = ran.stderr.split("\n=== exit\n")
    said = zip(out[0:-1:2], out[1::2], errs[: len(commands)], strict=True)
    return [(int(code), text, err) for text, code, err in said]


def _main(capfd: Any, address: str, command: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `orchestrator COMMAND`, run in this process."""
    capfd.readouterr()
    code = main([*command.split(), "--address", address])
    out, err = capfd.readouterr()
    return code, out, err


LISTED = {
    "supervisors/supervisor-huge-abcdef": json.dumps({"name": "huge", "started": 10**400}).encode(),
    "supervisors/supervisor-deep-abcdef": b"[" * 100_000 + b"]" * 100_000,
    "listing/supervisor-fake-abcdef": b"\xff\xfe not UTF-8",
    "supervisors/\udcff\udcfe": json.dumps({"name": "odd", "started": 1}).encode(),
}
"""Records that the listing reads, each of a kind that broke it for every user: a huge
number (OverflowError), deep nesting (RecursionError), a value and a key that are not
UTF-8 (UnicodeDecodeError)."""
POOL = "pools/0123456789abcdef"
"""A warm pool's record, read by a driver that asks for that pool: here not UTF-8."""


def _shown(key: str) -> str:
    """`key` as a warning names it (and `orchestrator stop` takes it): escaped."""
    return key.replace("\udcff", "\\udcff").replace("\udcfe", "\\udcfe")


def test_a_bad_record_is_skipped_named_once_and_removed_by_stop(cluster, fn, capfd):
    job = fn.submit(0)
    assert job.result(timeout=60) == [0]
    for key, value in {**LISTED, POOL: b"\xff\xfe"}.items():
        _ray_compat.kv_put(key, value)
    try:
        capfd.readouterr()
        for _ in range(2):
            assert job.id in {info.id for info in list_jobs()}
            assert registry.pool_supervisor(POOL) is None
        assert get_job(job.id, show=False).result(timeout=30) == [0]
        said = capfd.readouterr().err
        for key in [*LISTED, POOL]:  # each named once, with what removes it
            assert said.count(f"skipped {shlex.quote(_shown(key))} in") == 1, said
        assert said.count("removes it") == len(LISTED) + 1, said
        readable = f"supervisors/{job.record.supervisor}"
        listed, logs, refused, *removed = _cli(
            cluster.address,
            "jobs",
            f"logs {job.id}",
            f"stop {readable}",
            *(f"stop {_shown(key)}" for key in [*LISTED, POOL]),
        )
        assert listed[0] == 0 and job.id in listed[1], listed
        assert all(listed[2].count(f"{_shown(key)}") == 2 for key in LISTED), listed[2]
        assert logs[0] == 0, logs
        assert refused[0] != 0 and "can be read" in refused[2], refused
        assert len(removed) == len(LISTED) + 1, removed
        assert all(code == 0 and "removed" in out for code, out, _ in removed), removed
        assert not {*LISTED, POOL} & set(_ray_compat.kv_keys("")), "a bad record stayed"
        assert registry.readable(readable), "a record that can be read was removed"
    finally:
        for key in [*LISTED, POOL]:
            _ray_compat.kv_delete(key)
        job.release()


def test_listing_and_finding_never_unpickle_what_a_fake_supervisor_answers(
    cluster, fn, tmp_path, capfd
):
    """A second token holder registers an actor as a supervisor whose every answer leaves
    a mark where it is unpickled: listing, and finding one's own job by id or name, ask
    it nothing (its jobs, a warm pool it claims, what it finds)."""
    mark = tmp_path / "unpickled"

    class Mark:
        """An answer whose unpickling creates the file `mark` (code run by the receiver),
        then is `answer`, as a supervisor of the earlier format would answer."""

        def __init__(self, answer: Any) -> None:
            self.answer = answer

        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (eval, (f"open({str(mark)!r}, 'a').close() or {self.answer!r}",))

    class Fake:
        def find(self, _id: str) -> Any:
            return Mark(pickle.dumps(None))

        def jobs(self) -> Any:
            return Mark(pickle.dumps([]))

        def pool_info(self) -> Any:
            return Mark(None)

    fake_name = "supervisor-fake-abcdef"
    fake = ray.remote(num_cpus=0)(Fake).options(name=fake_name, namespace=NAMESPACE).remote()
    registry.keep_supervisor(fake_name, NAME)  # claims the function's name
    registry.keep_pool("pools/feedfacefeedface", fake_name)
    job = fn.submit(0)
    try:
        assert job.result(timeout=60) == [0]
        assert job.id in {info.id for info in list_jobs()}
        assert get_job(job.id, show=False).id == job.id
        assert get_job(NAME, show=False).id == job.id  # this user's newest of the name
        with pytest.raises(ConfigError, match=f"{fake_name}, of an earlier version"):
            get_job(f"{NAME}-000000", show=False)  # one it might keep: not asked
        listed = _main(capfd, cluster.address, "jobs")
        logs = _main(capfd, cluster.address, f"logs {job.id}")
        assert not mark.exists(), "the driver unpickled what a fake supervisor answered"
        assert listed[0] == 0 and job.id in listed[1], listed
        assert f"{fake_name}  earlier version" in listed[1], listed  # one that answers by Ray
        assert logs[0] == 0, logs
    finally:
        registry.forget_supervisor(fake_name)
        registry.remove("pools/feedfacefeedface")
        ray.kill(fake)
        job.release()


def test_a_user_name_with_escape_sequences_is_listed_escaped(cluster, fn, monkeypatch, capfd):
    """BY is what the submitter claims ($USER): a name that erases the row above it is
    printed with its control characters escaped; the API returns it as recorded."""
    spoof = "eve\x1b[1A\x1b[2K"
    with monkeypatch.context() as patch:
        _as_user(patch, spoof)
        job = fn.submit(0)
    try:
        assert job.result(timeout=60) == [0]
        assert {info.user for info in list_jobs() if info.id == job.id} == {
            f"{spoof}@{os.uname().nodename}"
        }
        code, out, _ = _main(capfd, cluster.address, "jobs")
        assert code == 0 and "eve\\x1b[1A\\x1b[2K@" in out, out
        assert "\x1b" not in out, out
    finally:
        job.release()


def test_a_job_name_reaches_the_caller_s_own_jobs_and_asks_for_an_id_otherwise(
    cluster, fn, monkeypatch, capfd
):
    """alice's job, then bob's newer one of the same name: alice's `stop NAME` stops hers,
    not bob's; carol, who has none, is asked for an id, never given one of theirs."""
    jobs = {}
    for user, seconds in (("alice", 120), ("bob", 0)):
        with monkeypatch.context() as patch:
            _as_user(patch, user)
            jobs[user] = fn.submit(seconds)  # bob's waits behind alice's
    alice, bob = jobs["alice"], jobs["bob"]
    try:
        wait_for(alice.running, 60, "alice's job running")
        with monkeypatch.context() as patch:
            _as_user(patch, "carol")
            with pytest.raises(ConfigError, match=f"{alice.id} \\(by alice@.*{bob.id} \\(by bob@"):
                get_job(NAME, show=False)
            carol = _main(capfd, cluster.address, f"logs {NAME}")
            assert carol[0] != 0 and alice.id in carol[2] and bob.id in carol[2], carol
            assert "Give the job's id" in carol[2], carol
            _as_user(patch, "alice")
            assert get_job(NAME, show=False).id == alice.id
            stopped = _main(capfd, cluster.address, f"stop {NAME}")
        assert stopped[0] == 0 and f"stopped job {alice.id}" in stopped[1], stopped
        wait_for(alice.done, 30, "alice's job stopped")
        assert alice.cancelled() and not bob.cancelled()
    finally:
        for job in (alice, bob):
            job.cancel()
            wait_for(job.done, 30, f"{job.id} done")
            job.release()
