"""Failure traces: the time-ordered failures a job meets, independent of its strategy.

A trace names host *slots*: job slots `0 .. hosts-1` and spare slots
`hosts .. hosts+spares-1`. Every slot (and every failure domain) runs its own
renewal process: the hardware in it fails, is replaced by fresh hardware, fails
again. Each failed slot carries a pre-drawn replacement delay, so two strategies
simulated with the same seed see exactly the same failures and the same
replacement times (common random numbers); spares draw from their own streams, so
adding spares does not change the job's failures.

Approximation: a slot's next lifetime starts at its failure, not when the
replacement arrives (replacement takes minutes, lifetimes are years); a failure
that falls on an empty slot (still waiting for its replacement) is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from elastrain.sim.config import DAY, Delay, FailureProcess, SimConfig

ACCELERATOR, HOST, DOMAIN, INJECTED = 0, 1, 2, 3
CAUSES = ("accelerator", "host", "domain", "injected")


class FailureEvent(NamedTuple):
    t: float
    """Wall time of the failure, seconds from the job start."""
    cause: int
    """Index into CAUSES."""
    slots: tuple[int, ...]
    """Failed host slots (job slots first, then spare slots)."""
    delays: tuple[float, ...]
    """Replacement delay for each failed slot, seconds after detection."""
    detect_s: float | None = None
    """Detection time of this failure (e.g. measured: a crash is seen at once, a hang
    only when a watchdog fires); None = RecoveryCosts.detect_s."""


class Trace(Protocol):
    """A time-ordered, possibly endless, sequence of failures."""

    def __iter__(self) -> Iterator[FailureEvent]: ...


def sample_lifetimes(
    rng: np.random.Generator, proc: FailureProcess, n: int, count: int = 1
) -> np.ndarray:
    """`n` samples of the time until the first of `count` iid fresh components fails."""
    if proc.rate == 0.0 or count == 0:
        return np.full(n, np.inf)
    if proc.kind == "exponential":
        return rng.exponential(proc.mtbf_s / count, n)
    # min of `count` iid Weibull(k, s) is Weibull(k, s * count**(-1/k)).
    scale = proc.weibull_scale * count ** (-1.0 / proc.shape)
    return scale * rng.weibull(proc.shape, n)


def sample_delays(rng: np.random.Generator, delay: Delay, n: int) -> np.ndarray:
    """`n` samples of a Delay."""
    if delay.kind == "fixed" or delay.mean_s == 0.0:
        return np.full(n, delay.mean_s)
    if delay.kind == "exponential":
        return rng.exponential(delay.mean_s, n)
    sigma2 = math.log1p(delay.cv**2)
    mu = math.log(delay.mean_s) - sigma2 / 2
    return rng.lognormal(mu, math.sqrt(sigma2), n)


Draw = Callable[[int], tuple[np.ndarray, np.ndarray]]


class _Renewal:
    """`n` independent renewal processes advanced window by window, vectorized."""

    def __init__(self, n: int, draw: Draw) -> None:
        self._draw = draw
        self.next_t, self.next_cause = draw(n)

    def until(self, t1: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times, units, causes) of all failures before t1 not yet returned."""
        times, units, causes = [], [], []
        while True:
            idx = np.flatnonzero(self.next_t < t1)
            if idx.size == 0:
                break
            times.append(self.next_t[idx])
            units.append(idx)
            causes.append(self.next_cause[idx])
            life, cause = self._draw(idx.size)
            self.next_t[idx] = self.next_t[idx] + life
            self.next_cause[idx] = cause
        if not times:
            empty = np.empty(0)
            return empty, empty.astype(np.int64), empty.astype(np.int64)
        return np.concatenate(times), np.concatenate(units), np.concatenate(causes)


def _host_draw(
    rng: np.random.Generator, acc: FailureProcess, host: FailureProcess, per_host: int
) -> Draw:
    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        a = sample_lifetimes(rng, acc, n, per_host)
        h = sample_lifetimes(rng, host, n)
        return np.minimum(a, h), np.where(a <= h, ACCELERATOR, HOST)

    return draw


def _domain_draw(rng: np.random.Generator, proc: FailureProcess) -> Draw:
    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        return sample_lifetimes(rng, proc, n), np.full(n, DOMAIN)

    return draw


class RandomTrace:
    """Failures of a job (and its spares) drawn from the configured processes.

    Deterministic for a given (config.seed, topology, failures); spares and
    strategy do not change the failures of the job's own slots.
    """

    def __init__(self, config: SimConfig, *, chunk_s: float | None = None) -> None:
        topo, fail = config.topology, config.failures
        seq = np.random.SeedSequence(config.seed)
        job_rng, dom_rng, job_delay_rng, spare_rng, spare_delay_rng = (
            np.random.Generator(np.random.PCG64(s)) for s in seq.spawn(5)
        )
        self._hosts = topo.hosts
        self._hpd = topo.hosts_per_domain
        self._replacement = fail.replacement
        self._job_delay_rng, self._spare_delay_rng = job_delay_rng, spare_delay_rng
        aph = topo.accelerators_per_host
        self._job = _Renewal(topo.hosts, _host_draw(job_rng, fail.accelerator, fail.host, aph))
        self._spares = _Renewal(
            config.strategy.spare_hosts, _host_draw(spare_rng, fail.accelerator, fail.host, aph)
        )
        self._domains = _Renewal(topo.domains, _domain_draw(dom_rng, fail.domain))
        horizon = config.horizon_s if config.horizon_s is not None else 30 * DAY
        self._chunk_s = chunk_s if chunk_s is not None else min(horizon, 30 * DAY) * 1.0001

    def __iter__(self) -> Iterator[FailureEvent]:
        t0 = 0.0
        while self._next_failure() < math.inf:
            t1 = t0 + self._chunk_s
            yield from self._window(t1)
            t0 = t1

    def _next_failure(self) -> float:
        return min(
            (
                float(r.next_t.min())
                for r in (self._job, self._domains, self._spares)
                if r.next_t.size
            ),
            default=math.inf,
        )

    def _window(self, t1: float) -> list[FailureEvent]:
        jt, ju, jc = self._job.until(t1)
        dt, du, dc = self._domains.until(t1)
        st, su, sc = self._spares.until(t1)
        # Job events (hosts and domains) in time order; their delays come from the
        # job's own stream so that spares never shift them.
        t = np.concatenate([jt, dt])
        unit = np.concatenate([ju, du])
        cause = np.concatenate([jc, dc])
        order = np.argsort(t, kind="stable")
        sizes = np.where(cause[order] == DOMAIN, self._domain_size(unit[order]), 1)
        job_delays = sample_delays(self._job_delay_rng, self._replacement, int(sizes.sum()))
        spare_delays = sample_delays(self._spare_delay_rng, self._replacement, st.size)
        events: list[FailureEvent] = []
        pos = 0
        for i, k in zip(order.tolist(), sizes.tolist(), strict=True):
            u, c = int(unit[i]), int(cause[i])
            if c == DOMAIN:
                first = u * self._hpd
                slots = tuple(range(first, first + k))
            else:
                slots = (u,)
            events.append(
                FailureEvent(float(t[i]), c, slots, tuple(job_delays[pos : pos + k].tolist()))
            )
            pos += k
        for j in range(st.size):
            slot = self._hosts + int(su[j])
            events.append(
                FailureEvent(float(st[j]), int(sc[j]), (slot,), (float(spare_delays[j]),))
            )
        events.sort(key=lambda e: e.t)
        return events

    def _domain_size(self, domains: np.ndarray) -> np.ndarray:
        if self._hpd == 0:
            return np.zeros_like(domains)
        return np.minimum(self._hpd, self._hosts - domains * self._hpd)


class ExplicitTrace:
    """A fixed list of failures, e.g. the fault schedule of a recorded run."""

    def __init__(self, events: Sequence[FailureEvent]) -> None:
        self.events = sorted(events, key=lambda e: e.t)
        for e in self.events:
            if len(e.slots) != len(e.delays):
                raise ValueError(f"failure at t={e.t}: one replacement delay per slot is needed")

    def __iter__(self) -> Iterator[FailureEvent]:
        return iter(self.events)
