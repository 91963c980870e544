"""Section 4 of bench_core: memory of ranks, Ray's daemons, drivers and references."""

from __future__ import annotations

import contextlib
import json
import os

import psutil

from benchmarks.core.common import (
    PYTHON,
    RANKS,
    Check,
    SectionResult,
    Settings,
    Table,
    clean_env,
    fmt_mb,
    launch,
    progress,
    tagged_processes,
    torchrun,
    train_args,
    train_kwargs,
)


def ray_processes_rss_mb(exclude: set[int]) -> tuple[int, float]:
    """(count, total RSS) of this run's Ray processes other than `exclude` and this one."""
    tmpdir = os.environ.get("RAY_TMPDIR", "")
    procs = [p for p in tagged_processes("RAY_TMPDIR", tmpdir) if p.pid not in exclude]
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss / (1 << 20)
    return len(procs), total


def run(s: Settings) -> SectionResult:
    """Memory of ranks (ours vs torchrun workers), of Ray's daemons, drivers and references."""
    import ray

    from benchmarks._jobs import train, trivial
    from benchmarks._memory import memory, memory_after_torch
    from orchestrator import distribute

    ranks_table = Table(
        f"4a. Memory of a rank, {RANKS} ranks (max over ranks, measured inside the job)",
        ["job", "launcher", "peak RSS", "anon RSS", "file RSS", "idle RSS"],
    )
    checks = []
    launcher_peaks = []
    daemons = (0, 0.0)
    cols = ("peak_rss_mb", "anon_mb", "file_mb")
    for label, fn, kwargs, job_name, extra in (
        ("trivial gloo job", trivial, {}, "trivial", []),
        (
            f"DDP MLP, {s.memory_train_steps} steps",
            train,
            train_kwargs(s, steps=s.memory_train_steps),
            "train",
            train_args(s, steps=s.memory_train_steps),
        ),
    ):
        progress(f"memory: {label} through distribute")
        job = distribute(fn, num_replicas=RANKS)
        ours = job(**kwargs)
        pids = job.pids()
        idle = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                idle.append(psutil.Process(pid).memory_info().rss / (1 << 20))
        daemons = ray_processes_rss_mb(set(pids))
        job.shutdown()
        progress(f"memory: {label} under torchrun")
        run, theirs = torchrun(job_name, extra)
        launcher_peaks.append(run.peak_rss_mb)
        worst_ours = {c: max(r[c] for r in ours) for c in cols}
        worst_theirs = {c: max(r[c] for r in theirs) for c in cols}
        ranks_table.rows += [
            [label, "distribute", *(fmt_mb(worst_ours[c]) for c in cols), fmt_mb(max(idle))],
            ["", "torchrun", *(fmt_mb(worst_theirs[c]) for c in cols), "-"],
            ["", "difference", *(f"{worst_ours[c] - worst_theirs[c]:+.1f} MB" for c in cols), ""],
        ]
        diff = worst_ours["peak_rss_mb"] - worst_theirs["peak_rss_mb"]
        checks.append(
            Check(
                f"rank peak RSS, ours - torchrun ({label})",
                f"{diff:+.1f} MB",
                "<= +100 MB",
                diff <= 100,
            )
        )

    progress("memory: bare Ray actor, Ray actor with torch, plain python with torch")
    bare = ray.get(ray.remote(num_cpus=1)(memory).remote())
    with_torch = ray.get(ray.remote(num_cpus=1)(memory_after_torch).remote())
    code = "import json, benchmarks._memory as m; print(json.dumps(m.memory_after_torch()))"
    plain = launch([PYTHON, "-c", code], clean_env())
    plain_torch = json.loads(plain.output.strip().splitlines()[-1])
    ray.shutdown()
    driver = memory()

    ranks_table.notes += [
        "peak: ru_maxrss at the job's end; anon: the process's own pages (RssAnon) at the "
        "job's end; file: mapped shared libraries (RssFile), shared with other processes",
        "idle: current RSS of the warm rank process after the call (ours only)",
    ]
    ref = Table(
        "4b. Memory of the other processes, and of reference processes",
        ["process", "peak RSS", "anon RSS", "file RSS"],
    )
    ref.rows += [
        [
            "this section's driver (torch, Ray driver, pools)",
            fmt_mb(driver["peak_rss_mb"]),
            fmt_mb(driver["anon_mb"]),
            fmt_mb(driver["file_mb"]),
        ],
        ["torchrun launcher (polled VmHWM, whole life)", fmt_mb(max(launcher_peaks)), "-", "-"],
        [f"Ray daemons, {daemons[0]} processes (current RSS)", fmt_mb(daemons[1]), "-", "-"],
        *(
            [name, fmt_mb(m["peak_rss_mb"]), fmt_mb(m["anon_mb"]), fmt_mb(m["file_mb"])]
            for name, m in (
                ("bare Ray actor (Ray's worker code only)", bare),
                ("Ray actor after `import torch`", with_torch),
                ("plain python after `import torch`", plain_torch),
            )
        ),
    ]
    ref.notes.append(
        f"Ray's worker code in a torch process: "
        f"{with_torch['anon_mb'] - plain_torch['anon_mb']:+.1f} MB anon, "
        f"{with_torch['file_mb'] - plain_torch['file_mb']:+.1f} MB file; "
        "Ray daemons: gcs, raylet, agents of the embedded instance (torchrun has none)"
    )
    ref.notes.append("a cold user script's driver peak: see section 1")
    return SectionResult([ranks_table, ref], checks)
