"""Property tests: accounting invariants hold for any configuration."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import small_config

from elastrain.sim.config import (
    HOUR,
    CheckpointPolicy,
    Delay,
    FailureProcess,
    Failures,
    RecoveryCosts,
    StrategyConfig,
    Topology,
    Workload,
)
from elastrain.sim.engine import simulate


@st.composite
def configs(draw: st.DrawFn) -> object:
    hosts = draw(st.integers(1, 12))
    hpr = draw(st.sampled_from([h for h in (1, 2, 3, 4) if hosts % h == 0]))
    kind = draw(st.sampled_from(["restart", "elastic", "hot-spare"]))
    spares = (
        draw(st.integers(1, 3))
        if kind == "hot-spare"
        else (draw(st.integers(0, 2)) if kind == "elastic" else 0)
    )
    weibull = draw(st.booleans())
    shape = draw(st.floats(0.5, 2.0)) if weibull else 1.0
    topo = Topology(
        accelerators=hosts * 4,
        accelerators_per_host=4,
        accelerators_per_replica=hpr * 4,
        hosts_per_domain=draw(st.integers(0, 4)),
    )
    job_mtbf = draw(st.floats(0.2, 20.0)) * HOUR
    failures = Failures(
        accelerator=FailureProcess(
            mtbf_s=job_mtbf * hosts * 8, kind="weibull" if weibull else "exponential", shape=shape
        ),
        host=FailureProcess(mtbf_s=job_mtbf * hosts * 2),
        domain=FailureProcess(mtbf_s=job_mtbf * 10),
        replacement=Delay(
            mean_s=draw(st.floats(0, 3600)),
            kind=draw(st.sampled_from(["fixed", "exponential", "lognormal"])),
        ),
    )
    interval = draw(st.one_of(st.floats(60, 7200), st.just(math.inf), st.just("young")))
    ck = CheckpointPolicy(
        interval_s=interval,  # type: ignore[arg-type]
        save_s=draw(st.floats(1, 600)),
        persist_s=draw(st.sampled_from([0.0, 30.0, 900.0])),
        restore_s=draw(st.floats(0, 600)),
    )
    costs = RecoveryCosts(
        detect_s=draw(st.floats(0, 300)),
        restart_s=draw(st.floats(0, 600)),
        regroup_s=draw(st.floats(0, 60)),
        heal_s=draw(st.floats(0, 120)),
        spare_swap_s=draw(st.floats(0, 120)),
    )
    mb = draw(st.one_of(st.none(), st.integers(topo.replicas, 4 * topo.replicas)))
    steps = draw(st.one_of(st.none(), st.integers(1, 50_000)))
    return small_config(
        topology=topo,
        failures=failures,
        checkpoint=ck,
        costs=costs,
        strategy=StrategyConfig(
            kind=kind, spare_hosts=spares, min_replicas=draw(st.integers(1, topo.replicas))
        ),  # type: ignore[arg-type]
        workload=Workload(step_s=draw(st.floats(0.5, 30)), global_microbatches=mb, steps=steps),
        days=draw(st.floats(0.5, 3)),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=60, deadline=None, database=None)
@given(configs())
def test_accounting_invariants(cfg: object) -> None:
    r = simulate(cfg)  # type: ignore[arg-type]
    assert sum(r.buckets.values()) == pytest.approx(r.wall_s, rel=1e-9, abs=1e-6)
    assert all(v >= -1e-6 for v in r.buckets.values()), r.buckets
    assert r.steps >= 0 and r.lost_steps >= -1e-9
    # Kept work never exceeds the time spent computing it (equal when never shrunk).
    assert r.useful_s <= r.buckets["productive"] * (1 + 1e-9) + 1e-6
    assert r.lost_accelerator_s >= -1e-6
    assert r.productive_accelerator_s <= r.busy_accelerator_s + 1e-6
    if r.strategy != "elastic":
        assert r.useful_s == pytest.approx(r.buckets["productive"], rel=1e-9, abs=1e-6)
        kept = r.useful_s * r.accelerators
        assert r.productive_accelerator_s == pytest.approx(kept, rel=1e-9, abs=1e-3)
        assert r.rollbacks <= r.interruptions
    assert r.ettr <= r.time_goodput + 1e-9 and r.throughput_goodput <= r.ettr + 1e-12
    assert r.badput_energy_j >= 0 and r.energy_j > 0
    if r.time_to_train_s is not None:
        assert r.steps == pytest.approx(cfg.workload.steps)  # type: ignore[attr-defined]
