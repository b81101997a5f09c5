"""Side by side: elastrain against torchrun restarts and torchft, on the same job (issue 6).

Run from the repository root (about 15 minutes on the busy 2-core dev machine):

    .venv/bin/python benchmarks/versus.py            # 3 repeats of every case, records
    .venv/bin/python benchmarks/versus.py --quick    # smoke run: 1 repeat, marked as such

torchft is optional. Install it beside torch without letting pip touch torch:

    .venv/bin/pip install --no-deps torchft
    .venv/bin/pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    .venv/bin/python -c "import torch; print(torch.__version__)"   # must be unchanged

(or `pip install -e .[bench]` then the same torch check). Without it the
torchft rows say "not run: torchft is not installed" and the rest runs.

The job, identical everywhere: the demo's GPT (`elastrain demo`'s size: dim 128,
2 layers, 4 heads, context 64, byte vocabulary) on the Python stdlib's source,
AdamW, global batch 32 in micro-batches of 4, 4 workers, one thread each,
elastrain's seeded global sample order (step s takes positions [32s, 32s+32)).

The cases (each repeated --repeats times, interleaved so that the shared
machine's load drifts over all of them alike):

- elastrain: `Launcher` (what `elastrain run` runs) with the faults below,
  replacement after --replace-delay seconds.
- torchrun: `torch.distributed.run --standalone --max-restarts 5
  --monitor-interval 0.1`, DDP on gloo, checkpoint every --ckpt-every steps
  (rank 0, atomic rename) and resume on start, one store prefix per restart
  round; the killed rank's restarted process waits the replacement delay.
- torchft: its own `DistributedDataParallel` wrapper ("ddp") and its manager
  with one flat all-reduce ("flat"), with the lighthouse's heartbeat timeout at
  its default (5 s, gloo collective timeout 5 s as in torchft's train_ddp.py
  example) and at 1 s (collective timeout 1 s too: with 4 replicas a survivor
  that is not the dead one's ring neighbour waits out the collective timeout, so
  a 1 s heartbeat alone does not shorten the stall). Rows: ddp 5 s, flat 5 s,
  flat 1 s; `--cases all` adds ddp 1 s (left out by default to fit in 15
  minutes). One replica group of one process per worker, set up like torchft's
  example; a replica that dies is restarted after the replacement delay and
  heals from a peer.

The fault schedule, the same for all: SIGKILL of worker 1 once --kill-at steps
are committed, SIGSTOP of worker 2 once --hang-at steps are committed and
SIGCONT --hang-s seconds later; each signal lands a seeded fraction (0.2-0.8,
the same draws for every case of a repeat) of a step time after the step
boundary, as elastrain's own fault schedule does. One failure-free run of the
job (plain DDP under torchrun) gives the loss curve every run is compared with
(the systems agree with it to ~1e-7 before their first fault, which is checked).

A run goes on until step --steps is committed, and past it until the
replacement has trained (at most 40 s after the kill). Measured, per run, from
the systems' own logs (elastrain's events; JSON lines written by the torchrun
and torchft jobs; the arithmetic is in _versus/analysis.py and tested in
tests/test_versus.py; definitions in docs/design/versus.md): step time before the
first fault, kill and hang -> next commit on survivors, torchrun's time back to
the step it had reached, time until the replacement trains, steps recomputed,
samples dropped, wall time to step --steps, goodput against the failure-free
run, the loss curve's largest deviation from the failure-free run's, and
whether the run survived. Prints min / median / max over the repeats, checks
the acceptance targets, and records the run (benchmarks/results/) with
date, machine, load and command (unless --no-record).

The pieces, under benchmarks/_versus/: job.py (the job, the cases, one run's
record), runners.py (one run of each system), procs.py (process bookkeeping and
the fault injector for torchrun and torchft), analysis.py (the arithmetic),
report.py (tables, targets, the reproducibility check's previous run),
torchrun_gpt.py and torchft_gpt.py (the training scripts those systems run).

Run directories: benchmarks/runs/versus-<stamp>/ (git-ignored). Every process
the benchmark starts is stopped by PID when it ends, also on error or Ctrl-C.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_jobs"))
sys.path.insert(0, str(HERE / "_versus"))

from _harness import Bench, Figure, targets_from_rows, turns  # noqa: E402
from analysis import Plan, compare_runs, span, step_time_s  # noqa: E402
from job import (  # noqa: E402
    CASES,
    FT_INSTALL,
    HANG_VICTIM,
    KILL_VICTIM,
    REFERENCE,
    SHAPE,
    WORKERS,
    Run,
    log,
)
from procs import PROCS  # noqa: E402
from report import find_previous, fmt, slug, summarize, table  # noqa: E402
from runners import execute  # noqa: E402

METRICS = (
    # (figure key stem, label, unit, the value of one run)
    ("step_s", "median step before the first fault", "s", None),
    ("kill_to_next_commit_s", "kill -> survivors' next commit", "s", lambda r: r.kill_s),
    ("hang_to_next_commit_s", "hang (--hang-s) -> survivors' next commit", "s", lambda r: r.hang_s),
    ("replacement_training_s", "kill -> replacement's first committed step", "s",
     lambda r: r.repl_s),
    ("steps_recomputed", "steps recomputed per run", "steps", lambda r: float(r.recomputed)),
    ("samples_dropped", "samples dropped per run", "samples", lambda r: float(r.dropped)),
)  # fmt: skip


def case_figures(cases: list[Any], runs: dict[str, list[Run]], kill_at: int) -> list[Figure]:
    """Each case's medians over its repeats, named `<metric>[<case>]` (what the README's
    headline table quotes, see render.py), and how many of its runs lost the state."""
    out = []
    for c in cases:
        rs = runs.get(c.name) or []
        if not rs:
            continue
        for key, label, unit, of in METRICS:
            xs = [step_time_s(r.commits, 2, kill_at) for r in rs] if of is None else map(of, rs)
            m = span(xs)[1]
            out.append(Figure(f"{key}[{c.name}]", f"{label}, {c.name}",
                              None if math.isnan(m) else m, unit))  # fmt: skip
        out.append(Figure(f"state_lost_runs[{c.name}]",
                          f"runs that lost the training state, {c.name}",
                          sum(r.state_lost for r in rs), f"of {len(rs)} runs"))  # fmt: skip
    return out


def main() -> int:
    bench = Bench("versus.py", __doc__, quick="smoke run: 1 repeat")
    ap = bench.ap
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (3; --quick 1)")
    ap.add_argument("--steps", type=int, default=40, help="steps S every run reaches (40)")
    ap.add_argument("--kill-at", type=int, default=15, help="SIGKILL of worker 1 at (15)")
    ap.add_argument("--hang-at", type=int, default=25, help="SIGSTOP of worker 2 at (25)")
    ap.add_argument("--hang-s", type=float, default=6.0, help="SIGCONT after (6 s)")
    ap.add_argument("--replace-delay", type=float, default=2.0, help="replacement delay (2 s)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun checkpoint interval (10)")
    ap.add_argument(
        "--cases", default=None,
        help="'all' or a comma-separated subset of: " + ", ".join(slug(c.name) for c in CASES),
    )  # fmt: skip
    ap.add_argument(
        "--compare",
        default="latest",
        metavar="RUN_DIR",
        help="check reproducibility against this earlier run directory's summary.json "
        "('latest': the newest under benchmarks/runs; 'none': skip)",
    )
    args = bench.parse()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if not 2 < args.kill_at < args.hang_at < args.steps or repeats < 1:
        ap.error("need 2 < --kill-at < --hang-at < --steps and --repeats >= 1")
    cases = [c for c in CASES if c.default]
    if args.cases == "all":
        cases = list(CASES)
    elif args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in CASES if slug(c.name) in want]
        if not cases:
            ap.error(f"no case matches {args.cases!r}")

    import torch

    have_ft = (
        importlib.util.find_spec("torchft") is not None
        and (Path(sys.executable).parent / "torchft_lighthouse").exists()
    )
    ft_why = f"not run: torchft is not installed ({FT_INSTALL})"
    load = bench.load
    assert load is not None and bench.ctx is not None
    load0 = os.getloadavg()
    date, head = bench.ctx.date, bench.ctx.code
    ft_ver = ""
    if have_ft:
        from importlib.metadata import version

        ft_ver = version("torchft")
    base = bench.run_dir("versus")
    S, B = args.steps, SHAPE.global_batch
    log(f"load average {load0[0]:.1f} on {os.cpu_count()} cores; run dirs under {base}")
    log(f"job: demo GPT dim {SHAPE.dim}, {SHAPE.layers} layers, {WORKERS} workers, global "
        f"batch {B}, {S} steps; kill w{KILL_VICTIM}@{args.kill_at}, hang "
        f"w{HANG_VICTIM}@{args.hang_at}/{args.hang_s:g}s, replace delay "
        f"{args.replace_delay:g}s; {repeats} repeat(s) of {len(cases)} case(s)")  # fmt: skip

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # stop: the finally below stops every process by PID

    signal.signal(signal.SIGTERM, on_term)
    runs: dict[str, list[Run]] = {c.name: [] for c in cases}
    ref = Run(REFERENCE.name, 0, False, base / "reference")
    interrupted = False
    try:
        t = time.monotonic()
        plan0 = Plan(S, None, None, args.hang_s, args.replace_delay, 0)
        execute(REFERENCE, plan0, ref, args.ckpt_every)
        log(f"{REFERENCE.name}: {'ok' if ref.survived else 'FAILED ' + ref.why} in "
            f"{time.monotonic() - t:.0f} s, step {fmt(step_time_s(ref.commits, 2, S), 3)} s")  # fmt: skip
        for rep in range(repeats):
            order = turns(cases, rep)
            for c in order:
                if c.system == "torchft" and not have_ft:
                    continue
                plan = Plan(S, args.kill_at, args.hang_at, args.hang_s, args.replace_delay,
                            seed=rep + 1)  # fmt: skip
                run = Run(c.name, rep, True, base / f"{slug(c.name)}-r{rep}")
                t = time.monotonic()
                execute(c, plan, run, args.ckpt_every)
                runs[c.name].append(run)
                log(f"{c.name} #{rep}: {'survived' if run.survived else 'DID NOT SURVIVE: ' + run.why}"
                    f" in {time.monotonic() - t:.0f} s; kill->commit {fmt(run.kill_s)} s, "
                    f"hang->commit {fmt(run.hang_s)} s, replacement {fmt(run.repl_s)} s")  # fmt: skip
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: reporting what ran")
    finally:
        PROCS.stop()
    runtime = bench.elapsed_s()
    report = summarize(args, cases, runs, ref, have_ft, ft_why)
    notes = report["notes"] + [
        f"machine load (1-min load average min / mean / max during the benchmark): "
        f"{load.summary()}; {os.cpu_count()} cores shared with other work",
        f"run dirs {base.relative_to(ROOT) if base.is_relative_to(ROOT) else base}",
    ]
    report["targets"].append([
        "one command, at most 15 minutes", f"{runtime / 60:.1f} min",
        "PASS" if runtime <= 900 else "FAIL",
    ])  # fmt: skip
    # Reproducibility: against the newest earlier full run (or --compare), each
    # case metric must land within the noise the two runs report (see compare_runs).
    prev_path = find_previous(args.compare, base)
    repro_table = ""
    if prev_path is not None and repeats >= 3:
        prev = json.loads(prev_path.read_text())
        rows = compare_runs(prev["stats"], report["stats"])
        bad = [r for r in rows if not r.agrees]
        repro_table = table(
            ["case", "metric", f"previous run ({prev['date']})", "this run", "within noise"],
            [[r.case, r.metric, r.previous, r.current, ("yes: " if r.agrees else "NO: ") + r.how]
             for r in rows],
        )  # fmt: skip
        report["targets"].append([
            f"reproducible: within the noise of this run and {prev_path.parent.name}",
            f"{len(rows) - len(bad)}/{len(rows)} case metrics",
            "PASS" if rows and not bad else "FAIL",
        ])  # fmt: skip
    if not interrupted and repeats >= 3:
        (base / "summary.json").write_text(
            json.dumps({"date": date, "commit": head, "stats": report["stats"]}, indent=1)
        )
    target_table = table(["target", "measured", "verdict"], report["targets"])
    print()
    print(report["main"])
    print()
    print(target_table)
    print()
    print(report["detail"])
    print()
    if repro_table:
        print(repro_table)
        print()
    if interrupted:
        bench.ap.exit(130, "interrupted: not recorded\n")
    if repeats < 3:
        notes.append(f"{repeats} repeat(s): fewer than the 3 the figures are judged over")
    details = [
        report["main"], "", "Per run:", "", report["detail"], "",
        *(["Against the previous run:", "", repro_table, ""] if repro_table else []),
    ]  # fmt: skip
    judged, reported = targets_from_rows(report["targets"])
    bench.finish(
        f"torch {torch.__version__}" + (f", torchft {ft_ver}" if ft_ver else ", torchft missing"),
        case_figures(cases, runs, args.kill_at), judged, reported + notes, details,
        report["anomalies"],
    )  # fmt: skip
    return 0 if not interrupted else 130


if __name__ == "__main__":
    sys.exit(main())
