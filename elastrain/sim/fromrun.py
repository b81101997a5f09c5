"""Calibrate the simulator on a recorded elastrain run (`elastrain sim --from-run RUN_DIR`).

From the run's events (docs/guide/events.md) take: the full-size step time (median
`step_s` of `step_commit` in generations with every member) and the median at
each smaller size; each recognised failure's recovery phases (detect, quorum, regroup,
heal, first step: `elastrain.observe.recovery.recoveries`, the "Recovery phases"
of docs/guide/events.md) and its replacement's arrival (`recovery.joins`); the pause a
replacement's join costs when it joins on its own; and the fault schedule.

Replay that schedule through the elastic model: each fault keeps its own measured
detection time (a crash is seen at once, a hang when a watchdog fires) and its own
replacement delay; regroup and join costs are the medians. The run's start-up
(job start to the first step) and shutdown (last commit to job end) are taken as
measured; the simulator models the training window in between. Prediction and
measurement are compared on the run's goodput ledger (`elastrain.observe.goodput`)
and on the ETTR of the training window.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.observe.events import read_events
from elastrain.observe.goodput import goodput
from elastrain.observe.recovery import JoinTiming, joins, recoveries
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


@dataclass(frozen=True)
class FaultRecovery:
    t: float
    """Fault time, seconds from the start of the training window."""
    member: str
    slot: int
    fault: str
    detect_s: float
    recover_s: float
    """Detection to the survivors' first commit, less one step: quorum + regroup + heal."""
    replacement_s: float
    """Detection until the replacement (or the expelled member) registered; inf if never."""
    join_pause_s: float | None
    """The job's pause when the replacement joined on its own (less one step); None when
    it joined inside a failure's regroup or never."""


@dataclass(frozen=True)
class Prediction:
    result: SimResult
    """The simulated training window."""
    time_goodput: float
    """Predicted ledger time goodput (productive member-seconds / ledger total)."""
    throughput_goodput: float
    """Predicted ledger throughput goodput (scaled by predicted / measured steps)."""
    window_ettr: float


@dataclass(frozen=True)
class Calibration:
    members: int
    min_members: int
    steps: int
    window_s: float
    startup_s: float
    shutdown_s: float
    step_s: float
    """Nominal full-size step time: the median (as the goodput ledger's nominal rate)."""
    step_s_by_size: dict[int, float]
    """Mean step time at each member count: the pace the replay runs at."""
    faults: list[FaultRecovery]
    measured_time_goodput: float
    """Ledger time goodput of the whole run (elastrain.observe.goodput)."""
    measured_throughput_goodput: float
    ledger_total_s: float
    measured_window_ettr: float
    """Steps x full-size step time / training window."""

    def config(self) -> SimConfig:
        """An elastic job of `members` one-accelerator hosts with the measured costs."""
        regroup = _median([f.recover_s for f in self.faults], 0.0)
        pauses = [f.join_pause_s for f in self.faults if f.join_pause_s is not None]
        heal = max(0.0, _median(pauses, regroup) - regroup)
        detect = _median([f.detect_s for f in self.faults], 0.0)
        table = tuple(sorted((n, s) for n, s in self.step_s_by_size.items() if n < self.members))
        return SimConfig(
            topology=Topology(accelerators=self.members, accelerators_per_host=1),
            costs=RecoveryCosts(detect_s=detect, regroup_s=regroup, heal_s=heal),
            checkpoint=CheckpointPolicy(interval_s=math.inf, save_s=0.0),
            strategy=StrategyConfig(kind="elastic", min_replicas=self.min_members),
            workload=Workload(
                step_s=self.step_s_by_size.get(self.members, self.step_s),
                step_s_by_replicas=table,
            ),
            horizon_s=self.window_s,
        )

    def trace(self) -> ExplicitTrace:
        """The recorded faults, each with its measured detection and replacement delay."""
        return ExplicitTrace(
            [
                FailureEvent(f.t, INJECTED, (f.slot,), (f.replacement_s,), detect_s=f.detect_s)
                for f in self.faults
            ]
        )

    def predict(self) -> Prediction:
        r = simulate(self.config(), self.trace())
        tg = r.productive_accelerator_s / self.ledger_total_s if self.ledger_total_s else 0.0
        tput = self.measured_throughput_goodput * r.steps / self.steps if self.steps else 0.0
        ettr = r.steps * self.step_s / self.window_s
        return Prediction(result=r, time_goodput=tg, throughput_goodput=tput, window_ettr=ettr)


def _median(xs: Sequence[float], default: float) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.median(xs) if xs else default


def calibrate(run_dir: str | os.PathLike[str]) -> Calibration:
    """Read RUN_DIR/events/*.jsonl and measure what the simulator needs."""
    events = read_events(run_dir)
    commits = [e for e in events if e["kind"] == "step_commit"]
    if not commits:
        raise ValueError(f"{run_dir}: no step_commit events; is this an elastrain run directory?")
    start_ev = next((e for e in events if e["kind"] == "job_start"), None)
    end_ev = next((e for e in reversed(events) if e["kind"] == "job_end"), None)
    gens: dict[int, Event] = {}
    for e in events:
        if e["kind"] in ("generation_ready", "generation_formed"):
            gens.setdefault(int(e["gen"]), e)
    members = int(start_ev["target"]) if start_ev else max(len(g["members"]) for g in gens.values())
    min_members = int(start_ev.get("min") or 1) if start_ev else 1

    def size(gen: int) -> int:
        g = gens.get(gen)
        return len(g["members"]) if g is not None else members

    by_size: dict[int, list[float]] = defaultdict(list)
    for c in commits:
        by_size[size(int(c["gen"]))].append(float(c["step_s"]))
    # Steps are not stationary (warm-up, CPU contention while a replacement starts):
    # the replay runs at the mean pace; the nominal step is the median.
    step_by_size = {n: statistics.fmean(v) for n, v in by_size.items()}
    nominal = by_size.get(members) or [float(c["step_s"]) for c in commits]
    step_s = statistics.median(nominal)

    first = min(commits, key=lambda c: c["t"] - c["step_s"])
    t_start = float(first["t"]) - float(first["step_s"])
    t_end = max(float(c["t"]) for c in commits)
    steps = len({int(c["step"]) for c in commits})
    ledger = goodput(events)
    faults = _faults(events, commits, t_start, members, step_by_size, step_s, size)
    window = t_end - t_start
    return Calibration(
        members=members,
        min_members=min(min_members, members),
        steps=steps,
        window_s=window,
        startup_s=t_start - float(start_ev["t"]) if start_ev else 0.0,
        shutdown_s=float(end_ev["t"]) - t_end if end_ev else 0.0,
        step_s=step_s,
        step_s_by_size=step_by_size,
        faults=faults,
        measured_time_goodput=ledger.time_goodput,
        measured_throughput_goodput=ledger.throughput_goodput or 0.0,
        ledger_total_s=ledger.total_s,
        measured_window_ettr=steps * step_s / window,
    )


def _faults(
    events: Sequence[Event],
    commits: Sequence[Event],
    t_start: float,
    members: int,
    step_by_size: dict[int, float],
    step_s: float,
    size: Any,
) -> list[FaultRecovery]:
    slot_of = {f"w{i}": i for i in range(members)}
    timings = joins(events)
    formed = [e for e in events if e["kind"] == "generation_formed"]
    out: list[FaultRecovery] = []
    recs = sorted(recoveries(events), key=lambda r: r.t0)
    for i, r in enumerate(recs):
        detect = r.phase("detect")
        if not math.isfinite(detect) or r.gen is None:
            continue
        marks = [r.phase(p) for p in ("quorum", "regroup", "heal")]
        step_after = step_by_size.get(size(r.gen), step_s)
        overhead = max(0.0, r.phase("first_step") - step_after)
        recover = sum(x for x in marks if math.isfinite(x)) + overhead
        # Who fills the victim's place: the victim itself when it comes back (a hung
        # member that was expelled and re-registers before it fails again).
        again = next((x.t0 for x in recs[i + 1 :] if x.member == r.member), math.inf)
        join = _first_join(timings, r.member, r.t0)
        newcomer = r.member
        if join is None or join.spawned_t >= again:
            # Else the replacement the launcher spawned for it (the recogniser's match).
            newcomer = r.replacement or ""
            join = _first_join(timings, newcomer, r.t0) if r.replacement else None
        slot = slot_of.get(r.member, 0)
        replacement_s, pause = math.inf, None
        if join is not None:
            slot_of[newcomer] = slot
            arrival = join.spawned_t + (join.registered_s or 0.0)
            replacement_s = max(0.0, arrival - (r.t0 + detect))
            pause = _join_pause(formed, commits, newcomer, arrival, step_by_size, step_s, size)
        out.append(
            FaultRecovery(
                t=r.t0 - t_start,
                member=r.member,
                slot=slot,
                fault=r.fault,
                detect_s=detect,
                recover_s=recover,
                replacement_s=replacement_s,
                join_pause_s=pause,
            )
        )
    return out


def _first_join(timings: Sequence[JoinTiming], member: str, after: float) -> JoinTiming | None:
    return next((j for j in timings if j.member == member and j.spawned_t >= after), None)


def _join_pause(
    formed: Sequence[Event],
    commits: Sequence[Event],
    member: str,
    arrival: float,
    step_by_size: dict[int, float],
    step_s: float,
    size: Any,
) -> float | None:
    gen = next((g for g in formed if g["t"] >= arrival and member in g["members"]), None)
    if gen is None or gen.get("reason") != "join":
        return None  # joined inside a failure's regroup: its cost is in that recovery
    g, t_formed = int(gen["gen"]), float(gen["t"])
    before = [float(c["t"]) for c in commits if float(c["t"]) <= t_formed]
    after = next((float(c["t"]) for c in commits if int(c["gen"]) == g), None)
    if not before or after is None:
        return None
    return max(0.0, after - max(before) - step_by_size.get(size(g), step_s))


def replace_costs(config: SimConfig, calibration: Calibration) -> SimConfig:
    """`config` with the recovery costs measured in a run (for projections)."""
    measured = calibration.config()
    costs = dataclasses.replace(
        config.costs,
        detect_s=measured.costs.detect_s,
        regroup_s=measured.costs.regroup_s,
        heal_s=measured.costs.heal_s,
        state_bytes=0.0,
    )
    return dataclasses.replace(config, costs=costs)
