"""`elastrain demo --sharded`: 4 workers train a GPT as 2 replica groups x 2 shards.

1. One rank is SIGKILLed. Its group-mate becomes a shadow, the other group keeps
   committing, and the replacement (started at once) is healed only the dead
   rank's shard, about half the state, from that shard's twin.
2. Once that heal is seen in the events, a rank of the other group is SIGKILLed
   with its replacement held back (`kill@S:wN/hold=...`). After `--reshard-after`
   the 3 survivors regroup in memory as 1 x 3 and go on.
3. The held replacement returns and the job goes back to 2 x 2.

The driver follows the run's events while the job runs: it schedules the
second kill only after the first replacement has healed, and it slows the
steps (a pace file the GPT script reads every step) while it waits for a
phase, so every phase happens before the end however slow the machine is.
At the end it prints the tables `elastrain demo` prints, the layout of every
generation and each regroup, the first heal against the whole state, the loss
and the invariants line.

    elastrain demo --sharded [--steps 75] [--run-dir DIR] [--plain]

Timing (why these constants): the coordinator reshards when a vacancy has
lasted `--reshard-after` (`RESHARD_AFTER_S`), whatever its cause; there is no
per-vacancy switch. So the first replacement must register before then (a
Python + torch worker takes a few seconds to start; 13 s was measured on a
2-core machine at load 9), while the held one must stay away longer: `HOLD_S`
plus its own start. A job whose first replacement is slower than that regroups
twice; the demo says so and exits 1.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos.schedule import FaultSchedule, parse_fault
from elastrain.demo.driven import run_driven
from elastrain.demo.pace import write_pace
from elastrain.launch.launcher import LaunchConfig, Launcher
from elastrain.observe.events import EventTail

Event = Mapping[str, Any]

GPT_ARGS = ["--dim", "192", "--layers", "4", "--micro", "8"]
"""The sharded demo's GPT: 4 blocks of width 192 (about 1.9M parameters, 4x the
plain demo's 128 x 2). Micro-batches of 8 (4 per step of 32): at 2x2 each member
computes one round per step. (This once avoided a member leaving between its
group's rounds while its group-mate waited in the next round's collective; the
engine no longer asks "superseded?" between rounds, see runtime/shard_groups.py
`ShardedGroups.turns`, so the choice now only keeps the demo's steps short.)"""
RECIPE_ARGS = ["--clip", "1.0", "--warmup", "5", "--eval-every", "25"]
"""What an LLM recipe has, on for the sharded demo: clipping to a global norm of
1.0 (the norm over every shard), a warm-up + cosine LR registered with the
trainer (heals and reshards carry it), and an evaluation on held-out text every
25 steps that every complete replica group shares."""
SHARD_SIZE = 2
FIRST_KILL_STEP = 8
FIRST_VICTIM = "w1"
REPLACE_DELAY_S = 0.5
RESHARD_AFTER_S = 30.0
HOLD_S = 36.0
BASE_PACE_S = 0.2
"""Seconds per step (at least) outside the waits."""
WAIT_PACE_S = 1.5
"""Seconds per step while a phase is awaited (a replacement starting, a reshard)."""
LATE_PACE_S = 3.0
"""... and when fewer than LATE_STEPS steps are left: the job must not end first."""
LATE_STEPS = 15
STEPS = 75


def shard_size_of(layout: str) -> int | None:
    """`2x2: r0=[w0,w1] r1=[w2,w3]` -> 2 (the shard size); None for "unsharded"."""
    m = re.match(r"(\d+)x(\d+)", layout)
    return int(m[2]) if m else None


def groups_of(layout: str) -> list[list[str]]:
    """`2x2: r0=[w0,w1] r1=[-,w3]` -> [["w0", "w1"], ["-", "w3"]]."""
    return [g.split(",") for g in re.findall(r"r\d+=\[([^\]]*)\]", layout)]


def second_victim(layout: str, replacement: str) -> str | None:
    """A member of a replica group other than the healed replacement's (the last
    one listed), so the other group now loses a rank."""
    for g in groups_of(layout):
        if replacement not in g:
            alive = [m for m in g if m != "-"]
            if alive:
                return alive[-1]
    return None


@dataclass
class Driver:
    """Follows the run's events on the launcher's status calls (its own thread):
    schedules the second kill once the first replacement has healed, and sets
    the pace file. `phase` is one of "first kill", "reshard", "back", "done"."""

    run_dir: Path
    pace: Path
    steps: int
    schedule: FaultSchedule
    note: Callable[[str], None]
    phase: str = "first kill"
    originals: set[str] = field(default_factory=set)
    layout: str = ""
    second: str | None = None
    _tail: EventTail | None = None

    def on_status(self, status: Mapping[str, Any]) -> None:
        if self._tail is None:
            self._tail = EventTail(self.run_dir)
        step = int(status.get("step", 0))
        for e in sorted(self._tail.poll(), key=lambda e: e.get("t", 0.0)):
            self._see(e, step)
        self._set_pace(step)

    def _see(self, e: Event, step: int) -> None:
        k = e.get("kind")
        if k == "worker_spawned" and not e.get("replacement"):
            self.originals.add(str(e.get("member")))
        elif k == "generation_ready" and e.get("layout"):
            self.layout = str(e["layout"])
        elif k == "fault_injected" and e.get("fault") == "kill":
            held = f", its replacement held back {e['hold_s']:g} s" if e.get("hold_s") else ""
            self.note(f"step {e.get('step')}: SIGKILL {e.get('member')}{held}")
        elif k == "layout_changed":
            self.note(f"gen {e.get('gen')}: regroup {e.get('old')} -> {e.get('new')}")
            size = shard_size_of(str(e.get("new", "")))
            if self.phase == "first kill" and size != SHARD_SIZE:
                self.note(
                    f"the first replacement did not register within {RESHARD_AFTER_S:g} s "
                    "(--reshard-after): the job regrouped before it came"
                )
            elif self.phase == "reshard" and size is not None and size != SHARD_SIZE:
                self.phase = "back"
            elif self.phase == "back" and size == SHARD_SIZE:
                self.phase = "done"
                self.note("back at 2x2: the job runs to its end")
        elif (
            k == "heal_end"
            and e.get("role") == "recv"
            and self.phase == "first kill"
            and e.get("proc") not in self.originals
        ):
            who = str(e.get("proc"))
            self.note(f"{who} healed {int(e.get('bytes', 0)) / 1e6:.3f} MB (its shard only)")
            self.second = second_victim(self.layout, who)
            if self.second is None:
                self.note(f"no second victim in {self.layout!r}: the demo stops here")
                self.phase = "done"
                return
            self.schedule.add(parse_fault(f"kill@{step + 2}:{self.second}/hold={HOLD_S:g}s"))
            self.phase = "reshard"

    def _set_pace(self, step: int) -> None:
        if self.phase == "done" or self.phase == "first kill" and step < FIRST_KILL_STEP:
            pace = BASE_PACE_S
        elif self.steps - step < LATE_STEPS:
            pace = LATE_PACE_S
        else:
            pace = WAIT_PACE_S
        write_pace(self.pace, pace)


def run_sharded_demo(*, steps: int = STEPS, run_dir: str | None = None, plain: bool = False) -> int:
    from elastrain.demo.show import report

    script = str(Path(__file__).with_name("gpt.py"))
    with tempfile.TemporaryDirectory(prefix="elastrain-demo-") as tmp:
        pace = Path(tmp) / "pace"
        write_pace(pace, BASE_PACE_S)
        cfg = LaunchConfig(
            script=script,
            script_args=[*GPT_ARGS, *RECIPE_ARGS, "--pace-file", str(pace)],
            workers=4,
            shard_size=SHARD_SIZE,
            reshard_after_s=RESHARD_AFTER_S,
            replace_delay_s=REPLACE_DELAY_S,
            run_dir=run_dir,
            steps=steps,
            faults=[parse_fault(f"kill@{FIRST_KILL_STEP}:{FIRST_VICTIM}")],
            seed=1,
        )
        print(
            "elastrain demo --sharded: 4 workers train a GPT (4 blocks of width 192) as 2 replica\n"
            "groups x 2 shards: FSDP2 inside a group, the twins' float64 reduction across groups.\n"
            f"At step {FIRST_KILL_STEP} {FIRST_VICTIM} is SIGKILLed; its replacement is healed "
            "only the dead shard.\n"
            "Then a rank of the other group is SIGKILLed with its replacement held back "
            f"{HOLD_S:g} s:\nafter {RESHARD_AFTER_S:g} s the 3 survivors regroup in memory as "
            "1x3; when the replacement\nreturns, the job goes back to 2x2.\n"
        )

        def make_driver(launcher: Launcher, note: Callable[[str], None]) -> Driver:
            schedule = launcher.schedule
            assert isinstance(schedule, FaultSchedule)  # chaos's, registered by run_driven
            return Driver(launcher.run_dir, pace, steps, schedule, note)

        result, launcher, driver = run_driven(cfg, steps, plain, make_driver)
        if driver.phase != "done":
            print(f"\nthe demo did not reach every phase (stopped while waiting: {driver.phase})")
    full = state_bytes()
    return report(
        result,
        launcher,
        sections=lambda ev: "\n\n".join(
            [format_layouts(ev), format_first_heal(ev, full), format_recipe(ev)]
            + [f"NOT SHOWN: {p}" for p in problems(ev)]
        ),
        ok=lambda ev: driver.phase == "done" and not problems(ev),
    )


def state_bytes(args: Sequence[str] = GPT_ARGS) -> int:
    """The whole training state of the demo's GPT: parameters and AdamW's two moments."""
    import torch

    from elastrain.demo.gpt import GPT

    a = dict(zip(args[::2], args[1::2], strict=True))
    with torch.device("meta"):
        model = GPT(d=int(a.get("--dim", 128)), layers=int(a.get("--layers", 2)))
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def layout_rows(events: Sequence[Event]) -> list[tuple[int, str, str, int]]:
    """(gen, reason, layout, steps committed in it) of every ready generation of a
    sharded run, in order."""
    reasons = {
        e.get("gen"): str(e.get("reason", ""))
        for e in events
        if e.get("kind") == "generation_formed"
    }
    steps: dict[Any, set[Any]] = {}
    for e in events:
        if e.get("kind") == "step_commit":
            steps.setdefault(e.get("gen"), set()).add(e.get("step"))
    out = []
    for e in sorted(events, key=lambda e: e.get("t", 0.0)):
        if e.get("kind") == "generation_ready" and e.get("layout"):
            g = e["gen"]
            out.append((int(g), reasons.get(g, ""), str(e["layout"]), len(steps.get(g, ()))))
    return out


def format_layouts(events: Sequence[Event]) -> str:
    """The layout of every generation, then each regroup to another shard size with
    the bytes its members received (sum) and its time (the slowest member)."""
    rows = layout_rows(events)
    lines = [
        "layouts (one row per generation; `-` a vacant slot: its group-mate is a shadow that",
        "computes nothing and applies every update, the complete groups compute the batch):",
        f"  {'gen':>4}  {'reason':8} {'steps':>5}  layout",
    ]
    lines += [f"  {g:>4}  {r:8} {n:>5}  {lay}" for g, r, lay, n in rows]
    changes = [e for e in events if e.get("kind") == "layout_changed"]
    ends = [e for e in events if e.get("kind") == "reshard_end"]
    lines += ["", "regroups in memory (no disk, no restart; moved: bytes the members received):"]
    if not changes:
        lines.append("  none")
    for c in sorted(changes, key=lambda e: e.get("t", 0.0)):
        mine = [e for e in ends if e.get("gen") == c.get("gen")]
        moved = sum(int(e.get("received", 0)) for e in mine)
        secs = max((float(e.get("seconds", 0.0)) for e in mine), default=float("nan"))
        sizes = sorted({(e.get("old_size"), e.get("new_size")) for e in mine}, key=str)
        how = ", ".join(f"{a} -> {b} ways" for a, b in sizes) or "no reshard_end seen"
        lines.append(
            f"  gen {c.get('gen')} ({c.get('reason')}): {c.get('old')}  ->  {c.get('new')}"
        )
        lines.append(f"      {how}: {len(mine)} members, moved {moved / 1e6:.3f} MB, {secs:.3f} s")
    return "\n".join(lines)


def first_heal(events: Sequence[Event]) -> tuple[Event, list[str]] | None:
    """The first replacement's heal (`heal_end`, role recv, by a spawned
    replacement) and the members that sent it (its senders in that generation)."""
    spawned = {
        e.get("member")
        for e in events
        if e.get("kind") == "worker_spawned" and e.get("replacement")
    }
    for e in sorted(events, key=lambda e: e.get("t", 0.0)):
        if e.get("kind") == "heal_end" and e.get("role") == "recv" and e.get("proc") in spawned:
            senders = sorted(
                str(s.get("proc"))
                for s in events
                if s.get("kind") == "heal_end"
                and s.get("role") == "send"
                and s.get("gen") == e["gen"]
            )
            return e, senders
    return None


def format_first_heal(events: Sequence[Event], full_bytes: int) -> str:
    got = first_heal(events)
    if got is None:
        return "first replacement: no heal seen"
    e, senders = got
    n = int(e.get("bytes", 0))
    return (
        f"first replacement: {e.get('proc')} was healed {n / 1e6:.3f} MB of the "
        f"{full_bytes / 1e6:.3f} MB training state ({n / full_bytes:.0%}),\n"
        f"  only the dead rank's shard, from its twin {', '.join(senders) or '?'} "
        f"in {float(e.get('seconds', 0)):.3f} s"
    )


def layout_sizes(events: Sequence[Event]) -> list[int]:
    """The shard size of every ready generation, in order, repeats collapsed."""
    out: list[int] = []
    for _, _, lay, _ in layout_rows(events):
        s = shard_size_of(lay)
        if s is not None and (not out or out[-1] != s):
            out.append(s)
    return out


def evaluations(events: Sequence[Event]) -> dict[int, tuple[float, int]]:
    """Step -> (mean held-out loss, evaluations run for it) from the `eval_end`
    events: the result every member got (the same sums on all of them), and how
    many times that step's evaluation completed (more than once: redone after a
    member died during it)."""
    out: dict[int, tuple[float, int]] = {}
    gens: dict[int, set[Any]] = {}
    for e in events:
        if e.get("kind") == "eval_end" and e.get("samples"):
            step = int(e["step"])
            gens.setdefault(step, set()).add(e.get("gen"))
            out[step] = (float(e["sums"]["loss"]) / int(e["samples"]), len(gens[step]))
    return out


def format_recipe(events: Sequence[Event]) -> str:
    """The recipe's line: the clipped norms and the held-out losses."""
    norms = [
        float(e["grad_norm"])
        for e in events
        if e.get("kind") == "step_commit" and e.get("grad_norm") is not None
    ]
    evals = evaluations(events)
    lines = ["the recipe (clipping to 1.0, warm-up + cosine LR registered, held-out evaluation):"]
    if norms:
        lines.append(
            f"  global gradient norm over all shards: {norms[0]:.2f} at the first step, "
            f"{norms[-1]:.2f} at the last (clipped to 1.0)"
        )
    if evals:
        shown = ", ".join(
            f"step {s}: {loss:.3f}" + (f" (run {n}x)" if n > 1 else "")
            for s, (loss, n) in sorted(evals.items())
        )
        lines.append(f"  held-out loss: {shown}")
    return "\n".join(lines)


def problems(events: Sequence[Event]) -> list[str]:
    """What the demo set out to show and did not (empty: all of it)."""
    out = []
    if not evaluations(events):
        out.append("no evaluation completed")
    sizes = layout_sizes(events)
    if sizes != [2, 3, 2]:
        out.append(f"shard sizes went {sizes}, not 2 -> 3 -> 2")
    if first_heal(events) is None:
        out.append("no replacement was healed")
    return out
