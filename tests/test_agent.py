"""`elastrain coordinator` + one `elastrain agent` per node: workers of several
agents form one job; a killed worker is replaced by its own agent and healed;
a node that leaves (SIGTERM to its agent) takes its workers out gracefully;
a node that dies (SIGKILL to its agent) takes its workers with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state

from .conftest import MLP, ROOT, stop_processes
from .test_elastic import expected_ids

TOKEN = "agent-test-token"


def start_coordinator(
    run_dir: Path, target: int, min_members: int
) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), ELASTRAIN_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastrain.cli", "coordinator", "--bind", "127.0.0.1:0",
         "--target", str(target), "--min", str(min_members), "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    return proc, f"{info['host']}:{info['port']}"


def start_agent(
    address: str, name: str, run_dir: Path, nproc: int, steps: int, *extra: str
) -> subprocess.Popen[str]:
    token_file = run_dir.parent / "token"
    token_file.write_text(TOKEN)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ELASTRAIN_TOKEN", None)
    return subprocess.Popen(
        [sys.executable, "-m", "elastrain.cli", "agent", "--coordinator", address,
         "--token-file", str(token_file), "--name", name, "--nproc", str(nproc), "--plain",
         "--steps", str(steps), "--run-dir", str(run_dir), *_opts(extra), MLP,
         *_script_args(extra)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _opts(extra: tuple[str, ...]) -> list[str]:
    return list(extra[: extra.index("--")]) if "--" in extra else list(extra)


def _script_args(extra: tuple[str, ...]) -> list[str]:
    return list(extra[extra.index("--") :]) if "--" in extra else []


def all_events(*dirs: Path) -> list[dict[str, Any]]:
    return sorted((e for d in dirs for e in read_events(d)), key=lambda e: e["t"])


def pids_of(*dirs: Path) -> set[int]:
    return {e["pid"] for e in all_events(*dirs) if "pid" in e}


def wait_for(cond: Any, what: str, dirs: tuple[Path, ...], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond(all_events(*dirs)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # polling files other processes write


def test_two_agents_form_one_job_replace_their_own_and_drain(tmp_path: Path) -> None:
    steps = 400
    # Paced until the replacement has healed and node b has left, so that a slow
    # start-up (import torch on a loaded machine) never lets the job end first.
    pace = tmp_path / "pace"
    pace.write_text("0.1")
    coord, address = start_coordinator(tmp_path / "coord", target=4, min_members=2)
    dirs = (tmp_path / "coord", tmp_path / "a", tmp_path / "b")
    a = start_agent(address, "a", dirs[1], 2, steps, "--fault", "kill@20:a-w0", "--",
                    "--pace-file", str(pace))  # fmt: skip
    b = start_agent(address, "b", dirs[2], 2, steps, "--", "--pace-file", str(pace))
    procs = [coord, a, b]
    try:
        # a-w0 dies and agent a replaces it; then node b leaves (SIGTERM to its agent).
        wait_for(lambda ev: any(e["kind"] == "heal_end" and e["proc"] == "a-w2" for e in ev),
                 "a's replacement to heal", dirs, timeout=300)  # fmt: skip
        b.send_signal(signal.SIGTERM)
        out_b, _ = b.communicate(timeout=60)
        assert b.returncode == 0 and "job drained" in out_b, out_b
        pace.write_text("0")
        out_a, _ = a.communicate(timeout=180)
        assert a.returncode == 0, out_a
    finally:
        stop_processes(coord, set())
        for p in procs:
            stop_processes(p, pids_of(*dirs))
    ev = all_events(*dirs)
    assert check_same_state(ev) == []
    led = check_exactly_once(ev, expected_ids)
    assert led.violations == [] and led.committed_steps == steps
    ready = [e["members"] for e in ev if e["kind"] == "generation_ready"]
    assert sorted(ready[0]) == ["a-w0", "a-w1", "b-w0", "b-w1"]
    assert any(sorted(m) == ["a-w1", "a-w2", "b-w0", "b-w1"] for m in ready)
    assert sorted(ready[-1]) == ["a-w1", "a-w2"]  # node b left; nobody replaced its workers
    assert not [e for e in ev if e["kind"] == "worker_spawned" and e["member"].startswith("b-")
                and e["replacement"]]  # fmt: skip
    left = [e for e in ev if e["kind"] == "worker_exit" and e["proc"].startswith("b-")]
    assert {e["reason"] for e in left} == {"left"}


def test_a_dead_agent_takes_its_workers_with_it(tmp_path: Path) -> None:
    coord, address = start_coordinator(tmp_path / "coord", target=2, min_members=1)
    dirs = (tmp_path / "coord", tmp_path / "a")
    a = start_agent(address, "a", dirs[1], 2, 100_000)
    try:
        wait_for(lambda ev: any(e["kind"] == "step_commit" for e in ev), "a first step", dirs)
        workers = {e["pid"] for e in all_events(*dirs) if e["kind"] == "worker_spawned"}
        a.kill()
        a.wait()
        deadline = time.monotonic() + 10
        for pid in workers:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                # A zombie is dead too (its parent, the agent, is gone; init reaps it).
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    break
                assert time.monotonic() < deadline, f"worker {pid} outlived its agent"
                time.sleep(0.05)  # waiting for the kernel to deliver the parent-death signal
    finally:
        stop_processes(coord, set())
        stop_processes(a, pids_of(*dirs))
