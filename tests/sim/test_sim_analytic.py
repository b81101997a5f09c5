"""The simulator against closed-form results (the heart of its validation)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import numpy as np
import pytest
from sim_helpers import small_config

from elastrain.sim.analytic import (
    checkpoint_interval_s,
    daly_interval_s,
    elastic_time_goodput_approx,
    exact_optimal_interval_s,
    job_mtbf_s,
    p_any_failure,
    restart_downtime_s,
    restart_time_goodput,
    rollback_mtbf_s,
    young_interval_s,
)
from elastrain.sim.config import (
    DAY,
    HOUR,
    YEAR,
    FailureProcess,
    Failures,
    SimConfig,
    Topology,
)
from elastrain.sim.sweep import default_intervals, run_seeds, sweep_interval
from elastrain.sim.trace import RandomTrace, sample_lifetimes


def test_p_any_failure_closed_form() -> None:
    assert p_any_failure(0, 0.1, DAY) == 0.0
    assert p_any_failure(1, 1.0, YEAR) == pytest.approx(1 - math.exp(-1))
    # 16,384 GPUs at ~1.9 failures/GPU-century: about one failure every 3 hours.
    assert p_any_failure(16384, 0.0173, 3 * HOUR) == pytest.approx(
        1 - math.exp(-0.0173 * 16384 * 3 / 8760)
    )


def test_probability_of_any_failure_matches_simulated_traces() -> None:
    # 1,000 accelerators at AFR 5 %: P(at least one failure within a day) = 1 - e^(-50/365).
    afr, n, horizon = 0.05, 1000, DAY
    cfg = SimConfig(
        topology=Topology(accelerators=n, accelerators_per_host=1),
        failures=Failures(accelerator=FailureProcess.from_afr(afr)),
        horizon_s=horizon,
    )
    seeds = 800
    hits = sum(
        next(iter(RandomTrace(dataclasses.replace(cfg, seed=s)))).t < horizon for s in range(seeds)
    )
    p = p_any_failure(n, afr, horizon)
    assert hits / seeds == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / seeds))


@pytest.mark.parametrize("shape", [0.5, 0.8, 1.0, 1.5])
def test_weibull_lifetimes_have_the_configured_mean_and_shape(shape: float) -> None:
    kind = "exponential" if shape == 1.0 else "weibull"
    proc = FailureProcess(mtbf_s=1000.0, kind=kind, shape=shape)  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    x = sample_lifetimes(rng, proc, 200_000)
    assert x.mean() == pytest.approx(1000.0, rel=0.02)
    # CDF at the scale parameter is 1 - 1/e for every shape.
    assert (x < proc.weibull_scale).mean() == pytest.approx(1 - math.exp(-1), abs=0.005)
    # The first of 8 fails like one component with scale / 8^(1/k).
    first = sample_lifetimes(rng, proc, 200_000, count=8)
    scale8 = proc.weibull_scale * 8 ** (-1 / shape)
    assert (first < scale8).mean() == pytest.approx(1 - math.exp(-1), abs=0.005)


def test_renewal_trace_rate_is_one_over_mtbf() -> None:
    # Long-run renewal rate is 1/mean for any lifetime shape (renewal theorem).
    f = Failures(host=FailureProcess(mtbf_s=20 * DAY, kind="weibull", shape=2.0))
    cfg = SimConfig(topology=Topology(accelerators=8 * 200), failures=f, horizon_s=400 * DAY)
    n = sum(1 for _ in itertools.takewhile(lambda e: e.t < 400 * DAY, RandomTrace(cfg)))
    assert n == pytest.approx(200 * 400 / 20, rel=0.05)


def test_interval_rules() -> None:
    assert young_interval_s(7200, 60) == pytest.approx(math.sqrt(2 * 7200 * 60))
    # Daly's estimate is close to the exact optimum of the same model.
    for mtbf, save in ((7200, 60), (7200, 300), (3600, 600)):
        assert daly_interval_s(mtbf, save) == pytest.approx(
            exact_optimal_interval_s(mtbf, save), rel=0.01
        )
    cfg = small_config(interval_s="young")
    assert checkpoint_interval_s(cfg) == pytest.approx(young_interval_s(2 * HOUR, 300))
    cfg = small_config(interval_s="daly")
    assert checkpoint_interval_s(cfg) == pytest.approx(daly_interval_s(2 * HOUR, 300))
    # An elastic job with many replicas almost never rolls back: interval hits the cap.
    elastic = small_config(kind="elastic", interval_s="young")
    assert rollback_mtbf_s(elastic) > 1e6 * YEAR
    assert checkpoint_interval_s(elastic) == elastic.checkpoint.max_interval_s


@pytest.mark.parametrize(
    ("interval_s", "save_s", "job_mtbf_h"), [(1800.0, 300.0, 2.0), ("young", 60.0, 1.0)]
)
def test_restart_goodput_matches_daly_closed_form(
    interval_s: float | str, save_s: float, job_mtbf_h: float
) -> None:
    cfg = small_config(interval_s=interval_s, save_s=save_s, job_mtbf_s=job_mtbf_h * HOUR, days=12)
    results = run_seeds(cfg, 40)
    g = [r.time_goodput for r in results]
    expected = restart_time_goodput(
        job_mtbf_s(cfg), checkpoint_interval_s(cfg), save_s, restart_downtime_s(cfg)
    )
    sem = statistics.stdev(g) / math.sqrt(len(g))
    # Within sampling error (plus 0.3 pp for the model's one approximation: a host
    # already down cannot fail again while it waits for its replacement).
    assert statistics.mean(g) == pytest.approx(expected, abs=4 * sem + 0.003)
    assert all(r.ettr == pytest.approx(r.time_goodput) for r in results)  # rigid: never shrunk


def test_elastic_goodput_matches_first_order_model() -> None:
    cfg = small_config(kind="elastic", interval_s=3600.0, days=20)
    results = run_seeds(cfg, 10)
    time_goodput, ettr = elastic_time_goodput_approx(cfg, 3600.0)
    assert statistics.mean(r.time_goodput for r in results) == pytest.approx(
        time_goodput, abs=0.004
    )
    assert statistics.mean(r.ettr for r in results) == pytest.approx(ettr, abs=0.004)


def test_sweep_finds_the_young_daly_optimum_within_ten_percent() -> None:
    cfg = small_config(save_s=60.0, days=10, hosts=32)
    sweep = sweep_interval(cfg, default_intervals(cfg, points=9, span=3.0), seeds=10)
    assert sweep.daly_s == pytest.approx(exact_optimal_interval_s(2 * HOUR, 60.0), rel=0.001)
    assert sweep.fitted_s == pytest.approx(sweep.daly_s, rel=0.10)
    assert sweep.fitted_s == pytest.approx(sweep.young_s, rel=0.10)
    # The goodput curve peaks inside the grid, not at an edge.
    means = [s.mean for s in sweep.goodput]
    assert 0 < means.index(max(means)) < len(means) - 1


def test_sweep_optimum_tracks_daly_when_young_is_off() -> None:
    # save / MTBF = 1/24: Young overshoots the true optimum by ~10 %, Daly does not.
    cfg = small_config(save_s=300.0, days=10, hosts=32)
    sweep = sweep_interval(cfg, default_intervals(cfg, points=9, span=3.0), seeds=10)
    assert sweep.young_s / sweep.daly_s > 1.09
    assert sweep.fitted_s == pytest.approx(sweep.daly_s, rel=0.06)
