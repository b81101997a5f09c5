"""The benchmark's job, its cases and one run's record (see versus.py for the whole).

Imported by versus.py, which puts benchmarks/_jobs and benchmarks/_versus on sys.path."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from analysis import (
    Commit,
    FaultMark,
    step_times,
)
from common import Shape

HERE = Path(__file__).resolve().parent.parent
"""benchmarks/"""
ROOT = HERE.parent
JOBS = HERE / "_jobs"
VERSUS = HERE / "_versus"

WORKERS = 4
SHAPE = Shape(dim=128, layers=2, heads=4, block=64, global_batch=32, micro_batch=4)
"""The demo's GPT and batch (elastrain/demo/gpt.py defaults)."""
KILL_VICTIM = 1
HANG_VICTIM = 2
REPLACEMENT_CAP_S = 40.0
"""A run waits at most this long after the kill for the replacement to train."""
RUN_TIMEOUT_S = 150.0
"""A run that has not finished by then did not survive."""
SAME_MATH_TOL = 1e-4
"""Largest relative loss deviation from the failure-free run still called the same math
(float rounding of a different reduction order; a dropped sample changes the loss by more)."""
TARGET_ABS_S = 0.5
TARGET_FACTOR = 5.0
SPARE_TARGET_S = 1.0
"""Issue 18: with a hot spare, kill -> the replacement's first committed step."""
HANG_TARGET_S = 1.0
"""Issue 18: a hang -> the survivors' next commit, when the all-reduce takes < 0.1 s."""
HEARTBEATS_MS = (5000, 1000)

FT_INSTALL = (
    "pip install --no-deps torchft && pip install opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape_args() -> list[str]:
    s = SHAPE
    return [
        "--dim", str(s.dim), "--layers", str(s.layers), "--heads", str(s.heads),
        "--block", str(s.block), "--batch", str(s.global_batch), "--micro", str(s.micro_batch),
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


@dataclass
class Run:
    case: str
    rep: int
    faulty: bool
    run_dir: Path
    commits: list[Commit] = field(default_factory=list)
    faults: list[FaultMark] = field(default_factory=list)
    t_launch: float = math.nan
    survived: bool = True
    why: str = ""
    state_lost: bool = False
    """The run ended because no process held the training state any more."""
    t_crash: float | None = None
    """When a run that did not survive lost its state (its figures use commits before it)."""
    survivors_lost: int = 0
    kill_s: float | None = None
    hang_s: float | None = None
    back_s: float | None = None
    repl_s: float | None = None
    recomputed: int = 0
    dropped: int = 0
    dropped_to_s: int = 0
    short: int = 0
    exactly_once: str = ""
    notes: list[str] = field(default_factory=list)

    def commit_t(self, step: int) -> float | None:
        return step_times(self.commits).get(step)


@dataclass(frozen=True)
class Case:
    name: str
    system: str  # elastrain | torchrun | torchft
    mode: str = ""
    heartbeat_ms: int = 0
    pg_timeout_s: float = 5.0
    default: bool = True


CASES = [
    Case("elastrain", "elastrain"),
    Case("elastrain, 1 hot spare", "elastrain", "spare"),
    Case("torchrun restart", "torchrun"),
    Case("torchft ddp, hb 5 s", "torchft", "ddp", 5000, 5.0),
    Case("torchft ddp, hb 1 s", "torchft", "ddp", 1000, 1.0, default=False),
    Case("torchft flat, hb 5 s", "torchft", "flat", 5000, 5.0),
    Case("torchft flat, hb 1 s", "torchft", "flat", 1000, 1.0),
]
"""hb: the lighthouse's heartbeat timeout (5 s is its default); the gloo collective timeout
goes with it (5 s as in torchft's train_ddp.py example; 1 s in the "1 s" rows, since with
4 replicas a survivor that is not next to the dead one in the ring waits out the
collective timeout, so a 1 s heartbeat alone does not shorten the stall).
torchft's DDP wrapper at a 1 s heartbeat is left out by default (`--cases all` runs
it): the heartbeat's effect shows on the flat rows, and 3 repeats of 6 cases do not fit
in 15 minutes on the 2-core machine."""
REFERENCE = Case("failure-free reference (plain DDP, torchrun)", "torchrun")
"""The failure-free run every loss curve is compared with: the same job under plain
DDP, no faults. The systems agree with it to float rounding (checked on the steps
before the first fault of every run; ~1e-7 over 60 steps on the dev machine)."""
