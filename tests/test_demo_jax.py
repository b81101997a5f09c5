"""`elastrain demo --jax` (issue 44 item 5): run as a user runs it, the console
script, and its printed sections read back; its refusal without JAX."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain.demo import jax_replicas
from elastrain.observe.events import read_events

from .conftest import ROOT, stop_processes

CONSOLE = Path(sys.executable).with_name("elastrain")


def test_without_jax_the_demo_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(jax_replicas, "jax_missing", lambda: True)
    assert jax_replicas.run_jax_demo() == 2
    assert "pip install 'elastrain[jax]'" in capsys.readouterr().err


def test_the_driver_paces_the_wait_for_the_rebuilt_replica(tmp_path: Path) -> None:
    """Base pace before the kill; slow while the fresh processes start, slower near
    the end; as fast as it goes once both fresh processes (not a sender, not an
    original member) were healed."""
    pace, notes = tmp_path / "pace", list[str]()
    d = jax_replicas.Driver(tmp_path, pace, 30, notes.append)

    def status(step: int, *events: dict[str, Any]) -> float:
        (tmp_path / "events").mkdir(exist_ok=True)
        with open(tmp_path / "events" / "test.jsonl", "a") as f:
            f.writelines(json.dumps({"t": 0.0, **e}) + "\n" for e in events)
        d.on_status({"step": step})
        return float(pace.read_text())

    spawned = [{"kind": "worker_spawned", "member": f"w{i}"} for i in range(4)]
    assert status(2, *spawned) == jax_replicas.BASE_PACE_S
    kill = {"kind": "fault_injected", "fault": "kill", "member": "w1", "step": 5}
    assert status(5, kill) == jax_replicas.WAIT_PACE_S
    heal = {"kind": "heal_end", "role": "recv", "bytes": 9}
    assert status(10, {**heal, "proc": "w2"}, {**heal, "proc": "w4", "role": "send"}) == (
        jax_replicas.WAIT_PACE_S
    )
    assert status(25, {**heal, "proc": "w4"}) == jax_replicas.LATE_PACE_S  # one of two
    assert status(26, {**heal, "proc": "w5"}) == jax_replicas.AFTER_PACE_S
    assert notes == [
        "step 5: SIGKILL w1",
        "w4 healed 9 bytes (its shard)",
        "w5 healed 9 bytes (its shard)",
    ]


def test_the_jax_demo(tmp_path: Path) -> None:
    """2 replicas x 2 processes, w1 SIGKILLed: the printout shows w0 stopped with
    it, the other replica's next commit from the same PIDs, the rebuilt replica's
    2 fresh processes each healed half the state from its own twin, exactly-once
    and the twins' digests equal at every generation start (ledger.py)."""
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    run_dir = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [str(CONSOLE), "demo", "--jax", "--plain", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        pids = [e["pid"] for e in read_events(run_dir) if e.get("kind") == "worker_spawned"]
        stop_processes(proc, pids)
    tail = out[-4000:]
    assert proc.returncode == 0 and "NOT SHOWN" not in out, tail
    assert re.search(r"SIGKILL w1 \(replica 0, process 1\) at step \d+", out), tail
    assert re.search(r"replica-mate w0 was stopped [\d.]+ s later \(exit -9\)", out), tail
    spawned = {
        e["member"]: e["pid"] for e in read_events(run_dir) if e.get("kind") == "worker_spawned"
    }
    for m, shard in (("w2", 0), ("w3", 1)):
        row = rf"  {m} +{shard} +{spawned[m]}  same PID +step \d+, [\d.]+ s after the kill"
        assert re.search(row, out), tail
    half = jax_replicas_half()
    for m, twin in (("w4", "w2"), ("w5", "w3")):
        row = rf"  {m} +\d +{spawned[m]}  {twin} +{half} +50%  step \d+"
        assert re.search(row, out), tail
    assert "exactly-once (every step committed once, on exactly its samples): yes" in out, tail
    assert out.rstrip().splitlines()[-1] == (
        "invariants: all members bit-identical at every generation start: yes"
    ), tail


def jax_replicas_half() -> int:
    """One process's part of the demo MLP's state: its rows of w1, b1, w2 (and
    Adam's two moments of them), b2 whole, Adam's count and the key."""
    from elastrain.demo.jax_mlp import HIDDEN, D

    rows = (D * HIDDEN + HIDDEN + HIDDEN) // 2 + 1
    return 3 * rows * 4 + 4 + 8
