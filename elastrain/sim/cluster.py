"""Shared-cluster view: several jobs on one cluster under Kueue-style quotas.

Queues (ClusterQueues in one cohort) hold nominal quotas; a queue may borrow
idle quota of the others up to its borrowing limit. Pending jobs are admitted in
(priority, arrival) order, best-effort FIFO (a job that does not fit does not block
smaller ones behind it). A pending job that does not fit may preempt:

1. capacity an elastic job holds above its request (opportunistic growth), always;
2. capacity other queues borrowed, when the job fits in its own nominal quota;
3. lower-priority jobs of its own queue.

An elastic victim shrinks to its minimum before it is evicted; a rigid victim is
evicted, loses the work since its last checkpoint and waits to be admitted again.
After admissions, idle accelerators go to running elastic jobs, up to their
maximum. Work is in accelerator-seconds at perfect scaling (fixed global batch: a
job on fewer accelerators runs slower, not differently). Hardware failures are
not modelled here; the single-job model covers them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class QueueConfig:
    """One ClusterQueue of the shared cohort."""

    name: str
    """Queue name, referenced by JobSpec.queue."""
    nominal: int
    """Accelerators guaranteed to this queue."""
    borrowing_limit: int | None = None
    """Most accelerators it may use above its nominal quota; None = any idle ones."""


@dataclass(frozen=True, kw_only=True)
class ClusterCosts:
    """Overheads the scheduler's decisions cost a job."""

    startup_s: float = 300.0
    """Admission (first or again after eviction) to the first step: pods, init, restore."""
    resize_s: float = 30.0
    """Elastic grow or shrink: regroup and heal; the job pauses."""
    checkpoint_interval_s: float = 1800.0
    """Wall time between checkpoints while running; an eviction loses the work since."""
    save_s: float = 30.0
    """Blocking time of each checkpoint."""

    def __post_init__(self) -> None:
        for name in ("startup_s", "resize_s", "save_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ClusterCosts.{name} must be >= 0")
        if not self.checkpoint_interval_s > 0:
            raise ValueError("ClusterCosts.checkpoint_interval_s must be > 0 (inf = never)")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One job of the arrival trace."""

    name: str
    queue: str
    arrival_s: float
    accelerators: int
    """Accelerators requested (a rigid job runs on exactly these)."""
    work_acc_s: float
    """Accelerator-seconds of training to do (request x hours at full size)."""
    priority: int = 0
    """Higher preempts lower within a queue."""
    min_accelerators: int | None = None
    """Elastic jobs: the fewest it runs on. None = rigid."""
    max_accelerators: int | None = None
    """Elastic jobs: the most it grows to (default: the request)."""

    @property
    def elastic(self) -> bool:
        return self.min_accelerators is not None

    @property
    def ceiling(self) -> int:
        return self.max_accelerators or self.accelerators


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The cluster, its queues and the decision costs."""

    accelerators: int
    """Accelerators in the cluster."""
    queues: tuple[QueueConfig, ...]
    """ClusterQueues; their nominal quotas must fit in the cluster."""
    unit: int = 8
    """Allocation granularity (a host); every size is a multiple of it."""
    costs: ClusterCosts = field(default_factory=ClusterCosts)
    """Startup, resize and checkpoint costs."""

    def __post_init__(self) -> None:
        if self.unit < 1 or self.accelerators % self.unit:
            raise ValueError("ClusterConfig.accelerators must be a positive multiple of unit")
        if sum(q.nominal for q in self.queues) > self.accelerators:
            raise ValueError("the queues' nominal quotas exceed the cluster; lower them")
        if len({q.name for q in self.queues}) != len(self.queues) or not self.queues:
            raise ValueError("ClusterConfig.queues needs at least one queue, with unique names")

    def check(self, jobs: Sequence[JobSpec]) -> None:
        """Refuse jobs that could never be admitted, with what to change."""
        queues = {q.name: q for q in self.queues}
        for j in jobs:
            q = queues.get(j.queue)
            if q is None:
                raise ValueError(f"job {j.name}: unknown queue {j.queue!r}")
            lo = j.min_accelerators or j.accelerators
            sizes = (lo, j.accelerators, j.ceiling)
            if (
                any(s < self.unit or s % self.unit for s in sizes)
                or not lo <= j.accelerators <= j.ceiling
            ):
                raise ValueError(
                    f"job {j.name}: sizes must be multiples of {self.unit} with min <= request <= max"
                )
            cap = q.nominal + (
                self.accelerators if q.borrowing_limit is None else q.borrowing_limit
            )
            if j.accelerators > min(self.accelerators, cap):
                raise ValueError(f"job {j.name}: requests more than queue {q.name} can ever get")


@dataclass
class _Job:
    spec: JobSpec
    elastic: bool
    alloc: int = 0
    progress: float = 0.0  # accelerator-seconds done and kept
    ckpt_progress: float = 0.0
    since_ckpt_s: float = 0.0
    paused_until: float = 0.0
    admitted_at: float = math.nan  # last admission (for victim order)
    first_start: float = math.nan
    finish: float = math.nan
    held_acc_s: float = 0.0
    lost_acc_s: float = 0.0
    evictions: int = 0
    resizes: int = 0

    @property
    def floor(self) -> int:
        return (
            (self.spec.min_accelerators or self.spec.accelerators)
            if self.elastic
            else self.spec.accelerators
        )


@dataclass(frozen=True)
class JobOutcome:
    name: str
    priority: int
    elastic: bool
    wait_s: float
    completion_s: float
    """Arrival to finish."""
    goodput: float
    """Work done / accelerator-seconds held."""
    evictions: int
    resizes: int


@dataclass(frozen=True)
class ClusterResult:
    makespan_s: float
    utilisation: float
    """Useful accelerator-seconds / (cluster x makespan)."""
    allocated: float
    """Held accelerator-seconds / (cluster x makespan)."""
    jobs: list[JobOutcome]

    def mean(self, attr: str, priority: int | None = None) -> float:
        xs = [getattr(j, attr) for j in self.jobs if priority is None or j.priority == priority]
        return float(np.mean(xs)) if xs else math.nan


def simulate_cluster(
    config: ClusterConfig, jobs: Sequence[JobSpec], *, elastic: bool, strict: bool = False
) -> ClusterResult:
    """Run the arrival trace to completion; `elastic=False` runs every job rigid.
    `strict` checks capacity and quota invariants after every scheduling pass (tests)."""
    config.check(jobs)
    return _Cluster(config, jobs, elastic, strict).run()


class _Cluster:
    def __init__(
        self, config: ClusterConfig, jobs: Sequence[JobSpec], elastic: bool, strict: bool
    ) -> None:
        self.cfg = config
        self.strict = strict
        self.queues = {q.name: q for q in config.queues}
        self.jobs = [
            _Job(s, elastic and s.elastic) for s in sorted(jobs, key=lambda s: s.arrival_s)
        ]
        self.t = 0.0
        c = config.costs
        self.ck_factor = c.checkpoint_interval_s / (c.checkpoint_interval_s + c.save_s)

    def usage(self, queue: str) -> int:
        return sum(j.alloc for j in self.jobs if j.spec.queue == queue)

    def free(self) -> int:
        return self.cfg.accelerators - sum(j.alloc for j in self.jobs)

    def room(self, queue: str) -> int:
        q = self.queues[queue]
        limit = math.inf if q.borrowing_limit is None else q.nominal + q.borrowing_limit
        return int(min(self.free(), limit - self.usage(queue)))

    def run(self) -> ClusterResult:
        pending: list[_Job] = []
        arrivals = list(self.jobs)
        while arrivals or pending or any(j.alloc for j in self.jobs):
            t_next = arrivals[0].spec.arrival_s if arrivals else math.inf
            for j in self.jobs:
                if j.alloc:
                    t_next = min(t_next, self._done_at(j))
            self._advance(t_next)
            while arrivals and arrivals[0].spec.arrival_s <= self.t:
                pending.append(arrivals.pop(0))
            for j in self.jobs:
                if j.alloc and j.progress >= j.spec.work_acc_s - 1e-6:
                    j.finish, j.alloc = self.t, 0
            pending = self._schedule(pending)
            if self.strict:
                self._check()
        return self._result()

    def _check(self) -> None:
        assert self.free() >= 0, "cluster over-allocated"
        for q in self.cfg.queues:
            limit = math.inf if q.borrowing_limit is None else q.nominal + q.borrowing_limit
            assert self.usage(q.name) <= limit, f"queue {q.name} over its limit"
        for j in self.jobs:
            if j.alloc:
                assert j.floor <= j.alloc <= (j.spec.ceiling if j.elastic else j.spec.accelerators)
                assert j.alloc % self.cfg.unit == 0

    def _rate(self, j: _Job) -> float:
        return j.alloc * self.ck_factor

    def _done_at(self, j: _Job) -> float:
        return max(self.t, j.paused_until) + (j.spec.work_acc_s - j.progress) / self._rate(j)

    def _advance(self, t_new: float) -> None:
        interval = self.cfg.costs.checkpoint_interval_s
        for j in self.jobs:
            if not j.alloc:
                continue
            j.held_acc_s += j.alloc * (t_new - self.t)
            start = max(self.t, j.paused_until)
            if t_new <= start:
                continue
            dt = t_new - start
            r = self._rate(j)
            crossed = math.floor((j.since_ckpt_s + dt) / interval)
            if crossed:  # progress at the last checkpoint crossed
                last = crossed * interval - j.since_ckpt_s
                j.ckpt_progress = j.progress + r * last
            j.since_ckpt_s = (j.since_ckpt_s + dt) % interval if math.isfinite(interval) else 0.0
            j.progress = min(j.spec.work_acc_s, j.progress + r * dt)
        self.t = t_new

    # -- scheduling -----------------------------------------------------------
    def _schedule(self, pending: list[_Job]) -> list[_Job]:
        waiting: list[_Job] = []
        evicted: list[_Job] = []
        for j in sorted(pending, key=lambda j: (-j.spec.priority, j.spec.arrival_s)):
            need = j.floor
            if self.room(j.spec.queue) < need and not self._preempt(j, need, evicted):
                waiting.append(j)
                continue
            j.alloc = need
            j.admitted_at = self.t
            j.paused_until = self.t + self.cfg.costs.startup_s
            j.since_ckpt_s = 0.0
            if math.isnan(j.first_start):
                j.first_start = self.t
        self._grow()
        return [j for j in waiting if not j.alloc] + evicted

    def _victims(self, j: _Job) -> list[tuple[_Job, int]]:
        """(victim, accelerators it would keep), in the order they are asked."""
        q = j.spec.queue
        running = [v for v in self.jobs if v.alloc and v is not j]
        # 1. Opportunistic growth above a request, from anyone.
        out = [
            (v, v.spec.accelerators) for v in running if v.elastic and v.alloc > v.spec.accelerators
        ]
        order = sorted(running, key=lambda v: (v.spec.priority, -v.admitted_at))
        groups = []
        if self.usage(q) + j.floor <= self.queues[q].nominal:
            # 2. Reclaim what other queues borrowed (the job fits in its own quota).
            groups.append(
                [
                    v
                    for v in order
                    if v.spec.queue != q
                    and self.usage(v.spec.queue) > self.queues[v.spec.queue].nominal
                ]
            )
        # 3. Lower priority in the same queue.
        groups.append([v for v in order if v.spec.queue == q and v.spec.priority < j.spec.priority])
        for group in groups:  # shrink the elastic ones first, then evict
            out += [(v, v.floor) for v in group if v.elastic]
            out += [(v, 0) for v in group]
        return out

    def _preempt(self, j: _Job, need: int, evicted: list[_Job]) -> bool:
        plan: dict[int, tuple[_Job, int]] = {}  # id(victim) -> (victim, accelerators it keeps)
        q = j.spec.queue
        free, freed_q = self.free(), 0
        for v, target in self._victims(j):
            keep = plan[id(v)][1] if id(v) in plan else v.alloc
            if target >= keep:
                continue
            plan[id(v)] = (v, target)
            free += keep - target
            if v.spec.queue == q:
                freed_q += keep - target
            if free >= need and self.room_after(q, freed_q, free) >= need:
                break
        else:
            return False
        for v, keep in plan.values():
            if keep == 0:
                self._evict(v)
                evicted.append(v)
            else:
                self._resize(v, keep)
        return True

    def room_after(self, queue: str, freed_in_queue: int, free: int) -> int:
        qc = self.queues[queue]
        limit = math.inf if qc.borrowing_limit is None else qc.nominal + qc.borrowing_limit
        return int(min(free, limit - (self.usage(queue) - freed_in_queue)))

    def _evict(self, v: _Job) -> None:
        lost = v.progress - v.ckpt_progress
        v.lost_acc_s += lost
        v.progress = v.ckpt_progress
        v.alloc = 0
        v.evictions += 1

    def _resize(self, v: _Job, alloc: int) -> None:
        v.alloc = alloc
        v.resizes += 1
        v.paused_until = max(v.paused_until, self.t + self.cfg.costs.resize_s)

    def _grow(self) -> None:
        for v in sorted(self.jobs, key=lambda v: (-v.spec.priority, v.spec.arrival_s)):
            if not (v.alloc and v.elastic and v.alloc < v.spec.ceiling):
                continue
            room = self.room(v.spec.queue)
            extra = min(room, v.spec.ceiling - v.alloc) // self.cfg.unit * self.cfg.unit
            if extra > 0:
                self._resize(v, v.alloc + extra)

    def _result(self) -> ClusterResult:
        makespan = max((j.finish for j in self.jobs), default=0.0)
        cap = self.cfg.accelerators * makespan
        useful = sum(j.spec.work_acc_s for j in self.jobs)
        held = sum(j.held_acc_s for j in self.jobs)
        outcomes = [
            JobOutcome(
                name=j.spec.name,
                priority=j.spec.priority,
                elastic=j.elastic,
                wait_s=j.first_start - j.spec.arrival_s,
                completion_s=j.finish - j.spec.arrival_s,
                goodput=j.spec.work_acc_s / j.held_acc_s if j.held_acc_s else 0.0,
                evictions=j.evictions,
                resizes=j.resizes,
            )
            for j in self.jobs
        ]
        return ClusterResult(
            makespan_s=makespan,
            utilisation=useful / cap if cap else 0.0,
            allocated=held / cap if cap else 0.0,
            jobs=outcomes,
        )
