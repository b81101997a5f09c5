"""Data at speed (issue 17): a decode-heavy job with and without prefetch, and
plain DDP with a DataLoader, side by side.

Run from the repository root:

    .venv/bin/python benchmarks/data.py [--world 1] [--num-workers 1] [--steps 100]
        [--repeats 2] [--quick] [--no-record]

The job (benchmarks/_jobs/decode.py): an MLP (dim 128, 3 layers of 1024,
global batch 256 in micro-batches of 32) on a dataset whose every sample is
"decoded" by a pure-Python loop (it holds the GIL, like most Python decode and
augmentation code), sized so that decoding a step's samples costs about what
computing them does. Three sides, `--world` members/ranks each, one torch
thread each:

  elastic-inline    elastrain, samples loaded on the training thread (the
                    default: num_workers 0, prefetch_steps 0)
  elastic-prefetch  elastrain, `--num-workers` data worker processes per
                    member, prefetch_steps 1 (the next step's micro-batches
                    load while this one computes)
  ddp-loader        torchrun + DistributedDataParallel, a DataLoader with
                    `--num-workers` workers per rank (prefetch_factor 2) over
                    the same order and micro-batch assignment

The sides run one after the other, alternating, `--repeats` times. Per run:
the wall time per step from the end of step 10 to the end of the last one
(elastrain: the last member's step_commit; DDP: rank 0's end of step, which
its all-reduce synchronises), and the median time a step waited for its data
(elastrain: step_commit's data_s, the slowest member; DDP: time in the
DataLoader's next()). Verdict: elastic-prefetch within 5% of ddp-loader
(median of runs). Prints a table and appends it to benchmarks/RESULTS.md with
date, machine, load, command and commit (unless --no-record; --quick never
records: tiny sizes to check that it works).

The defaults fit a 2-core machine: one member (or rank) and one data worker
use both cores, so prefetch can hide the decode behind the compute (up to 2x
over inline loading). Decode is CPU work wherever it runs: with more members
than cores / (1 + workers), every side is CPU-bound and prefetch gains
nothing; on a bigger machine use e.g. --world 4 --num-workers 2. About 4
minutes with the defaults (6 runs: 100 steps of 45-90 ms plus 10-20 s of
start-up each).
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "benchmarks" / "_jobs"
sys.path.insert(0, str(JOBS))

from decode import Settings  # noqa: E402

WARM = 10
"""Steps left out at the start of each run (start-up, first allocations)."""


@dataclass(frozen=True)
class Measured:
    step_s: float
    """Wall time per step after the warm-up."""
    data_s: float
    """Median time a step waited for its data."""
    wall_s: float
    """The whole run, start-up included."""


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def per_step(ends: list[float], warm: int) -> float:
    if len(ends) <= warm + 1:
        raise SystemExit(f"only {len(ends)} steps measured; use more --steps")
    return (ends[-1] - ends[warm]) / (len(ends) - 1 - warm)


def measure_elastic(
    s: Settings, world: int, steps: int, workers: int, prefetch: int, run_dir: Path, warm: int
) -> Measured:
    """One elastrain run; per step: the last member's commit and the slowest data wait."""
    argv = [
        sys.executable,
        "-m",
        "elastrain.cli",
        "run",
        "-n",
        str(world),
        "--steps",
        str(steps),
        "--plain",
        "--run-dir",
        str(run_dir),
        str(JOBS / "elastic_data.py"),
        "--",
        "--num-workers",
        str(workers),
        "--prefetch-steps",
        str(prefetch),
        *s.argv(),
    ]
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env(), cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(
            f"elastrain run failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        )
    end: dict[int, float] = {}
    wait: dict[int, float] = {}
    for f in (run_dir / "events").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("kind") == "step_commit":
                k = int(e["step"])
                end[k] = max(end.get(k, 0.0), float(e["t"]))
                wait[k] = max(wait.get(k, 0.0), float(e.get("data_s", 0.0)))
    ends = [end[k] for k in sorted(end)]
    data = [wait[k] for k in sorted(wait) if k >= warm]
    return Measured(per_step(ends, warm), statistics.median(data), wall)


def measure_ddp(
    s: Settings, world: int, steps: int, workers: int, out: Path, warm: int
) -> Measured:
    """One torchrun + DDP run with a DataLoader of `workers` workers per rank."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(JOBS / "ddp_data.py"),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--num-workers",
        str(workers),
        *s.argv(),
    ]
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env(), cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    got = json.loads(out.read_text())
    return Measured(per_step(got["end_t"], warm), statistics.median(got["data_s"][warm:]), wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1, help="members (elastrain) / ranks (DDP)")
    ap.add_argument("--num-workers", type=int, default=1, help="data workers per member/rank")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check it works")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    Settings.add_arguments(ap)
    a = ap.parse_args()
    s = Settings.of(a)
    steps, warm = a.steps, WARM
    if a.quick:
        s = Settings(dim=32, hidden=64, layers=2, decode_iters=500, samples=4096, batch=16, micro=4)
        steps, warm, a.repeats = 12, 3, 1
    head = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True
        ).stdout.strip()
        or "unknown"
    )
    load0 = os.getloadavg()[0]
    sides = {
        "elastic-inline": lambda d: measure_elastic(s, a.world, steps, 0, 0, d, warm),
        "elastic-prefetch": lambda d: measure_elastic(s, a.world, steps, a.num_workers, 1, d, warm),
        "ddp-loader": lambda d: measure_ddp(s, a.world, steps, a.num_workers, d / "ddp.json", warm),
    }
    runs: dict[str, list[Measured]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        for rep in range(a.repeats):
            for name, run in sides.items():
                d = Path(tmp) / f"{name}-{rep}"
                d.mkdir()
                m = run(d)
                runs[name].append(m)
                print(
                    f"[{name} #{rep}] {m.step_s * 1e3:.1f} ms/step, data wait "
                    f"{m.data_s * 1e3:.1f} ms ({m.wall_s:.0f} s, load "
                    f"{os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    med = {k: statistics.median(m.step_s for m in v) for k, v in runs.items()}
    rows = [
        "| side | runs: ms per step | median ms/step | median data wait (ms) | vs ddp-loader |",
        "|---|---|---|---|---|",
    ]
    for k, v in runs.items():
        rows.append(
            f"| {k} | {', '.join(f'{m.step_s * 1e3:.1f}' for m in v)} | "
            f"{med[k] * 1e3:.1f} | "
            f"{statistics.median(m.data_s for m in v) * 1e3:.1f} | "
            f"{med[k] / med['ddp-loader']:.3f} |"
        )
    ratio = med["elastic-prefetch"] / med["ddp-loader"]
    gain = med["elastic-inline"] / med["elastic-prefetch"]
    verdict = (
        f"elastic-prefetch / ddp-loader = {ratio:.3f} (bar: <= 1.05) -> "
        f"{'PASS' if ratio <= 1.05 else 'FAIL'}; prefetch speed-up over inline "
        f"loading: {gain:.2f}x"
    )
    table = "\n".join(rows)
    print(table)
    print(verdict)
    if a.quick or a.no_record:
        if a.quick:
            print("(--quick: a smoke run; not recorded)")
        return 0
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = shlex.join([".venv/bin/python", "benchmarks/data.py", *sys.argv[1:]])
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(
            f"\n## data.py — {stamp} (commit {head})\n\n"
            f"Machine: `{platform.system()} {platform.release()} {platform.machine()}`, "
            f"{os.cpu_count()} cores (shared), load average {load0:.1f} at start. "
            f"Python {platform.python_version()}.\n\nCommand: `{cmd}`\n\n"
            f"{a.world} members/ranks, {a.num_workers} data workers each (prefetch side and "
            f"DDP), {steps} steps (first {warm} left out), {a.repeats} runs per side, "
            f"alternating. Job: {s}.\n\n{table}\n\n{verdict}\n"
        )
    print("appended to benchmarks/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
