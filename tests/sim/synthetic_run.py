"""Write a plausible elastrain run directory (events only) for the --from-run tests.

The timeline follows docs/events.md: a job of `members` workers steps with a fixed
global batch (a step on k members takes base * members / k, with jitter); each fault
kills a member mid-step; survivors detect, regroup and go on shrunk; the launcher
spawns a replacement that registers, joins at the next step boundary and heals.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Fault:
    at_s: float
    """Seconds after the first step starts."""
    victim: str
    detect_s: float = 0.3
    regroup_s: float = 0.4
    spawn_s: float = 0.5
    startup_s: float = 2.5
    heal_s: float = 0.6


@dataclass
class SyntheticRun:
    members: int = 4
    steps: int = 600
    base_step_s: float = 0.2
    jitter: float = 0.05
    faults: list[Fault] = field(default_factory=list)
    seed: int = 0
    t0: float = 1_800_000_000.0

    def write(self, run_dir: Path) -> dict[str, float]:
        """Write RUN_DIR/events/*.jsonl; return the true step time and window."""
        rng = random.Random(self.seed)
        files: dict[str, list[dict[str, Any]]] = {}
        pids: dict[str, int] = {}

        def emit(proc: str, t: float, kind: str, **fields: Any) -> None:
            pid = pids.setdefault(proc, 1000 + len(pids))
            files.setdefault(f"{proc}-{pid}", []).append(
                {"t": t, "mono": t - self.t0, "proc": proc, "pid": pid, "kind": kind, **fields}
            )

        t = self.t0
        emit("launcher", t, "job_start", job_id="syn", target=self.members, min=1, script="x.py")
        emit("coordinator", t, "coordinator_start", host="127.0.0.1", port=1, store_port=2)
        active = [f"w{i}" for i in range(self.members)]
        for m in active:
            emit("launcher", t + 0.01, "worker_spawned", member=m, pid=0, replacement=False)
            emit("coordinator", t + 2.0, "member_registered", member=m, incarnation=0)
        gen = 1
        t += 2.0
        self._form(emit, t, gen, active, "start", 0)
        t += 0.2
        next_id = self.members
        pending = sorted(self.faults, key=lambda f: f.at_s)
        joiners: list[tuple[float, str]] = []  # (registered at, member)
        start = t
        step = 0
        while step < self.steps:
            # Replacements that registered join at this step boundary.
            ready = [m for r, m in joiners if r <= t]
            if ready:
                joiners = [(r, m) for r, m in joiners if m not in ready]
                f = self._fault_for_join
                gen += 1
                active = active + ready
                self._form(emit, t + 0.01, gen, active, "join", step)
                for m in ready:
                    emit(m, t + f.regroup_s, "heal_begin", gen=gen, role="recv", bytes=1000)
                    emit(
                        m,
                        t + f.regroup_s + f.heal_s,
                        "heal_end",
                        gen=gen,
                        role="recv",
                        bytes=1000,
                        seconds=f.heal_s,
                        rate_mb_s=1.0,
                    )
                t += f.regroup_s + f.heal_s
            d = (
                self.base_step_s
                * self.members
                / len(active)
                * (1 + rng.uniform(-self.jitter, self.jitter))
            )
            if pending and start + pending[0].at_s < t + d:
                f = pending.pop(0)
                self._fault_for_join = f
                tf = max(t, start + f.at_s)
                emit(
                    "launcher",
                    tf,
                    "fault_injected",
                    fault="kill",
                    member=f.victim,
                    pid=0,
                    step=step,
                )
                emit(
                    "launcher",
                    tf + f.detect_s,
                    "worker_exited",
                    member=f.victim,
                    pid=0,
                    returncode=-9,
                )
                active = [m for m in active if m != f.victim]
                for m in active:
                    emit(
                        m,
                        tf + f.detect_s + 0.01,
                        "step_abort",
                        step=step,
                        gen=gen,
                        error="peer",
                        phase="allreduce",
                    )
                emit(
                    "coordinator",
                    tf + f.detect_s + 0.01,
                    "member_removed",
                    member=f.victim,
                    reason="exited",
                )
                gen += 1
                self._form(emit, tf + f.detect_s + 0.05, gen, active, "failure", step)
                t = tf + f.detect_s + f.regroup_s
                new = f"w{next_id}"
                next_id += 1
                t_spawn = tf + f.detect_s + f.spawn_s
                emit("launcher", t_spawn, "worker_spawned", member=new, pid=0, replacement=True)
                emit(
                    "coordinator",
                    t_spawn + f.startup_s,
                    "member_registered",
                    member=new,
                    incarnation=0,
                )
                joiners.append((t_spawn + f.startup_s, new))
                continue
            for m in active:
                emit(
                    m,
                    t + d,
                    "step_commit",
                    step=step,
                    gen=gen,
                    loss=1.0,
                    step_s=d,
                    compute_s=d * 0.8,
                    allreduce_s=d * 0.2,
                    samples_per_s=1.0,
                )
            t += d
            step += 1
        emit("launcher", t + 0.1, "job_end", status="done", steps=self.steps)
        d = run_dir / "events"
        d.mkdir(parents=True, exist_ok=True)
        for name, recs in files.items():
            with open(d / f"{name}.jsonl", "w") as fh:
                for r in recs:
                    fh.write(json.dumps(r) + "\n")
        return {"start": start, "end": t, "window": t - start}

    _fault_for_join: Fault = field(default_factory=lambda: Fault(0.0, "w0"))

    def _form(
        self, emit: Any, t: float, gen: int, members: list[str], reason: str, step: int
    ) -> None:
        emit("coordinator", t, "generation_formed", gen=gen, members=members, reason=reason)
        emit(
            "coordinator",
            t + 0.02,
            "generation_ready",
            gen=gen,
            members=members,
            steps={m: step for m in members},
            start_step=step,
        )
        for rank, m in enumerate(members):
            emit(m, t + 0.1, "group_built", gen=gen, rank=rank, size=len(members), build_s=0.1)
            emit(m, t + 0.15, "generation_start", gen=gen, step=step, state_hash="x")
