"""The long soak (issue 5's acceptance): 30 minutes, at least 150 faults, zero violations.

Run from the repository root:

    .venv/bin/python benchmarks/soak.py [--duration 30m] [--job torch|jax] [--every 8s] [--seed 1]
        [--no-record]

It is `elastrain chaos soak` (see elastrain/chaos/soak.py for what it injects
and checks) with a longer duration and a denser schedule, run as root so that
the disk-filling fault can mount its small tmpfs. It prints the soak's table
and records the run in benchmarks/results/ (unless --no-record) with date,
machine, load and command. The run directory is kept under
benchmarks/runs/soak-<stamp>/ (git-ignored). Takes the duration plus about 4
minutes (start-up, the end's emergency checkpoint, the failure-free reference).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure, target  # noqa: E402

from elastrain.chaos.schedule import KINDS, parse_duration  # noqa: E402
from elastrain.chaos.soak import format_table, soak  # noqa: E402
from elastrain.chaos.soak_jobs import SoakJob  # noqa: E402


def main() -> int:
    bench = Bench("soak.py", __doc__, runs_dir=True)
    ap = bench.ap
    ap.add_argument("--duration", default="30m")
    ap.add_argument("--job", type=SoakJob, choices=list(SoakJob), default=SoakJob.TORCH)
    ap.add_argument("--every", default="8s")
    ap.add_argument("-n", "--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = bench.parse()
    duration, every = parse_duration(args.duration), parse_duration(args.every)
    run_dir = bench.run_dir("soak")
    summary = soak(
        duration, job=args.job, workers=args.workers, every_s=every, kinds=list(KINDS), seed=args.seed,
        run_dir=run_dir,
    )  # fmt: skip
    table = format_table(summary)
    print(table)
    injected = sum(1 for f in summary["faults"] if not f["skipped"])
    targets = [
        target("faults injected", ">= 150", str(injected), injected >= 150),
        target("invariant violations", "0", str(summary["violations"]),
               summary["violations"] == 0),
    ]  # fmt: skip
    print("\n".join(f"- {t.target} {t.threshold}: {t.measured} -> {t.verdict.value}"
                    for t in targets))  # fmt: skip
    bench.finish(
        "",
        [Figure("faults_injected", "faults injected", injected, ""),
         Figure("violations", "invariant violations", summary["violations"], "")],
        targets,
        [f"{args.job.value} job, {args.workers} workers, a fault every {args.every} for "
         f"{args.duration}, seed {args.seed}; run dir {run_dir.name}"],
        ["```", table, "```"],
    )  # fmt: skip
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
