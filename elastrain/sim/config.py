"""Validated configuration of one simulated training job (one dataclass per component).

Durations are seconds (`*_s`). All dataclasses are frozen and keyword-only; a bad
value or a bad combination raises `ValueError` with a message that says what to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

HOUR = 3600.0
DAY = 86400.0
YEAR = 365.0 * DAY

FailureKind = Literal["exponential", "weibull"]
DelayKind = Literal["fixed", "exponential", "lognormal"]
StrategyKind = Literal["restart", "elastic", "hot-spare"]
IntervalRule = Literal["young", "daly"]
STRATEGIES: tuple[StrategyKind, ...] = ("restart", "elastic", "hot-spare")


def _positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class FailureProcess:
    """Lifetime of one kind of component (accelerator, host or failure domain).

    Each component fails, is replaced by a fresh one, and starts a new lifetime
    (a renewal process). Components of one kind are independent.
    """

    mtbf_s: float = math.inf
    """Mean time between failures of ONE component, seconds; `inf` = never fails."""
    kind: FailureKind = "exponential"
    """Lifetime distribution: `exponential` (constant hazard) or `weibull`."""
    shape: float = 1.0
    """Weibull shape k: < 1 infant mortality, 1 = exponential, > 1 wear-out.
    Only meaningful with kind='weibull'; the scale is derived so the mean is mtbf_s."""

    def __post_init__(self) -> None:
        _positive("FailureProcess.mtbf_s", self.mtbf_s, allow_inf=True)
        if self.kind not in ("exponential", "weibull"):
            raise ValueError(
                f"FailureProcess.kind must be 'exponential' or 'weibull', got {self.kind!r}"
            )
        if not self.shape > 0 or math.isinf(self.shape):
            raise ValueError(f"FailureProcess.shape must be a positive number, got {self.shape!r}")
        if self.kind == "exponential" and self.shape != 1.0:
            raise ValueError(
                "FailureProcess.shape applies to Weibull lifetimes only: set kind='weibull' "
                "or leave shape at 1.0"
            )

    @property
    def rate(self) -> float:
        """Long-run failures per second of one component (renewal theorem: 1/mean)."""
        return 0.0 if math.isinf(self.mtbf_s) else 1.0 / self.mtbf_s

    @property
    def weibull_scale(self) -> float:
        """Weibull scale lambda with mean `mtbf_s` for this shape."""
        return self.mtbf_s / math.gamma(1.0 + 1.0 / self.shape)

    @classmethod
    def from_afr(
        cls, afr: float, *, kind: FailureKind = "exponential", shape: float = 1.0
    ) -> FailureProcess:
        """From an annualized failure rate (expected failures per component-year)."""
        if not afr >= 0:
            raise ValueError(f"annualized failure rate must be >= 0, got {afr!r}")
        return cls(mtbf_s=math.inf if afr == 0 else YEAR / afr, kind=kind, shape=shape)


@dataclass(frozen=True, kw_only=True)
class Delay:
    """A random duration, e.g. the time the cluster needs to provide a replacement host."""

    mean_s: float = 0.0
    """Mean duration, seconds."""
    kind: DelayKind = "fixed"
    """`fixed` (always mean_s), `exponential`, or `lognormal` (with coefficient of variation cv)."""
    cv: float = 1.0
    """Coefficient of variation (std / mean) of the lognormal; ignored otherwise."""

    def __post_init__(self) -> None:
        _non_negative("Delay.mean_s", self.mean_s)
        if self.kind not in ("fixed", "exponential", "lognormal"):
            raise ValueError(
                f"Delay.kind must be fixed, exponential or lognormal, got {self.kind!r}"
            )
        if not self.cv > 0 or math.isinf(self.cv):
            raise ValueError(f"Delay.cv must be a positive number, got {self.cv!r}")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The accelerators of the job: hosts, model replicas and failure domains.

    A host is the unit a scheduler replaces: any accelerator failure takes its host
    out of the job. A replica is the group of hosts that together hold one full copy
    of the training state (tensor/pipeline parallel inside, data parallel across);
    an elastic job shrinks and grows by whole replicas. A failure domain (rack,
    TPU cube, power feed) is a group of consecutive hosts that can fail together.
    """

    accelerators: int
    """Accelerators in the job (excluding spares)."""
    accelerators_per_host: int = 8
    """Accelerators per host (8 for a DGX-style GPU server, 4 for a TPU host)."""
    accelerators_per_replica: int | None = None
    """Accelerators holding one full copy of the state; None = one host."""
    hosts_per_domain: int = 0
    """Hosts per correlated failure domain; 0 = no domains."""

    def __post_init__(self) -> None:
        if self.accelerators < 1:
            raise ValueError(f"Topology.accelerators must be >= 1, got {self.accelerators}")
        if self.accelerators_per_host < 1:
            raise ValueError("Topology.accelerators_per_host must be >= 1")
        if self.accelerators % self.accelerators_per_host:
            raise ValueError(
                f"Topology.accelerators ({self.accelerators}) must be a multiple of "
                f"accelerators_per_host ({self.accelerators_per_host}); round the job size"
            )
        apr = self.replica_accelerators
        if apr < 1 or apr % self.accelerators_per_host:
            raise ValueError(
                f"Topology.accelerators_per_replica ({apr}) must be a positive multiple of "
                f"accelerators_per_host ({self.accelerators_per_host}): a replica is whole hosts"
            )
        if self.accelerators % apr:
            raise ValueError(
                f"Topology.accelerators ({self.accelerators}) must be a multiple of "
                f"accelerators_per_replica ({apr}); the job is a whole number of replicas"
            )
        if self.hosts_per_domain < 0:
            raise ValueError("Topology.hosts_per_domain must be >= 0 (0 = no failure domains)")

    @property
    def replica_accelerators(self) -> int:
        return self.accelerators_per_replica or self.accelerators_per_host

    @property
    def hosts(self) -> int:
        return self.accelerators // self.accelerators_per_host

    @property
    def hosts_per_replica(self) -> int:
        return self.replica_accelerators // self.accelerators_per_host

    @property
    def replicas(self) -> int:
        return self.accelerators // self.replica_accelerators

    @property
    def domains(self) -> int:
        if self.hosts_per_domain == 0:
            return 0
        return -(-self.hosts // self.hosts_per_domain)


@dataclass(frozen=True, kw_only=True)
class Failures:
    """Failure processes of each component kind and how fast a failed host is replaced."""

    accelerator: FailureProcess = field(default_factory=FailureProcess)
    """Lifetime of each accelerator (GPU/TPU chip, its HBM)."""
    host: FailureProcess = field(default_factory=FailureProcess)
    """Lifetime of the rest of each host (CPU, NIC, disk, software), per host."""
    domain: FailureProcess = field(default_factory=FailureProcess)
    """Lifetime of each failure domain; a domain failure takes all its hosts at once."""
    replacement: Delay = field(default_factory=lambda: Delay(mean_s=300.0))
    """Time from detection until the cluster provides a healthy replacement host."""


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    """Durations of the recovery phases (see DESIGN 'Recovery, phase by phase')."""

    detect_s: float = 60.0
    """Failure to detection (watchdog / collective timeout / lease expiry)."""
    restart_s: float = 300.0
    """Relaunch of a whole job: scheduling, container start, imports, process groups."""
    regroup_s: float = 10.0
    """Elastic: new quorum and process group among the survivors (paid by the whole job)."""
    heal_s: float = 0.0
    """Elastic: fixed part of bringing joiners up to date from their peers."""
    state_bytes: float = 0.0
    """Training state of one replica, bytes (model + optimizer); adds to the heal time."""
    heal_gbps: float = 100.0
    """Per-host network bandwidth for healing, Gbit/s; joiners fetch their shards in parallel."""
    spare_swap_s: float = 30.0
    """Hot spare: time to put a warm spare host in place of a failed one."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "restart_s", "regroup_s", "heal_s", "state_bytes", "spare_swap_s"):
            _non_negative(f"RecoveryCosts.{name}", getattr(self, name))
        _positive("RecoveryCosts.heal_gbps", self.heal_gbps)

    def heal_time_s(self, hosts_per_replica: int) -> float:
        """Seconds the job pauses to heal joining replicas."""
        per_host_bytes = self.state_bytes / hosts_per_replica
        return self.heal_s + per_host_bytes * 8.0 / (self.heal_gbps * 1e9)


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """When durable checkpoints are taken and what they cost."""

    interval_s: float | IntervalRule = "young"
    """Training (compute) time between checkpoint starts, seconds; or `young`
    (sqrt(2 * MTBF * save_s)) or `daly` (Daly's higher-order optimum), computed
    from the MTBF of the failures that force a rollback. `inf` = never checkpoint."""
    save_s: float = 60.0
    """Time training is blocked while a checkpoint is taken."""
    persist_s: float = 0.0
    """Further background time until the checkpoint is durable; a failure before
    then falls back to the previous checkpoint."""
    restore_s: float = 120.0
    """Time to load a checkpoint when the whole job restarts."""
    max_interval_s: float = 24 * HOUR
    """Upper bound on a Young/Daly interval (an elastic job rarely rolls back)."""

    def __post_init__(self) -> None:
        if isinstance(self.interval_s, str):
            if self.interval_s not in ("young", "daly"):
                raise ValueError(
                    f"CheckpointPolicy.interval_s must be seconds, 'young' or 'daly', got {self.interval_s!r}"
                )
        else:
            _positive("CheckpointPolicy.interval_s", self.interval_s, allow_inf=True)
        _non_negative("CheckpointPolicy.save_s", self.save_s)
        _non_negative("CheckpointPolicy.persist_s", self.persist_s)
        _non_negative("CheckpointPolicy.restore_s", self.restore_s)
        _positive("CheckpointPolicy.max_interval_s", self.max_interval_s)
        if isinstance(self.interval_s, str) and self.save_s == 0:
            raise ValueError(
                "CheckpointPolicy: a Young/Daly interval needs save_s > 0; "
                "give a fixed interval_s for free checkpoints"
            )


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """How the job reacts to a failure."""

    kind: StrategyKind = "restart"
    """`restart`: stop everything, wait for a replacement, relaunch, restore the last
    checkpoint (torchrun style). `hot-spare`: the same, but a warm spare host takes
    the failed host's place at once. `elastic`: survivors regroup and continue on fewer
    replicas; a replacement joins later and heals from its peers (elastrain)."""
    spare_hosts: int = 0
    """Warm spare hosts held beside the job (required by hot-spare, optional for elastic)."""
    min_replicas: int = 1
    """Elastic: fewest replicas the job runs on; below it the job waits (keeping state)."""

    def __post_init__(self) -> None:
        if self.kind not in STRATEGIES:
            raise ValueError(f"StrategyConfig.kind must be one of {STRATEGIES}, got {self.kind!r}")
        if self.spare_hosts < 0:
            raise ValueError("StrategyConfig.spare_hosts must be >= 0")
        if self.kind == "hot-spare" and self.spare_hosts == 0:
            raise ValueError("the hot-spare strategy needs spare_hosts >= 1 (--spare-hosts)")
        if self.kind == "restart" and self.spare_hosts:
            raise ValueError(
                "restart with spare hosts is the hot-spare strategy: use kind='hot-spare'"
            )
        if self.min_replicas < 1:
            raise ValueError("StrategyConfig.min_replicas must be >= 1")

    @property
    def rigid(self) -> bool:
        """True when any failure stops the whole job and rolls back to a checkpoint."""
        return self.kind != "elastic"


@dataclass(frozen=True, kw_only=True)
class PowerConfig:
    """Electrical power per accelerator (including its share of host and cooling if wanted)."""

    busy_w: float = 700.0
    """Watts while computing."""
    idle_w: float = 150.0
    """Watts while allocated but idle (waiting, restarting, spare)."""

    def __post_init__(self) -> None:
        _non_negative("PowerConfig.busy_w", self.busy_w)
        _non_negative("PowerConfig.idle_w", self.idle_w)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The training work: step time at full size, and optionally how many steps to run."""

    step_s: float = 5.0
    """Seconds per optimizer step with every replica present (fixed global batch)."""
    steps: int | None = None
    """Steps to train; the run ends when they are done (time-to-train). None = run
    until the horizon."""
    global_microbatches: int | None = None
    """Micro-batches per global batch; with it a shrunk job's step time is quantized
    (ceil(M / replicas) rounds), otherwise it scales as replicas_total / replicas_alive."""
    step_s_by_replicas: tuple[tuple[int, float], ...] = ()
    """Measured (replicas alive, step seconds) pairs that override the scaling rule for
    those sizes (e.g. from a recorded run)."""

    def __post_init__(self) -> None:
        _positive("Workload.step_s", self.step_s)
        for n, s in self.step_s_by_replicas:
            if n < 1:
                raise ValueError("Workload.step_s_by_replicas: replica counts must be >= 1")
            _positive(f"Workload.step_s_by_replicas[{n}]", s)
        if self.steps is not None and self.steps < 1:
            raise ValueError("Workload.steps must be >= 1 or None")
        if self.global_microbatches is not None and self.global_microbatches < 1:
            raise ValueError("Workload.global_microbatches must be >= 1 or None")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated job: what it runs on, how it fails and recovers, for how long."""

    topology: Topology
    """Accelerators, hosts, replicas and failure domains."""
    failures: Failures = field(default_factory=Failures)
    """Failure processes and replacement time."""
    costs: RecoveryCosts = field(default_factory=RecoveryCosts)
    """Recovery phase durations."""
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    """Checkpoint interval and costs."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """Recovery strategy."""
    power: PowerConfig = field(default_factory=PowerConfig)
    """Power draw, for the energy spent on badput."""
    workload: Workload = field(default_factory=Workload)
    """Step time and optional step target."""
    horizon_s: float | None = 30 * DAY
    """Wall-clock length of the simulated run; with workload.steps it is a cap."""
    seed: int = 0
    """Seed of the failure trace (same seed = same failures for every strategy)."""

    def __post_init__(self) -> None:
        if self.horizon_s is None and self.workload.steps is None:
            raise ValueError("SimConfig needs horizon_s (--days) or workload.steps (--steps)")
        if self.horizon_s is not None:
            _positive("SimConfig.horizon_s", self.horizon_s)
        if self.strategy.min_replicas > self.topology.replicas:
            raise ValueError(
                f"StrategyConfig.min_replicas ({self.strategy.min_replicas}) exceeds the job's "
                f"{self.topology.replicas} replicas; lower min_replicas or enlarge the job"
            )
        mb = self.workload.global_microbatches
        if mb is not None and mb < self.topology.replicas:
            raise ValueError(
                f"Workload.global_microbatches ({mb}) is smaller than the number of replicas "
                f"({self.topology.replicas}): every replica needs a micro-batch; raise it"
            )
        if self.seed < 0:
            raise ValueError("SimConfig.seed must be >= 0")
        for n, _ in self.workload.step_s_by_replicas:
            if n > self.topology.replicas:
                raise ValueError(
                    f"Workload.step_s_by_replicas names {n} replicas but the job has "
                    f"{self.topology.replicas}; drop that entry or enlarge the job"
                )

    @property
    def spare_accelerators(self) -> int:
        return self.strategy.spare_hosts * self.topology.accelerators_per_host
