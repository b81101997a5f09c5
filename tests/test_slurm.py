"""A rendered job on a real Slurm cluster: munged, slurmctld and three slurmd on
this machine (tests/slurm_cluster.py; slurm-wlm and munge are installed with
apt-get when absent; skipped with the reason without root).

One test, 35-60 s on the 2 busy cores (three rounds of Python processes
starting and importing torch: the first agents, the replacement, the rerun;
and about 6 s in which Slurm holds the requeued job): sbatch a
rendered job of two agent nodes and one spare on three slurmd; while it runs,
the second agent node fails as Slurm sees a node failure (`scontrol update
State=DOWN`: slurmctld removes the node from the job, which `--no-kill` keeps
alive, and kills the job's step on it); the script starts a replacement agent
on the spare, whose worker the survivor heals, the survivor keeping its PID;
then SIGTERM to the batch shell alone (`scancel --batch --signal=TERM`, what
`--signal=B:TERM@grace` delivers before the time limit) becomes an emergency
checkpoint; the script requeues the job; the rerun resumes from that checkpoint
and finishes (COMPLETED); each run commits its steps exactly once; `elastrain
slurm status` shows the job and its members.
"""

from __future__ import annotations

import os
import re
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


def node_state(cluster: LocalSlurm, node: str) -> str:
    return cluster.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip()


def slurm_node_of(pid: int) -> str | None:
    """The Slurm node a live process runs on (slurmstepd puts SLURMD_NODENAME in a
    step's environment; the agent's workers inherit it); None once it is gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in environ:
        if kv.startswith(b"SLURMD_NODENAME="):
            return kv.split(b"=", 1)[1].decode()
    return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_lost_node_is_replaced_on_the_spare_and_the_requeued_rerun_resumes(
    cluster: LocalSlurm, tmp_path: Path
) -> None:
    steps = 300
    # Paced until the notice, so that the job cannot end before it; the rerun runs at
    # full speed.
    pace = tmp_path / "pace"
    pace.write_text("0.1")
    job_id = submit(cluster, tmp_path, "--ckpt-every", "10", steps=steps,
                    script_args=("--pace-file", str(pace)))  # fmt: skip
    run_dir = tmp_path / "run"
    n0, n1, spare = cluster.nodes
    survivor, lost, replacement = f"{n0}-r0-w0", f"{n1}-r0-w0", f"{spare}-r0-w0"

    def events() -> list[dict[str, Any]]:
        return read_events(run_dir) if (run_dir / "events").is_dir() else []

    def commits_of(member: str) -> list[dict[str, Any]]:
        return [e for e in events() if e["kind"] == "step_commit" and e["proc"] == member]

    wait_until(lambda: len(commits_of(survivor)) >= 3 and len(commits_of(lost)) >= 3,
               "3 steps committed by both workers", cluster)  # fmt: skip
    ev = events()
    agent_pid = {e["proc"]: e["pid"] for e in ev if e["proc"].startswith("agent-")}
    pid_of = {e["member"]: e["pid"] for e in ev if e["kind"] == "worker_spawned"}
    assert slurm_node_of(pid_of[survivor]) == n0 and slurm_node_of(pid_of[lost]) == n1
    # n1 fails as Slurm sees a node failure: slurmctld removes it from the job
    # (--no-kill: the job goes on) and kills the job's step on it, agent and worker.
    # Slower steps leave the replacement time to start before the job could end.
    pace.write_text("0.3")
    t_fail = time.time()
    r = cluster.run("scontrol", "update", f"NodeName={n1}", "State=DOWN",
                    "Reason=elastrain test: node failure")  # fmt: skip
    assert r.returncode == 0, r.stderr
    wait_until(lambda: len(commits_of(replacement)) >= 2,
               "the replacement on the spare node to commit 2 steps", cluster)  # fmt: skip
    spawned = {e["member"]: e for e in events() if e["kind"] == "worker_spawned"}
    assert spawned[replacement]["proc"] == f"agent-{spare}-r0"
    assert slurm_node_of(spawned[replacement]["pid"]) == spare  # it runs on the spare
    # Slurm killed the failed node's agent and worker (slurmd kills the step after
    # slurmctld has told srun: waited for, not assumed).
    wait_until(lambda: not alive(agent_pid[f"agent-{n1}-r0"]) and not alive(pid_of[lost]),
               f"the agent and worker on {n1} to be killed", cluster, timeout=30)  # fmt: skip
    # The failed node is back (ReturnToService=2 and its slurmd answers): the rerun
    # gets all three nodes again.
    wait_until(lambda: node_state(cluster, n1) == "idle", f"{n1} back in service", cluster)

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
    assert f"spare: {spare}" in out
    # How srun reports the step Slurm killed on the failed node is a race inside Slurm:
    # status 0 once the node has left the allocation, or the kill's (137, "task 0:
    # Killed") when slurmd's kill reaches srun first. The script replaces it either way.
    replaced = (
        re.escape(f"the agent step on {n1} ended with status ")
        + (r"(0, its node removed from the allocation \(a node failure\)|137)")
        + re.escape(f": a replacement agent starts on spare node {spare}")
    )
    assert re.search(replaced, out), out
    assert "requeueing job" in out and "training finished" in out
    first, second = runs(read_events(run_dir))

    # The node failure: the survivor kept its process; the replacement ran on the
    # spare and was healed by the survivor.
    assert {e["member"] for e in first if e["kind"] == "worker_spawned"} == {
        survivor, lost, replacement}  # fmt: skip
    commits_in = {m: [e for e in first if e["kind"] == "step_commit" and e["proc"] == m]
                  for m in (survivor, lost, replacement)}  # fmt: skip
    t = {m: sorted(e["t"] for e in commits_in[m]) for m in commits_in}
    assert t[survivor][0] < t_fail < t[survivor][-1]  # before and after the failure,
    assert {e["pid"] for e in commits_in[survivor]} == {pid_of[survivor]}  # one PID
    assert t[lost][-1] < t[replacement][0]
    roles = {e["role"] for e in first if e["kind"] == "heal_end" and e["proc"] == replacement}
    assert roles == {"recv"}, "the replacement was not healed by the survivor"

    # The notice and the requeue: the rerun resumes from the emergency checkpoint.
    emergency = [e for e in first if e["kind"] == "checkpoint_emergency" and e["ok"]]
    assert emergency, "no emergency checkpoint in the first run"
    saved = max(e["step"] for e in emergency)
    loaded = [e for e in second if e["kind"] == "checkpoint_loaded"]
    assert {e["step"] for e in loaded} == {saved} and len(loaded) == 2
    # The rerun is a new allocation of all three nodes: agents on the first two again.
    assert {e["member"] for e in second if e["kind"] == "worker_spawned"} == {
        f"{n0}-r1-w0", f"{n1}-r1-w0"}  # fmt: skip
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
