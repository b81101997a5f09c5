"""Closed-form results the simulator is checked against, and the checkpoint interval rules.

References: J. W. Young, "A first order approximation to the optimum checkpoint
interval" (CACM 1974); J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps" (FGCS 2006).
"""

from __future__ import annotations

import math

from elastrain.sim.config import YEAR, SimConfig


def p_any_failure(components: int, afr: float, t_s: float) -> float:
    """Probability that at least one of `components` independent exponential components
    with annualized failure rate `afr` (failures per component-year) fails within t_s."""
    return -math.expm1(-components * afr * t_s / YEAR)


def host_failure_rate(config: SimConfig) -> float:
    """Long-run failures per second of one host (its accelerators plus the rest of it)."""
    f = config.failures
    return config.topology.accelerators_per_host * f.accelerator.rate + f.host.rate


def job_failure_rate(config: SimConfig) -> float:
    """Long-run failure events per second that hit the job's own hosts (not spares)."""
    topo = config.topology
    return topo.hosts * host_failure_rate(config) + topo.domains * config.failures.domain.rate


def job_mtbf_s(config: SimConfig) -> float:
    """Mean time between failures of the whole job (any host or domain), seconds."""
    rate = job_failure_rate(config)
    return math.inf if rate == 0 else 1.0 / rate


def young_interval_s(mtbf_s: float, save_s: float) -> float:
    """Young's optimum compute time between checkpoints: sqrt(2 * MTBF * save)."""
    return math.sqrt(2.0 * mtbf_s * save_s)


def daly_interval_s(mtbf_s: float, save_s: float) -> float:
    """Daly's higher-order optimum (exact to second order for exponential failures)."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = math.sqrt(save_s / (2.0 * mtbf_s))
    return math.sqrt(2.0 * mtbf_s * save_s) * (1.0 + r / 3.0 + r * r / 9.0) - save_s


def exact_optimal_interval_s(mtbf_s: float, save_s: float) -> float:
    """The interval that maximizes `restart_time_goodput` (root of e^(x+d)(1-x) = 1)."""
    d = save_s / mtbf_s
    lo, hi = 0.0, 1.0  # in units of the MTBF; f(x) = e^(x+d)(1-x) - 1 falls through 0 here
    for _ in range(100):
        mid = (lo + hi) / 2
        if math.exp(mid + d) * (1.0 - mid) - 1.0 > 0:
            lo = mid
        else:
            hi = mid
    return lo * mtbf_s


def restart_time_goodput(
    mtbf_s: float, interval_s: float, save_s: float, downtime_s: float
) -> float:
    """Expected fraction of wall time spent on kept training for restart-from-checkpoint
    with exponential failures (Daly's model: failures also strike during saves and
    during the downtime, which then starts over):
    tau / (M * e^(R/M) * (e^((tau+delta)/M) - 1))."""
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + save_s)
    m = mtbf_s
    return interval_s / (m * math.exp(downtime_s / m) * math.expm1((interval_s + save_s) / m))


def restart_downtime_s(config: SimConfig) -> float:
    """Failure to resumed training for a rigid job with a fixed replacement delay:
    detect + replacement (or spare swap) + restart + restore."""
    c = config.costs
    replace = c.spare_swap_s if config.strategy.spare_hosts else config.failures.replacement.mean_s
    return c.detect_s + replace + c.restart_s + config.checkpoint.restore_s


def rollback_mtbf_s(config: SimConfig) -> float:
    """Mean time between failures that force a rollback to the last checkpoint.

    Rigid strategies roll back on every job failure. An elastic job rolls back only
    when every replica is down at once: roughly R * l * (l * w)^(R-1) for replica
    failure rate l and replica outage w, plus domain failures covering the whole job.
    """
    if config.strategy.rigid or config.topology.replicas == 1:
        return job_mtbf_s(config)
    topo, c = config.topology, config.costs
    lam = topo.hosts_per_replica * host_failure_rate(config)
    replace = c.spare_swap_s if config.strategy.spare_hosts else config.failures.replacement.mean_s
    outage = c.detect_s + replace + c.regroup_s + c.heal_time_s(topo.hosts_per_replica)
    r = topo.replicas
    rate = r * lam * (lam * outage) ** (r - 1) if lam > 0 else 0.0
    if topo.domains == 1:
        rate += config.failures.domain.rate
    return math.inf if rate <= 0 else 1.0 / rate


def checkpoint_interval_s(config: SimConfig) -> float:
    """The compute time between checkpoints this config asks for, seconds."""
    ck = config.checkpoint
    if not isinstance(ck.interval_s, str):
        return ck.interval_s
    mtbf = rollback_mtbf_s(config)
    if math.isinf(mtbf):
        return ck.max_interval_s
    rule = young_interval_s if ck.interval_s == "young" else daly_interval_s
    return min(rule(mtbf, ck.save_s), ck.max_interval_s)


def elastic_time_goodput_approx(config: SimConfig, interval_s: float) -> tuple[float, float]:
    """First-order (time goodput, ETTR) of the elastic strategy with rare failures,
    no rollbacks and no overlapping outages. Per job failure the whole job pauses for
    detect + regroup, loses half a step on average, and pauses again for regroup + heal
    when the replacement joins; in between the job runs one replica short."""
    c, topo = config.costs, config.topology
    lam = job_failure_rate(config)
    heal = c.heal_time_s(topo.hosts_per_replica)
    pause = c.detect_s + 2 * c.regroup_s + heal
    ck = interval_s / (interval_s + config.checkpoint.save_s)
    step = config.workload.step_s
    time_goodput = (1.0 - lam * pause) * ck - lam * step / 2.0
    replace = c.spare_swap_s if config.strategy.spare_hosts else config.failures.replacement.mean_s
    # The replica is away from detection until its replacement arrives; the first
    # detect + regroup of that are a full pause, already counted above.
    degraded = max(0.0, replace - c.regroup_s)
    ettr = time_goodput - lam * degraded * ck / topo.replicas
    return time_goodput, ettr
