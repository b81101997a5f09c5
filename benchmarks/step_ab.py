"""Steady-state step time of this checkout against an earlier commit, interleaved.

Run from the repository root:

    .venv/bin/python benchmarks/step_ab.py --base 2dbd1be [--repeats 3] [--steps 80] [--no-record]
        [--workers 4] [--job-args "--dim 128 --layers 2 ..."]

A refactor of the worker must not slow the step. Comparing a benchmark run
against one made minutes earlier mixes the change with the shared machine's
drift, so this runs the same job (the versus benchmark's: the demo GPT, 4
workers, global batch 32 in micro-batches of 4, one thread each, no faults)
alternately under the base commit (checked out into a temporary git worktree)
and under this checkout, `--repeats` times each, and compares the medians.
Per run: the median over steps 10.. of the slowest member's `step_s`. Prints a
table and records the run (benchmarks/results/) with date, machine, load and
command (unless --no-record). The worktree is removed at the end.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Bench, Figure, turns  # noqa: E402

SHAPE = ["--dim", "128", "--layers", "2", "--heads", "4", "--block", "64"]
SHAPE += ["--batch", "32", "--micro", "4"]


def step_times(run_dir: Path, first: int) -> list[float]:
    """The slowest member's step time of each committed step >= `first`."""
    by_step: dict[int, float] = {}
    for f in (run_dir / "events").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if e.get("kind") == "step_commit" and e["step"] >= first:
                by_step[e["step"]] = max(by_step.get(e["step"], 0.0), float(e["step_s"]))
    return [by_step[s] for s in sorted(by_step)]


def run_once(
    tree: Path, run_dir: Path, steps: int, workers: int = 4, job_args: list[str] = SHAPE
) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "elastrain.cli", "run", "-n", str(workers), "--steps", str(steps)]
    argv += ["--plain", "--run-dir", str(run_dir), str(tree / "benchmarks/_jobs/elastic_gpt.py")]
    r = subprocess.run([*argv, "--", *job_args], env=env, cwd=tree, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the job under {tree} failed ({r.returncode}):\n{r.stdout[-2000:]}")
    times = step_times(run_dir, 10)
    if len(times) < steps - 10:
        raise SystemExit(f"the job under {tree} committed only {len(times)} measured steps")
    return statistics.median(times)


def main() -> int:
    bench = Bench("step_ab.py", __doc__, repeats=3)
    ap = bench.ap
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--workers", type=int, default=4, help="workers of the job (4)")
    ap.add_argument(
        "--job-args", default=shlex.join(SHAPE),
        help=f"the job's arguments, one string (default: {shlex.join(SHAPE)!r})",
    )  # fmt: skip
    args = bench.parse()
    job_args = shlex.split(args.job_args)
    assert bench.ctx is not None
    head = bench.ctx.code
    base = subprocess.check_output(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True
    ).strip()
    med: dict[str, list[float]] = {"base": [], "this": []}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="step-ab-") as tmp:
        wt = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(wt), base], cwd=ROOT, check=True
        )
        try:
            for rep in range(args.repeats):
                for name, tree in turns([("base", wt), ("this", ROOT)], rep):
                    t0 = time.monotonic()
                    m = run_once(
                        tree, Path(tmp) / f"{name}-{rep}", args.steps, args.workers, job_args
                    )
                    med[name].append(m)
                    loads.append(os.getloadavg()[0])
                    print(f"[{name} #{rep}] median step {m * 1e3:.1f} ms "
                          f"({time.monotonic() - t0:.0f} s, load {loads[-1]:.1f})", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    b, t = statistics.median(med["base"]), statistics.median(med["this"])
    rows = [
        "| code | runs: median step (ms) | median of runs (ms) |",
        "|---|---|---|",
        f"| base {base} | {', '.join(f'{x * 1e3:.1f}' for x in med['base'])} | {b * 1e3:.1f} |",
        f"| this {head} | {', '.join(f'{x * 1e3:.1f}' for x in med['this'])} | {t * 1e3:.1f} |",
    ]
    verdict = f"this / base = {t / b:.3f} ({(t / b - 1) * 100:+.1f}%)"
    table = "\n".join(rows)
    print(table)
    print(verdict)
    bench.finish(
        f"Python {platform.python_version()}",
        [Figure("this_over_base", f"median step, this checkout / base {base}", t / b, ""),
         Figure("step_ms[base]", f"median step, base {base}", b * 1e3, "ms"),
         Figure("step_ms[this]", "median step, this checkout", t * 1e3, "ms")],
        [],
        [f"the demo GPT job, {args.workers} workers, `{shlex.join(job_args)}`, no faults, "
         f"{args.steps} steps, base and this checkout in turns (A B | B A | ...); per run the median over "
         "steps 10.. of the slowest member's step time"],
        table,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
