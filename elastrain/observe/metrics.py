"""The coordinator's Prometheus metrics (`GET /metrics`), kept and served by
`prometheus_client`: its registry, metric types and text exposition
(`generate_latest`); nothing here formats or parses the text itself.

The coordinator serves them on its HTTP port at `/metrics`; like every other
path it requires the job token (`Authorization: Bearer <token>`; in Prometheus:
`authorization: {credentials_file: <run_dir>/token}`), so nothing about the job
leaks to whoever can reach the port. Workers open no port: what only they
measure (step, heal and recovery seconds, healed bytes) reaches the
coordinator in their quorum requests (`elastrain.observe.tally`).

Base units (seconds, bytes), counters end in `_total`:

- counters: `elastrain_failures_total{kind}` (the failures that
  `elastrain.observe.failures.recognise_failures` recognises in what the
  coordinator itself saw: `failure_counts` over its own events),
  `elastrain_recoveries_total`, `elastrain_committed_steps_total`,
  `elastrain_samples_total`, `elastrain_healed_bytes_total`,
  `elastrain_hang_checks_total{answer}` (overdue collectives the coordinator
  was asked about: `confirmed` hangs, `alive` slow steps, `stale`);
- histograms: `elastrain_step_seconds`, `elastrain_recovery_seconds{phase}`,
  `elastrain_heal_seconds`;
- gauges: the live status (`elastrain_members`, `elastrain_generation`,
  `elastrain_goodput_ratio`, ... `GAUGES`) and `elastrain_job_info{job_id}`;
  `elastrain_user_scalar{name}`: the last value of each of the script's own
  scalars (`trainer.log`, rank 0's), the first `MAX_METRIC_SCALARS` names
  this coordinator received; later names are left out (logged once each).

A restarted coordinator starts every counter and histogram from zero
(Prometheus reads it as a counter reset: `rate()` and `increase()` are
unaffected).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from elastrain.observe.failures import FailureKind, recognise_failures
from elastrain.observe.scalars import MAX_METRIC_SCALARS
from elastrain.observe.tally import RECOVERY_KEYS, RECOVERY_PHASES, Observed

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of `CoordinatorMetrics.exposition()` (prometheus_client's)."""

GAUGES: tuple[tuple[str, str, Any], ...] = (
    ("elastrain_step", "Committed steps (the next step to run).", "step"),
    ("elastrain_members", "Members of the current generation.", lambda s: len(s.get("members") or [])),
    ("elastrain_target", "Target member count of the job.", "target"),
    ("elastrain_min_members", "Fewest members that may train.", "min"),
    ("elastrain_registered_members", "Registered (live) members.",
     lambda s: len(s.get("registered") or {})),
    ("elastrain_standby_members", "Registered members outside the generation (hot spares).",
     lambda s: len(s.get("standby") or [])),
    ("elastrain_generation", "Current generation number.", "gen"),
    ("elastrain_generation_ready", "1 when the current generation is ready and not broken.", "ready"),
    ("elastrain_steps_per_second", "Committed steps per second (recent).", "steps_per_s"),
    ("elastrain_samples_per_second", "Committed samples per second (recent).", "samples_per_s"),
    ("elastrain_loss", "Mean loss of the last committed step.", "loss"),
    ("elastrain_waiting", "1 while training is paused waiting for members.",
     lambda s: bool(s.get("waiting"))),
    ("elastrain_finished", "1 once the job has finished.", "finished"),
    ("elastrain_preempting", "1 while the job is being preempted.", "preempting"),
    ("elastrain_uptime_seconds", "Seconds since the coordinator started.", "uptime_s"),
)  # fmt: skip
"""name, help, status key (or a function of the status): the gauges read from
`Coordinator.status()` at each scrape; one whose value is unknown (the loss
before the first step) is left out."""

GOODPUT = "elastrain_goodput_ratio"
USER_SCALAR = "elastrain_user_scalar"
FAILURES = "elastrain_failures_total"
FAILURE_KINDS = tuple(k for k in FailureKind if k is not FailureKind.COORDINATOR)
"""The kinds `elastrain_failures_total` reports. A coordinator cannot see its own
death: a restarted one starts counting from zero (a counter reset), and the
run's events (`elastrain report`) count coordinator failures."""

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HEAL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def failure_counts(events: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Recognised failures per kind (every kind of FAILURE_KINDS, zeros included)."""
    out = dict.fromkeys(map(str, FAILURE_KINDS), 0)
    for f in recognise_failures(events):
        if f.kind in FAILURE_KINDS:
            out[str(f.kind)] += 1
    return out


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


class _StatusCollector(Collector):
    """The gauges and the failure counter, read from the status at each scrape
    (prometheus_client's custom-collector way for values kept elsewhere)."""

    def __init__(
        self,
        status: Callable[[], Mapping[str, Any]],
        goodput: Callable[[], float | None],
        scalars: Callable[[], Mapping[str, float]],
    ) -> None:
        self.status = status
        self.goodput = goodput
        self.scalars = scalars

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        yield InfoMetricFamily(
            "elastrain_job",
            "The job this coordinator runs.",
            value={"job_id": str(st.get("job_id", ""))},
        )
        for name, help_, key in GAUGES:
            v = _num(key(st) if callable(key) else st.get(key))
            if v is not None:
                yield GaugeMetricFamily(name, help_, value=v)
        g = self.goodput()
        if g is not None:
            yield GaugeMetricFamily(
                GOODPUT,
                "Seconds in committed steps (the leader's step times) over the seconds since "
                "the first of them began, as this coordinator saw it (elastrain report has "
                "the member-second ledger).",
                value=g,
            )
        scalars = self.scalars()
        if scalars:
            u = GaugeMetricFamily(
                USER_SCALAR,
                "The last value the training script logged under each name (trainer.log), "
                "rank 0's.",
                labels=["name"],
            )
            for name, v in scalars.items():
                u.add_metric([name], v)
            yield u
        failures = st.get("failures")
        if isinstance(failures, Mapping) and failures:
            c = CounterMetricFamily(
                FAILURES,
                "Failures recognised from what the coordinator saw, by kind.",
                labels=["kind"],
            )
            for kind, n in failures.items():
                v = _num(n)
                if v is not None:
                    c.add_metric([str(kind)], v)
            yield c


class CoordinatorMetrics:
    """One per coordinator: its Prometheus registry. The coordinator calls
    `count_commit` once per step it lets proceed and `observe` with each quorum
    request's `observed` (under its lock); the HTTP handler serves
    `exposition()`, which reads `status()` for the gauges."""

    def __init__(
        self,
        status: Callable[[], Mapping[str, Any]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.committed_steps = Counter("elastrain_committed_steps", "Steps committed.", registry=r)
        self.samples = Counter(
            "elastrain_samples", "Samples in committed steps (steps x global batch).", registry=r
        )
        self.recoveries = Counter(
            "elastrain_recoveries",
            "Interruptions the job recovered from: a step aborted, then one committed in "
            "a new generation.",
            registry=r,
        )
        self.healed_bytes = Counter(
            "elastrain_healed_bytes", "Bytes of state received from peers in heals.", registry=r
        )
        self.hang_checks = Counter(
            "elastrain_hang_checks",
            "Overdue collectives a member asked about (past its soft watchdog deadline), by "
            "answer: confirmed (a peer was silent: expelled), alive (a slow step), stale.",
            labelnames=["answer"],
            registry=r,
        )
        for answer in ("confirmed", "alive", "stale"):
            self.hang_checks.labels(answer=answer)  # every answer exposed, at zero
        self.step_seconds = Histogram(
            "elastrain_step_seconds",
            "Seconds of each committed step (the leader's).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "elastrain_recovery_seconds",
            "Seconds of each recovery phase, from the survivors' abort to the first commit "
            "(the resumed generation's leader's clock; detect is in elastrain report).",
            labelnames=["phase"],
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        for phase in RECOVERY_PHASES:
            self.recovery_seconds.labels(phase=phase)  # every phase exposed, at zero
        self.heal_seconds = Histogram(
            "elastrain_heal_seconds",
            "Seconds of each member's heal (receiving state from peers).",
            buckets=HEAL_BUCKETS,
            registry=r,
        )
        self._productive_s = 0.0
        self._first_start: float | None = None
        self._scalars: dict[str, float] = {}
        self._dropped: set[str] = set()
        r.register(_StatusCollector(status, self.goodput, lambda: dict(self._scalars)))

    def count_commit(self, global_batch: int) -> None:
        """A step was let proceed (committed): one step, `global_batch` samples."""
        self.committed_steps.inc()
        if global_batch > 0:
            self.samples.inc(global_batch)

    def observe(self, observed: Mapping[str, Sequence[float]]) -> None:
        """Add one member's observations (`QuorumRequest.observed`, checked by
        the wire: known kinds, finite values >= 0)."""
        now = self.clock()
        for v in observed.get(Observed.STEP_S, ()):
            self.step_seconds.observe(v)
            if self._first_start is None:
                self._first_start = now - v
            self._productive_s += v
        for v in observed.get(Observed.HEAL_S, ()):
            self.heal_seconds.observe(v)
        for v in observed.get(Observed.HEALED_BYTES, ()):
            self.healed_bytes.inc(v)
        for phase in RECOVERY_PHASES:
            for v in observed.get(RECOVERY_KEYS[phase], ()):
                self.recovery_seconds.labels(phase=phase).observe(v)
        self.recoveries.inc(len(observed.get(Observed.RECOVERY_FIRST_STEP_S, ())))

    def observe_scalars(self, scalars: Mapping[str, float]) -> None:
        """Keep the last value of each of the script's scalars (`QuorumRequest.scalars`,
        checked by the wire). A name past the first `MAX_METRIC_SCALARS` is left
        out of /metrics (one warning per name): each name is a time series, so
        a script logging ever new names must not grow the scrape without bound."""
        for name, v in scalars.items():
            if name in self._scalars or len(self._scalars) < MAX_METRIC_SCALARS:
                self._scalars[name] = v
            elif name not in self._dropped and len(self._dropped) < MAX_METRIC_SCALARS:
                self._dropped.add(name)
                log.warning(
                    "scalar %r is not in /metrics: it carries the first %d names only",
                    name,
                    MAX_METRIC_SCALARS,
                )

    def goodput(self) -> float | None:
        """Committed steps' seconds over the seconds since the first began (None
        before any); at most 1."""
        if self._first_start is None:
            return None
        wall = self.clock() - self._first_start
        return min(1.0, self._productive_s / wall) if wall > 0 else None

    def exposition(self) -> bytes:
        """The Prometheus text of every metric (`prometheus_client.generate_latest`)."""
        return _generate_latest(self.registry)
