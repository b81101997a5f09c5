"""Small configs shared by the simulator tests (module name unique across tests/)."""

from __future__ import annotations

from typing import Any

from elastrain.sim.config import (
    DAY,
    HOUR,
    CheckpointPolicy,
    Delay,
    FailureProcess,
    Failures,
    RecoveryCosts,
    SimConfig,
    StrategyConfig,
    StrategyKind,
    Topology,
    Workload,
)


def small_config(
    *,
    seed: int = 0,
    kind: StrategyKind = "restart",
    hosts: int = 128,
    job_mtbf_s: float = 2 * HOUR,
    interval_s: float | str = 1800.0,
    save_s: float = 300.0,
    days: float = 30.0,
    spare_hosts: int = 0,
    **overrides: Any,
) -> SimConfig:
    """A 8-accelerators-per-host job whose hosts fail (exponential) at a given job MTBF."""
    kw: dict[str, Any] = dict(
        topology=Topology(accelerators=hosts * 8),
        failures=Failures(
            host=FailureProcess(mtbf_s=job_mtbf_s * hosts), replacement=Delay(mean_s=240.0)
        ),
        costs=RecoveryCosts(detect_s=60.0, restart_s=180.0, regroup_s=20.0, heal_s=30.0),
        checkpoint=CheckpointPolicy(interval_s=interval_s, save_s=save_s, restore_s=120.0),
        workload=Workload(step_s=1.0),
        strategy=StrategyConfig(kind=kind, spare_hosts=spare_hosts),
        horizon_s=days * DAY,
        seed=seed,
    )
    kw.update(overrides)
    return SimConfig(**kw)
