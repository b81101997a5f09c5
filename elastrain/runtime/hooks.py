"""The step engine's hook seam: code outside the core reaches a worker's step here.

A hook is told where the engine is (`StepPoint`) at every step; the chaos
package's fault points are one, installed by the worker entry point
(`elastrain.worker`, the seam's registration) when the launcher asked for faults. The engine
never imports who implements a hook: the core does not depend on the tools.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from elastrain.observe.events import EventLog


class StepPoint(StrEnum):
    """Where in a step a hook is called (the `phase` of a fault point)."""

    CONNECT = "connect"
    """Before this member builds the process group of a generation that starts at
    step `step` (after the coordinator said every member is ready)."""
    COMPUTE = "compute"
    """After this member's first micro-batch's backward."""
    ALLREDUCE = "allreduce"
    """Right after the step's all-reduce was posted."""
    VOTE = "vote"
    """Sharded steps: the commit vote (the extras' all-reduce over the generation,
    posted once the shard's twins had reduced the gradient) completed here; the
    step is not applied yet."""
    COMMIT = "commit"
    """After the step was applied (and any due checkpoint snapshot taken)."""
    EVAL = "eval"
    """After this member's first batch of the evaluation of the model after step
    `step` (the step's index: the evaluation sees `step` + 1 committed steps)."""


class InjectedFailure(RuntimeError):
    """Raised by a hook's `at` (at `StepPoint.VOTE`) to lose this member's answer:
    the engine waits on as for an answer that never comes (until a deadline or the
    generation's end) while its peers, whose vote completed, commit. The fault no
    signal can produce at an exact point (the chaos "fail" action)."""


class StepHook(Protocol):
    def attach(self, member: str, events: EventLog) -> None:
        """Called once, when the engine starts, with the member id and its event log."""

    def at(self, step: int, point: StepPoint) -> None:
        """Called by the training thread at `point` of step `step` (0-based)."""


_installed: list[StepHook] = []


def install(hook: StepHook) -> None:
    """Add a hook that every engine created afterwards in this process calls."""
    _installed.append(hook)


def installed() -> list[StepHook]:
    return list(_installed)


def clear() -> None:
    """Remove every installed hook (tests)."""
    _installed.clear()
