"""The step watchdog's deadlines, derived from measured collective waits.

Two deadlines for one collective wait:

- the *soft* one, `confirm_multiplier` x the p99 of the recent waits plus a
  small margin: past it the member asks the coordinator whether a peer has
  stopped heartbeating (`Membership.confirm_hang`) and gives up at once if
  one has. It is cheap to be early here, because a live peer is not accused:
  the wait alone never ends the generation.
- the *hard* one, `multiplier` x the slowest recent wait clamped to [floor,
  ceiling]: the member gives up whatever the heartbeats say (a peer whose
  training thread is stuck while its heartbeat thread runs, a coordinator
  that cannot be reached).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice

from elastrain.runtime.config import WatchdogConfig

HANG_ASK_EVERY_S = 0.1
"""Past the soft watchdog deadline, how often an overdue all-reduce asks the
coordinator whether a peer is hung: a hang is confirmed within this of the
peer's silence reaching `hang_silence_s`."""

SOFT_MIN_SAMPLES = 5
"""Waits measured before the soft deadline is trusted (warm-up steps first)."""


class HangTimeout:
    """Deadlines for one collective wait. A wait includes the skew between
    members (the slowest member's compute), which is what a healthy step can
    legitimately take beyond the transfer itself."""

    def __init__(self, config: WatchdogConfig, window: int = 20, soft_window: int = 100) -> None:
        self.config = config
        self.window = window
        self._waits: deque[float] = deque(maxlen=max(window, soft_window))

    def observe(self, wait_s: float) -> None:
        self._waits.append(wait_s)

    @property
    def timeout_s(self) -> float:
        """The hard deadline (seconds from the start of the wait)."""
        c = self.config
        if not self._waits:
            return max(c.floor_s, min(c.initial_s, c.ceiling_s))
        t = c.multiplier * max(islice(reversed(self._waits), self.window))
        return max(c.floor_s, min(t, c.ceiling_s))

    @property
    def soft_s(self) -> float | None:
        """The soft deadline, never later than the hard one; None: do not ask
        (switched off, or fewer than `SOFT_MIN_SAMPLES` waits measured)."""
        c = self.config
        n = len(self._waits)
        if c.confirm_multiplier <= 0 or n < SOFT_MIN_SAMPLES:
            return None
        p99 = sorted(self._waits)[math.ceil(0.99 * n) - 1]
        return min(self.timeout_s, c.confirm_multiplier * p99 + c.confirm_margin_s)
