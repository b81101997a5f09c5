"""Durable state end to end: real jobs (coordinator + worker processes) that write
checkpoints, die, get rerun on the same run directory and resume; damaged
checkpoints; a full disk; SIGTERM to the whole job. Each run is compared with a
failure-free reference run of the same seed (40 steps)."""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from elastrain import env
from elastrain.checkpoint import latest_verified, load
from elastrain.checkpoint.files import committed_steps, list_steps, shard_file_name, step_dir
from elastrain.checkpoint.store import _verify
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer
from elastrain.data import GlobalOrder
from elastrain.exitcodes import EXIT_PREEMPTED
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve

from .conftest import MLP, ROOT, Job, stop_processes

STEPS, EVERY, WORKERS = 40, 5, 2
# Every member waits after step 12 until the checkpoint of step 10 (and any before it
# that was begun) is committed or given up (tests/scripts/checkpoint_gate.py).
AWAIT_10 = ["--await-checkpoint", "10@12"]
"""Script arguments of a run whose checkpoints must commit before a kill 8 steps later."""
NOTICE_PACE_S = 1.0
"""Seconds per step of the job a preemption notice ends (see its test)."""
B, SEED, DATASET = 32, 7, 4096


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


@dataclass
class Reference:
    run_dir: Path
    events: list[dict[str, Any]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The failure-free run every test compares with: the same script and seed,
    trained in this process as a single member (the math does not depend on
    membership; test_elastic checks that), checkpointing every EVERY steps
    (the last 3 kept). In-process to spare the suite a job's process start-up."""
    d = tmp_path_factory.mktemp("durable-ref") / "ref"
    spec = importlib.util.spec_from_file_location("train_mlp_ref", MLP)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    srv = CoordinatorServer(CoordinatorConfig(target=1), "ref-token", run_dir=str(d))
    srv.start()
    worker_env = {
        env.COORDINATOR: srv.address,
        env.TOKEN: "ref-token",
        env.MEMBER_ID: "w0",
        env.RUN_DIR: str(d),
        env.STEPS: str(STEPS),
        env.CKPT_EVERY: str(EVERY),
        env.CKPT_DIR: str(d / "checkpoints"),
        env.RESUME: "none",
    }
    errors: list[BaseException] = []

    def train() -> None:
        try:
            script.main()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        # Paced (>= 0.1 s a step): a checkpoint whose predecessor is still writing is
        # skipped by design, and the tests below need every one of the reference's
        # (on a loaded machine unpaced steps outran the writer and step 40 was skipped).
        argv = [MLP, "--min-step-s", "0.1"]
        path = [str(Path(MLP).parent), *sys.path]  # as when run: its directory first
        with (
            mock.patch.dict(os.environ, worker_env),
            mock.patch.object(sys, "argv", argv),
            mock.patch.object(sys, "path", path),
        ):
            # Off the main thread, so the trainer leaves pytest's SIGTERM handler alone.
            t = threading.Thread(target=train, name="reference-worker")
            t.start()
            t.join(timeout=300)
    finally:
        srv.stop()
    assert not t.is_alive() and not errors, errors
    ref = Reference(d, read_events(d))
    assert sorted(loss_curve(ref.events)) == list(range(STEPS))
    return ref


def since_last_start(job: Job) -> list[dict[str, Any]]:
    """The events of the latest run in the run directory (a rerun appends to it)."""
    t0 = max(e["t"] for e in job.events if e["kind"] == "job_start")
    return [e for e in job.events if e["t"] >= t0]


def assert_resumed(job: Job, ref: Reference, step: int) -> None:
    """The latest run resumed at `step` on every member and followed the reference."""
    assert job.result.status == "done", job.result.message
    assert job.result.resumed_from == step
    ev = since_last_start(job)
    loaded = [e for e in ev if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == WORKERS and {e["step"] for e in loaded} == {step}
    first_gen = next(e for e in ev if e["kind"] == "generation_ready")
    assert first_gen["start_step"] == step and set(first_gen["steps"].values()) == {step}
    commits = sorted({e["step"] for e in ev if e["kind"] == "step_commit"})
    assert commits == list(range(step, STEPS)), "the rerun did not continue where it stopped"
    assert check_same_state(ev) == []
    led = check_exactly_once(ev, expected_ids)
    assert [v for v in led.violations if not v.startswith("steps never committed")] == []
    # Same step, same data, same RNG: the loss curve continues the reference's.
    a, b = loss_curve(ref.events), loss_curve(ev)
    for s in range(step, STEPS):
        assert math.isclose(a[s], b[s], rel_tol=1e-5), f"step {s}: {a[s]} vs {b[s]}"
    np.testing.assert_allclose(
        np.load(job.run_dir / "final" / "w0.npy"),
        np.load(ref.run_dir / "final" / "w0.npy"),
        rtol=1e-5,
        atol=1e-6,
    )


def test_every_worker_killed_then_rerun_resumes_from_the_last_checkpoint(
    run_job, reference
) -> None:  # type: ignore[no-untyped-def]
    kill_at = 13
    first = run_job(
        steps=STEPS,
        workers=WORKERS,
        checkpoint_every=EVERY,
        replace=False,
        # The test needs the checkpoints before the kill at step 13 decided; rank 0
        # commits in a background thread, so every member waits for that after step 12
        # (under load steps reached the kill before the step-5 checkpoint's commit, seen
        # once in `make test` beside `stress --cpu 1`).
        script_args=AWAIT_10,
        points=[
            {"member": m, "step": kill_at, "phase": "compute", "action": "kill"}
            for m in ("w0", "w1")
        ],
    )
    assert first.result.status == "failed"
    assert {e["member"] for e in first.of("fault_injected")} == {"w0", "w1"}
    assert {e["returncode"] for e in first.of("worker_exited")} == {-signal.SIGKILL}
    ckpt_dir = first.run_dir / "checkpoints"
    newest = latest_verified(ckpt_dir)
    # Step 10's, unless a member skipped it because its step-5 write was still
    # running (seen beside `stress --cpu 1`): then step 5's.
    assert newest is not None and newest.step in (EVERY, 2 * EVERY)
    assert committed_steps(ckpt_dir)[-1] == newest.step
    # Rerun the job on the same run directory.
    second = run_job(steps=STEPS, workers=WORKERS, checkpoint_every=EVERY)
    assert second.run_dir == first.run_dir
    assert_resumed(second, reference, newest.step)
    assert committed_steps(ckpt_dir)[-1] == STEPS


def _torch_loaded(path: Path, hidden: int = 256) -> dict[str, Any]:
    """A DCP checkpoint read by torch's own loader (no process group) into
    train_mlp.py's plain model and Adam state, by flattened name (as `load` names
    a flat checkpoint's tensors)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    sd = model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    optim = {n: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                 "exp_avg_sq": torch.zeros_like(p)} for n, p in model.named_parameters()}  # fmt: skip
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd, "optim": {"state": optim}}, checkpoint_id=str(path))
    out: dict[str, Any] = {f"model/{k}": v for k, v in sd.items()}
    for i, n in enumerate(names):
        out.update({f"optim/{i}/{k}": v for k, v in optim[n].items()})
    return out


def test_dcp_format_job_killed_then_rerun_resumes_and_torch_loads_its_checkpoint(
    run_job, reference
) -> None:  # type: ignore[no-untyped-def]
    """--ckpt-format dcp: every member writes its rows as a DCP data file, rank 0
    commits; every worker killed, the rerun resumes from that checkpoint and
    follows the reference, and torch's `dcp.load` reads the last checkpoint into
    a plain model and Adam state equal to the reference's at that step."""
    import torch

    first = run_job(
        steps=STEPS,
        workers=WORKERS,
        checkpoint_every=EVERY,
        checkpoint_format="dcp",
        replace=False,
        script_args=AWAIT_10,  # a checkpoint must commit before the kill (see above)
        points=[
            {"member": m, "step": 13, "phase": "compute", "action": "kill"} for m in ("w0", "w1")
        ],
    )
    assert first.result.status == "failed"
    ckpt_dir = first.run_dir / "checkpoints"
    newest = latest_verified(ckpt_dir)
    assert newest is not None and newest.step in (EVERY, 2 * EVERY)
    assert newest.kind == "dcp" and newest.num_shards == WORKERS  # one part per member
    files = sorted(p.name for p in newest.path.iterdir())
    assert "__0_0.distcp" in files and "__1_0.distcp" in files and ".metadata" in files
    assert not any(f.endswith(".safetensors") for f in files)
    saved = [e for e in first.of("checkpoint_saved") if e["step"] == newest.step]
    assert sorted(e["proc"] for e in saved) == ["w0", "w1"]
    # Rerun on the same run directory, still DCP: it resumes from that checkpoint.
    second = run_job(steps=STEPS, workers=WORKERS, checkpoint_every=EVERY,
                     checkpoint_format="dcp")  # fmt: skip
    assert_resumed(second, reference, newest.step)
    last = latest_verified(ckpt_dir)
    assert last is not None and last.step == STEPS and last.kind == "dcp"
    ref = latest_verified(reference.run_dir / "checkpoints")
    assert ref is not None and ref.step == STEPS and ref.kind == "flat"
    want, _ = load(ref)
    got = _torch_loaded(last.path)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_flat_checkpoint_resumes_into_a_dcp_format_job(
    run_job, reference, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Old-format checkpoints still resume: a job switched to --ckpt-format dcp
    resumes from the reference's flat step-30 checkpoint, follows the reference,
    and writes its own checkpoints as DCP beside it (retention counts both)."""
    ckpt_dir = tmp_path / "job" / "checkpoints"
    shutil.copytree(reference.run_dir / "checkpoints", ckpt_dir)
    for s in (35, 40):
        shutil.rmtree(step_dir(ckpt_dir, s))
    job = run_job(steps=STEPS, workers=WORKERS, checkpoint_every=EVERY, checkpoint_format="dcp")
    assert_resumed(job, reference, 30)
    kinds = {s: _verify(step_dir(ckpt_dir, s), verify_checksums=True).kind
             for s in committed_steps(ckpt_dir)}  # fmt: skip
    assert kinds == {30: "flat", 35: "dcp", 40: "dcp"}


def test_every_worker_killed_while_the_launcher_lives_replacements_resume(
    run_job, reference
) -> None:  # type: ignore[no-untyped-def]
    # The launcher replaces dead workers; with every worker dead, the replacements'
    # state is the newest checkpoint, not step 0.
    job = run_job(
        steps=STEPS,
        workers=WORKERS,
        checkpoint_every=EVERY,
        script_args=AWAIT_10,  # a checkpoint must commit before the kill (see above)
        points=[
            {"member": m, "step": 13, "phase": "compute", "action": "kill"} for m in ("w0", "w1")
        ],
    )
    assert job.result.status == "done", job.result.message
    # The replacements start from the newest checkpoint committed before the kill:
    # step 10's, or step 5's if a member skipped 10 (the gate waited for both to be
    # decided; step 15's was never reached). One that starts late, when the other
    # has trained alone (min 1), loads a newer one.
    loaded = {e["proc"]: e["step"] for e in job.of("checkpoint_loaded")}
    assert loaded and set(loaded) <= {"w2", "w3"}
    first = next(e for e in job.of("generation_ready") if set(e["members"]) <= {"w2", "w3"})
    assert first["start_step"] == min(loaded.values()) in (EVERY, 2 * EVERY)
    kill_t = min(e["t"] for e in job.of("fault_injected"))
    skipped_10 = [e for e in job.of("checkpoint_skipped") if e["step"] == 2 * EVERY
                  and e["t"] < kill_t]  # fmt: skip
    assert first["start_step"] == (EVERY if skipped_10 else 2 * EVERY)
    assert check_same_state(job.events) == []
    a, b = loss_curve(reference.events), loss_curve(job.events)
    assert sorted(b) == list(range(STEPS))
    for s in range(STEPS):
        assert math.isclose(a[s], b[s], rel_tol=1e-5), f"step {s}: {a[s]} vs {b[s]}"


def test_damaged_checkpoints_are_skipped_with_a_warning_naming_the_file(
    run_job, reference, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    # The reference's checkpoints (written by one member: one shard each; two
    # members resume from them, membership may change across a resume).
    ckpt_dir = tmp_path / "job" / "checkpoints"
    shutil.copytree(reference.run_dir / "checkpoints", ckpt_dir)
    assert committed_steps(ckpt_dir) == [30, 35, 40]
    # Step 40: one flipped byte in the middle of a shard's data.
    flipped = ckpt_dir / "step-00000040" / shard_file_name(0, 1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    # Step 35: a shard cut short.
    truncated = ckpt_dir / "step-00000035" / shard_file_name(0, 1)
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 100)
    job = run_job(steps=STEPS, workers=WORKERS, checkpoint_every=EVERY)
    err = capsys.readouterr().err
    assert f"checkpoint step 40 fails verification: {flipped}" in err, err
    assert "crc32" in err
    assert f"checkpoint step 35 fails verification: {truncated}" in err, err
    assert "truncated" in err
    assert "using the previous one, step 30" in err
    assert_resumed(job, reference, 30)
    (resume,) = job.of("checkpoint_resume")
    assert [s["step"] for s in resume["skipped"]] == [40, 35]
    # The damaged ones were moved aside, never to be read again.
    assert (ckpt_dir / "rejected-step-00000040").is_dir()
    assert (ckpt_dir / "rejected-step-00000035").is_dir()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 150 KiB tmpfs mounted as the job's checkpoint directory (needs root)."""
    d = tmp_path / "job" / "checkpoints"
    d.mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=150k", "tmpfs", str(d)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_full_disk_fails_the_save_loudly_and_training_goes_on(
    run_job, reference, small_disk: Path
) -> None:  # type: ignore[no-untyped-def]
    # One checkpoint of this job takes about 60 KiB of the disk's 150 (two shards of
    # ~28 KiB): once one is committed, the next ones do not fit, or fit only now and
    # then after a failed one is cleaned up. Which step is the first to fail is up to
    # the writers' timing: a member whose writer is a whole interval ahead of its
    # twin's can take the space the older step needed (each member writes its shard
    # asynchronously). So the test asserts what holds in every order.
    job = run_job(steps=STEPS, workers=WORKERS, checkpoint_every=EVERY)
    assert job.result.status == "done", job.result.message
    a, b = loss_curve(reference.events), loss_curve(job.events)
    assert sorted(b) == list(range(STEPS))
    assert all(math.isclose(a[s], b[s], rel_tol=1e-5) for s in range(STEPS))
    # Saves failed loudly: an event with the errno, and a log line.
    writes = job.of("checkpoint_failed", phase="write")
    assert writes and all(e["errno"] == errno.ENOSPC for e in writes), writes
    assert all(e["errno_name"] == "ENOSPC" and "No space left" in e["error"] for e in writes)
    assert "No space left on device" in job.log("w0") + job.log("w1")
    failed = {e["step"] for e in job.of("checkpoint_failed")}
    # Rank 0 gave up on every step whose shard failed, and cleaned up after it: no
    # half-written step is left to fill the disk.
    given_up = {e["step"] for e in job.of("checkpoint_failed", phase="commit")}
    assert {e["step"] for e in writes} <= given_up
    on_disk = {s for s, _ in list_steps(small_disk)}
    assert not given_up & on_disk, (given_up, on_disk)
    # No failed step claims to be complete; every committed checkpoint verifies, and
    # the cleanup of failed ones never removed a committed one (retention keeps 3).
    announced = sorted({e["step"] for e in job.of("checkpoint_committed")})
    committed = committed_steps(small_disk)
    assert announced and not failed & set(announced), (announced, failed)
    assert committed == announced[-3:], (committed, announced)
    for s in committed:
        _verify(step_dir(small_disk, s), verify_checksums=True)
    newest = latest_verified(small_disk)
    assert newest is not None and newest.step == committed[-1]
    tensors, meta = load(newest)
    assert meta["committed"] == newest.step and tensors


def test_sigterm_to_the_launcher_takes_an_emergency_checkpoint_then_resume(
    run_job, reference, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "job"
    grace = 30.0
    assert grace < NOTICE_PACE_S * (STEPS - 5)
    cmd = [
        sys.executable,
        "-m",
        "elastrain.cli",
        "run",
        "-n",
        str(WORKERS),
        "--plain",
        "--steps",
        "100000",  # it would run for a long time: only the notice ends it
        "--grace",
        str(grace),
        "--run-dir",
        str(run_dir),
        MLP,
        # Paced so that the steps left before the reference's end take longer
        # than the grace period: the job cannot outrun the notice unless the
        # notice itself takes longer than the grace (which fails below anyway).
        # Unpaced, ~40 steps of this job fit in one 0.2 s poll of the events.
        "--min-step-s",
        str(NOTICE_PACE_S),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "step_commit" and e["step"] >= 3 for e in read_events(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, "job did not start"
            time.sleep(0.2)  # polling files another process writes
        pids = {
            e["pid"]
            for e in read_events(run_dir)
            if e["kind"] in ("worker_spawned", "coordinator_start")
        }
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=grace + 30)
        took = time.monotonic() - t_term
    finally:
        stop_processes(proc, pids)
    assert took < grace, f"the job took {took:.1f} s to stop, grace was {grace} s"
    assert "job preempted" in out, out
    ev = read_events(run_dir)
    (end,) = [e for e in ev if e["kind"] == "job_end"]
    assert end["status"] == "preempted"
    assert any(e["kind"] == "preempt_notice" and e["proc"] == "coordinator" for e in ev)
    emergency = [e for e in ev if e["kind"] == "checkpoint_emergency"]
    assert len(emergency) == WORKERS and all(e["ok"] for e in emergency), emergency
    (step,) = {e["step"] for e in emergency}
    assert step < STEPS, (
        f"the notice took effect only at step {step}; the reference stops at {STEPS}"
    )
    committed = [e for e in ev if e["kind"] == "checkpoint_committed"]
    assert [e["step"] for e in committed] == [step]  # no periodic ones: only the emergency one
    exits = [e for e in ev if e["kind"] == "worker_exited"]
    assert len(exits) == WORKERS and {e["returncode"] for e in exits} == {EXIT_PREEMPTED}
    # Nothing was left running, nothing ran past the emergency checkpoint.
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert max(e["step"] for e in ev if e["kind"] == "step_commit") == step - 1
    # Rerun: it continues from the emergency checkpoint; this time with the
    # automatic (Young/Daly) interval, which the members must agree on.
    assert latest_verified(run_dir / "checkpoints").step == step  # type: ignore[union-attr]
    job = run_job(steps=STEPS, workers=WORKERS, checkpoint_mtbf_s=60.0)
    assert_resumed(job, reference, step)
    ev = since_last_start(job)
    chosen = [e for e in ev if e["kind"] == "checkpoint_interval"]
    rank0 = {e["members"][0] for e in ev if e["kind"] == "generation_ready"}
    assert chosen and {e["proc"] for e in chosen} <= rank0  # rank 0 announces it
    assert any(e["interval_steps"] > 0 and "Young/Daly" in e["reason"] for e in chosen), chosen
    # Each member took part in the same checkpoints (saved, or skipped/failed
    # on its side), so the schedule was the same everywhere.
    attempted = {
        m: {
            e["step"]
            for e in ev
            if e["proc"] == m
            and (
                e["kind"] == "checkpoint_saved"
                or (
                    e["kind"] in ("checkpoint_skipped", "checkpoint_failed")
                    and e.get("phase") in ("snapshot", "write")
                )
            )
        }
        for m in ("w0", "w1")
    }
    # How many fit in the rerun depends on the machine's speed; that they agree does not.
    assert attempted["w0"] == attempted["w1"] and len(attempted["w0"]) >= 1, attempted
    done = {e["step"] for e in ev if e["kind"] == "checkpoint_committed"}
    assert done and done <= attempted["w0"]


def test_sigterm_to_the_coordinator_preempts_the_whole_job(
    run_job, reference, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Kubernetes evicting a job sends SIGTERM to every pod, the coordinator's
    included; there may be no launcher to tell. The coordinator turns it into
    the job's preemption notice: one emergency checkpoint, then every member
    exits and nobody is replaced; a rerun resumes from that checkpoint."""
    from elastrain.launch.launcher import LaunchConfig, Launcher

    grace = 30.0
    la = Launcher(
        LaunchConfig(
            script=MLP,
            script_args=["--min-step-s", str(NOTICE_PACE_S)],  # see the launcher's test
            workers=WORKERS,
            steps=100_000,  # only the notice ends it
            run_dir=str(tmp_path / "job"),
            progress=False,
            grace_s=grace,
            extra_env={"PYTHONPATH": str(ROOT)},
        )
    )
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(la.run()), name="launcher")
    t.start()
    try:
        deadline = time.monotonic() + 120
        while not any(
            e["kind"] == "step_commit" and e["step"] >= 3 for e in read_events(la.run_dir)
        ):
            assert t.is_alive() and time.monotonic() < deadline, "job did not start"
            time.sleep(0.2)  # polling files other processes write
        coordinator = la.coordinator
        assert coordinator is not None
        t_term = time.monotonic()
        coordinator.send_signal(signal.SIGTERM)
        t.join(timeout=grace + 30)
        took = time.monotonic() - t_term
    finally:
        if t.is_alive():
            la.stop()
            t.join(timeout=30)
    (result,) = out
    assert result.status == "preempted", result.message
    assert took < grace, f"the job took {took:.1f} s to stop, grace was {grace} s"
    ev = read_events(la.run_dir)
    assert any(e["kind"] == "preempt_notice" and e["proc"] == "coordinator" for e in ev)
    emergency = [e for e in ev if e["kind"] == "checkpoint_emergency"]
    assert len(emergency) == WORKERS and all(e["ok"] for e in emergency), emergency
    (step,) = {e["step"] for e in emergency}
    exits = [e for e in ev if e["kind"] == "worker_exited"]
    assert len(exits) == WORKERS and {e["returncode"] for e in exits} == {EXIT_PREEMPTED}
    assert not [e for e in ev if e["kind"] == "worker_spawned" and e["replacement"]]
    assert not [e for e in ev if e["kind"] == "coordinator_restarted"]
    for pids in la.pids.values():
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    assert latest_verified(la.run_dir / "checkpoints").step == step  # type: ignore[union-attr]
    assert step < STEPS, step
    job = run_job(steps=STEPS, workers=WORKERS)
    assert_resumed(job, reference, step)
