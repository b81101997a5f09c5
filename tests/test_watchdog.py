"""The step watchdog's two deadlines (elastrain.runtime.watchdog.HangTimeout)."""

from __future__ import annotations

import pytest

from elastrain.runtime.config import TrainerConfig, WatchdogConfig
from elastrain.runtime.watchdog import SOFT_MIN_SAMPLES, HangTimeout


def watchdog(**kw: float) -> WatchdogConfig:
    base = dict(floor_s=3.0, ceiling_s=60.0, multiplier=8.0, initial_s=30.0)
    base.update(kw)
    return WatchdogConfig(**base)


def test_the_soft_deadline_follows_the_p99_wait_and_the_hard_one_keeps_its_floor() -> None:
    h = HangTimeout(watchdog())
    assert h.soft_s is None and h.timeout_s == 30.0  # nothing measured: warm-up
    for _ in range(SOFT_MIN_SAMPLES - 1):
        h.observe(0.01)
    assert h.soft_s is None  # too few waits to trust
    h.observe(0.01)
    assert h.soft_s == pytest.approx(4 * 0.01 + 0.1)
    assert h.timeout_s == 3.0  # 8 x 0.01 s, raised to the floor
    # Two slow waits in the last hundred set the p99: the soft deadline makes
    # room for them (one in a hundred does not: such a step only asks, once).
    for _ in range(94):
        h.observe(0.01)
    h.observe(0.2)
    assert h.soft_s == pytest.approx(4 * 0.01 + 0.1)
    h.observe(0.2)
    assert h.soft_s == pytest.approx(4 * 0.2 + 0.1)
    h.observe(2.0)
    h.observe(2.0)
    assert h.timeout_s == 16.0 and h.soft_s == pytest.approx(4 * 2.0 + 0.1)
    # Never later than the hard deadline (here the ceiling).
    for _ in range(5):
        h.observe(20.0)
    assert h.timeout_s == 60.0 and h.soft_s == 60.0


def test_the_soft_deadline_can_be_switched_off_and_is_validated() -> None:
    h = HangTimeout(watchdog(confirm_multiplier=0.0))
    for _ in range(10):
        h.observe(0.01)
    assert h.soft_s is None
    with pytest.raises(ValueError, match="hang_confirm_multiplier"):
        TrainerConfig(
            global_batch_size=8, micro_batch_size=2, total_steps=1, hang_confirm_multiplier=-1
        )
    with pytest.raises(ValueError, match="hang_confirm_margin_s"):
        TrainerConfig(
            global_batch_size=8,
            micro_batch_size=2,
            total_steps=1,
            hang_confirm_margin_s=float("nan"),
        )
