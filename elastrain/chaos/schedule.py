"""Launcher-side fault schedule: signals sent to worker processes from outside.

A fault is written `KIND@STEP[:MEMBER][/SECONDS]`:

    kill@15          SIGKILL a seeded-random member once the job reached step 15
    kill@15:w2       ... member w2
    hang@30/6        SIGSTOP a member at step 30, SIGCONT it 6 s later
    term@40          SIGTERM a member (graceful leave)
    kill-coordinator@20
                     SIGKILL the coordinator (the launcher restarts it)

The victim is chosen with a seeded generator among the members alive at that
moment, so a schedule with a seed is reproducible. To land *inside* a step
rather than at its boundary, the signal is sent after a seeded fraction of the
measured step time.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

KINDS = ("kill", "hang", "term", "kill-coordinator")
COORDINATOR = "coordinator"
"""The victim name of a fault aimed at the coordinator rather than a member."""
_RE = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<member>[\w.-]+))?(?:/(?P<dur>[\d.]+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    at_step: int
    member: str | None = None
    duration_s: float | None = None
    """For hang: when to SIGCONT (None: leave it stopped; the launcher kills it at the end)."""

    def __str__(self) -> str:
        s = f"{self.kind}@{self.at_step}"
        if self.member:
            s += f":{self.member}"
        if self.duration_s is not None:
            s += f"/{self.duration_s:g}"
        return s


def parse_fault(text: str) -> Fault:
    m = _RE.match(text.strip())
    if not m:
        raise ValueError(
            f"bad fault {text!r}: expected KIND@STEP[:MEMBER][/SECONDS], e.g. kill@15 or hang@30/6"
        )
    kind = m["kind"]
    if kind not in KINDS:
        raise ValueError(f"bad fault {text!r}: kind must be one of {', '.join(KINDS)}")
    dur = float(m["dur"]) if m["dur"] else None
    if kind == "kill-coordinator" and m["member"]:
        raise ValueError(f"bad fault {text!r}: kill-coordinator takes no member")
    if dur is not None and kind != "hang":
        raise ValueError(f"bad fault {text!r}: only hang takes a /SECONDS duration")
    return Fault(kind, int(m["step"]), m["member"], dur)


class FaultSchedule:
    """Which fault is due, and on whom. Pure apart from its seeded generator."""

    def __init__(self, faults: list[Fault], seed: int = 0) -> None:
        self.pending = sorted(faults, key=lambda f: f.at_step)
        self.rng = random.Random(seed)

    def due(self, step: int) -> list[Fault]:
        out = [f for f in self.pending if f.at_step <= step]
        self.pending = [f for f in self.pending if f.at_step > step]
        return out

    def pick(self, fault: Fault, members: list[str]) -> str | None:
        if fault.kind == "kill-coordinator":
            return COORDINATOR
        if fault.member is not None:
            return fault.member if fault.member in members else None
        return self.rng.choice(members) if members else None

    def offset(self, step_s: float) -> float:
        """Delay after the step boundary so the signal lands mid-step."""
        return self.rng.uniform(0.2, 0.8) * step_s
