"""When the replacement of a worker whose slot a hot spare took is started.

With `--spares K`, a death promotes a waiting spare into the failure's
generation at once, and the dead worker's replacement only refills the spare
pool. Started at once, that replacement builds its model, data and trainer on
the same host's cores while the survivors and the promoted spare recompute the
interrupted step, and slows the very recovery the pool exists to make fast (on
the 2-core development machine the refill's start took 0.1-0.3 s from each of
the two steps after a kill). So a refill waits until the job has moved past
the step it died in, or `REFILL_WAIT_S` at most; a replacement that fills a
member's slot (no spare waited) is started as before, after the replace delay.
The decision is pure (`refill_due`); the launcher polls it.
"""

from __future__ import annotations

from dataclasses import dataclass

REFILL_WAIT_S = 30.0
"""The longest a refill waits for the job to move on (a job that stalls after a
failure still gets its spare pool back)."""


@dataclass(frozen=True)
class Refill:
    """A refill waiting to be started: the replacement of `member` (PID `pid`)."""

    member: str
    pid: int
    progress: int
    """The job's progress when the member died: the highest step a generation
    had been told to proceed past (the coordinator's status ``step``)."""
    not_before: float
    """Monotonic time: the death plus the replace delay."""
    deadline: float
    """Monotonic time: started by then whatever the job did."""


def refill_at(member: str, pid: int, progress: int, now: float, delay_s: float) -> Refill:
    """The refill of `member`, dead at `now` with the job at `progress`."""
    return Refill(member, pid, progress, now + delay_s, now + max(delay_s, REFILL_WAIT_S))


def refill_due(refill: Refill, now: float, progress: int, alive: int) -> bool:
    """Start it now? After the replace delay: once the job has been told to
    proceed past a later step than when the member died (the promoted spare's
    generation has committed the interrupted step), when none of the launcher's
    workers is alive (nothing left to slow down), or at the deadline."""
    if now < refill.not_before:
        return False
    return progress > refill.progress or alive == 0 or now >= refill.deadline
