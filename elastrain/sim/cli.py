"""`elastrain sim`: what goodput will a job get, and what does it cost, per recovery strategy.

The top-level CLI calls `add_arguments(parser)` on its `sim` sub-parser and
`run(args)` to execute. Every flag overrides the preset (or the default: Llama 3
failure rates and costs); see docs/sim.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from elastrain.sim import presets
from elastrain.sim.analytic import checkpoint_interval_s
from elastrain.sim.cluster_trace import (
    compare,
    comparison_table,
    default_cluster,
    load_trace,
    synthetic_trace,
)
from elastrain.sim.config import (
    STRATEGIES,
    StrategyConfig,
    Topology,
)
from elastrain.sim.fromrun import calibrate, replace_costs
from elastrain.sim.metrics import Stat, summarize
from elastrain.sim.options import build_config, describe, strategies
from elastrain.sim.report import (
    interval_chart,
    interval_table,
    scale_chart,
    scale_table,
    strategy_table,
)
from elastrain.sim.svg import render
from elastrain.sim.sweep import run_seeds, sweep_interval, sweep_scale, with_strategy


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    return [int(x) for x in _floats(text)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """All `elastrain sim` flags."""
    a = parser.add_argument
    a("--preset", choices=sorted(presets.PRESETS), help="start from a named job (see docs/sim.md)")
    a(
        "--accelerators",
        type=int,
        help="accelerators in the job (default: the preset's, else 16384)",
    )
    a("--days", type=float, help="simulated wall-clock days (default: the preset's, else 30)")
    a("--steps", type=int, help="train this many steps and report time-to-train (--days caps it)")
    a(
        "--strategy",
        default="all",
        help=f"comma list of {', '.join(STRATEGIES)}, or 'all' (default)",
    )
    a("--seeds", type=int, default=3, help="runs per strategy, seeds SEED..SEED+N-1 (default 3)")
    a("--seed", type=int, default=0, help="first seed (default 0)")
    a("--json", metavar="PATH", help="also write the results as JSON ('-' = stdout only JSON)")

    g = parser.add_argument_group("topology")
    g.add_argument("--accelerators-per-host", type=int)
    g.add_argument("--accelerators-per-replica", type=int, help="one full copy of the state")
    g.add_argument(
        "--hosts-per-domain", type=int, help="hosts per correlated failure domain (0 = none)"
    )

    g = parser.add_argument_group("failures")
    g.add_argument(
        "--interruptions", type=float, help="job failures expected in --days; rescales all rates"
    )
    g.add_argument("--accelerator-mtbf-h", type=float, help="per accelerator, hours")
    g.add_argument("--host-mtbf-h", type=float, help="per host (non-accelerator parts), hours")
    g.add_argument("--domain-mtbf-h", type=float, help="per failure domain, hours")
    g.add_argument(
        "--weibull-shape",
        type=float,
        help="Weibull lifetimes with this shape (default exponential)",
    )
    g.add_argument("--replacement-s", type=float, help="mean time to get a replacement host")
    g.add_argument("--replacement-dist", choices=["fixed", "exponential", "lognormal"])

    g = parser.add_argument_group("recovery costs (seconds)")
    for name in (
        "detect",
        "restart",
        "regroup",
        "heal",
        "spare-swap",
        "save",
        "persist",
        "restore",
    ):
        g.add_argument(f"--{name}-s", type=float)
    g.add_argument("--state-gb", type=float, help="training state of one replica, GB (heal time)")
    g.add_argument("--heal-gbps", type=float, help="per-host heal bandwidth, Gbit/s")
    g.add_argument(
        "--checkpoint-interval",
        help="compute seconds between checkpoints, 'young', 'daly' or 'none'",
    )

    g = parser.add_argument_group("strategy, workload, power")
    g.add_argument(
        "--spare-hosts", type=int, help="hot spares (default for hot-spare: hosts/128, min 1)"
    )
    g.add_argument("--min-replicas", type=int, help="elastic: fewest replicas to run on")
    g.add_argument("--step-s", type=float, help="full-size step time")
    g.add_argument("--microbatches", type=int, help="micro-batches per global batch")
    g.add_argument("--busy-w", type=float, help="watts per computing accelerator")
    g.add_argument("--idle-w", type=float, help="watts per idle accelerator")

    g = parser.add_argument_group("sweeps and plots")
    g.add_argument("--sweep-scale", type=_ints, metavar="N1,N2,..", help="accelerator counts")
    g.add_argument(
        "--sweep-interval",
        metavar="auto|I1,I2,..",
        help="checkpoint intervals (s) for a rigid strategy",
    )
    g.add_argument("--plot-dir", type=Path, help="write SVG charts of the sweeps here")

    g = parser.add_argument_group(
        "shared cluster (elastic vs. rigid jobs under Kueue-style quotas)"
    )
    g.add_argument(
        "--cluster", action="store_true", help="run the shared-cluster comparison instead"
    )
    g.add_argument(
        "--cluster-accelerators", type=int, default=1024, help="cluster size (default 1024)"
    )
    g.add_argument("--cluster-jobs", type=int, default=200, help="synthetic arrivals (default 200)")
    g.add_argument("--cluster-load", type=float, default=0.9, help="offered load (default 0.9)")
    g.add_argument(
        "--cluster-trace", type=Path, help="JSON list of jobs instead of a synthetic trace"
    )

    g = parser.add_argument_group("calibration")
    g.add_argument(
        "--from-run", type=Path, metavar="RUN_DIR", help="replay a recorded elastrain run"
    )


def _stat_json(s: dict[str, Stat]) -> dict[str, dict[str, float]]:
    return {k: {"mean": v.mean, "std": v.std, "n": v.n} for k, v in s.items()}


def run(args: argparse.Namespace) -> int:
    """Execute `elastrain sim`; print tables; return the exit code."""
    out: TextIO = sys.stderr if args.json == "-" else sys.stdout
    try:
        return _run(args, out)
    except ValueError as e:
        print(f"elastrain sim: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, out: TextIO) -> int:
    if args.seeds < 1:
        raise ValueError("--seeds must be >= 1")
    report: dict[str, Any] = {}
    if args.cluster:
        report["cluster"] = _cluster(args, out)
        return _finish(args, report)
    only_calibration = (
        args.from_run is not None and args.preset is None and args.accelerators is None
    )
    if args.from_run is not None:
        report["calibration"] = _calibration(args.from_run, out)
        if only_calibration:
            return _finish(args, report)
    cfg = build_config(args)
    if args.from_run is not None:
        cfg = replace_costs(cfg, calibrate(args.from_run))
        print("projection with the measured step time and recovery costs:", file=out)
    chosen = strategies(args, cfg)
    print(describe(cfg, args.seeds), file=out)
    summaries = {}
    for s in chosen:
        c = with_strategy(cfg, s)
        name = s.kind + (f" ({s.spare_hosts} spares)" if s.spare_hosts else "")
        ck = checkpoint_interval_s(c)
        name += f" ckpt {ck:.0f} s" if math.isfinite(ck) else " no ckpt"
        summaries[name] = summarize(run_seeds(c, args.seeds))
    print(strategy_table(summaries), file=out)
    report["strategies"] = {k: _stat_json(v) for k, v in summaries.items()}
    plot_dir: Path | None = args.plot_dir
    if plot_dir is not None:
        plot_dir.mkdir(parents=True, exist_ok=True)
    scales, intervals = args.sweep_scale, args.sweep_interval
    if plot_dir is not None and not scales and not intervals:  # plots asked for: default sweeps
        scales, intervals = default_scales(cfg.topology), "auto"
    if scales:
        points = sweep_scale(cfg, scales, chosen, args.seeds)
        print("goodput vs. scale:", file=out)
        print(scale_table(points), file=out)
        report["sweep_scale"] = [
            {"accelerators": p.accelerators, "strategy": p.strategy, **_stat_json(p.summary)}
            for p in points
        ]
        if plot_dir is not None:
            path = plot_dir / "goodput_vs_scale.svg"
            path.write_text(render(scale_chart(points)))
            print(f"wrote {path}", file=out)
    if intervals:
        rigid = next((s for s in chosen if s.rigid), StrategyConfig(kind="restart"))
        base = with_strategy(cfg, rigid)
        xs = None if intervals == "auto" else _floats(intervals)
        sweep = sweep_interval(base, xs, args.seeds)
        print(f"goodput vs. checkpoint interval ({rigid.kind}):", file=out)
        print(interval_table(sweep), file=out)
        report["sweep_interval"] = dataclasses.asdict(sweep)
        if plot_dir is not None:
            path = plot_dir / "goodput_vs_interval.svg"
            path.write_text(render(interval_chart(sweep, rigid.kind)))
            print(f"wrote {path}", file=out)
    return _finish(args, report)


def default_scales(topo: Topology) -> list[int]:
    """1/16, 1/4, 1 and 4 times the job, in whole replicas."""
    rep = topo.replica_accelerators
    sizes = {max(rep, round(topo.accelerators * k / rep) * rep) for k in (1 / 16, 1 / 4, 1, 4)}
    return sorted(sizes)


def _calibration(run_dir: Path, out: TextIO) -> dict[str, Any]:
    cal = calibrate(run_dir)
    pred = cal.predict()
    cfg = cal.config()
    sizes = ", ".join(
        f"{n}: {s:.3f} s" for n, s in sorted(cal.step_s_by_size.items(), reverse=True)
    )
    print(
        f"calibration from {run_dir}: {cal.members} members, {cal.steps} steps, training window "
        f"{cal.window_s:.1f} s (+{cal.startup_s:.1f} s start-up), {len(cal.faults)} faults\n"
        f"measured: step by members {sizes}; detect {cfg.costs.detect_s:.2f} s, regroup "
        f"{cfg.costs.regroup_s:.2f} s, join heal {cfg.costs.heal_s:.2f} s (medians)",
        file=out,
    )
    rows = [
        ("ETTR", cal.measured_ettr, pred.ettr),
        ("time goodput", cal.measured_time_goodput, pred.time_goodput),
    ]
    print(f"{'':14}{'measured':>10}{'predicted':>11}{'diff pp':>9}", file=out)
    for name, m, p in rows:
        print(f"{name:14}{m * 100:9.2f}%{p * 100:10.2f}%{(p - m) * 100:9.2f}", file=out)
    print(file=out)
    return {
        "members": cal.members,
        "steps": cal.steps,
        "window_s": cal.window_s,
        "step_s": cal.step_s,
        "faults": [dataclasses.asdict(f) for f in cal.faults],
        "measured": {"ettr": cal.measured_ettr, "time_goodput": cal.measured_time_goodput},
        "predicted": {"ettr": pred.ettr, "time_goodput": pred.time_goodput},
    }


def _cluster(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    cluster = default_cluster(args.cluster_accelerators)
    if args.cluster_trace is not None:
        jobs = load_trace(args.cluster_trace)
    else:
        jobs = synthetic_trace(
            cluster, jobs=args.cluster_jobs, load=args.cluster_load, seed=args.seed
        )
    queues = ", ".join(f"{q.name} {q.nominal}" for q in cluster.queues)
    print(
        f"shared cluster: {cluster.accelerators} accelerators, queues {queues} (one cohort, "
        f"borrowing allowed), {len(jobs)} jobs; the same arrival trace run rigid and elastic",
        file=out,
    )
    results = compare(cluster, jobs)
    print(comparison_table(results), file=out)
    return {
        name: {
            "utilisation": r.utilisation,
            "allocated": r.allocated,
            "makespan_s": r.makespan_s,
            "jobs": [dataclasses.asdict(j) for j in r.jobs],
        }
        for name, r in results.items()
    }


def _finish(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.json:
        text = json.dumps(report, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0
