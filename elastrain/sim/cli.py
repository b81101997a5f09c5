"""`elastrain sim`: what goodput will a job get, and what does it cost, per recovery strategy.

The top-level CLI calls `add_arguments(parser)` on its `sim` sub-parser and
`run(args)` to execute. Every flag overrides the preset (or the default: Llama 3
failure rates and costs); see docs/guide/simulator.md.
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
    a(
        "--preset",
        choices=sorted(presets.PRESETS),
        help="start from a named job (see docs/guide/simulator.md)",
    )
    a("--accelerators", type=int, metavar="N", help="job size (default: the preset's, else 16384)")
    a("--days", type=float, metavar="D", help="simulated days (default: the preset's, else 30)")
    a("--steps", type=int, metavar="S", help="train S steps, report time-to-train (--days caps)")
    a("--strategy", default="all", metavar="LIST", help=f"{', '.join(STRATEGIES)} or all (default)")
    a("--seeds", type=int, default=3, metavar="K", help="runs per strategy (default 3)")
    a("--seed", type=int, default=0, metavar="S", help="first seed (default 0)")
    a("--json", metavar="PATH", help="also write results as JSON ('-': JSON only, on stdout)")

    def group(title: str, flags: list[tuple[str, type, str, str]]) -> None:
        g = parser.add_argument_group(title)
        for flag, kind, metavar, text in flags:
            g.add_argument(flag, type=kind, metavar=metavar, help=text)

    group(
        "topology",
        [
            ("--accelerators-per-host", int, "N", "accelerators per host (8 for GPU servers)"),
            ("--accelerators-per-replica", int, "N", "accelerators holding one copy of the state"),
            ("--hosts-per-domain", int, "N", "hosts per correlated failure domain (0 = none)"),
        ],
    )
    group(
        "failures",
        [
            ("--interruptions", float, "N", "job failures expected in the run; rescales all rates"),
            ("--accelerator-mtbf-h", float, "H", "MTBF of one accelerator, hours"),
            ("--host-mtbf-h", float, "H", "MTBF of one host's other parts, hours"),
            ("--domain-mtbf-h", float, "H", "MTBF of one failure domain, hours"),
            ("--weibull-shape", float, "K", "Weibull lifetimes with shape K (default exponential)"),
            ("--replacement-s", float, "S", "mean time to get a replacement host"),
            ("--replacement-dist", str, "fixed|exponential|lognormal", "its distribution"),
        ],
    )
    group(
        "recovery and checkpoint costs",
        [
            ("--detect-s", float, "S", "failure to detection"),
            ("--restart-s", float, "S", "relaunch of the whole job (rigid strategies)"),
            ("--restore-s", float, "S", "checkpoint load after a restart"),
            ("--regroup-s", float, "S", "elastic: new quorum and process group"),
            ("--heal-s", float, "S", "elastic: fixed part of a join's heal"),
            ("--state-gb", float, "GB", "training state of one replica (adds to the heal)"),
            ("--heal-gbps", float, "GBIT", "per-host heal bandwidth, Gbit/s"),
            ("--spare-swap-s", float, "S", "hot spare put in a failed host's place"),
            ("--save-s", float, "S", "training blocked per checkpoint"),
            ("--persist-s", float, "S", "further time until a checkpoint is durable"),
            ("--checkpoint-interval", str, "S|young|daly|none", "compute time between checkpoints"),
        ],
    )
    group(
        "strategy, workload, power",
        [
            ("--spare-hosts", int, "N", "hot spares (hot-spare default: hosts/128, at least 1)"),
            ("--min-replicas", int, "N", "elastic: fewest replicas the job runs on"),
            ("--step-s", float, "S", "step time with every replica (fixed global batch)"),
            ("--microbatches", int, "M", "micro-batches per global batch (quantizes shrunk steps)"),
            ("--busy-w", float, "W", "watts per computing accelerator"),
            ("--idle-w", float, "W", "watts per idle accelerator"),
        ],
    )
    g = parser.add_argument_group("sweeps and plots")
    g.add_argument("--sweep-scale", type=_ints, metavar="N1,N2,..", help="accelerator counts")
    g.add_argument(
        "--sweep-interval", metavar="auto|S1,S2,..", help="checkpoint intervals, rigid strategy"
    )
    g.add_argument("--plot-dir", type=Path, metavar="DIR", help="write SVG charts here")
    g = parser.add_argument_group("shared cluster: the same arrival trace, rigid vs. elastic")
    g.add_argument("--cluster", action="store_true", help="run the shared-cluster comparison")
    g.add_argument("--cluster-accelerators", type=int, default=1024, metavar="N", help="(1024)")
    g.add_argument("--cluster-jobs", type=int, default=200, metavar="N", help="arrivals (200)")
    g.add_argument(
        "--cluster-load", type=float, default=0.9, metavar="X", help="offered load (0.9)"
    )
    g.add_argument("--cluster-trace", type=Path, metavar="FILE", help="JSON list of jobs to use")
    g = parser.add_argument_group("calibration")
    g.add_argument(
        "--from-run", type=Path, metavar="RUN_DIR", help="replay a recorded elastrain run's faults"
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
        f"{cal.window_s:.1f} s (+{cal.startup_s:.1f} s start-up, {cal.shutdown_s:.1f} s "
        f"shutdown), {len(cal.faults)} faults\n"
        f"measured: mean step by members {sizes}; regroup {cfg.costs.regroup_s:.2f} s, "
        f"join heal {cfg.costs.heal_s:.2f} s (medians)",
        file=out,
    )
    for f in cal.faults:
        print(
            f"  {f.fault:5} {f.member:4} at {f.t:8.2f} s: detect {f.detect_s:.2f} s, "
            f"recover {f.recover_s:.2f} s, replacement {f.replacement_s:.2f} s after detection",
            file=out,
        )
    rows = [
        ("time goodput (ledger)", cal.measured_time_goodput, pred.time_goodput),
        ("throughput goodput", cal.measured_throughput_goodput, pred.throughput_goodput),
        ("ETTR of the window", cal.measured_window_ettr, pred.window_ettr),
    ]
    print(f"{'':22}{'measured':>10}{'predicted':>11}{'diff pp':>9}", file=out)
    for name, m, p in rows:
        print(f"{name:22}{m * 100:9.2f}%{p * 100:10.2f}%{(p - m) * 100:9.2f}", file=out)
    print(file=out)
    return {
        "members": cal.members,
        "steps": cal.steps,
        "window_s": cal.window_s,
        "step_s": cal.step_s,
        "faults": [dataclasses.asdict(f) for f in cal.faults],
        "measured": {name: m for name, m, _ in rows},
        "predicted": {name: p for name, _, p in rows},
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
