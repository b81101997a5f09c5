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
date, machine, versions and command, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

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


class KillPacer:
    """On the launcher's status callback: once the last victim's replacement is in
    a ready generation of WORKERS members that committed `settle` steps, schedule
    the next `kill@step+1`; after the last one settles, stop the job."""

    def __init__(self, kills: int, settle: int) -> None:
        self.left = kills - 1
        self.scheduled = 1
        self.settle = settle
        self.launcher: Launcher | None = None
        self.first_seen: dict[int, int] = {}
        self.done = False

    def __call__(self, st: dict[str, Any]) -> None:
        lc = self.launcher
        if lc is None or self.done or len(lc.fault_log) < self.scheduled:
            return
        victim = lc.fault_log[-1]["member"]
        members = st.get("members") or []
        if len(members) != WORKERS or victim in members or not st.get("ready"):
            return
        step = int(st.get("step", 0))
        if step - self.first_seen.setdefault(int(st["gen"]), step) < self.settle:
            return
        if self.left > 0:
            self.left -= 1
            self.scheduled += 1
            lc.schedule.pending.append(parse_fault(f"kill@{step + 1}"))
            return
        self.done = True
        lc.stop()


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--first", type=int, default=10, help="step of the first kill")
    ap.add_argument("--settle", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = HERE / "runs" / f"jax-recovery-{stamp}"
    cfg = LaunchConfig(
        script=str(ROOT / "examples" / "jax_gpt.py"),
        script_args=[],
        workers=WORKERS,
        min_workers=1,
        replace_delay_s=1.0,
        run_dir=str(run_dir),
        steps=100_000,
        faults=[parse_fault(f"kill@{args.first}")],
        progress=False,
        seed=0,
        extra_env={"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    pacer = KillPacer(args.kills, args.settle)
    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=pacer)
    pacer.launcher = launcher
    timer = threading.Timer(args.timeout, launcher.stop)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    try:
        result = launcher.run()
    finally:
        timer.cancel()
    wall = time.monotonic() - t0
    events = read_events(run_dir)
    recs = [r for r in recoveries(events) if r.gen is not None]
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
    per_kill = format_recoveries(recs, origin)
    per_join = format_joins(js, origin)
    same = check_same_state(events)
    print("\n".join(lines))
    print(per_kill)
    print(per_join)
    print(f"status {result.status}; same state at every generation start: {not same}; {wall:.0f} s")
    if args.no_record:
        return 0
    import jax
    import optax
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    uname = " ".join(os.uname()[i] for i in (0, 2, 4))
    load = os.getloadavg()[0]
    text = (
        f"\n## jax_recovery.py — {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}\n\n"
        f"Machine: `{uname}`, {os.cpu_count()} cores (shared with other work; load average "
        f"{load:.1f} at the end). torch {torch.__version__}, JAX {jax.__version__}, "
        f"optax {optax.__version__}, gloo over loopback. Code: commit {commit}.\n\n"
        f"Command: `.venv/bin/python benchmarks/jax_recovery.py --kills {args.kills}`\n\n"
        "Job: examples/jax_gpt.py defaults (plain JAX/optax GPT: dim 128, 2 layers, 4 heads, "
        "context 64, dropout 0.1; AdamW + global-norm clipping), 4 workers, global batch 32, "
        "micro-batch 4, `--min 1`, replace delay 1 s; each next kill scheduled once the "
        f"previous replacement's generation committed {args.settle} steps.\n\n"
        + "\n".join(lines)
        + "\n\nPer kill (seconds; t0 from job start):\n\n```\n"
        + per_kill
        + "\n```\n\nPer replacement (seconds from its spawn):\n\n```\n"
        + per_join
        + "\n```\n\n"
        f"- same state at every generation start (state_hash): {same or 'yes'}\n"
        f"- run: {wall:.0f} s, status {result.status} (the pacer stops the job once the last "
        "replacement settled), run dir {run_dir.relative_to(ROOT)}\n"
    )
    with open(HERE / "RESULTS.md", "a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
