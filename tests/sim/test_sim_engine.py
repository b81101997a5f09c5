"""The discrete-event model: accounting, strategies, checkpoints and recovery paths."""

from __future__ import annotations

import itertools
import math
import statistics
import time

import pytest
from sim_helpers import small_config

from elastrain.sim import engine
from elastrain.sim.config import (
    DAY,
    HOUR,
    CheckpointPolicy,
    Delay,
    FailureProcess,
    Failures,
    SimConfig,
    StrategyConfig,
    Topology,
    Workload,
)
from elastrain.sim.engine import simulate
from elastrain.sim.metrics import BUCKETS
from elastrain.sim.trace import HOST, ExplicitTrace, FailureEvent, RandomTrace


def no_failures() -> Failures:
    return Failures(replacement=Delay(mean_s=240.0))


def test_zero_failures_goodput_is_one_minus_checkpoint_overhead() -> None:
    # 30 days = 1440 cycles of (1500 s compute + 300 s save).
    cfg = small_config(failures=no_failures(), interval_s=1500.0, save_s=300.0)
    r = simulate(cfg)
    assert r.failures == r.interruptions == r.rollbacks == 0
    assert r.time_goodput == pytest.approx(1500 / 1800, abs=1e-9)
    assert r.ettr == pytest.approx(1500 / 1800, abs=1e-9)
    assert r.buckets["checkpoint"] == pytest.approx(1440 * 300, rel=1e-9)
    assert r.lost_work_s == 0.0
    assert r.steps == pytest.approx(1440 * 1500, rel=1e-9)


def test_zero_failures_without_checkpoints_is_perfect() -> None:
    r = simulate(small_config(failures=no_failures(), interval_s=math.inf))
    assert r.time_goodput == 1.0 and r.throughput_goodput == 1.0


@pytest.mark.parametrize("kind", ["restart", "elastic", "hot-spare"])
def test_every_second_lands_in_one_bucket(kind: str) -> None:
    spares = 4 if kind == "hot-spare" else 0
    cfg = small_config(kind=kind, spare_hosts=spares, job_mtbf_s=HOUR, days=10)  # type: ignore[arg-type]
    r = simulate(cfg)
    assert set(r.buckets) == set(BUCKETS)
    assert all(v >= -1e-6 for v in r.buckets.values()), r.buckets
    assert sum(r.buckets.values()) == pytest.approx(r.wall_s, rel=1e-12)
    assert r.wall_s == pytest.approx(10 * DAY)
    assert r.interruptions > 100


def test_same_seed_same_result_and_spares_do_not_change_job_failures() -> None:
    a = simulate(small_config(seed=3))
    b = simulate(small_config(seed=3))
    assert a == b
    spared = small_config(seed=3, kind="hot-spare", spare_hosts=8)

    def job_failures(cfg: SimConfig) -> list[FailureEvent]:
        events = itertools.takewhile(lambda e: e.t < 30 * DAY, RandomTrace(cfg))
        return [e for e in events if e.slots[0] < 128]

    assert job_failures(spared) == job_failures(small_config(seed=3))
    hot = simulate(spared)
    assert hot.time_goodput > a.time_goodput  # a spare is faster than the cluster


def test_elastic_beats_restart_on_the_same_failure_trace() -> None:
    for seed in range(5):
        restart = simulate(small_config(seed=seed))
        elastic = simulate(small_config(seed=seed, kind="elastic"))
        assert restart.host_failures == elastic.host_failures
        assert elastic.time_goodput > restart.time_goodput
        assert elastic.ettr > restart.ettr
        assert elastic.throughput_goodput > restart.throughput_goodput
        assert elastic.badput_energy_j < restart.badput_energy_j
        assert elastic.rollbacks == 0 and restart.rollbacks > 0


def test_elastic_with_one_replica_is_a_restart() -> None:
    # One replica: every failure loses the only copy of the state.
    topo = Topology(accelerators=64, accelerators_per_replica=64)
    kw = dict(topology=topo, job_mtbf_s=HOUR, hosts=8)
    restart = simulate(small_config(**kw))  # type: ignore[arg-type]
    elastic = simulate(small_config(kind="elastic", **kw))  # type: ignore[arg-type]
    assert restart.buckets == pytest.approx(elastic.buckets)
    assert restart.rollbacks == elastic.rollbacks > 10


def one_failure(t: float, slot: int = 0, delay: float = 240.0) -> ExplicitTrace:
    return ExplicitTrace([FailureEvent(t, HOST, (slot,), (delay,))])


def test_restart_recovery_path_costs_add_up() -> None:
    # Failure 1000 s into the second checkpoint interval: the last 1000 s are lost.
    cfg = small_config(interval_s=1500.0, save_s=300.0, days=1)
    r = simulate(cfg, one_failure(1800.0 + 1000.0))
    assert r.rollbacks == 1 and r.interruptions == 1
    assert r.lost_work_s == pytest.approx(1000.0)
    assert r.lost_steps == pytest.approx(1000.0)
    assert r.buckets["detect"] == pytest.approx(60.0)
    assert r.buckets["wait"] == pytest.approx(240.0)
    assert r.buckets["restart"] == pytest.approx(180.0)
    assert r.buckets["restore"] == pytest.approx(120.0)
    assert r.buckets["regroup"] == r.buckets["heal"] == 0.0


def test_failure_during_a_save_falls_back_to_the_previous_checkpoint() -> None:
    cfg = small_config(interval_s=1500.0, save_s=300.0, days=1)
    r = simulate(cfg, one_failure(1800.0 + 1500.0 + 100.0))  # 100 s into the 2nd save
    assert r.lost_work_s == pytest.approx(1500.0)


def test_checkpoint_is_lost_until_persisted() -> None:
    ck = CheckpointPolicy(interval_s=1500.0, save_s=300.0, persist_s=600.0, restore_s=120.0)
    cfg = small_config(checkpoint=ck, days=1)
    early = simulate(cfg, one_failure(1800.0 + 500.0))  # first checkpoint not durable yet
    assert early.lost_work_s == pytest.approx(2000.0)
    late = simulate(cfg, one_failure(1800.0 + 700.0))
    assert late.lost_work_s == pytest.approx(700.0)


def test_elastic_recovery_path() -> None:
    cfg = small_config(kind="elastic", interval_s=math.inf, days=1)
    r = simulate(cfg, one_failure(1000.5))  # half a step in flight
    assert r.rollbacks == 0 and r.interruptions == 1
    assert r.lost_steps == pytest.approx(0.5)
    assert r.lost_work_s == pytest.approx(0.5)
    assert r.buckets["detect"] == pytest.approx(60.0)
    assert r.buckets["regroup"] == pytest.approx(40.0)  # leave, then the replacement's join
    assert r.buckets["heal"] == pytest.approx(30.0)
    assert r.buckets["restart"] == r.buckets["restore"] == r.buckets["wait"] == 0.0
    # 127 of 128 replicas between the regroup (t=1080.5) and the join (arrival at t=1300.5).
    shrunk = 1300.5 - 1080.5
    # (the join waits for the step boundary: up to one 128/127 s step later)
    assert r.ettr == pytest.approx(r.time_goodput - shrunk / 128 / r.wall_s, abs=1.1 / 128 / DAY)


def test_elastic_waits_below_min_replicas_without_losing_state() -> None:
    topo = Topology(accelerators=32, accelerators_per_host=8)  # 4 replicas
    cfg = small_config(topology=topo, hosts=4, kind="elastic", interval_s=math.inf, days=1)
    cfg = cfg.__class__(
        **{**cfg.__dict__, "strategy": StrategyConfig(kind="elastic", min_replicas=4)}
    )
    r = simulate(cfg, one_failure(1000.0))
    assert r.rollbacks == 0 and r.lost_work_s == 0.0
    assert r.buckets["wait"] == pytest.approx(240.0)
    assert r.buckets["regroup"] == pytest.approx(20.0) and r.buckets["heal"] == pytest.approx(30.0)


def test_elastic_loses_state_only_when_every_replica_is_down() -> None:
    topo = Topology(accelerators=16, accelerators_per_host=8)  # 2 replicas
    cfg = small_config(topology=topo, hosts=2, kind="elastic", interval_s=1500.0, days=1)
    trace = ExplicitTrace(
        [FailureEvent(2000.0, HOST, (0,), (240.0,)), FailureEvent(2100.0, HOST, (1,), (240.0,))]
    )
    r = simulate(cfg, trace)
    assert r.rollbacks == 1
    assert r.buckets["restart"] == pytest.approx(180.0)
    assert r.buckets["restore"] == pytest.approx(120.0)


def test_hot_spare_swaps_instead_of_waiting() -> None:
    cfg = small_config(kind="hot-spare", spare_hosts=2, days=1)
    r = simulate(cfg, one_failure(1000.0))
    assert r.buckets["wait"] == pytest.approx(30.0)  # spare_swap_s
    assert r.throughput_goodput < r.ettr  # the spares are held capacity


def test_domain_failure_takes_all_its_hosts() -> None:
    topo = Topology(accelerators=1024, hosts_per_domain=16)
    failures = Failures(domain=FailureProcess(mtbf_s=8 * HOUR * topo.domains))
    cfg = small_config(topology=topo, failures=failures, kind="elastic", days=10)
    r = simulate(cfg)
    assert r.failures > 10
    assert r.host_failures == 16 * r.failures


def test_shrunk_job_runs_slower_not_differently() -> None:
    # Quantized micro-batches: 8 micro-batches on 4 replicas = 2 rounds; on 3 = 3 rounds.
    topo = Topology(accelerators=32, accelerators_per_host=8)
    wl = Workload(step_s=2.0, global_microbatches=8)
    cfg = small_config(
        topology=topo, hosts=4, kind="elastic", interval_s=math.inf, days=1, workload=wl
    )
    r = simulate(cfg, one_failure(1000.0, delay=10 * HOUR))
    # Pauses: detect 60 + regroup 20, later regroup 20 + heal 30. Shrunk from the first
    # regroup (t=1080) until the replacement arrives (t=1000+60+36000): 3 s steps, not 2 s.
    shrunk_s = 1000 + 60 + 10 * HOUR - 1080
    steps = (DAY - 130) / 2.0 - shrunk_s * (1 / 2 - 1 / 3)
    assert r.steps == pytest.approx(steps, abs=1.0)


def test_time_to_train() -> None:
    cfg = small_config(
        failures=no_failures(),
        interval_s=1500.0,
        save_s=300.0,
        workload=Workload(step_s=1.0, steps=15_000),
    )
    r = simulate(cfg)
    assert r.time_to_train_s == pytest.approx(
        15_000 + 9 * 300
    )  # 10 intervals, 9 saves before the end
    slow = simulate(small_config(workload=Workload(step_s=1.0, steps=15_000), job_mtbf_s=HOUR))
    assert slow.time_to_train_s is not None and slow.time_to_train_s > r.time_to_train_s


def test_weibull_failures_run() -> None:
    f = Failures(host=FailureProcess(mtbf_s=128 * 2 * HOUR, kind="weibull", shape=0.7))
    r = simulate(small_config(failures=f, days=10))
    assert 60 < r.host_failures < 200  # ~120 expected, more early on (infant mortality)


def test_llama3_scale_runs_in_well_under_a_second_per_strategy() -> None:
    topo = Topology(accelerators=16384)
    mtbf = 54 * DAY * 16384 / 419
    f = Failures(accelerator=FailureProcess(mtbf_s=mtbf))
    for kind in ("restart", "elastic"):
        cfg = small_config(topology=topo, failures=f, kind=kind, days=54)  # type: ignore[arg-type]
        start = time.perf_counter()
        r = simulate(cfg)
        assert time.perf_counter() - start < 2.0
        assert 340 < r.failures < 500


def test_goodput_spread_is_small_across_seeds() -> None:
    g = [simulate(small_config(seed=s, days=10)).time_goodput for s in range(5)]
    assert statistics.stdev(g) < 0.03


@pytest.mark.parametrize("persist_s", [0.0, 60.0, 600.0])
@pytest.mark.parametrize("kind", ["restart", "elastic"])
def test_skipping_quiet_checkpoint_cycles_changes_nothing(
    persist_s: float, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = CheckpointPolicy(interval_s=900.0, save_s=60.0, persist_s=persist_s, restore_s=120.0)
    cfg = small_config(kind=kind, checkpoint=ck, days=5, job_mtbf_s=HOUR)  # type: ignore[arg-type]
    fast = simulate(cfg)
    monkeypatch.setattr(engine._Job, "_skip_quiet_cycles", lambda self, t, target: None)
    slow = simulate(cfg)
    assert fast.buckets == pytest.approx(slow.buckets, rel=1e-9, abs=1e-6)
    assert fast.steps == pytest.approx(slow.steps, rel=1e-12)
    assert fast.rollbacks == slow.rollbacks and fast.lost_steps == pytest.approx(slow.lost_steps)
