"""Kill-to-next-commit for the JAX path (issue 9's benchmark row).

Run from the repository root (needs `pip install 'elastrain[jax]'`):

    .venv/bin/python benchmarks/jax_recovery.py [--kills 3] [--no-record]

One `elastrain run` (Python API) of examples/jax_gpt.py (plain JAX + optax
GPT, dim 128, 2 layers, context 64, dropout 0.1, on the demo corpus; global
batch 32, micro-batch 4) on 4 workers, `--min 1`, replace delay 1 s. The first
SIGKILL is `kill@--first`; each next one is scheduled only once the previous
replacement has joined, been healed and its generation committed `--settle`
steps, so recoveries and joins never overlap (as in benchmarks/recovery.py).
From the run's events (`elastrain.observe.recovery`): time from each kill to
the survivors' next committed step with its phases, and each replacement's
join timings (spawn -> registered -> group -> healed -> first step; JAX
workers compile before registering). Prints the tables and appends them, with
date, machine, versions and command, as a record in benchmarks/results/.

`--replica-procs K` (K > 1): the multi-process case (issue 44) instead, JAX
replicas the way MaxText runs slices: examples/jax_multiprocess.py (the same
GPT at dim 64, every weight's rows over a K-process `jax.distributed` mesh) as
2 replicas of K processes. A SIGKILL takes the victim's replica down (its mates
are stopped); the other replica commits its next step; the replica is rebuilt
as K fresh processes healed shard by shard from their twins. Also the steady
step before the first kill against the same model's plain K-process JAX run
without elastrain (benchmarks/_jobs/jax_multiproc_plain.py: one replica, the
whole global batch).
"""

from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure  # noqa: E402
from _kills import KillPacer, run_bounded  # noqa: E402

from elastrain.chaos.injector import register as register_chaos  # noqa: E402
from elastrain.chaos.schedule import parse_fault  # noqa: E402
from elastrain.launch.launcher import LaunchConfig, Launcher  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402
from elastrain.observe.ledger import check_same_state  # noqa: E402
from elastrain.observe.recovery import (  # noqa: E402
    PHASES,
    format_joins,
    format_recoveries,
    joins,
    recoveries,
)

WORKERS = 4


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def steady_step(events: list[dict[str, Any]], first: int) -> float | None:
    """The median time between a member's commits from step 5 up to the first kill
    (every member commits every step; the first one to commit step 0 is taken)."""
    commits = [e for e in events if e["kind"] == "step_commit"]
    if not commits:
        return None
    who = commits[0]["proc"]
    ts = sorted(float(e["t"]) for e in commits if e["proc"] == who and 5 <= e["step"] < first)
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def join_steps(events: list[dict[str, Any]]) -> list[float]:
    """At each generation formed for a join: the survivors' (the member with the
    most commits: never killed) first step in it, `step_s` (what they waited for a
    rebuilt replica's heal and first round; a compile there would show here)."""
    commits = [e for e in events if e["kind"] == "step_commit"]
    if not commits:
        return []
    counts = Counter(e["proc"] for e in commits)
    who = counts.most_common(1)[0][0]
    mine = sorted((e for e in commits if e["proc"] == who), key=lambda e: float(e["t"]))
    out = []
    for g in (e for e in events if e["kind"] == "generation_formed" and e.get("reason") == "join"):
        first = next((e for e in mine if e.get("gen", -1) >= g["gen"]), None)
        if first is not None and first["gen"] == g["gen"]:
            out.append(float(first["step_s"]))
    return out


def plain_step(procs: int) -> float | None:
    """The plain K-process JAX run's median step (benchmarks/_jobs/jax_multiproc_plain.py)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "_jobs" / "jax_multiproc_plain.py"), "--procs", str(procs)],
        capture_output=True, text=True, timeout=900,
    ).stdout  # fmt: skip
    m = re.search(r"median step ([0-9.]+) s", out)
    return float(m.group(1)) if m else None


def main() -> int:
    bench = Bench("jax_recovery.py", __doc__)
    ap = bench.ap
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--first", type=int, default=10, help="step of the first kill")
    ap.add_argument("--settle", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument(
        "--replica-procs", type=int, default=1,
        help="K > 1: 2 JAX replicas of K processes each (examples/jax_multiprocess.py)",
    )  # fmt: skip
    args = bench.parse()
    k = args.replica_procs
    run_dir = bench.run_dir("jax-recovery" if k == 1 else f"jax-replicas-2x{k}")
    workers = WORKERS if k == 1 else 2 * k
    cfg = LaunchConfig(
        script=str(ROOT / "examples" / ("jax_gpt.py" if k == 1 else "jax_multiprocess.py")),
        script_args=[],
        workers=workers,
        replica_procs=k,
        min_workers=1 if k == 1 else k,
        replace_delay_s=1.0,
        run_dir=str(run_dir),
        steps=100_000,
        faults=[parse_fault(f"kill@{args.first}")],
        progress=False,
        seed=0,
        extra_env={"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    # A replacement's JAX import and compile take minutes on a shared machine: only the
    # --timeout bounds a stall here.
    pacer = KillPacer(args.kills, args.first, args.settle, workers, stall_s=args.timeout)
    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=pacer)
    pacer.launcher = launcher
    result, wall = run_bounded(launcher, args.timeout)
    events = read_events(run_dir)
    every = [r for r in recoveries(events) if r.gen is not None]
    # With replicas, the mates' stops and any stall at a rebuilt replica's join are
    # failures of their own in the events: the table's rows are the injected kills.
    recs = every if k == 1 else [r for r in every if r.injected == "kill"]
    stalls = [r.total_s for r in every if r.injected is None and r.fault == "hang" and r.total_s]
    js = joins(events)
    totals = [r.total_s for r in recs if r.total_s is not None]
    lines = [
        "| JAX recovery (SIGKILLs) | median | min | max | n |",
        "|---|---|---|---|---|",
        f"| kill -> next commit (s) | {med(totals)} | {min(totals, default=0):.3f} | "
        f"{max(totals, default=0):.3f} | {len(totals)} |",
    ]
    for ph in PHASES:
        xs = [r.phase(ph) for r in recs if not math.isnan(r.phase(ph))]
        lo, hi = min(xs, default=0.0), max(xs, default=0.0)
        lines.append(f"|   {ph} | {med(xs)} | {lo:.3f} | {hi:.3f} | {len(xs)} |")
    origin = min((float(e["t"]) for e in events), default=None)
    per_kill = format_recoveries(every, origin)
    per_join = format_joins(js, origin)
    same = check_same_state(events)
    case = "" if k == 1 else f"[2x{k} replicas]"
    steps: list[tuple[str, str, float | None]] = []
    if k > 1:
        steps = [
            (f"steady_step_s[2x{k} replicas]", f"steady step, elastrain 2 x {k}",
             steady_step(events, args.first)),
            (f"steady_step_s[plain {k}-process JAX]", f"steady step, plain {k}-process JAX",
             plain_step(k)),
        ]  # fmt: skip
        lines += [f"| {label} (s) | {v:.3f} | | | |" if v is not None else f"| {label} | - | | | |"
                  for _, label, v in steps]  # fmt: skip
        at_join = join_steps(events)
        lines.append(
            f"| survivors' first step at a rebuilt process's join (s) | {med(at_join)} | "
            f"{min(at_join, default=0):.3f} | {max(at_join, default=0):.3f} | {len(at_join)} |"
        )
        lines.append(
            f"| survivors' stall at a rebuilt replica's join (s) | {med(stalls)} | "
            f"{min(stalls, default=0):.3f} | {max(stalls, default=0):.3f} | {len(stalls)} |"
        )
    print("\n".join(lines))
    print(per_kill)
    print(per_join)
    print(f"status {result.status}; same state at every generation start: {not same}; {wall:.0f} s")
    import jax
    import optax
    import torch

    bench.finish(
        f"torch {torch.__version__}, JAX {jax.__version__}, optax {optax.__version__}, "
        "gloo over loopback",
        ([Figure("kill_to_next_commit_s" + case, "JAX job: kill -> next commit, median",
                 statistics.median(totals), "s")] if totals else [])
        + [Figure(key, label, v, "s") for key, label, v in steps]
        + ([Figure(f"join_stall_s{case}", "survivors' stall at a rebuilt replica's join, "
                   "median", statistics.median(stalls), "s")] if stalls else []),
        [],
        [("job: examples/jax_gpt.py defaults (plain JAX/optax GPT: dim 128, 2 layers, 4 heads, "
          "context 64, dropout 0.1; AdamW + global-norm clipping), 4 workers, global batch 32, "
          "micro-batch 4, `--min 1`, replace delay 1 s") if k == 1 else
         (f"job: examples/jax_multiprocess.py defaults (the GPT at dim 64, 2 layers, context "
          f"64, dropout 0.1; adamw, clipped to a global norm of 1.0 over all the replica's "
          f"shards by max_grad_norm; the plain run does not clip) as 2 replicas x {k} processes, every weight's "
          "rows over each replica's `fsdp` mesh, global batch 32, micro-batch 4, replace delay "
          f"1 s; a kill takes its replica down, rebuilt as {k} fresh processes; the steady "
          f"step is the median between commits from step 5 to the first kill, the plain run's "
          f"one replica of {k} processes computing the whole global batch with no elastrain "
          "(benchmarks/_jobs/jax_multiproc_plain.py)"),
         f"each next kill scheduled once the previous replacement's generation committed "
         f"{args.settle} steps",
         *([] if k == 1 else [
             "kill -> next commit: the injected kills only (a kill's replica-mates, stopped "
             "by the launcher, and a stall when the rebuilt replica joins are rows of their own "
             "in the per-failure table: the stall is the survivors' watchdog firing while a "
             "rebuilt process's first step is slow); the survivors' first step at a join: their "
             "first committed step in each generation formed for a join (a rebuilt process's "
             "heal and first round inside it)"]),
         f"same state at every generation start (state_hash): {same or 'yes'}",
         f"run: {wall:.0f} s, status {result.status} (the pacer stops the job once the last "
         f"replacement settled), run dir {run_dir.name}"],
        [*lines, "", "Per kill (seconds; t0 from job start):", "", "```", per_kill, "```", "",
         "Per replacement (seconds from its spawn):", "", "```", per_join, "```"],
        [f"state differs at a generation start: {same}"] if same else [],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
