"""The step watchdog's timeout, derived from measured collective waits."""

from __future__ import annotations

from collections import deque

from elastrain.runtime.config import WatchdogConfig


class HangTimeout:
    """Timeout for one collective wait: `multiplier` x the slowest of the last
    `window` measured waits, clamped to the user's [floor, ceiling]. A wait
    includes the skew between members (the slowest member's compute), which is
    what a healthy step can legitimately take beyond the transfer itself."""

    def __init__(self, config: WatchdogConfig, window: int = 20) -> None:
        self.config = config
        self._waits: deque[float] = deque(maxlen=window)

    def observe(self, wait_s: float) -> None:
        self._waits.append(wait_s)

    @property
    def timeout_s(self) -> float:
        c = self.config
        if not self._waits:
            return max(c.floor_s, min(c.initial_s, c.ceiling_s))
        t = c.multiplier * max(self._waits)
        return max(c.floor_s, min(t, c.ceiling_s))
