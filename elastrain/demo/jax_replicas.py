"""`elastrain demo --jax`: 2 JAX replicas x 2 processes; one process is SIGKILLed.

A replica is 2 processes of one `jax.distributed` runtime with the model's
rows split over its mesh; replicas are data parallel (process k of each
replica holds the same rows as process k of the other: twins). Once a few
steps are committed, process 1 of replica 0 (w1) is SIGKILLed. Its
replica-mate cannot outlive the dead peer's runtime and is stopped; the
other replica keeps its processes and commits its next step; the lost
replica is started again as 2 fresh processes, each healed only its own
shard from its twin. The printout shows each of these from the run's
events, and the invariants (exactly-once, twins' digests equal at every
generation start) checked by `elastrain.observe.ledger`.

    elastrain demo --jax [--steps 30] [--run-dir DIR] [--plain]

The driver follows the events on the launcher's status calls and sets the
pace file (`elastrain.demo.pace`): slow while the rebuilt replica starts
(JAX import, runtime, compile: seconds), fast once both its processes are
healed, so the rebuild happens before the last step on a slow machine while
the demo stays short on a fast one.
"""

from __future__ import annotations

import enum
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos.schedule import parse_fault
from elastrain.demo.pace import write_pace
from elastrain.observe.events import EventTail
from elastrain.observe.ledger import check_exactly_once

Event = Mapping[str, Any]

STEPS = 30
KILL_STEP = 4
VICTIM = "w1"
"""Process 1 of replica 0 (the launcher places w0, w1 in replica 0; w2, w3 in 1)."""
BASE_PACE_S = 0.25
"""Seconds per step (at least) before the kill: a few commits to see first."""
WAIT_PACE_S = 1.0
"""... while the rebuilt replica starts and heals."""
LATE_PACE_S = 3.0
"""... when fewer than LATE_STEPS steps are left and it has not healed yet."""
LATE_STEPS = 8
AFTER_PACE_S = 0.0
"""Once healed: the remaining steps as fast as they go."""
INSTALL = "elastrain demo --jax needs JAX and optax: pip install 'elastrain[jax]'"


class Phase(enum.Enum):
    BEFORE_KILL = "before the kill"
    REBUILDING = "waiting for the rebuilt replica to heal"
    DONE = "healed"


@dataclass
class Driver:
    """Follows the run's events (the launcher's status thread): notes the kill and
    each heal of a fresh process, and sets the pace file for the phase."""

    run_dir: Path
    pace: Path
    steps: int
    note: Callable[[str], None]
    phase: Phase = Phase.BEFORE_KILL
    originals: set[str] = field(default_factory=set)
    healed: set[str] = field(default_factory=set)
    _tail: EventTail | None = None

    def on_status(self, status: Mapping[str, Any]) -> None:
        if self._tail is None:
            self._tail = EventTail(self.run_dir)
        for e in sorted(self._tail.poll(), key=lambda e: e.get("t", 0.0)):
            self.see(e)
        write_pace(self.pace, pace_for(self.phase, self.steps - int(status.get("step", 0))))

    def see(self, e: Event) -> None:
        k = e.get("kind")
        if k == "worker_spawned" and not e.get("replacement"):
            self.originals.add(str(e.get("member")))
        elif k == "fault_injected" and e.get("fault") == "kill":
            self.note(f"step {e.get('step')}: SIGKILL {e.get('member')}")
            self.phase = Phase.REBUILDING
        elif k == "heal_end" and e.get("role") == "recv" and e.get("proc") not in self.originals:
            self.healed.add(str(e.get("proc")))
            self.note(f"{e.get('proc')} healed {int(e.get('bytes', 0))} bytes (its shard)")
            if len(self.healed) >= 2:
                self.phase = Phase.DONE


def pace_for(phase: Phase, steps_left: int) -> float:
    """The minimum step time for `phase` with `steps_left` steps to go."""
    if phase is Phase.BEFORE_KILL:
        return BASE_PACE_S
    if phase is Phase.DONE:
        return AFTER_PACE_S
    return LATE_PACE_S if steps_left < LATE_STEPS else WAIT_PACE_S


def jax_missing() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is None for m in ("jax", "optax"))


def run_jax_demo(*, steps: int = STEPS, run_dir: str | None = None, plain: bool = False) -> int:
    """Run the demo; 2 when JAX is not installed, else `report`'s exit status."""
    if jax_missing():
        import sys

        print(INSTALL, file=sys.stderr)
        return 2
    from elastrain.demo import jax_mlp
    from elastrain.demo.driven import run_driven
    from elastrain.demo.show import report
    from elastrain.launch.launcher import LaunchConfig

    with tempfile.TemporaryDirectory(prefix="elastrain-demo-") as tmp:
        pace = Path(tmp) / "pace"
        write_pace(pace, BASE_PACE_S)
        cfg = LaunchConfig(
            script=jax_mlp.__file__,
            script_args=["--pace-file", str(pace)],
            workers=4,
            replica_procs=jax_mlp.PROCS,
            run_dir=run_dir,
            steps=steps,
            faults=[parse_fault(f"kill@{KILL_STEP}:{VICTIM}")],
            seed=1,
        )
        print(
            "elastrain demo --jax: 2 replicas x 2 processes train a small JAX MLP. Each replica\n"
            "is one jax.distributed runtime over 2 processes, its weights split by rows over\n"
            "them; process k of each replica holds the same rows (twins), their gradients\n"
            f"are summed across replicas. At step {KILL_STEP} {VICTIM} (replica 0, process 1) "
            "is SIGKILLed:\nthe other replica trains on; replica 0 is rebuilt as 2 fresh "
            "processes, healed\nshard by shard from their twins.\n"
        )
        result, launcher, _ = run_driven(
            cfg, steps, plain, lambda la, note: Driver(la.run_dir, pace, steps, note)
        )
    full = jax_mlp.state_bytes()
    return report(
        result,
        launcher,
        sections=lambda ev: format_sections(ev, full, jax_mlp.expected_ids),
        ok=lambda ev: not problems(ev, jax_mlp.expected_ids),
    )


def places(events: Sequence[Event]) -> dict[str, tuple[int, int]]:
    """Member -> (replica, shard) from its `generation_start` events."""
    return {
        str(e["proc"]): (int(e["replica"]), int(e["shard"]))
        for e in events
        if e.get("kind") == "generation_start" and "replica" in e and "shard" in e
    }


def _kill(events: Sequence[Event]) -> Event | None:
    kills = [e for e in events if e.get("kind") == "fault_injected" and e.get("fault") == "kill"]
    return min(kills, key=lambda e: e.get("t", 0.0), default=None)


def _commits(events: Sequence[Event], member: str) -> list[Event]:
    return sorted(
        (e for e in events if e.get("kind") == "step_commit" and e.get("proc") == member),
        key=lambda e: e.get("t", 0.0),
    )


def _spawned(events: Sequence[Event]) -> dict[str, Event]:
    return {str(e["member"]): e for e in events if e.get("kind") == "worker_spawned"}


def survivors(events: Sequence[Event]) -> list[tuple[str, int | None, set[int], Event | None]]:
    """The other replica's members: (member, PID at spawn, PIDs that committed,
    its first commit after the kill)."""
    kill = _kill(events)
    if kill is None:
        return []
    where = places(events)
    lost = where.get(str(kill.get("member")), (None, None))[0]
    spawned = _spawned(events)
    out = []
    for m, e in spawned.items():
        if e.get("replacement") or m not in where or where[m][0] == lost:
            continue
        commits = _commits(events, m)
        after = next((c for c in commits if c["t"] > kill["t"]), None)
        out.append((m, e.get("pid"), {int(c["pid"]) for c in commits}, after))
    return sorted(out)


def rebuilt(events: Sequence[Event]) -> list[tuple[str, Event, Event | None, list[str]]]:
    """The fresh processes: (member, its `worker_spawned`, its heal as receiver,
    the members of its shard that sent in that heal's generation: its twins)."""
    where = places(events)
    out = []
    for m, e in _spawned(events).items():
        if not e.get("replacement"):
            continue
        heal = next(
            (
                h
                for h in events
                if h.get("kind") == "heal_end" and h.get("role") == "recv" and h.get("proc") == m
            ),
            None,
        )
        shard = where.get(m, (None, None))[1]
        senders = sorted(
            str(s["proc"])
            for s in events
            if heal is not None
            and s.get("kind") == "heal_end"
            and s.get("role") == "send"
            and s.get("gen") == heal.get("gen")
            and where.get(str(s.get("proc")), (None, None))[1] == shard
        )
        out.append((m, e, heal, senders))
    return sorted(out, key=lambda r: where.get(r[0], (0, 0)))


def format_sections(
    events: Sequence[Event], full_bytes: int, expected: Callable[[int], list[int]]
) -> str:
    """The kill, the other replica's next commit, the rebuilt replica's heals and
    the exactly-once line."""
    kill = _kill(events)
    if kill is None:
        return "no kill was injected"
    where = places(events)
    t0, victim = float(kill["t"]), str(kill.get("member"))
    r, k = where.get(victim, ("?", "?"))
    exits = {str(e["member"]): e for e in events if e.get("kind") == "worker_exited"}
    lines = [f"the kill: SIGKILL {victim} (replica {r}, process {k}) at step {kill.get('step')}"]
    for m, (rm, _) in sorted(where.items()):
        if rm == r and m != victim and m in exits and not _spawned(events)[m].get("replacement"):
            x = exits[m]
            lines.append(
                f"  its replica-mate {m} was stopped {float(x['t']) - t0:.2f} s later "
                f"(exit {x.get('returncode')}): its JAX runtime cannot outlive a dead peer"
            )
    lines += ["", "the other replica kept its processes and committed its next step:"]
    lines.append(f"  {'member':6} {'shard':>5} {'pid':>8}  {'committed from':14}  next commit")
    for m, pid, pids, after in survivors(events):
        same = "same PID" if pids == {pid} else "PIDs " + ",".join(map(str, sorted(pids)))
        nxt = (
            f"step {after['step']}, {float(after['t']) - t0:.2f} s after the kill"
            if after
            else "none after the kill"
        )
        lines.append(f"  {m:6} {where[m][1]:>5} {pid:>8}  {same:14}  {nxt}")
    lines += [
        "",
        f"the lost replica, rebuilt as fresh processes; each healed its own shard from its twin\n"
        f"(whole training state: {full_bytes} bytes, what a replicated heal would move):",
        f"  {'member':6} {'shard':>5} {'pid':>8}  {'healed from':11}  {'bytes':>6}  "
        f"{'of whole':>8}  first commit",
    ]
    for m, spawn, heal, senders in rebuilt(events):
        shard = where.get(m, ("?", "?"))[1]
        if heal is None:
            lines.append(f"  {m:6} {shard:>5} {spawn.get('pid'):>8}  not healed")
            continue
        n = int(heal.get("bytes", 0))
        first = _commits(events, m)
        when = (
            f"step {first[0]['step']}, {float(first[0]['t']) - t0:.1f} s after the kill"
            if first
            else "none"
        )
        lines.append(
            f"  {m:6} {shard:>5} {spawn.get('pid'):>8}  {','.join(senders):11}  {n:>6}  "
            f"{n / full_bytes:>8.0%}  {when}"
        )
    led = check_exactly_once(events, expected)
    lines += [
        "",
        "exactly-once (every step committed once, on exactly its samples): "
        + ("yes" if not led.violations else f"NO ({len(led.violations)} violations)"),
    ]
    lines += [f"  {v}" for v in led.violations[:10]]
    lines += [f"NOT SHOWN: {p}" for p in problems(events, expected)]
    return "\n".join(lines)


def problems(events: Sequence[Event], expected: Callable[[int], list[int]]) -> list[str]:
    """What the demo set out to show and did not (empty: all of it)."""
    out = []
    surv = survivors(events)
    if len(surv) != 2 or any(pids != {pid} or after is None for _, pid, pids, after in surv):
        out.append("the other replica did not go on in the same processes")
    fresh = rebuilt(events)
    if len(fresh) != 2 or any(heal is None or not senders for _, _, heal, senders in fresh):
        out.append("the lost replica was not rebuilt and healed from its twins")
    if check_exactly_once(events, expected).violations:
        out.append("exactly-once did not hold")
    return out
