"""What one simulated run reports, and the summary over many seeds.

Every second of the run lands in exactly one bucket of `SimResult.buckets`:

productive  computing steps that are kept
checkpoint  blocked while saving a checkpoint
lost        computing steps that were later thrown away (rollback, aborted step)
detect      failure happened, not yet noticed
wait        waiting for replacement hosts (or for enough replicas)
restart     relaunching the whole job
restore     loading a checkpoint
regroup     elastic: forming a new generation / process group
heal        elastic: bringing joiners up to date from their peers
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

BUCKETS = (
    "productive",
    "checkpoint",
    "detect",
    "wait",
    "restart",
    "restore",
    "regroup",
    "heal",
    "lost",
)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Outcome of one simulated run."""

    strategy: str
    accelerators: int
    spare_accelerators: int
    seed: int
    wall_s: float
    """Simulated wall time (the horizon, or the time to train when steps were set)."""
    buckets: dict[str, float]
    """Wall seconds per bucket (see module docstring); they sum to wall_s."""
    steps: float
    """Training steps kept at the end."""
    step_s: float
    """Full-size step time."""
    checkpoint_interval_s: float
    """The compute time between checkpoints that was used."""
    failures: int
    """Failure events in the trace up to the end (job hosts, domains and spares)."""
    host_failures: int
    """Healthy job hosts lost (a domain failure counts each of its hosts)."""
    interruptions: int
    """Failures that hit the running job (stopped it, or removed replicas from it)."""
    rollbacks: int
    """Times the job fell back to its last checkpoint."""
    lost_steps: float
    """Steps computed and then thrown away."""
    busy_accelerator_s: float
    """Accelerator-seconds spent computing (kept or not)."""
    lost_accelerator_s: float
    """Of those, accelerator-seconds whose steps were thrown away."""
    energy_j: float
    """Energy of all allocated accelerators (job and spares), joules."""
    badput_energy_j: float
    """Energy not spent computing kept steps, joules."""
    time_to_train_s: float | None
    """Wall time to finish workload.steps; None when not set or not reached."""

    @property
    def useful_s(self) -> float:
        """Kept training expressed as full-size, failure-free seconds."""
        return self.steps * self.step_s

    @property
    def time_goodput(self) -> float:
        """Fraction of wall time spent computing kept steps (at whatever size)."""
        return self.buckets["productive"] / self.wall_s if self.wall_s else 0.0

    @property
    def ettr(self) -> float:
        """Effective training time ratio: kept training in full-size seconds / wall time.
        Equals time_goodput for rigid strategies; lower for a job that ran shrunk."""
        return self.useful_s / self.wall_s if self.wall_s else 0.0

    @property
    def throughput_goodput(self) -> float:
        """Kept work over the capacity held (job plus spare accelerators) for the run."""
        held = self.accelerators + self.spare_accelerators
        return self.ettr * self.accelerators / held

    @property
    def productive_accelerator_s(self) -> float:
        """Accelerator-seconds spent computing kept steps."""
        return self.busy_accelerator_s - self.lost_accelerator_s

    @property
    def lost_work_s(self) -> float:
        """Wall seconds of computation thrown away."""
        return self.buckets["lost"]

    @property
    def badput_energy_mwh(self) -> float:
        return self.badput_energy_j / 3.6e9

    @property
    def energy_mwh(self) -> float:
        return self.energy_j / 3.6e9

    def metrics(self) -> dict[str, float]:
        """Flat numeric view (for summaries, tables and JSON)."""
        out: dict[str, float] = {
            "time_goodput": self.time_goodput,
            "throughput_goodput": self.throughput_goodput,
            "ettr": self.ettr,
            "wall_h": self.wall_s / 3600.0,
            "steps": self.steps,
            "failures": float(self.failures),
            "host_failures": float(self.host_failures),
            "interruptions": float(self.interruptions),
            "rollbacks": float(self.rollbacks),
            "lost_work_h": self.lost_work_s / 3600.0,
            "lost_steps": self.lost_steps,
            "energy_mwh": self.energy_mwh,
            "badput_energy_mwh": self.badput_energy_mwh,
            "checkpoint_interval_s": self.checkpoint_interval_s,
            "time_to_train_h": math.nan
            if self.time_to_train_s is None
            else self.time_to_train_s / 3600.0,
        }
        for name, seconds in self.buckets.items():
            out[f"{name}_h"] = seconds / 3600.0
        return out


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float
    n: int

    @property
    def sem(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 1 else math.nan


def summarize(results: Sequence[SimResult]) -> dict[str, Stat]:
    """Mean, sample std and count of every metric over runs (NaNs ignored)."""
    if not results:
        raise ValueError("summarize needs at least one result")
    table: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics().items():
            table.setdefault(k, []).append(v)
    out: dict[str, Stat] = {}
    for k, vals in table.items():
        xs = [v for v in vals if not math.isnan(v)]
        if not xs:
            out[k] = Stat(math.nan, math.nan, 0)
            continue
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
        out[k] = Stat(mean, math.sqrt(var), len(xs))
    return out


def result_fields() -> list[str]:
    return [f.name for f in fields(SimResult)]
