"""A rendered job on a real Slurm cluster: munged, slurmctld and one slurmd on
this machine (tests/slurm_cluster.py; slurm-wlm and munge are installed with
apt-get when absent; skipped with the reason without root).

One test, 40-60 s on the 2 busy cores (two start-ups of the Python processes
importing torch, and about 6 s in which Slurm holds the requeued job): sbatch
a rendered job of two agent nodes and one spare on three slurmd; SIGTERM to the batch shell alone (`scancel --batch
--signal=TERM`, what `--signal=B:TERM@grace` delivers before the time limit)
becomes an emergency checkpoint; the script requeues the job; the rerun
resumes from that checkpoint and finishes (COMPLETED); each run commits its
steps exactly once; `elastrain slurm status` shows the job and its members.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once

from .conftest import MLP, ROOT
from .slurm_cluster import LocalSlurm, ensure_installed, unavailable
from .test_elastic import expected_ids

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        ensure_installed()
    except RuntimeError as e:
        pytest.skip(str(e))
    cl = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        yield cl
    finally:
        cl.close()


def submit(
    cluster: LocalSlurm, tmp: Path, *render_args: str, steps: int, script_args: tuple[str, ...] = ()
) -> str:
    """Render a CPU job of 2 nodes x 1 worker + 1 spare node and sbatch it; the job id."""
    job = tmp / "job.sbatch"
    r = subprocess.run(
        [sys.executable, "-m", "elastrain.cli", "slurm", "render", "--nodes", "2",
         "--spare-nodes", "1", "--gpus-per-node", "0", "--workers-per-node", "1", "--time", "10", "--grace", "60",
         "--run-dir", str(tmp / "run"), "--elastrain", f"{sys.executable} -m elastrain.cli",
         *render_args, "-o", str(job), MLP, "--", "--steps", str(steps), *script_args],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    env = {**cluster.env, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["sbatch", "--parsable", "--chdir", str(tmp), "--output",
                        str(tmp / "slurm-%j.out"), str(job)],
                       env=env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job_fields(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    out = cluster.run("scontrol", "-o", "show", "job", job_id).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_until(cond: Any, what: str, cluster: LocalSlurm, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{cluster.logs()}"
        time.sleep(0.2)  # polling slurmctld's and the job's state


def runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events split at each coordinator start: one list per run of the job."""
    starts = sorted(e["t"] for e in events if e["kind"] == "coordinator_start")
    bounds = [*starts[1:], float("inf")]
    return [[e for e in events if a <= e["t"] < b] for a, b in zip(starts, bounds, strict=True)]


def test_the_notice_checkpoints_requeues_and_the_rerun_resumes(
    cluster: LocalSlurm, tmp_path: Path
) -> None:
    steps = 150
    # Paced until the notice, so that the job cannot end before it; the rerun runs at
    # full speed.
    pace = tmp_path / "pace"
    pace.write_text("0.1")
    job_id = submit(cluster, tmp_path, "--ckpt-every", "10", steps=steps,
                    script_args=("--pace-file", str(pace)))  # fmt: skip
    run_dir = tmp_path / "run"

    def committed() -> int:
        return sum(1 for e in read_events(run_dir) if e["kind"] == "step_commit") if (
            run_dir / "events").is_dir() else 0  # fmt: skip

    wait_until(lambda: committed() >= 40, "20 steps committed by both workers", cluster)
    # What --signal=B:TERM@grace delivers before the time limit: the batch shell alone.
    r = cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: int(job_fields(cluster, job_id).get("Restarts", "0")) >= 1,
               "the script to requeue the job", cluster)  # fmt: skip
    pace.write_text("0")
    wait_until(lambda: job_fields(cluster, job_id).get("JobState") in ("COMPLETED", "FAILED",
               "CANCELLED", "TIMEOUT"), "the rerun to end", cluster, timeout=300)  # fmt: skip
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert job_fields(cluster, job_id)["JobState"] == "COMPLETED", out
    assert "requeueing job" in out and "training finished" in out
    first, second = runs(read_events(run_dir))
    emergency = [e for e in first if e["kind"] == "checkpoint_emergency" and e["ok"]]
    assert emergency, "no emergency checkpoint in the first run"
    saved = max(e["step"] for e in emergency)
    loaded = [e for e in second if e["kind"] == "checkpoint_loaded"]
    assert {e["step"] for e in loaded} == {saved} and len(loaded) == 2
    # One agent on each of the first two nodes, none on the spare, in both runs.
    n0, n1, spare = cluster.nodes
    for i, run in enumerate((first, second)):
        assert {e["member"] for e in run if e["kind"] == "worker_spawned"} == {
            f"{n0}-r{i}-w0", f"{n1}-r{i}-w0"}  # fmt: skip
    assert f"spare: {spare}" in out
    for run in (first, second):
        led = check_exactly_once(run, expected_ids)
        assert [v for v in led.violations if not v.startswith("steps never committed")] == []
    commits = sorted({e["step"] for e in second if e["kind"] == "step_commit"})
    assert commits == list(range(saved, steps)), "the rerun did not continue where it stopped"
    r = subprocess.run([sys.executable, "-m", "elastrain.cli", "slurm", "status", job_id,
                        "--run-dir", str(run_dir)],
                       env={**cluster.env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"job {job_id} COMPLETED" in r.stdout, r.stdout
    assert f"(2): {n0}-r1-w0, {n1}-r1-w0" in r.stdout, r.stdout
