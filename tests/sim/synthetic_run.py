"""Write a plausible elastrain run directory (events only) for the --from-run tests.

The timeline follows docs/guide/events.md: a job of `members` workers steps with a fixed
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
        """Write RUN_DIR/events/*.jsonl; return the training window."""
        rng = random.Random(self.seed)
        files: dict[str, list[dict[str, Any]]] = {}
        pids: dict[str, int] = {}

        def pid(proc: str) -> int:
            return pids.setdefault(proc, 1000 + len(pids))

        def emit(proc: str, t: float, kind: str, **fields: Any) -> None:
            rec = {"t": t, "mono": t - self.t0, "proc": proc, "pid": pid(proc), "kind": kind}
            files.setdefault(f"{proc}-{pid(proc)}", []).append({**rec, **fields})

        def form(t: float, gen: int, members: list[str], reason: str, step: int, go: float) -> None:
            """Generation formed at t; its members start stepping at `go`."""
            emit("coordinator", t, "generation_formed", gen=gen, members=members, reason=reason)
            steps = {m: step for m in members}
            emit("coordinator", t + 0.02, "generation_ready", gen=gen, members=members,
                 steps=steps, start_step=step)  # fmt: skip
            for rank, m in enumerate(members):
                emit(m, max(t + 0.03, go - 0.01), "group_built", gen=gen, rank=rank,
                     size=len(members), build_s=0.01)  # fmt: skip
                emit(m, go, "generation_start", gen=gen, step=step, state_hash="x")

        t = self.t0
        emit("launcher", t, "job_start", job_id="syn", target=self.members, min=1, script="x.py")
        active = [f"w{i}" for i in range(self.members)]
        for m in active:
            emit("launcher", t + 0.01, "worker_spawned", member=m, pid=pid(m), replacement=False)
            emit(m, t + 1.5, "worker_start", member=m)
            emit("coordinator", t + 2.0, "member_registered", member=m, incarnation=1)
        gen = 1
        t += 2.0
        form(t, gen, active, "start", 0, t + 0.2)
        t += 0.2
        next_id = self.members
        pending = sorted(self.faults, key=lambda f: f.at_s)
        joiners: list[tuple[float, str, Fault]] = []  # (registered at, member, its fault)
        start = t
        step = 0
        while step < self.steps:
            ready = [(r, m, f) for r, m, f in joiners if r <= t]
            if ready:  # replacements that registered join at this step boundary
                joiners = [j for j in joiners if j not in ready]
                gen += 1
                active = active + [m for _, m, _ in ready]
                f = ready[0][2]
                go = t + f.regroup_s + f.heal_s
                for m in active[: -len(ready)]:  # survivors leave their next step for the join
                    emit(m, t + 0.02, "step_abort", step=step, gen=gen - 1, error="regroup",
                         phase="quorum")  # fmt: skip
                for _, m, _ in ready:
                    emit(m, t + f.regroup_s, "heal_begin", gen=gen, role="recv", bytes=0)
                    emit(m, go - 0.005, "heal_end", gen=gen, role="recv",
                         bytes=1000, seconds=f.heal_s, rate_mb_s=1.0)  # fmt: skip
                form(t + 0.01, gen, active, "join", step, go)
                t = go
            k = len(active)
            d = self.base_step_s * self.members / k * (1 + rng.uniform(-self.jitter, self.jitter))
            if pending and start + pending[0].at_s < t + d:
                f = pending.pop(0)
                tf = max(t, start + f.at_s)
                v = f.victim
                emit(
                    "launcher", tf, "fault_injected", fault="kill", member=v, pid=pid(v), step=step
                )
                emit(
                    "launcher",
                    tf + f.detect_s,
                    "worker_exited",
                    member=v,
                    pid=pid(v),
                    returncode=-9,
                )
                active = [m for m in active if m != v]
                for m in active:
                    emit(m, tf + f.detect_s + 0.01, "step_abort", step=step, gen=gen,
                         error="peer", phase="allreduce")  # fmt: skip
                emit(
                    "coordinator",
                    tf + f.detect_s + 0.01,
                    "member_removed",
                    member=v,
                    reason="exited",
                )
                gen += 1
                t = tf + f.detect_s + f.regroup_s
                form(tf + f.detect_s + 0.05, gen, active, "failure", step, t)
                new = f"w{next_id}"
                next_id += 1
                t_spawn = tf + f.detect_s + f.spawn_s
                emit("launcher", t_spawn, "worker_spawned", member=new, pid=pid(new),
                     replacement=True, replaces=v)  # fmt: skip
                emit(new, t_spawn + f.startup_s - 0.1, "worker_start", member=new)
                emit(
                    "coordinator",
                    t_spawn + f.startup_s,
                    "member_registered",
                    member=new,
                    incarnation=1,
                )
                joiners.append((t_spawn + f.startup_s, new, f))
                continue
            for m in active:
                emit(m, t + d, "step_commit", step=step, gen=gen, loss=1.0, step_s=d,
                     compute_s=d * 0.8, allreduce_s=d * 0.2, samples_per_s=64 / d)  # fmt: skip
            t += d
            step += 1
        for m in active:
            emit(m, t + 0.05, "worker_exit", reason="done", committed=self.steps)
            emit("launcher", t + 0.3, "worker_exited", member=m, pid=pid(m), returncode=0)
        emit("launcher", t + 0.4, "job_end", status="done", steps=self.steps)
        d = run_dir / "events"
        d.mkdir(parents=True, exist_ok=True)
        for name, recs in files.items():
            with open(d / f"{name}.jsonl", "w") as fh:
                for r in recs:
                    fh.write(json.dumps(r) + "\n")
        return {"start": start, "end": t, "window": t - start}
