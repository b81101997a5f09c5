"""`elastrain slurm status JOBID`: Slurm's view of a job and the run directory's.

Slurm's side comes from `squeue` (a pending or running job), `sacct` (a
finished one, where accounting is on) or `scontrol show job` (a finished one
slurmctld still remembers, MinJobAge, when accounting is off); elastrain's from the run directory's
events: the members of the newest generation and the goodput summary of
`elastrain report`. Parsing and formatting are pure functions; `query` and
`show` are the thin I/O around them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SQUEUE_FORMAT = "%i|%T|%M|%l|%D|%N|%r|%Z"
"""squeue -o: job id, state, time used, limit, node count, nodes, reason, working dir."""

SACCT_FIELDS = "JobID,State,Elapsed,Timelimit,NNodes,NodeList,Reason,WorkDir"
"""sacct -o, in the same order as SQUEUE_FORMAT."""

_KEYS = ("job_id", "state", "elapsed", "limit", "nodes", "nodelist", "reason", "workdir")


@dataclass(frozen=True)
class SlurmJob:
    """One job as squeue or sacct reports it (strings as Slurm prints them)."""

    job_id: str
    state: str
    elapsed: str
    limit: str
    nodes: str
    nodelist: str
    reason: str
    workdir: str
    source: str
    """"squeue", "sacct" or "scontrol": which command answered."""


def parse_job_line(text: str, job_id: str, source: str) -> SlurmJob | None:
    """The line of `job_id` (not one of its steps) in `|`-separated squeue/sacct output;
    None when there is none."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < len(_KEYS) or parts[0] != job_id:
            continue
        return SlurmJob(**dict(zip(_KEYS, parts[: len(_KEYS)], strict=True)), source=source)
    return None


SCONTROL_KEYS = ("JobId", "JobState", "RunTime", "TimeLimit", "NumNodes", "NodeList", "Reason",
                 "WorkDir")  # fmt: skip
"""`scontrol -o show job`'s keys, in the order of SQUEUE_FORMAT."""


def parse_scontrol_job(text: str, job_id: str) -> SlurmJob | None:
    """The job from `scontrol -o show job JOBID` (one line of KEY=VALUE words)."""
    for line in text.splitlines():
        kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if kv.get("JobId") == job_id:
            return SlurmJob(
                **dict(zip(_KEYS, (kv.get(k, "") for k in SCONTROL_KEYS), strict=True)),
                source="scontrol",
            )
    return None


def current_members(events: Sequence[Mapping[str, Any]]) -> tuple[int | None, list[str]]:
    """(generation, members) of the newest `generation_ready`; (None, []) before any."""
    ready = [e for e in events if e.get("kind") == "generation_ready"]
    if not ready:
        return None, []
    last = max(ready, key=lambda e: float(e.get("t", 0.0)))
    return int(last["gen"]), sorted(str(m) for m in last.get("members", []))


def format_job(job: SlurmJob | None, note: str) -> str:
    """Slurm's lines of the status; `note` says why there is no job when `job` is None."""
    if job is None:
        return f"slurm: {note}"
    lines = [
        f"slurm ({job.source}): job {job.job_id} {job.state}, {job.elapsed} of {job.limit}, "
        f"{job.nodes} node(s) {job.nodelist}"
    ]
    if job.reason and job.reason not in ("None", "(null)"):
        lines.append(f"  reason: {job.reason}")
    return "\n".join(lines)


def format_members(gen: int | None, members: list[str]) -> str:
    if gen is None:
        return "members: none yet (no generation formed)"
    return f"members of generation {gen} ({len(members)}): {', '.join(members)}"


Runner = Callable[[list[str]], tuple[int, str, str]]
"""Runs a command: (exit status, stdout, stderr)."""


def run_command(argv: list[str]) -> tuple[int, str, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, "", str(e)
    return r.returncode, r.stdout, r.stderr


def query(
    job_id: str,
    run: Runner = run_command,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[SlurmJob | None, str]:
    """The job from squeue, else sacct; with None, a message saying why there is none
    (no Slurm commands here, unknown job, accounting off)."""
    tried = []
    for cmd, argv in (
        ("squeue", ["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT]),
        ("sacct", ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", SACCT_FIELDS]),
        ("scontrol", ["scontrol", "-o", "show", "job", job_id]),
    ):
        if which(cmd) is None:
            tried.append(f"{cmd} not found")
            continue
        rc, out, err = run(argv)
        if rc == 0:
            job = (
                parse_scontrol_job(out, job_id)
                if cmd == "scontrol"
                else parse_job_line(out, job_id, cmd)
            )
            if job is not None:
                return job, ""
            tried.append(f"{cmd} does not know job {job_id}")
        else:
            tried.append(f"{cmd} failed: {(err or out).strip() or f'exit {rc}'}")
    if all(t.endswith("not found") for t in tried):
        return None, "squeue, sacct and scontrol are not found here: Slurm's state is not shown"
    return None, "; ".join(tried)


def show(
    job_id: str,
    run_dir: Path | None,
    run: Runner = run_command,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[int, str]:
    """The whole status text and an exit status (0; 1 when neither Slurm nor a run
    directory could say anything about the job)."""
    from elastrain.observe.events import read_events
    from elastrain.observe.report import format_summary, report_from_events

    job, note = query(job_id, run, which)
    parts = [format_job(job, note)]
    if run_dir is None:
        parts.append("run directory: not given (--run-dir DIR): no members or goodput")
        return (0 if job is not None else 1), "\n".join(parts)
    if not (run_dir / "events").is_dir():
        parts.append(f"run directory {run_dir}: no events/ (has the job started?)")
        return (0 if job is not None else 1), "\n".join(parts)
    ev = read_events(run_dir)
    parts.append(format_members(*current_members(ev)))
    parts.append(format_summary(report_from_events(ev, str(run_dir))))
    return 0, "\n".join(parts)
