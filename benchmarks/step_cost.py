"""Steady step time of elastrain against plain DDP at two step sizes (issue 18, item 5).

Run from the repository root:

    .venv/bin/python benchmarks/step_cost.py [--quick] [--no-record] [--sizes 20ms,1s]
        [--reduce-dtype float64|native]

A fixed cost per step (the coordinator's verdict, event lines, the engine's own
Python) hides in a 1 s step and dominates a 20 ms one. For each size this runs a
failure-free elastrain job (_jobs/elastic_gpt.py through the Python API) and plain
`DistributedDataParallel` on gloo (_jobs/ddp_gpt.py: the same model, data
pipeline, global batch, micro-batches and per-micro-batch seeding) alive at once,
taking turns in blocks of steps (D E | E D | ...; the side not running waits idle
between steps: _steady.interleave), and compares:

- cycle time (judged): per rank, the time from one committed step to the next
  within a block (elastrain: `step_commit` to `step_commit`; DDP: end of step to
  end of step), so that everything a step costs counts, the engine's work between
  steps included; median over all ranks and measured steps. Target: elastrain /
  DDP <= 1.05 at both sizes.
- step_s (elastrain's `step_commit.step_s` against DDP's step start to after
  `optimizer.step()`), and CPU seconds per step of all of a side's processes
  (elastrain's coordinator included), the load-robust cross-check.
- where elastrain's step goes, from its `step_commit` events: compute (forward
  and backward, data loading left out), data_s, verdict_s (blocked on the
  coordinator's verdict after computing), allreduce_s, apply_s (the update), the
  engine's own cost between them, and the time between steps outside step_s;
  DDP's last micro-batch (forward, backward and its all-reduce) and optimizer.

Sizes (the demo GPT; one intra-op thread per process): "20ms" is dim 128, 2
layers, context 64, global batch 4 in micro-batches of 1; "1s" is dim 320, 8
layers, context 64, global batch 16 in micro-batches of 1. Two workers per side:
on this 2-core machine the running side has a core per worker (4 workers, as in
recovery.py, would put two busy processes on each core and time the scheduler);
the idle side sleeps in a TCPStore wait.

Prints the tables and records the run (benchmarks/results/) with date, machine,
load, command and commit (unless --no-record). --quick is a smoke run (a few
blocks, no number in it means anything) and never records. Run directories are
kept under benchmarks/runs/step-cost-<stamp>/ (git-ignored). Takes about 5
minutes on the 2-core machine at load average 6 (the 20 ms size 1-1.5, the 1 s
size 3-4; --quick: about 1.5).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_jobs"))

from _harness import (  # noqa: E402
    Bench,
    Figure,
    fmt,
    log,
    med,
    pct,
    table,
    target,
)
from _steady import (  # noqa: E402
    THREAD_KINDS,
    block_stats,
    measured_step,
    pick_sizes,
    steady_anomalies,
    steady_elastrain_vs,
)
from common import Shape, build, param_count  # noqa: E402

WORKERS = 2
TARGET = 0.05
"""The most elastrain's median cycle time may exceed plain DDP's, at each size."""


@dataclass(frozen=True)
class Size:
    """One step size of the comparison and how long it is measured."""

    name: str
    shape: Shape
    warmup: int
    """Steps each side runs before the first block (excluded)."""
    block: int
    """Steps per block (the first of each is excluded: it includes the go)."""
    blocks: int
    """Blocks per side."""


SIZES = {
    "20ms": Size(
        "20ms", Shape(dim=128, layers=2, heads=4, block=64, global_batch=4, micro_batch=1),
        warmup=10, block=20, blocks=12,
    ),
    "1s": Size(
        "1s", Shape(dim=320, layers=8, heads=5, block=64, global_batch=16, micro_batch=1),
        warmup=3, block=4, blocks=10,
    ),
}  # fmt: skip
QUICK = {"20ms": (3, 5, 2), "1s": (1, 3, 2)}
"""--quick's (warmup, block, blocks) per size."""


# ---- the arithmetic (pure: tests/test_step_cost.py) ------------------------------------


def cycle_times(ends: list[dict[int, float]], measured: Callable[[int], bool]) -> list[float]:
    """Per rank (`ends`: step -> the time that rank finished it), the time from step
    s - 1's end to step s's for every measured step s whose predecessor it also
    finished: a step's whole cost, whatever runs between steps included."""
    return [t - r[s - 1] for r in ends for s, t in sorted(r.items()) if measured(s) and s - 1 in r]


def between_steps(
    ends: list[dict[int, float]], step_s: list[dict[int, float]], measured: Callable[[int], bool]
) -> list[float]:
    """Per rank, for every step `cycle_times` counts: its cycle less its own step time
    (`step_s`: step -> seconds, same ranks as `ends`), i.e. what the loop does between
    the end of one step and the start of the next."""
    return [
        t - r[s - 1] - st[s]
        for r, st in zip(ends, step_s, strict=True)
        for s, t in sorted(r.items())
        if measured(s) and s - 1 in r
    ]


def elastrain_ends(commits: list[dict[str, Any]], field: str = "t") -> list[dict[int, float]]:
    """Per member, step -> `field` of its `step_commit` (default the wall time; from
    every commit of the run, so that a measured step's predecessor is there)."""
    by: dict[str, dict[int, float]] = {}
    for e in commits:
        by.setdefault(e["proc"], {})[int(e["step"])] = float(e[field])
    return [by[k] for k in sorted(by)]


BREAKDOWN = ("compute", "data_s", "verdict_s", "allreduce_s", "apply_s", "engine")
"""elastrain's step_s in parts, in the order a step runs them: `compute` (the
micro-batches' forward and backward: compute_s less data_s), `data_s`, `verdict_s`,
`allreduce_s`, `apply_s`, and `engine` (what is left: the engine's own work between
them)."""


def step_parts(e: dict[str, Any]) -> dict[str, float]:
    """One `step_commit` event's step_s in the parts of BREAKDOWN. An event without
    verdict_s and apply_s (an older engine) has them NaN, and `engine` holds them."""
    v = float(e.get("verdict_s", math.nan))
    a = float(e.get("apply_s", math.nan))
    known = e["compute_s"] + e["allreduce_s"] + (0.0 if math.isnan(v) else v)
    known += 0.0 if math.isnan(a) else a
    return {
        "compute": e["compute_s"] - e["data_s"],
        "data_s": e["data_s"],
        "verdict_s": v,
        "allreduce_s": e["allreduce_s"],
        "apply_s": a,
        "engine": e["step_s"] - known,
    }


def breakdown(commits: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each part of BREAKDOWN over `commits`, and of step_s."""
    parts = [step_parts(e) for e in commits]
    out = {k: med([p[k] for p in parts]) for k in BREAKDOWN}
    out["step_s"] = med([e["step_s"] for e in commits])
    return out


def verdict(e: float, d: float, target: float = TARGET) -> str:
    """PASS when elastrain's `e` is at most (1 + target) x DDP's `d`; n/a without both."""
    if not (e > 0 and d > 0):
        return "n/a"
    return "PASS" if e / d <= 1 + target else "FAIL"


def summary_rows(res: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per size: cycle time elastrain / DDP, ratio, verdict; step_s and CPU
    per step, each elastrain against DDP."""
    rows = []
    for name, r in res.items():
        e, d = r["cycle"]["E"], r["cycle"]["D"]
        rows.append(
            [name, f"{fmt(e * 1e3, 1)} / {fmt(d * 1e3, 1)}", fmt(e / d if d > 0 else math.nan),
             pct(e, d), verdict(e, d),
             f"{fmt(r['step_s']['E'] * 1e3, 1)} / {fmt(r['step_s']['D'] * 1e3, 1)} "
             f"({pct(r['step_s']['E'], r['step_s']['D'])})",
             f"{fmt(r['cpu']['E'] * 1e3, 1)} / {fmt(r['cpu']['D'] * 1e3, 1)} "
             f"({pct(r['cpu']['E'], r['cpu']['D'])})",
             str(r["n"]["E"]), str(r["n"]["D"])]
        )  # fmt: skip
    return rows


SUMMARY_HEADER = [
    "step size", "cycle ms, elastrain / DDP (median)", "ratio", "vs DDP",
    f"<= {TARGET:.0%}", "step_s ms", "CPU ms per step, all processes", "n E", "n D",
]  # fmt: skip


def breakdown_rows(res: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per size: the medians of elastrain's parts and DDP's, in ms."""
    rows = []
    for name, r in res.items():
        b = r["breakdown"]
        rows.append(
            [name, fmt(b["step_s"] * 1e3, 2), *(fmt(b[k] * 1e3, 2) for k in BREAKDOWN),
             fmt(r["between"]["E"] * 1e3, 2), fmt(r["step_s"]["D"] * 1e3, 2),
             fmt(r["ddp_last"] * 1e3, 2), fmt(r["ddp_opt"] * 1e3, 2),
             fmt(r["between"]["D"] * 1e3, 2)]
        )  # fmt: skip
    return rows


BREAKDOWN_HEADER = [
    "step size", "E step_s", "E compute", "E data", "E verdict wait", "E all-reduce",
    "E apply", "E engine rest", "E between steps", "D step_s", "D last micro-batch",
    "D optimizer", "D between steps",
]  # fmt: skip


def thread_rows(res: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per size and side: CPU ms per step by thread kind, and their sum."""
    rows = []
    for name, r in res.items():
        for side in ("E", "D"):
            th = r["threads"][side]
            rows.append(
                [name, SIDE_NAMES[side], *(fmt(th[k] * 1e3, 2) for k in THREAD_KINDS),
                 fmt(sum(v for v in th.values() if not math.isnan(v)) * 1e3, 2)]
            )  # fmt: skip
    return rows


SIDE_NAMES = {"E": "elastrain", "D": "DDP"}
THREAD_HEADER = ["step size", "side", *THREAD_KINDS, "sum"]


# ---- one size --------------------------------------------------------------------------


def measure(
    size: Size, warmup: int, block: int, blocks: int, out_dir: Path, job_args: tuple[str, ...]
) -> dict[str, Any]:
    """Run one size's comparison and reduce it to the figures of the tables."""
    st = steady_elastrain_vs(
        size.shape, WORKERS, {"D": []}, warmup, block, blocks, out_dir, 900, job_args
    )
    measured = measured_step(warmup, block)
    ev = st["E"]
    e_ends = elastrain_ends(ev["all_commits"])
    e_cycles = cycle_times(e_ends, measured)
    e_between = between_steps(e_ends, elastrain_ends(ev["all_commits"], "step_s"), measured)
    d_ends = [dict(enumerate(r["end_t"])) for r in st["D"]["ranks"]]
    d_cycles = cycle_times(d_ends, measured)
    d_steps = [dict(enumerate(r["step_s"])) for r in st["D"]["ranks"]]
    d_between = between_steps(d_ends, d_steps, measured)
    e_step = [e["step_s"] for e in ev["commits"]]
    bs = block_stats(st["blocks"], ["E", "D"], block, blocks)
    cycle = {"E": med(e_cycles), "D": med(d_cycles)}
    step_s = {"E": med(e_step), "D": med(st["D"]["step_s"])}
    return {
        "cycle": cycle,
        "step_s": step_s,
        "between": {"E": med(e_between), "D": med(d_between)},
        "cpu": bs["cpu"],
        "threads": bs["threads"],
        "wall": bs["wall"],
        "n": {"E": len(e_cycles), "D": len(d_cycles)},
        "breakdown": breakdown(ev["commits"]),
        "ddp_last": med(st["D"]["last_s"]),
        "ddp_opt": med(st["D"]["opt_s"]),
        "blocks": st["blocks"],
        "block": block,
        "anomalies": steady_anomalies(st, WORKERS, blocks * (block - 1), out_dir),
    }


# ---- main ------------------------------------------------------------------------------


def main() -> int:
    bench = Bench("step_cost.py", __doc__, quick="smoke run: a few blocks")
    ap = bench.ap
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"which sizes ({','.join(SIZES)})")
    ap.add_argument(
        "--reduce-dtype", choices=("float64", "native"), default="float64",
        help="elastrain's TrainerConfig.reduce_dtype (float64, its default; native: a "
        "diagnostic, the float64 widening left out)",
    )  # fmt: skip
    args = bench.parse()
    names = pick_sizes(ap, args.sizes, SIZES)

    t_wall0 = time.time()
    load = bench.load
    assert load is not None
    base = bench.run_dir("step-cost")
    cores = os.cpu_count()
    log(f"load average now {os.getloadavg()[0]:.1f} on {cores} cores; run dirs under {base}")

    import torch

    torch.set_num_threads(1)
    res: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for name in names:
        size = SIZES[name]
        warmup, block, blocks = (
            QUICK[name] if args.quick else (size.warmup, size.block, size.blocks)
        )
        model, _, _ = build(size.shape)
        n_params = param_count(model)
        del model
        sh = size.shape
        log(f"{name}: demo GPT dim {sh.dim}, {sh.layers} layers, context {sh.block} "
            f"({n_params:,} parameters), global batch {sh.global_batch} in micro-batches of "
            f"{sh.micro_batch}, {WORKERS} workers per side; {warmup} warm-up steps, then "
            f"{blocks} blocks of {block} steps per side")  # fmt: skip
        t = time.monotonic()
        t_w = time.time()
        try:
            res[name] = measure(
                size, warmup, block, blocks, base / name, ("--reduce-dtype", args.reduce_dtype)
            )
        except (RuntimeError, TimeoutError) as err:
            print(f"\nFATAL: the {name} comparison failed: {err}; nothing recorded.")
            load.stop()
            return 1
        r = res[name]
        log(f"{name} done in {time.monotonic() - t:.0f} s: cycle elastrain "
            f"{fmt(r['cycle']['E'] * 1e3, 1)} ms, DDP {fmt(r['cycle']['D'] * 1e3, 1)} ms "
            f"({pct(r['cycle']['E'], r['cycle']['D'])})")  # fmt: skip
        notes.append(
            f"{name}: demo GPT dim {sh.dim}, {sh.layers} layers, {sh.heads} heads, context "
            f"{sh.block} ({n_params:,} parameters, AdamW), global batch {sh.global_batch} in "
            f"micro-batches of {sh.micro_batch}; {warmup} warm-up steps, then {blocks} blocks "
            f"of {block} steps per side; {time.monotonic() - t:.0f} s at load average "
            f"{load.mean(t_w, time.time()):.1f}; run dir {(base / name).relative_to(ROOT)}"
        )

    t1 = table(SUMMARY_HEADER, summary_rows(res))
    t2 = table(BREAKDOWN_HEADER, breakdown_rows(res))
    t_threads = table(THREAD_HEADER, thread_rows(res))
    t3 = table(
        ["size", "block", "side", "wall per step (ms)", "CPU ms per step", "load avg (1 min)"],
        [[name, str(b["k"]), b["side"], fmt((b["t1"] - b["t0"]) / r["block"] * 1e3, 1),
          fmt(b["cpu_s"] / r["block"] * 1e3, 1),
          fmt(load.mean(b["t0"] - 2, b["t1"] + 2), 1)]
         for name, r in res.items() for b in r["blocks"]],
    )  # fmt: skip
    notes += [
        f"elastrain's reduce_dtype: {args.reduce_dtype}"
        + (" (its default)" if args.reduce_dtype == "float64" else " (a diagnostic run)"),
        f"{WORKERS} workers per side, torch.set_num_threads(1) in every process, gloo over "
        "loopback; sides alive together, taking turns in blocks (D E | E D | ...). Cycle: "
        "per rank, end of one step to end of the next within a block (the first step of "
        "each block left out); step_s: elastrain's step_commit.step_s, DDP's step start "
        "to after optimizer.step(). Breakdown: medians of each part over every member's "
        "measured steps (they need not add up to the median step_s); between steps: the "
        "median over steps of cycle - step_s (elastrain: the loop outside step_s, i.e. the "
        "trainer's yield, the commit hook, the protocol's next action).",
        "CPU by thread: utime + stime of each thread of the side's processes over each "
        "block (/proc/<pid>/task), by its native name: main (a worker's training thread), "
        "gloo (gloo's transport and work threads), el-* (elastrain's own worker threads: "
        "the quorum request, heartbeats, the collective waiter, the state hash, the energy "
        "sampler, the graveyard), other (unnamed threads), coordinator (all of its "
        "threads); per step, the mean over every block but the last (one clock tick is "
        "10 ms: a median of blocks would round small threads to 0 or a tick).",
        f"machine load (1-min load average, {cores} cores): "
        f"{load.mean(t_wall0, time.time()):.1f} mean over the benchmark",
    ]
    anomalies = [a for r in res.values() for a in r["anomalies"]]
    print()
    print("\n\n".join([t1, t2, t_threads, t3]))
    print()
    details = [t1, "", "Where a step goes (median ms):", "", t2, "",
               "CPU ms per step by thread, all processes of the side (mean over every block "
               "but the last):", "", t_threads, "", t3]  # fmt: skip
    figures, targets = [], []
    for name, r in res.items():
        e, d = r["cycle"]["E"], r["cycle"]["D"]
        ratio = e / d if d > 0 else math.nan
        figures += [
            Figure(f"cycle_ms[{name}, elastrain]", f"cycle, elastrain, {name} steps", e * 1e3, "ms"),
            Figure(f"cycle_ms[{name}, DDP]", f"cycle, DDP, {name} steps", d * 1e3, "ms"),
            Figure(f"elastrain_over_ddp[{name}]", f"cycle elastrain / DDP, {name} steps", ratio, ""),
        ]  # fmt: skip
        targets.append(target(
            f"step cost vs DDP, {name} steps (reduce_dtype {args.reduce_dtype})",
            f"<= {TARGET:.0%}", pct(e, d), {"PASS": True, "FAIL": False}.get(verdict(e, d)),
        ))  # fmt: skip
    bench.finish(f"torch {torch.__version__}, gloo over loopback", figures, targets, notes,
                 details, anomalies)  # fmt: skip
    if args.quick:
        print("\n(--quick smoke run: not recorded, and no number in it means anything)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
