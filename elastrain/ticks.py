"""Axis ticks for the SVG charts drawn without a plotting dependency.

Shared by the simulator's charts (`elastrain.sim.svg`) and the run report's
plots (`elastrain.observe.plots`), neither of which imports the other.
"""

from __future__ import annotations

import math


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About `n` round tick values (steps of 1, 2, 2.5 or 5 times a power of ten)
    covering [lo, hi]; an empty or inverted range is widened to [lo, lo + 1]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks
