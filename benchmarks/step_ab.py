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
table and appends it to benchmarks/RESULTS.md with date, machine, load and
command (unless --no-record). The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--workers", type=int, default=4, help="workers of the job (4)")
    ap.add_argument(
        "--job-args", default=shlex.join(SHAPE),
        help=f"the job's arguments, one string (default: {shlex.join(SHAPE)!r})",
    )  # fmt: skip
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    job_args = shlex.split(args.job_args)
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True)
    base = subprocess.check_output(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, text=True
    ).strip()
    load0 = os.getloadavg()[0]
    med: dict[str, list[float]] = {"base": [], "this": []}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="step-ab-") as tmp:
        wt = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(wt), base], cwd=ROOT, check=True
        )
        try:
            for rep in range(args.repeats):
                for name, tree in (("base", wt), ("this", ROOT)):
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
        f"| this {head.strip()} | {', '.join(f'{x * 1e3:.1f}' for x in med['this'])} | "
        f"{t * 1e3:.1f} |",
    ]
    verdict = f"this / base = {t / b:.3f} ({(t / b - 1) * 100:+.1f}%)"
    table = "\n".join(rows)
    print(table)
    print(verdict)
    if not args.no_record:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        cmd = shlex.join([".venv/bin/python", "benchmarks/step_ab.py", *sys.argv[1:]])
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(
                f"\n## step_ab.py — {stamp}\n\n"
                f"Machine: `{platform.system()} {platform.release()} {platform.machine()}`, "
                f"{os.cpu_count()} cores (shared), load average {load0:.1f} at start, "
                f"{min(loads):.1f}-{max(loads):.1f} during. Code: commit {head.strip()} "
                f"against {base}.\n\nCommand: `{cmd}`\n\n"
                f"The demo GPT job, {args.workers} workers, `{shlex.join(job_args)}`, no faults, "
                f"{args.steps} steps, alternating base and this checkout; per run the median "
                "over steps 10.. of the slowest member's step time.\n\n"
                f"{table}\n\n{verdict}\n"
            )
        print("appended to benchmarks/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
