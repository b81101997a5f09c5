"""Recovery runs of an elastrain job that the recovery benchmarks share (recovery.py,
sharded.py): SIGKILLs paced so that each recovery and its replacement's join are over
before the next, a run bounded in time, and the first step after each recovery.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from elastrain.chaos.schedule import parse_fault
from elastrain.launch.launcher import Launcher


class KillPacer:
    """Spaces the SIGKILLs so that each recovery and its replacement's join are over
    before the next one: the first kill is `kill@first_step` (in LaunchConfig.faults);
    each next `kill@K` is added to the launcher's fault schedule once the running
    generation again has every worker, the last victim is gone from it, and `settle`
    steps were committed in it (so the replacement is healed and training). After the
    last kill's replacement settles, it stops the job. Runs on the launcher's thread
    (its `on_status` callback), where the schedule is read."""

    def __init__(
        self, kills: int, first_step: int, settle: int, workers: int, stall_s: float = 90.0
    ) -> None:
        self.workers = workers
        self.left = kills - 1
        self.stall_s = stall_s
        self.stalled = False
        self._last_step = -1
        self._last_change = time.monotonic()
        self.settle = settle
        self.kill_steps = [first_step]
        self.launcher: Launcher | None = None
        self.first_seen: dict[int, int] = {}
        self.done = False

    def __call__(self, st: dict[str, Any]) -> None:
        lc = self.launcher
        if lc is None or self.done:
            return
        now = time.monotonic()
        if int(st.get("step", 0)) != self._last_step:
            self._last_step, self._last_change = int(st.get("step", 0)), now
        elif now - self._last_change > self.stall_s:
            # No step committed for stall_s: something is broken; do not wait for the guard.
            self.stalled = self.done = True
            lc.stop()
            return
        if len(lc.fault_log) < len(self.kill_steps):
            return
        victim = lc.fault_log[-1]["member"]
        members = st.get("members") or []
        if len(members) != self.workers or victim in members or not st.get("ready"):
            return
        step = int(st.get("step", 0))
        if step - self.first_seen.setdefault(int(st["gen"]), step) < self.settle:
            return
        if self.left > 0:
            self.left -= 1
            self.kill_steps.append(step + 1)
            lc.schedule.pending.append(parse_fault(f"kill@{step + 1}"))
        else:
            self.done = True
            lc.stop()


def run_bounded(launcher: Launcher, timeout_s: float) -> tuple[Any, float]:
    """Run the job, stopping it after `timeout_s` (a stuck job must not stall the
    benchmark forever); returns its RunResult and its wall seconds."""
    timer = threading.Timer(timeout_s, launcher.stop)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    try:
        result = launcher.run()
    finally:
        timer.cancel()
    return result, time.monotonic() - t0


def first_step_breakdown(
    events: list[dict[str, Any]], recs: list[Any]
) -> tuple[list[float], list[float]]:
    """For each recovery: the slowest survivor's group_built -> generation_start in the
    resumed generation (heal, if any, and the state hash), and the step_s of the first
    step committed in it (the interrupted step, recomputed by the survivors)."""
    gs: list[float] = []
    st: list[float] = []
    for r in recs:
        if r.gen is None:
            continue
        who = set(r.survivors)
        built = {
            e["proc"]: e["t"]
            for e in events
            if e["kind"] == "group_built" and e.get("gen") == r.gen and e["proc"] in who
        }
        start = {
            e["proc"]: e["t"]
            for e in events
            if e["kind"] == "generation_start" and e.get("gen") == r.gen and e["proc"] in who
        }
        d = [start[m] - built[m] for m in built if m in start]
        if d:
            gs.append(max(d))
        commits = [e for e in events if e["kind"] == "step_commit" and e.get("gen") == r.gen]
        if commits:
            s0 = min(e["step"] for e in commits)
            st.append(max(e["step_s"] for e in commits if e["step"] == s0))
    return gs, st
