"""Shared cluster: quotas, priorities, preemption; elastic vs. rigid on one trace."""

from __future__ import annotations

import pytest

from elastrain.sim.cluster import (
    ClusterConfig,
    ClusterCosts,
    JobSpec,
    QueueConfig,
    simulate_cluster,
)
from elastrain.sim.cluster_trace import compare, default_cluster, load_trace, synthetic_trace

COSTS = ClusterCosts(startup_s=100.0, resize_s=10.0, checkpoint_interval_s=1000.0, save_s=0.0)


def two_queues(borrow: int | None = None) -> ClusterConfig:
    return ClusterConfig(
        accelerators=64,
        unit=8,
        queues=(
            QueueConfig(name="a", nominal=32, borrowing_limit=borrow),
            QueueConfig(name="b", nominal=32, borrowing_limit=borrow),
        ),
        costs=COSTS,
    )


def job(name: str, queue: str, t: float, n: int, hours: float, **kw: object) -> JobSpec:
    return JobSpec(
        name=name, queue=queue, arrival_s=t, accelerators=n, work_acc_s=n * hours * 3600, **kw
    )  # type: ignore[arg-type]


def test_single_rigid_job() -> None:
    r = simulate_cluster(two_queues(), [job("x", "a", 0.0, 16, 1.0)], elastic=False, strict=True)
    (x,) = r.jobs
    assert x.wait_s == 0.0
    assert x.completion_s == pytest.approx(100.0 + 3600.0)
    assert x.goodput == pytest.approx(3600 / 3700)


def test_elastic_job_grows_into_idle_accelerators() -> None:
    spec = job("x", "a", 0.0, 16, 1.0, min_accelerators=8, max_accelerators=64)
    rigid = simulate_cluster(two_queues(), [spec], elastic=False, strict=True).jobs[0]
    elastic = simulate_cluster(two_queues(), [spec], elastic=True, strict=True).jobs[0]
    assert elastic.completion_s == pytest.approx(100.0 + 3600.0 / 4)  # 64 instead of 16
    assert elastic.completion_s < rigid.completion_s


def test_borrowing_limit_is_respected() -> None:
    spec = job("x", "a", 0.0, 16, 1.0, min_accelerators=8, max_accelerators=64)
    r = simulate_cluster(two_queues(borrow=8), [spec], elastic=True, strict=True).jobs[0]
    assert r.completion_s == pytest.approx(100.0 + 3600.0 * 16 / 40)  # nominal 32 + borrow 8


def test_higher_priority_evicts_rigid_job_which_loses_work_since_checkpoint() -> None:
    jobs = [
        job("low", "a", 0.0, 32, 2.0, priority=0),
        job("high", "a", 100.0 + 1500.0, 32, 1.0, priority=1),  # 1500 s into low's run
    ]
    cfg = ClusterConfig(
        accelerators=32, unit=8, queues=(QueueConfig(name="a", nominal=32),), costs=COSTS
    )
    r = simulate_cluster(cfg, jobs, elastic=False, strict=True)
    low, high = r.jobs
    assert low.evictions == 1 and high.wait_s == 0.0
    # low restarts after high (3700 s) and redoes the 500 s since its checkpoint at 1000 s.
    assert low.completion_s == pytest.approx(1600 + 3700 + 100 + 7200 - 1000)
    assert low.goodput < 1.0


def test_elastic_victim_shrinks_instead_of_being_evicted() -> None:
    jobs = [
        job("low", "a", 0.0, 32, 2.0, priority=0, min_accelerators=8),
        job("high", "a", 1000.0, 16, 1.0, priority=1),
    ]
    cfg = ClusterConfig(
        accelerators=32, unit=8, queues=(QueueConfig(name="a", nominal=32),), costs=COSTS
    )
    r = simulate_cluster(cfg, jobs, elastic=True, strict=True)
    low, high = r.jobs
    assert low.evictions == 0 and low.resizes >= 2  # shrank, then grew back
    assert high.wait_s == 0.0


def test_queue_reclaims_its_borrowed_quota() -> None:
    jobs = [
        job("borrower", "a", 0.0, 64, 2.0),  # uses b's idle half
        job("owner", "b", 500.0, 32, 1.0),
    ]
    r = simulate_cluster(two_queues(), jobs, elastic=False, strict=True)
    borrower, owner = r.jobs
    assert owner.wait_s == 0.0 and borrower.evictions == 1
    # Equal priority inside a queue never preempts: the second job waits.
    same = [job("first", "a", 0.0, 32, 1.0), job("second", "a", 10.0, 32, 1.0)]
    cfg = ClusterConfig(
        accelerators=32, unit=8, queues=(QueueConfig(name="a", nominal=32),), costs=COSTS
    )
    first, second = simulate_cluster(cfg, same, elastic=False, strict=True).jobs
    assert second.wait_s == pytest.approx(3700 - 10) and first.evictions == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_elastic_beats_rigid_on_the_same_arrival_trace(seed: int) -> None:
    cluster = default_cluster(256)
    jobs = synthetic_trace(cluster, jobs=50, seed=seed)
    r = compare(cluster, jobs)
    rigid, elastic = r["rigid"], r["elastic"]
    assert len(rigid.jobs) == len(elastic.jobs) == 50
    assert elastic.utilisation >= rigid.utilisation
    assert elastic.mean("completion_s") < rigid.mean("completion_s")
    assert elastic.mean("wait_s") <= rigid.mean("wait_s")
    for res in (rigid, elastic):
        assert 0 < res.utilisation <= res.allocated <= 1.0
    simulate_cluster(cluster, jobs, elastic=True, strict=True)
    simulate_cluster(cluster, jobs, elastic=False, strict=True)


def test_trace_file_round_trip(tmp_path: object) -> None:
    import dataclasses
    import json
    from pathlib import Path

    cluster = default_cluster(128)
    jobs = synthetic_trace(cluster, jobs=5)
    path = Path(str(tmp_path)) / "trace.json"
    path.write_text(json.dumps([dataclasses.asdict(j) for j in jobs]))
    assert load_trace(path) == jobs


def test_impossible_jobs_are_refused() -> None:
    with pytest.raises(ValueError, match="more than queue a can ever get"):
        simulate_cluster(two_queues(borrow=0), [job("x", "a", 0, 40, 1.0)], elastic=False)
    with pytest.raises(ValueError, match="multiples of 8"):
        simulate_cluster(two_queues(), [job("x", "a", 0, 12, 1.0)], elastic=False)
    with pytest.raises(ValueError, match="nominal quotas exceed"):
        ClusterConfig(accelerators=32, queues=(QueueConfig(name="a", nominal=64),))
