"""The worker's metering: a one-time FLOP count and a power/utilisation sampler.

`WorkerMetering.start(trainer)` is called once by `ElasticTrainer.steps()` in
the training thread, before the worker registers: it counts one micro-batch's
FLOPs (emits `flops_measured`, lands in the ledger's startup bucket) and
starts the `Sampler` thread (`power_sample` events, default 1 Hz). `stop()`
is called from the trainer's shutdown. $ELASTRAIN_METERING=off turns both off;
a number sets the sampling interval in seconds. Nothing here can fail a step:
a FLOP count or meter that raises is logged and skipped.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from elastrain import env
from elastrain.observe.power import Sampler, choose_meters

log = logging.getLogger("elastrain.observe")

DEFAULT_INTERVAL_S = 1.0


class _Trainer(Protocol):
    """What metering reads from `ElasticTrainer` (attributes, read once at start)."""

    model: Any
    loss_fn: Any
    dataset: Any
    collate_fn: Any
    config: Any
    order: Any
    events: Any


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
    def start(cls, trainer: _Trainer) -> WorkerMetering:
        interval = metering_interval()
        if interval is None:
            return cls(None)
        _count_flops(trainer)
        meters = choose_meters()
        if not meters:
            return cls(None)
        return cls(Sampler(trainer.events, meters, interval).start())

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None


def _count_flops(trainer: _Trainer) -> None:
    from elastrain.observe.efficiency import device_info
    from elastrain.observe.flops import measure_step_flops

    cfg = trainer.config
    try:
        ids = trainer.order.ids(0, cfg.micro_batch_size)
        batch = trainer.collate_fn([trainer.dataset[j] for j in ids])
        fc = measure_step_flops(
            trainer.model, trainer.loss_fn, batch, cfg.micro_batch_size, cfg.global_batch_size
        )
        info = device_info(trainer.model)
    except Exception as e:  # noqa: BLE001 - metering must never stop training
        log.warning("could not count FLOPs per step: %s", e)
        return
    trainer.events.emit(
        "flops_measured",
        flops_per_step=fc.flops_per_step,
        flops_per_microbatch=fc.flops_per_microbatch,
        flops_per_sample=fc.flops_per_sample,
        tokens_per_sample=fc.tokens_per_sample,
        micro_batch=cfg.micro_batch_size,
        global_batch=cfg.global_batch_size,
        seconds=fc.seconds,
        method=fc.method,
        **info,
    )
