"""In-worker fault points: fail *this* process at an exact (member, step, phase).

The launcher can only kill a process at some wall time; tests need faults that
land at a precise point of the step protocol, e.g. after this member has sent
its all-reduce contribution but before the collective completed. A worker reads
the plan from $ELASTRAIN_FAULTS (JSON list) and calls `hit(step, phase)` at each
point; a matching fault fires once per process.

    [{"member": "w1", "step": 5, "phase": "allreduce", "action": "kill"}]

phases: "compute" (between micro-batches), "allreduce" (collective issued, not
finished), "commit" (after the optimizer step). actions: "kill" (SIGKILL),
"hang" (SIGSTOP: someone else must SIGCONT or kill it), "term" (SIGTERM:
graceful leave).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("compute", "allreduce", "commit")
ACTIONS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}


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
    ) -> None:
        self.points = [p for p in points if p.member == member]
        self.on_fire = on_fire
        self._fired: set[FaultPoint] = set()

    def hit(self, step: int, phase: str) -> None:
        for p in self.points:
            if p.step == step and p.phase == phase and p not in self._fired:
                self._fired.add(p)
                if self.on_fire is not None:
                    self.on_fire(p)
                os.kill(os.getpid(), ACTIONS[p.action])
