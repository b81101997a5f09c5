"""Arrival traces for the shared-cluster view, and the elastic-vs-rigid comparison."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

from elastrain.sim.cluster import (
    ClusterConfig,
    ClusterResult,
    JobSpec,
    QueueConfig,
    simulate_cluster,
)
from elastrain.sim.report import format_table


def default_cluster(accelerators: int = 1024, unit: int = 8) -> ClusterConfig:
    """Two queues sharing one cohort, half the cluster each, borrowing allowed."""
    half = accelerators // 2 // unit * unit
    return ClusterConfig(
        accelerators=accelerators,
        unit=unit,
        queues=(
            QueueConfig(name="research", nominal=half),
            QueueConfig(name="production", nominal=accelerators - half),
        ),
    )


def synthetic_trace(
    cluster: ClusterConfig,
    *,
    jobs: int = 200,
    load: float = 0.9,
    mean_hours: float = 4.0,
    high_priority_share: float = 0.2,
    seed: int = 0,
) -> list[JobSpec]:
    """Poisson arrivals offering `load` x the cluster; requests of 1/16 to 1/4 of the
    cluster; lognormal durations; every job elastic-capable (min = request/4,
    max = 2 x request). High-priority jobs go to the production queue."""
    rng = np.random.default_rng(seed)
    unit, total = cluster.unit, cluster.accelerators
    names = [q.name for q in cluster.queues]
    fractions = np.array([1 / 16, 1 / 8, 1 / 4])
    sizes = np.maximum(unit, (fractions * total // unit).astype(int) * unit)
    sigma = 0.8
    durations = rng.lognormal(math.log(mean_hours * 3600) - sigma**2 / 2, sigma, jobs)
    requests = rng.choice(sizes, jobs)
    mean_work = float(np.mean(sizes)) * mean_hours * 3600
    gaps = rng.exponential(mean_work / (load * total), jobs)
    high = rng.random(jobs) < high_priority_share
    out = []
    for i in range(jobs):
        req = int(requests[i])
        queue = names[-1] if high[i] else names[i % len(names)] if len(names) > 1 else names[0]
        out.append(
            JobSpec(
                name=f"job{i}",
                queue=queue,
                arrival_s=float(np.sum(gaps[: i + 1])),
                accelerators=req,
                work_acc_s=float(req * durations[i]),
                priority=1 if high[i] else 0,
                min_accelerators=max(unit, req // 4 // unit * unit),
                max_accelerators=min(total // 2 // unit * unit, 2 * req)
                if total >= 2 * unit
                else req,
            )
        )
    return out


def load_trace(path: str | os.PathLike[str]) -> list[JobSpec]:
    """A JSON list of JobSpec field dicts (name, queue, arrival_s, accelerators, work_acc_s,
    priority, min_accelerators, max_accelerators)."""
    with open(path) as f:
        rows = json.load(f)
    return [JobSpec(**row) for row in rows]


def compare(cluster: ClusterConfig, jobs: Sequence[JobSpec]) -> dict[str, ClusterResult]:
    """The same arrival trace with every job rigid, and with elastic jobs elastic."""
    return {
        "rigid": simulate_cluster(cluster, jobs, elastic=False),
        "elastic": simulate_cluster(cluster, jobs, elastic=True),
    }


def comparison_table(results: dict[str, ClusterResult]) -> str:
    headers = [
        "scenario",
        "utilisation",
        "allocated",
        "makespan h",
        "mean JCT h",
        "p95 JCT h",
        "mean wait h",
        "JCT high-pri h",
        "job goodput",
        "evictions",
    ]
    rows = []
    for name, r in results.items():
        jct = [j.completion_s / 3600 for j in r.jobs]
        rows.append(
            [
                name,
                f"{r.utilisation * 100:.1f}%",
                f"{r.allocated * 100:.1f}%",
                f"{r.makespan_s / 3600:.1f}",
                f"{float(np.mean(jct)):.2f}",
                f"{float(np.percentile(jct, 95)):.2f}",
                f"{r.mean('wait_s') / 3600:.2f}",
                f"{r.mean('completion_s', priority=1) / 3600:.2f}",
                f"{r.mean('goodput') * 100:.1f}%",
                str(sum(j.evictions for j in r.jobs)),
            ]
        )
    return format_table(headers, rows)
