"""In-worker fault points: fail *this* process at an exact (member, step, phase).

The launcher can only kill a process at some wall time; tests need faults that
land at a precise point of the step protocol, e.g. after this member has sent
its all-reduce contribution but before the collective completed. A worker reads
the plan from $ELASTRAIN_FAULTS (JSON list) and calls `hit(step, phase)` at each
point; a matching fault fires once per process.

    [{"member": "w1", "step": 5, "phase": "allreduce", "action": "kill"}]

phases: "connect" (before building the group of a generation starting at
`step`), "compute" (between micro-batches), "allreduce" (collective issued, not
finished), "vote" (sharded: the commit vote completed here, the step not yet
applied), "commit" (after the optimizer step), "eval" (after this member's first
batch of the evaluation that follows step `step`). actions: "kill" (SIGKILL),
"hang" (SIGSTOP: someone else must SIGCONT or kill it), "term" (SIGTERM:
graceful leave), "fail" ("vote" only: this member's answer is lost, so it
waits on until a deadline or the generation's end while its peers commit the
step: `hooks.InjectedFailure`), "poison" ("compute" and "allreduce" only: a
sticky device error, so the worker leaves with EXIT_DEVICE_POISONED for a fresh
process: `elastrain.runtime.device`; in a process that uses CUDA a real one, a
device-side assert from an out-of-range index, else the error CUDA reports for
an illegal memory access, raised).

The launcher can also send orders while the job runs, through the member's
chaos inbox (`elastrain.chaos.inject.send_slow`): a JSON list of orders in
`<run_dir>/chaos/<member>.json`, polled at the start of every step (one
`stat`). The one order today is "slow": spend `delay_s` more on each of the
next `steps` steps, a straggler.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrain.observe.events import EventKind
from elastrain.runtime.hooks import InjectedFailure

log = logging.getLogger("elastrain.chaos")

PHASES = ("connect", "compute", "allreduce", "vote", "commit", "eval")
ACTIONS = {
    "kill": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "term": signal.SIGTERM,
    "fail": None,
    "poison": None,
}
RAISED_AT = {"fail": ("vote",), "poison": ("compute", "allreduce")}
"""The actions that raise in the training thread instead of sending a signal, and the
phases where the engine meets what they raise."""
POISON_MESSAGE = "CUDA error: an illegal memory access was encountered (injected)"


def poison_device() -> None:
    """Raise a sticky device error: in a process that has initialised CUDA, break its
    device for real (an out-of-range gather; the synchronisation raises CUDA's
    "device-side assert triggered", and every later CUDA call in this process fails
    too), so that what the engine meets is what a faulty kernel leaves; elsewhere
    (the CPU tests) raise CUDA's message for an illegal memory access."""
    import sys

    torch = sys.modules.get("torch")  # a JAX worker never imported it
    if torch is not None and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
        table = torch.zeros(1, device=device)
        table[torch.full((1,), 1 << 20, device=device)].sum()
        torch.cuda.synchronize(device)
    raise RuntimeError(POISON_MESSAGE)


@dataclass(frozen=True)
class FaultPoint:
    member: str
    step: int
    phase: str
    action: str

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"fault phase must be one of {PHASES}, got {self.phase!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {sorted(ACTIONS)}, got {self.action!r}")
        phases = RAISED_AT.get(self.action)
        if phases is not None and self.phase not in phases:
            raise ValueError(
                f"fault action {self.action!r} is injected at phase {' or '.join(phases)}, "
                f"got {self.phase!r}"
            )


def parse_points(text: str | None) -> list[FaultPoint]:
    if not text:
        return []
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("fault points must be a JSON list")
    return [
        FaultPoint(str(r["member"]), int(r["step"]), str(r["phase"]), str(r["action"])) for r in raw
    ]


class FaultPoints:
    def __init__(
        self,
        member: str,
        points: list[FaultPoint],
        on_fire: Callable[[FaultPoint], None] | None = None,
        inbox: Path | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.points = [p for p in points if p.member == member]
        self.on_fire = on_fire
        self.inbox = inbox
        self._sleep = sleep
        self._fired: set[FaultPoint] = set()
        self._inbox_mtime: int | None = None
        self._last_order = 0
        self._slow_delay = 0.0
        self._slow_until = -1

    def _poll(self, step: int) -> None:
        if self.inbox is None:
            return
        try:
            mtime = self.inbox.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._inbox_mtime:
            return
        self._inbox_mtime = mtime
        try:
            orders = json.loads(self.inbox.read_text())
        except (OSError, ValueError) as e:
            log.warning("unreadable chaos inbox %s: %s", self.inbox, e)
            return
        for o in orders:
            if int(o.get("id", 0)) <= self._last_order:
                continue
            self._last_order = int(o["id"])
            if o.get("action") == "slow":
                self._slow_delay = float(o["delay_s"])
                self._slow_until = step + int(o["steps"])

    def hit(self, step: int, phase: str) -> None:
        if phase == "compute":
            self._poll(step)
            if step < self._slow_until:
                self._sleep(self._slow_delay)  # the injected straggler itself
        for p in self.points:
            if p.step == step and p.phase == phase and p not in self._fired:
                self._fired.add(p)
                if self.on_fire is not None:
                    self.on_fire(p)
                if p.action == "fail":
                    raise InjectedFailure(f"injected: {p.phase} answer lost at step {step}")
                if p.action == "poison":
                    poison_device()
                sig = ACTIONS[p.action]
                assert sig is not None
                os.kill(os.getpid(), sig)


class FaultHook:
    """The fault points as a step hook (`elastrain.runtime.hooks.StepHook`).

    `from_env` reads $ELASTRAIN_FAULTS and the run directory's chaos inbox;
    the worker entry point installs it, so the engine never imports chaos.
    Every fault that fires is a `fault_injected` event in the member's log
    before the signal is sent."""

    def __init__(self, points: list[FaultPoint], inbox_dir: Path | None) -> None:
        self._points = points
        self._inbox_dir = inbox_dir
        self._fp: FaultPoints | None = None

    @classmethod
    def from_env(cls) -> FaultHook | None:
        """The hook the launcher asked for, or None (no faults and no run directory)."""
        from elastrain import env

        points = parse_points(os.environ.get(env.FAULTS))
        run_dir = os.environ.get(env.RUN_DIR)
        if not points and not run_dir:
            return None
        return cls(points, Path(run_dir) if run_dir else None)

    def attach(self, member: str, events: Any) -> None:
        from elastrain.chaos.inject import inbox_path

        def fired(f: FaultPoint) -> None:
            events.emit(
                EventKind.FAULT_INJECTED,
                fault=f.action,
                member=member,
                pid=os.getpid(),
                step=f.step,
                phase=f.phase,
            )

        inbox = inbox_path(str(self._inbox_dir), member) if self._inbox_dir else None
        self._fp = FaultPoints(member, self._points, on_fire=fired, inbox=inbox)

    def at(self, step: int, point: str) -> None:
        if self._fp is not None:
            self._fp.hit(step, str(point))
