"""Many seeds, scale sweeps and checkpoint-interval sweeps.

Every point of a sweep runs the same seeds, so points share their failure traces
where the topology allows it (common random numbers: differences between points
are not noise between traces).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from elastrain.sim.analytic import (
    daly_interval_s,
    exact_optimal_interval_s,
    rollback_mtbf_s,
    young_interval_s,
)
from elastrain.sim.config import CheckpointPolicy, SimConfig, StrategyConfig, Topology
from elastrain.sim.engine import simulate
from elastrain.sim.metrics import SimResult, Stat, summarize
from elastrain.sim.trace import Trace

TraceFactory = Callable[[SimConfig], Trace]


def run_seeds(
    config: SimConfig, seeds: int, *, trace: TraceFactory | None = None
) -> list[SimResult]:
    """Simulate `config` with seeds config.seed .. config.seed + seeds - 1."""
    if seeds < 1:
        raise ValueError("seeds must be >= 1")
    out = []
    for s in range(config.seed, config.seed + seeds):
        cfg = dataclasses.replace(config, seed=s)
        out.append(simulate(cfg, trace(cfg) if trace is not None else None))
    return out


def with_strategy(config: SimConfig, strategy: StrategyConfig) -> SimConfig:
    return dataclasses.replace(config, strategy=strategy)


def with_accelerators(config: SimConfig, accelerators: int) -> SimConfig:
    """The same job shape (host, replica, domain sizes and per-component rates) at another scale."""
    topo: Topology = dataclasses.replace(config.topology, accelerators=accelerators)
    strategy = config.strategy
    if strategy.min_replicas > topo.replicas:
        strategy = dataclasses.replace(strategy, min_replicas=topo.replicas)
    return dataclasses.replace(config, topology=topo, strategy=strategy)


def with_interval(config: SimConfig, interval_s: float) -> SimConfig:
    ck: CheckpointPolicy = dataclasses.replace(config.checkpoint, interval_s=interval_s)
    return dataclasses.replace(config, checkpoint=ck)


@dataclass(frozen=True)
class ScalePoint:
    accelerators: int
    strategy: str
    summary: dict[str, Stat]


def sweep_scale(
    config: SimConfig,
    accelerators: Sequence[int],
    strategies: Sequence[StrategyConfig],
    seeds: int,
) -> list[ScalePoint]:
    """Goodput and friends per (scale, strategy), `seeds` runs each."""
    points = []
    for n in accelerators:
        base = with_accelerators(config, n)
        for strategy in strategies:
            results = run_seeds(with_strategy(base, strategy), seeds)
            points.append(ScalePoint(n, strategy.kind, summarize(results)))
    return points


@dataclass(frozen=True)
class IntervalSweep:
    intervals_s: list[float]
    """Checkpoint intervals swept (compute seconds between checkpoint starts)."""
    goodput: list[Stat]
    """Time goodput at each interval."""
    young_s: float
    daly_s: float
    exact_s: float
    """Optimum of the closed-form restart model (exponential failures)."""
    best_s: float
    """The swept interval with the highest mean goodput."""
    fitted_s: float
    """Optimum of a smooth fit through all swept points (less noisy than best_s)."""


def default_intervals(config: SimConfig, points: int = 13, span: float = 4.0) -> list[float]:
    """A geometric grid from Young/span to Young*span."""
    young = young_interval_s(rollback_mtbf_s(config), config.checkpoint.save_s)
    if not math.isfinite(young):
        raise ValueError("no failures force a rollback: give the intervals to sweep explicitly")
    return [float(x) for x in np.geomspace(young / span, young * span, points)]


def sweep_interval(
    config: SimConfig, intervals_s: Sequence[float] | None = None, seeds: int = 10
) -> IntervalSweep:
    """Time goodput against the checkpoint interval, with the Young/Daly optima."""
    xs = list(intervals_s) if intervals_s is not None else default_intervals(config)
    stats = [summarize(run_seeds(with_interval(config, x), seeds))["time_goodput"] for x in xs]
    means = [s.mean for s in stats]
    mtbf, save = rollback_mtbf_s(config), config.checkpoint.save_s
    return IntervalSweep(
        intervals_s=xs,
        goodput=stats,
        young_s=young_interval_s(mtbf, save),
        daly_s=daly_interval_s(mtbf, save),
        exact_s=exact_optimal_interval_s(mtbf, save) if math.isfinite(mtbf) else math.inf,
        best_s=xs[int(np.argmax(means))],
        fitted_s=fit_optimum(xs, means),
    )


def fit_optimum(intervals_s: Sequence[float], goodput: Sequence[float]) -> float:
    """Interval maximizing a least-squares fit of 1/goodput = c0 + c1/t + c2*t + c3*t^2
    (the expansion of Daly's model) through the points, searched within their range."""
    x = np.asarray(intervals_s, dtype=float)
    y = 1.0 / np.asarray(goodput, dtype=float)
    if x.size < 4:
        return float(x[int(np.argmin(y))])
    scale = float(np.median(x))
    u = x / scale
    design = np.stack([np.ones_like(u), 1.0 / u, u, u * u], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    grid = np.geomspace(u.min(), u.max(), 4001)
    fit = coef[0] + coef[1] / grid + coef[2] * grid + coef[3] * grid * grid
    return float(grid[int(np.argmin(fit))] * scale)
