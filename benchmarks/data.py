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

The sides run one after the other, in turns (A B C | C B A | ...), `--repeats` times. Per run:
the wall time per step from the end of step 10 to the end of the last one
(elastrain: the last member's step_commit; DDP: rank 0's end of step, which
its all-reduce synchronises), and the median time a step waited for its data
(elastrain: step_commit's data_s, the slowest member; DDP: time in the
DataLoader's next()). Verdict: elastic-prefetch within 5% of ddp-loader
(median of runs). Prints a table and records the run (benchmarks/results/) with
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

import json
import os
import platform
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Bench, Figure, target, turns  # noqa: E402
from decode import Settings  # noqa: E402

BAR = 1.05
"""elastic-prefetch's step time at most this times DDP's DataLoader's."""

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
    bench = Bench("data.py", __doc__, quick="tiny sizes, to check it works", repeats=2)
    ap = bench.ap
    ap.add_argument("--world", type=int, default=1, help="members (elastrain) / ranks (DDP)")
    ap.add_argument("--num-workers", type=int, default=1, help="data workers per member/rank")
    ap.add_argument("--steps", type=int, default=100)
    Settings.add_arguments(ap)
    a = bench.parse()
    s = Settings.of(a)
    steps, warm = a.steps, WARM
    if a.quick:
        s = Settings(dim=32, hidden=64, layers=2, decode_iters=500, samples=4096, batch=16, micro=4)
        steps, warm, a.repeats = 12, 3, 1
    sides = {
        "elastic-inline": lambda d: measure_elastic(s, a.world, steps, 0, 0, d, warm),
        "elastic-prefetch": lambda d: measure_elastic(s, a.world, steps, a.num_workers, 1, d, warm),
        "ddp-loader": lambda d: measure_ddp(s, a.world, steps, a.num_workers, d / "ddp.json", warm),
    }
    runs: dict[str, list[Measured]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        for rep in range(a.repeats):
            for name, run in turns(list(sides.items()), rep):
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
    ok = ratio <= BAR
    verdict = (
        f"elastic-prefetch / ddp-loader = {ratio:.3f} (bar: <= {BAR:g}) -> "
        f"{'PASS' if ok else 'FAIL'}; prefetch speed-up over inline loading: {gain:.2f}x"
    )
    table = "\n".join(rows)
    print(table)
    print(verdict)
    figures = [
        *(Figure(f"step_ms[{k}]", f"median step, {k}", v * 1e3, "ms") for k, v in med.items()),
        Figure("prefetch_over_ddp_loader", "elastic-prefetch / ddp-loader", ratio, ""),
        Figure("prefetch_speedup", "prefetch speed-up over inline loading", gain, "x"),
    ]
    bench.finish(
        f"Python {platform.python_version()}", figures,
        [target("elastic-prefetch / ddp-loader step time", f"<= {BAR:g}", f"{ratio:.3f}", ok)],
        [f"{a.world} members/ranks, {a.num_workers} data workers each (prefetch side and DDP), "
         f"{steps} steps (first {warm} left out), {a.repeats} runs per side, in turns (A B C | C B A | ...). "
         f"Job: {s}."],
        table,
    )  # fmt: skip
    if a.quick:
        print("(--quick: a smoke run; not recorded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
