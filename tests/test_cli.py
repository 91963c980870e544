"""`orchestrator run` and `orchestrator nodes`: torchrun-style scripts on the session's Ray
cluster.

Each `run` is a fresh `python -m orchestrator` process joining the two-node cluster of
conftest.py with --address, so the working dir really travels through Ray's runtime_env.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.cli.upload import DEFAULT_EXCLUDES, check_upload, measure
from orchestrator.errors import LaunchError
from orchestrator_workers.script import Script, ScriptExit, run_script
from tests.helpers import (
    ROOT,
    TIMEOUT_S,
    TORCHRUN,
    cli,
    cli_env,
    message_lines,
    run_example,
    show,
    starting_nothing,
    wait_for,
    write,
)

# --- the rank side, in this process (no Ray) ---------------------------------------------


def test_run_script_exit_statuses_argv_and_local_rank(tmp_path, monkeypatch, capfd):
    write(
        tmp_path,
        {
            "s.py": """\
                import sys, helper
                print("ARGV", sys.argv[1:], __name__, helper.X)
                print("ARGV0", sys.argv[0])
                if sys.argv[-1] != "ok":
                    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else sys.argv[-1])
            """,
            "helper.py": "X = 7\n",
        },
    )
    monkeypatch.setenv("LOCAL_RANK", "3")
    before = (sys.argv[:], sys.path[:], os.getcwd())
    for last in ("ok", "0"):
        run_script(Script("s.py", (last,), cwd=str(tmp_path), local_rank_arg="--local-rank"))
    assert (sys.argv, sys.path, os.getcwd()) == before
    run_script(Script("s.py", ("ok",), cwd=str(tmp_path), argv0="./s.py"))
    assert "ARGV0 ./s.py" in capfd.readouterr().out  # as typed, as torchrun passes it
    for last, status in (("3", 3), ("bad news", 1)):
        with pytest.raises(ScriptExit) as caught:
            run_script(Script("s.py", (last,), cwd=str(tmp_path)))
        assert caught.value.status == status
        assert f"sys.exit({caught.value.code!r})" in str(caught.value)
        # The traceback starts in the script, where sys.exit was called.
        frames = [f.filename for f in traceback.extract_tb(caught.value.__traceback__)]
        assert frames[1:] == [str(tmp_path / "s.py")], frames
    assert (sys.argv, sys.path, os.getcwd()) == before


def test_run_script_as_module_sets_argv_like_python(tmp_path, capfd):
    write(tmp_path, {"pkg/__init__.py": "", "pkg/main.py": "import sys; print(sys.argv)\n"})
    run_script(Script("pkg.main", ("a", "--b"), module=True, cwd=str(tmp_path)))
    assert capfd.readouterr().out.strip() == str([str(tmp_path / "pkg" / "main.py"), "a", "--b"])


# --- the driver side, before anything starts ----------------------------------------------


def test_measure_honours_default_user_and_ignore_file_excludes(tmp_path):
    write(
        tmp_path,
        {
            "train.py": "x" * 100,
            "data/a.bin": "d" * 5000,
            "checkpoints/last.pt": "c" * 9000,
            "model.pt": "m" * 9000,
            ".gitignore": "secret/\n",
            "secret/keys": "s" * 9000,
            "sub/.rayignore": "*.log\n",
            "sub/run.log": "l" * 9000,
            "sub/mod.py": "y" * 10,
        },
    )
    measured = measure(tmp_path, [*DEFAULT_EXCLUDES, ".git"])
    # sub/ keeps mod.py and its .rayignore; the checkpoints, secret/ and run.log stay home.
    assert dict(measured.entries) == {"data/": 5000, "train.py": 100, "sub/": 16, ".gitignore": 8}
    assert measure(tmp_path, [*DEFAULT_EXCLUDES, "data"]).total == 124
    with pytest.raises(LaunchError) as caught:
        check_upload(tmp_path, DEFAULT_EXCLUDES, limit=1000)
    message = str(caught.value)
    assert "4.9 KB" in message and "data/" in message and "--exclude data" in message
    assert "--max-upload" in message


def test_bad_layout_is_reported_in_the_command_line_s_terms(tmp_path, capsys):
    assert main(["run", "--nproc", "4", "--per-node", "3", "x.py"]) == 2
    assert "--per-node 3 does not divide --nproc 4; valid: 1, 2, 4" in capsys.readouterr().err
    assert main(["run", "--nproc", "2", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: no such file" in capsys.readouterr().err


def test_a_syntax_error_is_shown_before_anything_starts(tmp_path, monkeypatch, capsys):
    write(tmp_path, {"broken.py": "import os\n\ndef train(:\n    pass\n"})
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--nproc", "2", "broken.py"]) == 2  # this lane refuses Ray and ranks
    err = capsys.readouterr().err
    assert "broken.py does not compile; nothing was started" in err, err
    assert 'broken.py", line 3' in err and "def train(:" in err and "SyntaxError" in err, err


def test_size_guard_refuses_before_connecting(processes, tmp_path):
    project = write(tmp_path / "p", {"train.py": "print('never')\n"})
    (project / "data").mkdir()
    (project / "data" / "blob.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    # Nothing listens at this address: reaching it would fail differently, and slowly.
    proc = cli(
        "run --nproc 2 --address 127.0.0.1:9 --max-upload 1M train.py",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 2, show(proc)
    assert "3 MB" in proc.stderr and "data/" in proc.stderr, show(proc)
    assert "--exclude data" in proc.stderr and "--max-upload" in proc.stderr
    assert "never" not in proc.stdout


# --- real runs on the session cluster ------------------------------------------------------


def test_message_passing_unchanged_under_torchrun_and_the_launcher(cluster, tmp_path):
    with ThreadPoolExecutor(1) as pool:  # the two runs share nothing: at once
        under_torchrun = pool.submit(
            run_example,
            "message_passing.py",
            "--backend=gloo",
            launcher=(str(TORCHRUN), "--standalone", "--nproc_per_node=4"),
        )
        proc = cli(
            f"run --nproc 4 --per-node 2 --address {cluster.address} "
            "examples/message_passing.py --backend=gloo",
            cwd=ROOT,
            tmp=tmp_path,
        )
        torchrun = under_torchrun.result()
    assert proc.returncode == 0, show(proc)
    lines = sorted(line for line in proc.stdout.splitlines() if line.strip())
    assert lines == message_lines("[message_passing r{}] "), show(proc)
    for line in message_lines():
        assert torchrun.stdout.count(line) == 1, torchrun.stdout


def test_resnet_guide_script_on_two_nodes(cluster, tmp_path):
    proc = cli(
        f"run --nproc 2 --per-node 1 --address {cluster.address} "
        "examples/resnet.py --arch resnet18 --use_syn --batch_size 4 --steps 2 --image-size 32",
        cwd=ROOT,
        tmp=tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert re.search(r"^\[resnet r0\] Throughput: \d+\.\d+ images/s", proc.stdout, re.M), show(proc)
    assert "resnet18: 2 rank(s), gloo" in proc.stdout


def test_working_dir_shipped_helper_imports_and_local_rank_arg(cluster, tmp_path):
    project = write(
        tmp_path / "proj",
        {
            "train.py": """\
                import argparse, os
                import helper
                parser = argparse.ArgumentParser()
                parser.add_argument("--local_rank", type=int, required=True)
                parser.add_argument("--tag")
                args = parser.parse_args()
                print(f"rank={os.environ['RANK']} local_rank={args.local_rank} "
                      f"tag={args.tag} helper={helper.VALUE} cwd={os.getcwd()} "
                      f"checkpoints={os.path.exists('checkpoints')}", flush=True)
            """,
            "helper.py": "VALUE = 'beside'\n",
            "checkpoints/big.pt": "not shipped\n",
        },
    )
    proc = cli(
        f"run --nproc 2 --per-node 1 --address {cluster.address} "
        "--local-rank-arg local_rank train.py --tag x",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert "shipping" in proc.stderr
    found = re.findall(
        r"rank=(\d) local_rank=(\d) tag=x helper=beside cwd=(\S+) checkpoints=False", proc.stdout
    )
    assert sorted(r[:2] for r in found) == [("0", "0"), ("1", "0")], show(proc)
    for _, _, cwd in found:  # each rank runs in Ray's unpacked copy, not the original
        assert cwd != str(project) and Path(cwd).name != "proj", cwd


def test_torchrun_spellings_and_a_script_outside_the_folder_on_a_cluster(cluster, tmp_path):
    """torchrun's command line with the program name swapped; the script's own folder is
    shipped when it lies outside the current one, and is its sys.path[0] on every rank."""
    write(
        tmp_path / "scripts",
        {
            "train.py": """\
                import os, sys
                import helper
                print(f"rank={os.environ['RANK']} group={os.environ['GROUP_RANK']} "
                      f"local_world={os.environ['LOCAL_WORLD_SIZE']} helper={helper.VALUE} "
                      f"path0={os.path.basename(sys.path[0]) == os.path.basename(os.getcwd())} "
                      f"args={sys.argv[1:]}", flush=True)
            """,
            "helper.py": "VALUE = 'beside'\n",
        },
    )
    here = tmp_path / "here"
    here.mkdir()
    proc = cli(
        f"run --address {cluster.address} --nnodes 2:2 --nproc_per_node gpu "
        "--master-addr 10.0.0.1 --rdzv-id x ../scripts/train.py --lr 0.1",
        cwd=here,
        tmp=tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert "(the script's folder: it is outside this one)" in proc.stderr, show(proc)
    assert "--master-addr, --rdzv-id: not needed here" in proc.stderr, show(proc)
    found = re.findall(
        r"rank=(\d) group=(\d) local_world=2 helper=beside path0=True args=\['--lr', '0.1'\]",
        proc.stdout,
    )
    # gpu: 2 per node, as Ray reports the fixture's nodes; 2 nodes.
    assert sorted(found) == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], show(proc)


def test_torchrun_spellings_on_this_machine_and_what_is_refused(processes, tmp_path, capsys):
    """On the embedded default a script elsewhere runs where it is, from the current folder."""
    write(
        tmp_path / "elsewhere",
        {
            "train.py": """\
                import os, sys
                import helper
                print(f"R{os.environ['RANK']}/{os.environ['WORLD_SIZE']} {sys.path[0]} "
                      f"{os.getcwd()} {helper.VALUE}", flush=True)
            """,
            "helper.py": "VALUE = 'beside'\n",
        },
    )
    here = tmp_path / "here"
    here.mkdir()
    script = tmp_path / "elsewhere" / "train.py"
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must be short
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator.run",
                "--standalone",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                str(script),
            ],
            cwd=here,
            env={**cli_env(tmp_path), "RAY_ADDRESS": "10.9.9.9:6379", "RAY_TMPDIR": ray_tmp},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, show(proc)
    assert "--standalone: running on an embedded Ray instance here; ignoring RAY_ADDRESS" in (
        proc.stderr
    ), show(proc)
    for rank in (0, 1):
        assert f"R{rank}/2 {script.parent} {here} beside" in proc.stdout, show(proc)
    refused = {
        "--nnodes 1:4": "an elastic range of nodes is not supported",
        "--node-rank 1": "one `orchestrator run` launches the ranks of every node",
        "--nproc 3 --nnodes 2": "cannot be spread evenly over --nnodes 2; valid --nnodes: 1, 3",
        "--nproc 6 --nnodes 2 --nproc-per-node 2": "disagrees with --nnodes 2 x",
        "--nproc-per-node lots": "give a number of ranks per node, or gpu, cpu or auto",
        "--per-node 2 --nproc-per-node 3": "disagree: give one",
    }
    for flags, said in refused.items():
        with starting_nothing("before its command line is refused"):
            assert main(["run", *flags.split(), str(script)]) == 2, flags
        assert said in capsys.readouterr().err, flags


def test_sigterm_stops_every_rank_and_says_so_in_one_line(processes, tmp_path):
    """`timeout` or a scheduler ends `orchestrator run` with SIGTERM: every rank is stopped,
    one line says so, and the exit status is a shell's for SIGTERM (Ray's crash reporter
    printed six lines of `*** SIGTERM received ***` and addresses)."""
    write(
        tmp_path,
        {
            "wait.py": """\
        import os, time
        print("PID", os.getpid(), flush=True)
        time.sleep(120)
    """
        },
    )
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # Ray's socket paths must be short
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", "--standalone", "--nproc", "2", "wait.py"],
        cwd=tmp_path,
        env={**cli_env(tmp_path), "RAY_TMPDIR": ray_tmp},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        pids = [int(line.split()[-1]) for _, line in zip(range(2), proc.stdout, strict=False)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 143, (out, err)
    assert "[orchestrator] terminated (SIGTERM): every rank of wait was stopped" in err, err
    assert "SIGTERM received" not in err and "logging.cc" not in err, err
    for pid in pids:
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), 30, f"rank pid {pid} gone")


def test_module_in_place_with_no_upload(cluster, tmp_path):
    project = write(
        tmp_path / "proj",
        {
            "pkg/__init__.py": "",
            "pkg/job.py": """\
                import os, sys
                print("MODULE", __name__, sys.argv[1:], os.getcwd(), os.environ["WORLD_SIZE"])
            """,
        },
    )
    proc = cli(
        f"run --nproc 1 --address {cluster.address} --no-upload -m pkg.job hello --flag",
        cwd=project,
        tmp=tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert f"[job r0] MODULE __main__ ['hello', '--flag'] {project} 1" in proc.stdout, show(proc)


def test_nodes_lists_each_node_with_cpus_and_gpus(cluster, tmp_path):
    proc = cli(f"nodes --address {cluster.address}", cwd=tmp_path, tmp=tmp_path)
    assert proc.returncode == 0, show(proc)
    rows = [line.split() for line in proc.stdout.splitlines()[1:-1]]
    assert [row[2:4] for row in rows] == [["4", "2"], ["4", "2"]], proc.stdout
    assert proc.stdout.splitlines()[-1] == "2 node(s): 8 CPUs, 4 GPUs in all"


def test_path_checks_follow_dots_and_symlinks(tmp_path, monkeypatch):
    """What the working dir holds is decided on resolved paths, as the ranks open them."""
    from orchestrator.cli.launch import RunOptions, script_for

    write(tmp_path, {"outside.py": "", "proj/inside.py": "", "proj/sub/x.py": ""})
    project = tmp_path / "proj"
    (project / "linked.py").symlink_to(tmp_path / "outside.py")
    (project / "alias.py").symlink_to(project / "sub" / "x.py")
    monkeypatch.chdir(project)
    for sneaky in ("../outside.py", "sub/../../outside.py", "linked.py"):
        with pytest.raises(LaunchError, match="is outside --working-dir"):
            script_for(RunOptions(sneaky, working_dir=project), shipped=True)
    assert script_for(RunOptions("sub/../inside.py"), shipped=True)[0].target == "inside.py"
    assert script_for(RunOptions("alias.py"), shipped=True)[0].target == "sub/x.py"
    # Without --working-dir, a script outside the folder is not refused: shipped, its own
    # folder goes; here, it runs where it is (both resolved first).
    shipped, folder = script_for(RunOptions("linked.py"), shipped=True)
    assert (shipped.target, folder) == ("outside.py", tmp_path)
    in_place, folder = script_for(RunOptions("../outside.py"), shipped=False)
    assert in_place.target == str(tmp_path / "outside.py")
    assert (in_place.cwd, folder) == (str(project), project)
    # sys.argv[0] as typed, as torchrun passes it, where it names the file from the ranks'
    # folder; a shipped copy is never named by this machine's absolute path.
    assert in_place.argv0 == "../outside.py"
    assert script_for(RunOptions("./sub/x.py"), shipped=True)[0].argv0 == "./sub/x.py"
    assert script_for(RunOptions(str(project / "sub/x.py")), shipped=False)[0].argv0 == str(
        project / "sub/x.py"
    )
    assert script_for(RunOptions(str(project / "sub/x.py")), shipped=True)[0].argv0 is None
    assert shipped.argv0 is None  # its own folder went: "../outside.py" names nothing there
    in_sub = RunOptions("sub/x.py", working_dir=project / "sub")  # the ranks run in sub/
    assert script_for(in_sub, shipped=False)[0].argv0 is None


CONTRACT = """\
    import json, os
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        keys = sorted(k for k in os.environ if k not in json.loads(os.environ["PARENT_KEYS"]))
        print("KEYS", os.environ["RANK"], json.dumps(keys), dist.is_torchelastic_launched(),
              os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]) != "", flush=True)
        if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
            raise ValueError("bad shard 7")

    main()
"""


def test_torchrun_s_contract_variables_and_record_reports(processes, tmp_path):
    """Every variable torchrun's agent gives a worker, a rank gets too; and an entry point
    decorated with torch's `record` is reported from its error file, as torchrun does."""
    write(tmp_path, {"contract.py": CONTRACT})
    env = cli_env(tmp_path)
    env["PARENT_KEYS"] = json.dumps([*sorted(env), "PARENT_KEYS"])

    def keys(stdout: str) -> dict[str, tuple[list[str], str, str]]:
        found = re.findall(r"KEYS (\d) (\[.*\]) (\w+) (\w+)", stdout)
        return {rank: (json.loads(names), *flags) for rank, names, *flags in found}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )

    # On a cluster (the session's, when it runs) ranks do not inherit the driver's variables.
    given = ["--env", f"PARENT_KEYS={env['PARENT_KEYS']}"]
    launch = [sys.executable, "-m", "orchestrator", "run", *given]
    with ThreadPoolExecutor(3) as pool:  # three runs that share nothing: at once
        started = [
            pool.submit(run, str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "contract.py"),
            pool.submit(run, *launch, "--nproc-per-node", "2", "contract.py"),
            pool.submit(run, *launch, "--nproc", "2", "--env", "FAIL_RANK=1", "contract.py"),
        ]
        theirs, ours, failed = (future.result() for future in started)
    assert theirs.returncode == 0, show(theirs)
    assert ours.returncode == 0, show(ours)
    their_keys, our_keys = keys(theirs.stdout), keys(ours.stdout)
    assert sorted(their_keys) == sorted(our_keys) == ["0", "1"], (show(theirs), show(ours))
    for rank in ("0", "1"):
        missing = set(their_keys[rank][0]) - set(our_keys[rank][0])
        assert not missing, missing  # TORCHELASTIC_ERROR_FILE, TORCH_NCCL_ASYNC_ERROR_HANDLING...
        assert our_keys[rank][1:] == ("True", "True")  # is_torchelastic_launched(); a file
    assert failed.returncode == 1, show(failed)
    report = failed.stderr.split("the job failed: ", 1)[1]
    first, when, where = report.splitlines()[:3]
    assert first.endswith("raised ValueError: bad shard 7"), report  # record's message
    assert when.startswith("  time      : 20") and "error_file: " in where, report
    # Kept beside the rank's log, as torchrun's stays on disk (the rank's own is gone).
    kept = Path(where.split("error_file: ", 1)[1])
    assert kept.name == "rank-1.error.json" and (kept.parent / "rank-1.log").exists(), report
    assert json.loads(kept.read_text())["message"]["message"].endswith("bad shard 7")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert 'contract.py", line 11, in main' in report and "in wrapper" in report, report
