"""Turn `elastrain sim` flags into a SimConfig and the strategies to compare."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, cast

from elastrain.sim import presets
from elastrain.sim.analytic import job_failure_rate, job_mtbf_s
from elastrain.sim.config import (
    DAY,
    HOUR,
    STRATEGIES,
    YEAR,
    FailureProcess,
    SimConfig,
    StrategyConfig,
    StrategyKind,
    Topology,
)


def _set(obj: Any, **changes: Any) -> Any:
    changes = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(obj, **changes) if changes else obj


def build_config(args: argparse.Namespace) -> SimConfig:
    """The base job (strategy set later) from the preset and the flags."""
    if args.preset:
        cfg = presets.get(args.preset)
    else:
        cfg = dataclasses.replace(presets.DEFAULT, horizon_s=30 * DAY)
    topo = _set(
        cfg.topology,
        accelerators_per_host=args.accelerators_per_host,
        accelerators_per_replica=args.accelerators_per_replica,
        hosts_per_domain=args.hosts_per_domain,
    )
    if args.accelerators is not None:
        topo = Topology(
            accelerators=args.accelerators,
            accelerators_per_host=topo.accelerators_per_host,
            accelerators_per_replica=topo.accelerators_per_replica
            if args.accelerators_per_replica is not None
            or args.accelerators % topo.replica_accelerators == 0
            else None,
            hosts_per_domain=topo.hosts_per_domain,
        )
    f = cfg.failures
    kind = "weibull" if args.weibull_shape is not None else None
    shape = args.weibull_shape

    def proc(p: FailureProcess, mtbf_h: float | None) -> FailureProcess:
        return _set(p, mtbf_s=None if mtbf_h is None else mtbf_h * HOUR, kind=kind, shape=shape)

    f = dataclasses.replace(
        f,
        accelerator=proc(f.accelerator, args.accelerator_mtbf_h),
        host=proc(f.host, args.host_mtbf_h),
        domain=proc(f.domain, args.domain_mtbf_h),
        replacement=_set(f.replacement, mean_s=args.replacement_s, kind=args.replacement_dist),
    )
    costs = _set(
        cfg.costs,
        detect_s=args.detect_s,
        restart_s=args.restart_s,
        regroup_s=args.regroup_s,
        heal_s=args.heal_s,
        spare_swap_s=args.spare_swap_s,
        state_bytes=None if args.state_gb is None else args.state_gb * 1e9,
        heal_gbps=args.heal_gbps,
    )
    interval: float | str | None = args.checkpoint_interval
    if interval is not None and interval not in ("young", "daly"):
        interval = math.inf if interval == "none" else float(interval)
    ck = _set(
        cfg.checkpoint,
        interval_s=interval,
        save_s=args.save_s,
        persist_s=args.persist_s,
        restore_s=args.restore_s,
    )
    wl = _set(
        cfg.workload, step_s=args.step_s, global_microbatches=args.microbatches, steps=args.steps
    )
    power = _set(cfg.power, busy_w=args.busy_w, idle_w=args.idle_w)
    horizon = cfg.horizon_s if args.days is None else args.days * DAY
    if args.steps is not None and args.days is None:
        horizon = None
    cfg = dataclasses.replace(
        cfg,
        topology=topo,
        failures=f,
        costs=costs,
        checkpoint=ck,
        workload=wl,
        power=power,
        horizon_s=horizon,
        seed=args.seed,
        strategy=StrategyConfig(),
    )
    if args.interruptions is not None:
        cfg = _rescale(cfg, args.interruptions, (args.days or 30.0) * DAY)
    return cfg


def _rescale(cfg: SimConfig, interruptions: float, window_s: float) -> SimConfig:
    rate = job_failure_rate(cfg)
    if rate == 0:
        raise ValueError("--interruptions needs some failure rate to rescale; give --host-mtbf-h")
    k = interruptions / (rate * window_s)
    f = cfg.failures

    def scale(p: FailureProcess) -> FailureProcess:
        return dataclasses.replace(p, mtbf_s=p.mtbf_s / k if k > 0 else math.inf)

    failures = dataclasses.replace(
        f, accelerator=scale(f.accelerator), host=scale(f.host), domain=scale(f.domain)
    )
    return dataclasses.replace(cfg, failures=failures)


def strategies(args: argparse.Namespace, cfg: SimConfig) -> list[StrategyConfig]:
    names = (
        list(STRATEGIES)
        if args.strategy == "all"
        else [s.strip() for s in args.strategy.split(",")]
    )
    out = []
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)} or all"
            )
        spares = 0
        if name == "hot-spare":
            spares = args.spare_hosts or max(1, cfg.topology.hosts // 128)
        elif name == "elastic":
            spares = args.spare_hosts or 0
        min_rep = min(args.min_replicas or 1, cfg.topology.replicas)
        kind = cast(StrategyKind, name)
        out.append(StrategyConfig(kind=kind, spare_hosts=spares, min_replicas=min_rep))
    return out


def describe(cfg: SimConfig, seeds: int) -> str:
    t, f, c, ck = cfg.topology, cfg.failures, cfg.costs, cfg.checkpoint

    def years(p: FailureProcess) -> str:
        return "-" if math.isinf(p.mtbf_s) else f"{p.mtbf_s / YEAR:.2f} y"

    days = "until done" if cfg.horizon_s is None else f"{cfg.horizon_s / DAY:g} days"
    mtbf = job_mtbf_s(cfg)
    expect = "" if cfg.horizon_s is None else f", ~{cfg.horizon_s / mtbf:.0f} expected failures"
    dist = f.accelerator.kind + (
        f" k={f.accelerator.shape:g}" if f.accelerator.kind == "weibull" else ""
    )
    return (
        f"job: {t.accelerators} accelerators = {t.hosts} hosts x {t.accelerators_per_host}, "
        f"{t.replicas} replicas of {t.replica_accelerators}"
        + (f", {t.domains} domains of {t.hosts_per_domain} hosts" if t.domains else "")
        + f"; {days}; {seeds} seed(s); step {cfg.workload.step_s:g} s\n"
        f"failures ({dist}): MTBF per accelerator {years(f.accelerator)}, per host "
        f"{years(f.host)}, per domain {years(f.domain)}; job MTBF {mtbf / HOUR:.2f} h{expect}\n"
        f"costs: detect {c.detect_s:g} s, replacement {f.replacement.mean_s:g} s "
        f"({f.replacement.kind}), restart {c.restart_s:g} s, restore {ck.restore_s:g} s, "
        f"save {ck.save_s:g} s (+{ck.persist_s:g} s persist), regroup {c.regroup_s:g} s, "
        f"heal {c.heal_time_s(t.hosts_per_replica):.1f} s, spare swap {c.spare_swap_s:g} s\n"
    )
