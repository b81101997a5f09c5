"""Calibrate the simulator on a recorded elastrain run (`elastrain sim --from-run RUN_DIR`).

From the run's events (docs/events.md) take: the full-size step time (median
`step_s` of `step_commit` in generations with every member) and the step time at
each smaller size; each injected fault's detection and recovery time (the
"Recovery phases" of docs/events.md); each replacement's arrival and the pause its
join costs; and the fault schedule. Replay that schedule through the elastic model
with those costs and compare the predicted goodput with the measured one, both over
the training window (first step start to last commit; start-up is reported apart).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.observe.events import read_events
from elastrain.sim.config import (
    CheckpointPolicy,
    RecoveryCosts,
    SimConfig,
    StrategyConfig,
    Topology,
    Workload,
)
from elastrain.sim.engine import simulate
from elastrain.sim.metrics import SimResult
from elastrain.sim.trace import INJECTED, ExplicitTrace, FailureEvent

Event = dict[str, Any]
FAULT_KINDS = ("kill", "hang", "term")


@dataclass(frozen=True)
class FaultRecovery:
    t: float
    """Fault time, seconds from the start of the training window."""
    member: str
    slot: int
    fault: str
    detect_s: float
    recover_s: float
    """Detection to the survivors' first step, less one step: quorum + regroup + heal."""
    replacement_s: float
    """Detection until the replacement is registered; inf when none came."""
    join_pause_s: float | None
    """Pause of the job when the replacement joined, less one step; None if it never did."""


@dataclass(frozen=True)
class Calibration:
    members: int
    min_members: int
    steps: int
    window_s: float
    startup_s: float
    step_s: float
    step_s_by_size: dict[int, float]
    faults: list[FaultRecovery]
    measured_time_goodput: float
    measured_ettr: float

    def config(self) -> SimConfig:
        """An elastic job of `members` one-accelerator hosts with the measured costs."""
        detect = _median([f.detect_s for f in self.faults], 0.0)
        regroup = _median([f.recover_s for f in self.faults], 0.0)
        joins = [f.join_pause_s for f in self.faults if f.join_pause_s is not None]
        heal = max(0.0, _median(joins, regroup) - regroup)
        table = tuple(sorted((n, s) for n, s in self.step_s_by_size.items() if n < self.members))
        return SimConfig(
            topology=Topology(accelerators=self.members, accelerators_per_host=1),
            costs=RecoveryCosts(detect_s=detect, regroup_s=regroup, heal_s=heal),
            checkpoint=CheckpointPolicy(interval_s=math.inf, save_s=0.0),
            strategy=StrategyConfig(kind="elastic", min_replicas=self.min_members),
            workload=Workload(step_s=self.step_s, step_s_by_replicas=table),
            horizon_s=self.window_s,
        )

    def trace(self) -> ExplicitTrace:
        """The recorded faults, each with its measured replacement delay."""
        return ExplicitTrace(
            [FailureEvent(f.t, INJECTED, (f.slot,), (f.replacement_s,)) for f in self.faults]
        )

    def predict(self) -> SimResult:
        return simulate(self.config(), self.trace())


def _median(xs: Sequence[float], default: float) -> float:
    return statistics.median(xs) if xs else default


def _first(events: Sequence[Event], after: float, **match: Any) -> Event | None:
    for e in events:
        if e["t"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def calibrate(run_dir: str | os.PathLike[str]) -> Calibration:
    """Read RUN_DIR/events/*.jsonl and measure what the simulator needs."""
    events = read_events(run_dir)
    commits = [e for e in events if e["kind"] == "step_commit"]
    if not commits:
        raise ValueError(f"{run_dir}: no step_commit events; is this an elastrain run directory?")
    start_ev = _first(events, -math.inf, kind="job_start")
    gen_members: dict[int, list[str]] = {}
    for e in events:
        if e["kind"] in ("generation_ready", "generation_formed"):
            gen_members.setdefault(int(e["gen"]), list(e["members"]))
    members = int(start_ev["target"]) if start_ev else max(len(m) for m in gen_members.values())
    min_members = int(start_ev.get("min") or 1) if start_ev else 1

    def size(gen: int) -> int:
        return len(gen_members.get(gen, ())) or members

    by_size: dict[int, list[float]] = defaultdict(list)
    for c in commits:
        by_size[size(int(c["gen"]))].append(float(c["step_s"]))
    step_by_size = {n: statistics.median(v) for n, v in by_size.items()}
    step_s = step_by_size.get(members) or statistics.median(float(c["step_s"]) for c in commits)

    first = min(commits, key=lambda c: c["t"] - c["step_s"])
    t_start = float(first["t"]) - float(first["step_s"])
    t_end = max(float(c["t"]) for c in commits)
    startup = t_start - float(start_ev["t"]) if start_ev else 0.0
    last_commit: dict[int, Event] = {}  # step -> its last commit
    for c in commits:
        last_commit[int(c["step"])] = c
    steps = len(last_commit)
    kept_compute = sum(float(c["step_s"]) for c in last_commit.values())
    window = t_end - t_start

    faults = _faults(events, commits, t_start, members, step_by_size, step_s, size)
    return Calibration(
        members=members,
        min_members=min(min_members, members),
        steps=steps,
        window_s=window,
        startup_s=startup,
        step_s=step_s,
        step_s_by_size=step_by_size,
        faults=faults,
        measured_time_goodput=kept_compute / window,
        measured_ettr=steps * step_s / window,
    )


def _faults(
    events: Sequence[Event],
    commits: Sequence[Event],
    t_start: float,
    members: int,
    step_by_size: dict[int, float],
    step_s: float,
    size: Callable[[int], int],
) -> list[FaultRecovery]:
    slot_of = {f"w{i}": i for i in range(members)}
    out: list[FaultRecovery] = []
    claimed: set[str] = set()
    faults = [e for e in events if e["kind"] == "fault_injected" and e.get("fault") in FAULT_KINDS]
    for f in faults:
        t0, victim = float(f["t"]), str(f["member"])
        detected = [
            e["t"]
            for e in events
            if e["t"] >= t0
            and (
                (e["kind"] in ("worker_exited", "member_removed") and e.get("member") == victim)
                or (e["kind"] == "step_abort" and e.get("proc") != victim)
            )
        ]
        if not detected:
            continue
        t_detect = float(min(detected))
        ready = next(
            (
                e
                for e in events
                if e["kind"] == "generation_ready" and e["t"] >= t0 and victim not in e["members"]
            ),
            None,
        )
        if ready is None:
            continue
        gen = int(ready["gen"])
        first_step = next((c for c in commits if int(c["gen"]) == gen), None)
        if first_step is None:
            continue
        recover = float(first_step["t"]) - t_detect - step_by_size.get(size(gen), step_s)
        # The replacement: the next spawned one nobody claimed yet, or the victim
        # itself re-registering (a hung worker that was expelled and came back).
        new: str | None = None
        for e in events:
            if e["t"] < t0:
                continue
            if (
                e["kind"] == "worker_spawned"
                and e.get("replacement")
                and e["member"] not in claimed
            ):
                new = str(e["member"])
                break
            if e["kind"] == "member_registered" and e.get("member") == victim and e["t"] > t_detect:
                new = victim
                break
        replacement_s, join_pause = math.inf, None
        if new is not None:
            claimed.add(new)
            slot_of[new] = slot_of.get(victim, len(slot_of))
            reg = _first(events, t0, kind="member_registered", member=new)
            joined = next(
                (
                    e
                    for e in events
                    if e["kind"] == "generation_ready" and e["t"] >= t0 and new in e["members"]
                ),
                None,
            )
            if reg is not None:
                replacement_s = max(0.0, float(reg["t"]) - t_detect)
            if joined is not None:
                jgen = int(joined["gen"])
                before = [c for c in commits if int(c["gen"]) < jgen and c["t"] <= joined["t"]]
                after = next((c for c in commits if int(c["gen"]) == jgen), None)
                if before and after is not None:
                    t_prev = max(float(c["t"]) for c in before)
                    step_j = step_by_size.get(size(jgen), step_s)
                    join_pause = max(0.0, float(after["t"]) - t_prev - step_j)
        out.append(
            FaultRecovery(
                t=t0 - t_start,
                member=victim,
                slot=slot_of.get(victim, 0),
                fault=str(f["fault"]),
                detect_s=t_detect - t0,
                recover_s=max(0.0, recover),
                replacement_s=replacement_s,
                join_pause_s=join_pause,
            )
        )
    return out


def replace_costs(config: SimConfig, calibration: Calibration) -> SimConfig:
    """`config` with the recovery costs and step time measured in a run (for projections)."""
    measured = calibration.config()
    costs = dataclasses.replace(
        config.costs,
        detect_s=measured.costs.detect_s,
        regroup_s=measured.costs.regroup_s,
        heal_s=measured.costs.heal_s,
        state_bytes=0.0,
    )
    workload = dataclasses.replace(config.workload, step_s=calibration.step_s)
    return dataclasses.replace(config, costs=costs, workload=workload)
