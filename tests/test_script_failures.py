"""A bug in the script is not a hardware failure (issue 40): jobs whose script
raises, end to end (tests/scripts/train_raising.py).

(a) the leader raises after every step from step 3: the job exits 1 soon after the
second identical failure, with at most 2 replacements, naming the exception and
the line; (b) every member raises at step 5: the same, and nothing is trained
again from step 0; a whole-job death with no checkpoint stops instead of starting
over; (c) one rank of a sharded 2 x 2 job raises once: its group-mate is a shadow
within 1 s of the exit, nobody is taken for a hang, and the job ends bit for bit
as the failure-free run; (d) --max-same-error 0: replaced as before (until the
restart budget).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain.launch.launcher import LaunchConfig, Launcher
from elastrain.launch.startup import StopCause
from elastrain.observe.events import read_events
from elastrain.observe.failures import FailureKind, recognise_failures
from elastrain.observe.ledger import check_same_state, loss_curve

from .conftest import ROOT, Job, run_in_process

SCRIPT = str(ROOT / "tests" / "scripts" / "train_raising.py")
ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'scripts'}"}
BUG_LINE = next(
    i
    for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1)
    if "the planted bug" in line
)


def _job(tmp: Path, name: str, args: list[str], **kw: Any) -> Job:
    cfg = LaunchConfig(
        script=SCRIPT,
        script_args=args,
        workers=kw.pop("workers", 4),
        steps=kw.pop("steps", 20),
        run_dir=str(tmp / name),
        progress=False,
        extra_env=ENV,
        **kw,
    )
    la = Launcher(cfg)
    try:
        return Job(la, la.run())
    finally:
        for pids in la.pids.values():
            for pid in pids:
                if Path(f"/proc/{pid}").exists() and "zombie" not in (
                    Path(f"/proc/{pid}/status").read_text().lower()
                ):
                    os.kill(pid, 9)
                    pytest.fail(f"process {pid} outlived its job")


def _replacements(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "worker_spawned" and e.get("replacement")]


def _failed_exits(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "worker_exited" and e["returncode"] == 1]


def test_a_leader_raising_after_every_step_stops_the_job_with_the_error(tmp_path: Path) -> None:
    """(a), through the command line: exit status and console output."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastrain.cli", "run", "--plain", "-n", "4", "--steps", "20",
           "--run-dir", str(run_dir), SCRIPT, "--", "--raise-at", "3", "--repeat",
           "--raise-on", "leader"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**ENV, "PATH": "/usr/bin:/bin"},
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 1, out
    assert "ValueError: grad norm is None at step" in out, out
    assert f"train_raising.py:{BUG_LINE}" in out, out
    assert "not a hardware failure" in out, out
    assert "--ckpt-every" in out, out  # what to run next: no checkpoint to resume from
    events = read_events(run_dir)
    failed = _failed_exits(events)
    assert len(failed) >= 2
    end = next(e for e in events if e["kind"] == "job_end")
    assert end["t"] - sorted(e["t"] for e in failed)[1] < 30.0
    assert end["cause"] == "same_error" and end["error_type"] == "ValueError"
    assert len(_replacements(events)) <= 2
    # The stop message shows the exception once (above it, the console followed
    # the leader's log), and the final table one row for the two failures.
    stop = out[out.index("job failed") :]
    assert stop.count("  ValueError: grad norm is None at step") == 1, stop
    assert "the same error: ValueError at" in stop, stop
    # The members the launcher stopped afterwards left on purpose: no more failures.
    assert "it announced a leave" not in stop and "left" not in stop.split("failures:")[1], stop


def test_every_member_raising_at_one_step_stops_and_trains_nothing_twice(tmp_path: Path) -> None:
    """(b): four identical failures at once stop at the second; no replacement ever
    trains, so no step is trained again from scratch."""
    job = _job(tmp_path, "all", ["--raise-at", "5"])
    assert job.result.status == "failed"
    assert "ValueError" in job.result.message and f":{BUG_LINE}" in job.result.message
    assert len(_replacements(job.events)) <= 2
    commits = job.of("step_commit")
    assert {e["step"] for e in commits} == set(range(6))
    starts = [e["step"] for e in job.of("generation_start")]
    assert starts == [0] * len(starts)  # one generation, from step 0, never again
    ends = job.of("job_end")
    assert ends[0]["t"] - sorted(e["t"] for e in _failed_exits(job.events))[1] < 30.0


class _Ended:
    """A worker process that has exited (what `Launcher` asks of its procs)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return 1


def test_a_replacement_waits_until_every_exit_already_happening_is_read(
    tmp_path: Path,
) -> None:
    """Every member raised at one step: the launcher read w0's exit and its
    replacement comes due while the others' exits are still in the queue. The
    whole-job-death rule is not asked until they are read (the same-error rule
    names the bug at the second); it once stopped the job as a whole-job death
    with no checkpoint, saying nothing of the error. An exit that never comes
    does not hold a replacement past `EXIT_READ_WAIT_S`."""
    from elastrain.launch import launcher as launcher_mod
    from elastrain.launch.launcher import Worker

    script = tmp_path / "job.py"
    script.write_text("")
    la = Launcher(LaunchConfig(script=str(script), workers=4, run_dir=str(tmp_path / "run")))
    la.status = {"step": 5, "members": ["w0", "w1", "w2", "w3"]}
    for i, m in enumerate(("w0", "w1", "w2", "w3")):
        la.workers[m] = Worker(m, _Ended(101 + i), 0.0, replacement=False)
    assert la._on_exit("w0", 101, 1) is None  # one failure: a replacement is due at once
    assert [(what, arg) for _, _, what, arg in la._timers] == [("spawn", ("w0", 101))]
    la._timers.clear()
    la._on_timer("spawn", ("w0", 101))
    assert not la._stop.is_set()  # held: no decision, no replacement
    assert [(what, arg) for _, _, what, arg in la._timers] == [("spawn", ("w0", 101))]
    # The others' exits are read (`_on_exit` takes them out of `workers`): only now
    # is the job's death decided (here with no exit records: the job-death rule).
    la._timers.clear()
    la.workers.clear()
    la._on_timer("spawn", ("w0", 101))
    assert la._stop.is_set() and "every member died" in la._stop_reason[1]
    # An unread exit holds a replacement for at most EXIT_READ_WAIT_S.
    late = Launcher(LaunchConfig(script=str(script), workers=2, run_dir=str(tmp_path / "late")))
    late.status = {"step": 5, "members": ["w0", "w1"]}
    for i, m in enumerate(("w0", "w1")):
        late.workers[m] = Worker(m, _Ended(300 + i), 0.0, replacement=False)
    assert late._on_exit("w0", 300, 1) is None
    late._on_timer("spawn", ("w0", 300))
    assert not late._stop.is_set()
    late._spawn_held[("w0", 300)] -= launcher_mod.EXIT_READ_WAIT_S
    late._on_timer("spawn", ("w0", 300))
    assert late._stop.is_set()


def test_a_whole_job_death_after_committed_steps_without_a_checkpoint_stops(
    tmp_path: Path,
) -> None:
    """(b) with the same-error rule off: every member dies, there is no checkpoint,
    and the job stops saying how to resume instead of training from step 0."""
    job = _job(tmp_path, "death", ["--raise-at", "5"], max_same_error=0)
    assert job.result.status == "failed"
    msg = job.result.message
    assert "every member died after the job had committed" in msg, msg
    assert "--ckpt-every" in msg
    assert not [e for e in job.of("step_commit") if e["proc"] not in ("w0", "w1", "w2", "w3")]


def test_max_same_error_zero_replaces_as_before_until_the_restart_budget(tmp_path: Path) -> None:
    """(d): the leader keeps raising; with the rule off every failure is replaced
    as before this issue, until the restart budget (or a whole-job death, when
    the replacements cannot heal as fast as the leaders die) ends the loop."""
    job = _job(
        tmp_path,
        "zero",
        ["--raise-at", "3", "--repeat", "--raise-on", "leader"],
        max_same_error=0,
        max_replacements=3,
    )
    assert job.result.status == "failed"
    # The same ValueError three times or more did not stop the job (the rule at
    # its default would have at the second).
    assert len(_failed_exits(job.events)) >= 3
    # The first failure's replacement is a fresh process (no standby exists yet).
    assert _replacements(job.events)
    (end,) = job.of("job_end")
    if end["cause"] == StopCause.BUDGET:
        # Three replaced, the fourth over the budget. Not three fresh processes
        # started: a replacement waiting as a standby may take a later failure's
        # slot (its refill is still due when the job stops).
        assert end["count"] == 4, end
        assert "restart budget" in job.result.message
    else:
        # The leader dies at every step, faster than a replacement heals: the last
        # member holding the state can die before the replacement for the one
        # before it starts, and that replacement is refused as a whole-job death
        # (no checkpoint) instead of counted.
        assert end["cause"] == StopCause.JOB_DEATH, end
        assert "every member died" in job.result.message


def test_a_sharded_rank_raising_once_makes_its_group_mate_a_shadow_not_a_hang(
    tmp_path: Path,
) -> None:
    """(c): 2 x 2, w1 raises once after step 5. Its group-mate learns it at once (its
    collective fails as the crashed process's sockets close; the launcher reports
    the exit): a shadow within 1 s, nobody suspected, and the loss curve the
    failure-free run's bit for bit (that run: one member in this process, whose
    curve a failure-free 2 x 2 job's equals bit for bit)."""
    ref = run_in_process(SCRIPT, tmp_path / "ref", 20)
    once = tmp_path / "once"
    args = ["--shard-size", "2", "--raise-at", "5", "--raise-on", "w1", "--once", str(once)]
    job = _job(tmp_path, "crash", args, shard_size=2)
    assert job.result.status == "done", job.result.message
    exit_t = next(e["t"] for e in job.of("worker_exited", member="w1"))
    slots = {e["proc"]: (e["replica"], e["shard"]) for e in job.of("generation_start", gen=1)}
    mate = next(m for m, (r, _) in slots.items() if r == slots["w1"][0] and m != "w1")
    after = [e for e in job.of("generation_start") if e["proc"] == mate and e["t"] > exit_t - 1]
    first = next(e for e in after if "w1" not in e["members"])
    assert first["t"] - exit_t < 1.0, first["t"] - exit_t
    removed = job.of("member_removed", member="w1")
    assert [e["reason"] for e in removed] == ["exited"]
    assert not [e for e in job.of("member_removed") if e["reason"] not in ("exited", "done")]
    failures = recognise_failures(job.events)
    assert [(f.member, f.kind) for f in failures] == [("w1", FailureKind.CRASH)]
    reported = job.of("exit_reported", member="w1")
    assert reported[0]["error_type"] == "ValueError"
    assert reported[0]["error_where"].endswith(f"train_raising.py:{BUG_LINE}")
    assert check_same_state(job.events) == []
    a, b = loss_curve(ref.events), loss_curve(job.events)
    assert list(a) == list(b) == list(range(20))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]]
