"""False hangs under load: a long elastic job with no real hang, beside CPU hogs.

Issue 18's sub-second hang detection must not call a slow step a hang. This runs
the versus job (the demo GPT, 4 workers, 1 thread each, all-reduce well under
0.1 s) with elastrain's default watchdog settings for --minutes, while
--hogs busy processes (`stress --cpu N` when installed, else Python busy loops,
said in the record) compete for the same cores, and counts what would be a
false positive:

- `watchdog_fired` events (soft-deadline confirmations and hard deadlines),
- `hang_confirmed` events and members removed as `suspected` or
  `lease_expired` (nobody was stopped, so each is a false accusation),
- generations formed after the first (each is a regroup nobody needed);

and, to show the soft deadline was really exercised, how often a member asked
the coordinator about an overdue all-reduce and was told every peer was alive
(`elastrain_hang_checks_total{answer="alive"}` on /metrics), with the
distribution of the all-reduce waits.

    .venv/bin/python benchmarks/false_hangs.py                 # 30 minutes, 2 hogs
    .venv/bin/python benchmarks/false_hangs.py --minutes 2 --no-record   # smoke

Prints a table and records the run in benchmarks/results/ (unless --no-record).
Every process it starts is stopped by PID when it ends, also on error or Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure, target  # noqa: E402

from elastrain.launch.launcher import LaunchConfig, Launcher  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402

JOB = HERE / "_jobs" / "elastic_gpt.py"
SHAPE_ARGS = ["--dim", "128", "--layers", "2", "--heads", "4", "--block", "64"]
SHAPE_ARGS += ["--batch", "32", "--micro", "4"]
"""The versus job's shape (benchmarks/_versus/job.py SHAPE)."""
ALIVE = 'elastrain_hang_checks_total{answer="alive"}'
CONFIRMED = 'elastrain_hang_checks_total{answer="confirmed"}'
STALE = 'elastrain_hang_checks_total{answer="stale"}'


def start_hogs(n: int) -> tuple[list[subprocess.Popen[bytes]], str]:
    """`n` CPU-bound processes; returns them and how they were made."""
    if shutil.which("stress"):
        p = subprocess.Popen(
            ["stress", "--cpu", str(n)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return [p], f"`stress --cpu {n}` (pid {p.pid}, {n} busy workers)"
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]
    return procs, f"{n} x `python -c 'while True: pass'`"


def stop_hogs(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # stress forks its workers into its group
        p.wait()


def scrape(address: str, token: str) -> dict[str, float]:
    """The coordinator's /metrics, as name{labels} -> value."""
    req = urllib.request.Request(
        f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def main() -> int:
    bench = Bench("false_hangs.py", __doc__, runs_dir=True)
    ap = bench.ap
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the job runs (30)")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-hungry processes beside it (2)")
    ap.add_argument("--workers", type=int, default=4)
    args = bench.parse()
    if args.minutes <= 0 or args.hogs < 0 or args.workers < 2:
        ap.error("need --minutes > 0, --hogs >= 0, --workers >= 2")
    run_dir = bench.run_dir("false-hangs")
    cfg = LaunchConfig(
        script=str(JOB),
        script_args=SHAPE_ARGS,
        workers=args.workers,
        min_workers=2,
        run_dir=str(run_dir),
        steps=10**9,
        progress=False,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    last: dict[str, dict[str, float]] = {}
    t_scrape = [0.0]

    def on_status(_st: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - t_scrape[0] >= 5.0 and getattr(launcher, "address", None):
            t_scrape[0] = now
            try:
                last["metrics"] = scrape(launcher.address, launcher.token)
            except OSError:
                pass  # between coordinator restarts; the next scrape counts

    launcher = Launcher(cfg, on_status=on_status)
    hogs, how = start_hogs(args.hogs) if args.hogs else ([], "none")
    loads: list[float] = []
    done = threading.Event()

    def sample_load() -> None:
        while not done.wait(10.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.setdefault("r", launcher.run()))
    t0 = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] job for {args.minutes:g} min beside {how}", flush=True)
    try:
        runner.start()
        end = t0 + args.minutes * 60
        while runner.is_alive() and time.monotonic() < end:
            runner.join(min(60.0, end - time.monotonic()))
            m = last.get("metrics", {})
            print(
                f"[{time.strftime('%H:%M:%S')}] {(time.monotonic() - t0) / 60:.1f} min, step "
                f"{m.get('elastrain_step', 0):.0f}, hang checks alive {m.get(ALIVE, 0):.0f}, "
                f"confirmed {m.get(CONFIRMED, 0):.0f}",
                flush=True,
            )
        t_scrape[0] = 0.0
        on_status({})  # the last scrape, while the coordinator still runs
    finally:
        t_stop = time.time()  # what the stop itself causes (leaves, regroups) is not counted
        launcher.stop()
        runner.join()
        done.set()
        stop_hogs(hogs)
    wall = time.monotonic() - t0
    events = [e for e in read_events(run_dir) if e["t"] < t_stop]

    def of(kind: str) -> list[dict[str, Any]]:
        return [e for e in events if e["kind"] == kind]

    commits = of("step_commit")
    waits = [float(e["allreduce_s"]) for e in commits]
    steps = max((int(e["step"]) for e in commits), default=-1) + 1
    fired = of("watchdog_fired")
    confirmed = of("hang_confirmed")
    accused = [e for e in of("member_removed") if e["reason"] in ("suspected", "lease_expired")]
    gens = of("generation_formed")
    m = last.get("metrics", {})
    alive = m.get(ALIVE, float("nan"))
    stale = m.get(STALE, float("nan"))
    step_s = [float(e["step_s"]) for e in commits]
    rows = [
        ("wall time of the job (min)", f"{wall / 60:.1f}"),
        ("steps committed", str(steps)),
        ("median step (s)", f"{statistics.median(step_s):.3f}" if step_s else "n/a"),
        (
            "all-reduce wait p50 / p99 / max (s), all members",
            f"{quantile(waits, 0.5):.4f} / {quantile(waits, 0.99):.4f} / {max(waits, default=0):.3f}",
        ),
        ("overdue all-reduces asked about, all alive (hang checks)", f"{alive:.0f}"),
        ("hang checks answered stale", f"{stale:.0f}"),
        ("watchdog firings (false: nobody hung)", str(len(fired))),
        ("hangs confirmed (false)", str(len(confirmed))),
        ("members expelled as suspected / lease expired (false)", str(len(accused))),
        ("generations formed after the first", str(max(0, len(gens) - 1))),
        (
            "load average (1 min) min / mean / max",
            f"{min(loads, default=0):.1f} / {statistics.mean(loads) if loads else 0:.1f} / "
            f"{max(loads, default=0):.1f}",
        ),
    ]
    false = len(fired) + len(confirmed) + len(accused)
    w = max(len(r[0]) for r in rows)
    table = "\n".join(
        [f"| {'measure':<{w}} | value |", f"|{'-' * (w + 2)}|-------|"]
        + [f"| {a:<{w}} | {b} |" for a, b in rows]
    )
    judged = target(
        f"false watchdog firings, confirmed hangs and expulsions over {wall / 60:.1f} min "
        f"beside {how}", "0",
        f"{len(fired)} firings, {len(confirmed)} confirmed hangs, {len(accused)} expulsions",
        false == 0 and steps > 0,
    )  # fmt: skip
    print()
    print(table)
    print()
    print(f"Target: {judged.target}: {judged.measured} -> {judged.verdict.value}")
    bench.finish(
        "",
        [Figure("false_alarms", "false watchdog firings + confirmed hangs + expulsions", false, ""),
         Figure("steps", "steps committed", steps, "steps"),
         Figure("job_minutes", "wall time of the job", wall / 60, "min")],
        [judged],
        [f"job: benchmarks/_jobs/elastic_gpt.py (the versus job: demo GPT dim 128, 2 layers, "
         f"global batch 32 in micro-batches of 4), {args.workers} workers, 1 thread each, "
         "elastrain's default watchdog (soft deadline 4 x p99 wait + 0.1 s, hang confirmed "
         "after 0.5 s without heartbeats; hard deadline 8 x the slowest recent wait, 3-60 s); "
         f"beside the job: {how}; run dir {run_dir.name}"],
        table,
    )  # fmt: skip
    return 0 if judged.verdict.value == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
