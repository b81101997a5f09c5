"""The worker's metering: a one-time FLOP count and a power/utilisation sampler.

`WorkerMetering.start(events, measure_flops)` is called once by the step
engine in the training thread, before the worker registers: it counts one micro-batch's
FLOPs (emits `flops_measured`, lands in the ledger's startup bucket) and
starts the `Sampler` thread (`power_sample` events, default 1 Hz). `stop()`
is called from the trainer's shutdown. $ELASTRAIN_METERING=off turns both off;
a number sets the sampling interval in seconds. Nothing here can fail a step:
a FLOP count or meter that raises is logged and skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from elastrain import env
from elastrain.observe.events import EventKind, EventLog
from elastrain.observe.power import Sampler, choose_meters

log = logging.getLogger("elastrain.observe")

DEFAULT_INTERVAL_S = 1.0


def metering_interval(raw: str | None = None) -> float | None:
    """Sampling interval from $ELASTRAIN_METERING (None: metering off)."""
    raw = (os.environ.get(env.METERING, "") if raw is None else raw).strip().lower()
    if raw in ("off", "0", "false", "no"):
        return None
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(
            f"{env.METERING}={raw!r}: use off, or a sampling interval in seconds"
        ) from None
    if not v > 0:
        raise ValueError(f"{env.METERING} must be off or an interval > 0 s, got {raw!r}")
    return v


class WorkerMetering:
    """One per worker process; see the module docstring."""

    def __init__(self, sampler: Sampler | None) -> None:
        self.sampler = sampler

    @classmethod
    def start(
        cls, events: EventLog, measure_flops: Callable[[], dict[str, Any] | None]
    ) -> WorkerMetering:
        """Count FLOPs once (`measure_flops` returns the `flops_measured` fields,
        or None where the backend cannot count) and start the sampler."""
        interval = metering_interval()
        if interval is None:
            return cls(None)
        _count_flops(events, measure_flops)
        meters = choose_meters()
        if not meters:
            return cls(None)
        return cls(Sampler(events, meters, interval).start())

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None


def _count_flops(events: EventLog, measure_flops: Callable[[], dict[str, Any] | None]) -> None:
    try:
        fields = measure_flops()
    except Exception as e:  # noqa: BLE001 - metering must never stop training
        log.warning("could not count FLOPs per step: %s", e)
        return
    if fields is not None:
        events.emit(EventKind.FLOPS_MEASURED, **fields)
