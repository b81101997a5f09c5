"""The long soak (issue 5's acceptance): 30 minutes, at least 150 faults, zero violations.

Run from the repository root:

    .venv/bin/python benchmarks/soak.py [--duration 30m] [--job torch|jax] [--every 8s] [--seed 1]
        [--no-record]

It is `elastrain chaos soak` (see elastrain/chaos/soak.py for what it injects
and checks) with a longer duration and a denser schedule, run as root so that
the disk-filling fault can mount its small tmpfs. It prints the soak's table
and appends it to benchmarks/RESULTS.md (unless --no-record) with date,
machine, load and command. The run directory is kept under
benchmarks/runs/soak-<stamp>/ (git-ignored). Takes the duration plus about 4
minutes (start-up, the end's emergency checkpoint, the failure-free reference).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from elastrain.chaos.schedule import KINDS, parse_duration  # noqa: E402
from elastrain.chaos.soak import format_table, soak  # noqa: E402
from elastrain.chaos.soak_jobs import SoakJob  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", default="30m")
    ap.add_argument("--job", type=SoakJob, choices=list(SoakJob), default=SoakJob.TORCH)
    ap.add_argument("--every", default="8s")
    ap.add_argument("-n", "--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    duration, every = parse_duration(args.duration), parse_duration(args.every)
    run_dir = HERE / "runs" / time.strftime("soak-%Y%m%d-%H%M%S")
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    summary = soak(
        duration, job=args.job, workers=args.workers, every_s=every, kinds=list(KINDS), seed=args.seed,
        run_dir=run_dir,
    )  # fmt: skip
    wall = time.monotonic() - t0
    table = format_table(summary)
    print(table)
    injected = sum(1 for f in summary["faults"] if not f["skipped"])
    verdict = (
        f"- at least 150 faults: {injected} -> {'PASS' if injected >= 150 else 'FAIL'}\n"
        f"- zero invariant violations: {summary['violations']} -> "
        f"{'PASS' if summary['violations'] == 0 else 'FAIL'}"
    )
    print(verdict)
    if not args.no_record:
        uname = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
        command = ".venv/bin/python benchmarks/soak.py " + " ".join(
            shlex.quote(a) for a in sys.argv[1:]
        )
        res = HERE / "RESULTS.md"
        with res.open("a") as f:
            f.write(
                f"\n## soak.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                f"Machine: `{uname}`, {os.cpu_count()} cores (shared; load average "
                f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end). "
                f"Wall time {wall / 60:.1f} min.\n\nCommand: `{command.strip()}`\n\n"
                f"```\n{table}\n```\n\n{verdict}\n"
            )
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
