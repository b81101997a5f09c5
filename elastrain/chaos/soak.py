"""`elastrain chaos soak`: train under a random mix of faults and check every invariant.

    elastrain chaos soak --duration 3m [--job torch|jax] [-n 3] [--every 9s]
        [--kinds kill,hang,...] [--seed 0] [--run-dir DIR]

It runs the `--job`'s script (`elastrain.chaos.soak_jobs`: a small MLP,
checkpointed every 20 steps, in PyTorch, `soak_job.py`, the default, or in
JAX, `soak_job_jax.py`; the same data, data order and checks for both), each
worker on a simulated host of its own (a network namespace, see
`elastrain.chaos.netns`, so that a `cut` can take one off the network), with a
seeded schedule of faults, one every `--every` seconds (with jitter), drawn
so that each kind in `--kinds` comes up (each damaged checkpoint comes right
after a kill of every worker and before their replacements start, so the
resume path must notice the damage). The last quarter of the duration is
quiet so every fault has time to recover; the clock starts at the job's first
committed step. At the end of the duration the soak waits, while any fault has
neither recovered nor used up its bound (a loaded machine recovers slower), so
that every fault is judged. Then the job is ended with a preemption notice, and the same job runs failure-free, as one member, for as many steps:
the reference. Checks, each a count of violations:

- same state: all members hash-identical at every generation start;
- exactly-once: every committed step consumed its samples exactly once
  (steps rolled back by a resume from an older checkpoint are counted apart);
- math: the loss curve equals the reference's within 1e-5 relative;
- leaks: each long-lived worker's and the coordinator's file descriptors and
  threads, sampled every 2 s after a warm-up, stay bounded (the peak of the
  last third against the peak of the first third),
  and no process, fill file or mount is left at the end;
- recovery: after every fault the job commits a step beyond the last one
  committed before it, within the kind's bound (60 s, plus a few times the
  run's measured process start-up for faults that need new processes).

It prints a table (faults by kind, recoveries, median and max recovery) and
ends with `violations: N`; the exit status is 0 only when N is 0. Everything
lands in the run directory, with `soak.json`. `fill-disk` needs root to mount
a small tmpfs for the checkpoints and `cut` needs root and iproute2 for the
namespaces; without them those kinds are left out and the table says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.chaos.netns import missing_requirement
from elastrain.chaos.schedule import KINDS, Fault, parse_duration
from elastrain.chaos.soak_jobs import SoakJob, expected_ids
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve
from elastrain.observe.stragglers import THRESHOLD as STRAGGLER_THRESHOLD
from elastrain.observe.stragglers import WINDOW as STRAGGLER_WINDOW
from elastrain.observe.stragglers import StepRatio, step_ratios, straggler_episodes
from elastrain.threads import TRANSIENT_THREADS

DEFAULT_KINDS = tuple(KINDS)
BOUND_S = 60.0
"""Seconds within which the job must make new progress after a fault, plus, for
faults that need new processes (every worker killed, the coordinator killed),
`STARTUPS` times the p90 of the run's own measured process start-up (spawn to
registered): on a loaded machine `import torch` alone can take tens of seconds."""
FAILURE_KINDS = frozenset({"kill", "hang", "term", "cut", "kill-all", "kill-coordinator"})
"""Injected kinds that make a process fail: each should be recognised as a failure."""
STARTUPS = {"kill-all": 3.0, "corrupt-ckpt": 3.0, "truncate-ckpt": 3.0, "kill-coordinator": 2.0}
FD_SLACK, THREAD_SLACK = 16, 8
QUIET_TAIL = 0.25
WARMUP_S = 20.0
"""Leak samples of a process's first seconds (imports, first connections) are not judged."""
REL_TOL = 1e-5


@dataclass
class Sampler:
    """Samples fds and threads of the job's processes every `period_s` (own thread)."""

    pids: Any
    """Callable returning {name: pid} of the processes to sample now."""
    period_s: float = 2.0
    samples: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, pid in dict(self.pids()).items():
                got = _fds_threads(pid)
                if got is not None:
                    self.names[pid] = name
                    self.samples.setdefault(pid, []).append((time.monotonic(), *got))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def violations(self) -> list[str]:
        out = []
        for pid, all_xs in self.samples.items():
            xs = [x for x in all_xs if x[0] - all_xs[0][0] >= WARMUP_S]
            if len(xs) < 6:
                continue
            # Peaks, not levels: a coordinator's threads and sockets follow the
            # number of connected workers, which faults change; a leak raises
            # the peak steadily.
            third = len(xs) // 3
            first, last = xs[:third], xs[-third:]
            fd0, fd1 = max(x[1] for x in first), max(x[1] for x in last)
            th0, th1 = max(x[2] for x in first), max(x[2] for x in last)
            who = f"{self.names[pid]} (pid {pid})"
            if fd1 - fd0 > FD_SLACK:
                out.append(f"{who}: open files grew from {fd0} to {fd1}")
            if th1 - th0 > THREAD_SLACK:
                out.append(f"{who}: threads grew from {th0} to {th1}")
        return out


def _fds_threads(pid: int) -> tuple[int, int] | None:
    """Open files and threads of `pid`, the threads that wait out an abandoned
    collective (`threads.TRANSIENT_THREADS`) left out: under a burst of faults there
    are many of them for up to the op timeout, and they are bounded, not a leak."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue  # the thread ended meanwhile
            threads += name not in TRANSIENT_THREADS
    except OSError:
        return None
    return fds, threads


def plan_faults(kinds: list[str], duration_s: float, every_s: float, seed: int) -> list[Fault]:
    """A seeded mix: one fault every `every_s` (+-30%) in the first 80% of the
    duration, kinds dealt from a shuffled deck so each kind comes up."""
    rng = random.Random(seed)
    out: list[Fault] = []
    deck: list[str] = []
    # Checkpoint damage brings its own kill-all; a deck with damage in it does
    # not deal another (each kill-all restarts every process: the costliest fault).
    if {"corrupt-ckpt", "truncate-ckpt"} & set(kinds):
        kinds = [k for k in kinds if k != "kill-all"]
    t = every_s
    end = duration_s * (1 - QUIET_TAIL)
    while t < end:
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        kind = deck.pop()
        if kind == "hang":
            out.append(Fault("hang", at_s=t, duration_s=round(rng.uniform(2, 6), 1)))
        elif kind == "cut":
            out.append(Fault("cut", at_s=t, duration_s=round(rng.uniform(3, 8), 1)))
        elif kind == "slow":
            out.append(Fault("slow", at_s=t, delay_s=0.05, steps=rng.randint(20, 60)))
        elif kind == "fill-disk":
            out.append(Fault("fill-disk", at_s=t, duration_s=round(rng.uniform(3, 6), 1)))
        elif kind in ("corrupt-ckpt", "truncate-ckpt"):
            # Kill everyone, then damage the newest checkpoint before their
            # replacements start (1 s later): the resume must skip it.
            out.append(Fault("kill-all", at_s=t))
            out.append(Fault(kind, at_s=t + 0.2))
        else:
            out.append(Fault(kind, at_s=t))
        t += every_s * rng.uniform(0.7, 1.3)
    return out


def startup_p90(events: list[dict[str, Any]]) -> float:
    """p90 of the seconds from a worker's spawn to its registration in this run."""
    spawned = {e["member"]: float(e["t"]) for e in events if e["kind"] == "worker_spawned"}
    took = sorted(
        float(e["t"]) - spawned[e["member"]]
        for e in events
        if e["kind"] == "member_registered" and e.get("member") in spawned
        and float(e["t"]) >= spawned[e["member"]]
    )  # fmt: skip
    return took[int(0.9 * (len(took) - 1))] if took else 0.0


def pending_recoveries(recs: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The recoveries (`recoveries`) that cannot be judged yet at `now`: no progress
    after the fault so far, and its bound is not up."""
    return [
        r
        for r in recs
        if not r["skipped"] and r["recovery_s"] is None and now - r["t"] < r["bound_s"]
    ]


def judge_recoveries(recs: list[dict[str, Any]], end_t: float) -> tuple[list[str], list[str]]:
    """(violations, notes) of the recoveries (`recoveries`) of a soak whose events end
    at `end_t`: a fault the job did not recover from within its bound is a
    violation, unless the soak ended before that bound was up (a note: the job had
    no chance to show it recovers in time)."""
    t0 = recs[0]["t"] if recs else 0.0
    late: list[str] = []
    notes: list[str] = []
    waiting = {id(r) for r in pending_recoveries(recs, end_t)}
    for r in recs:
        if r["skipped"]:
            continue
        at = f"{r['fault']} at {r['t'] - t0:.0f} s"
        if id(r) in waiting:
            notes.append(
                f"{at}: no progress before the soak ended {end_t - r['t']:.0f} s later, "
                f"within its bound ({r['bound_s']:g} s): not judged"
            )
        elif r["recovery_s"] is None:
            late.append(f"{at}: no progress after it (bound {r['bound_s']:g} s)")
        elif r["recovery_s"] > r["bound_s"]:
            late.append(f"{at}: {r['recovery_s']:.1f} s (bound {r['bound_s']:g} s)")
    return late, notes


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seconds until a step beyond the last one committed before it: for every
    recognised failure (`elastrain.observe.failures`; `fault` is the injected kind
    that labels it, else the recognised kind), and for every injected fault that
    is not a failure of a process (slow, checkpoint and disk faults; `recognised`
    None) or that no failure was recognised for (`recognised` False)."""
    from elastrain.observe.failures import recognise_failures

    startup = startup_p90(events)
    commits = sorted((float(e["t"]), int(e["step"])) for e in events if e["kind"] == "step_commit")
    fails = recognise_failures(events)
    labelled = {(f.injected, f.t) for f in fails if f.injected}
    rows: list[tuple[float, str, Any, Any, bool | None]] = [
        (f.t, f.injected or f.kind.value, f.member, None, True) for f in fails
    ]
    slowed: dict[float, int] = {}
    """Injection time of each slow fault -> the steps it slows."""
    for e in events:
        if e["kind"] != "fault_injected" or e.get("fault") not in KINDS:
            continue
        kind, t = str(e["fault"]), float(e["t"])
        if (kind, t) in labelled:
            continue
        if kind == "slow" and isinstance(e.get("steps"), int):
            slowed[t] = e["steps"]
        causes = kind in FAILURE_KINDS and not e.get("skipped")
        rows.append((t, kind, e.get("member"), e.get("skipped"), False if causes else None))
    episodes = straggler_episodes(events)
    ratios = step_ratios(events)
    out = []
    seen_job_wide: set[float] = set()
    for t0, kind, member, skipped, recognised in sorted(rows, key=lambda r: r[0]):
        if kind == "kill-all" and recognised:
            if t0 in seen_job_wide:
                continue  # one row for the fault, not one per worker it killed
            seen_job_wide.add(t0)
            member = "job"
        before = max((s for t, s in commits if t <= t0), default=-1)
        after = next((t for t, s in commits if t > t0 and s > before), None)
        out.append(
            {
                "fault": kind,
                "member": member,
                "t": t0,
                "skipped": skipped,
                "recognised": recognised,
                "recovery_s": None if after is None else after - t0,
                "bound_s": round(BOUND_S + STARTUPS.get(kind, 0.0) * startup, 1),
                "straggler": _straggler_seen(ratios, episodes, member, before, slowed.get(t0))
                if kind == "slow" and not skipped
                else None,
            }
        )
    return out


def _straggler_seen(
    ratios: list[StepRatio], episodes: list[Any], member: Any, before: int, steps: int | None
) -> bool | None:
    """Whether the straggler score flagged a slowed `member` within the steps it was
    slowed (after the last commit `before` the order); None when fewer than a
    window's worth of them could be scored: it was killed, expelled or done first,
    or it computed them alone (the score compares a member with the others
    computing the same step, and earlier faults may have left it the only one)."""
    if steps is None or not isinstance(member, str):
        return None
    first, last = before + 1, before + steps
    scored = {r.step for r in ratios if r.member == member and first <= r.step <= last}
    if len(scored) < STRAGGLER_WINDOW:
        return None
    return any(ep.member == member and ep.first <= last and ep.last >= first for ep in episodes)


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return r.returncode == 0


def _run_job(
    job: SoakJob, run_dir: Path, workers: int, steps: int | None, faults: list[Fault],
    seed: int, on_launcher: Any = None, hosts: int = 0,
) -> Any:  # fmt: skip
    from elastrain.chaos.injector import register
    from elastrain.launch.launcher import LaunchConfig, Launcher

    register()
    cfg = LaunchConfig(
        script=job.script,
        workers=workers,
        min_workers=1,
        replace_delay_s=1.0,
        run_dir=str(run_dir),
        steps=steps,
        faults=faults,
        seed=seed,
        progress=False,
        grace_s=20.0,
        hosts=hosts,
        extra_env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    la = Launcher(cfg)
    if on_launcher is not None:
        on_launcher(la)
    return la, la.run()


def soak(
    duration_s: float,
    *,
    job: SoakJob = SoakJob.TORCH,
    workers: int = 3,
    every_s: float = 9.0,
    kinds: list[str] | None = None,
    seed: int = 0,
    run_dir: Path,
    log: Any = print,
) -> dict[str, Any]:
    """Run the soak (see the module docstring); returns the summary written to soak.json."""
    kinds = list(kinds or DEFAULT_KINDS)
    notes: list[str] = []
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "faulty" / "checkpoints"
    mounted = False
    if "fill-disk" in kinds:
        mounted = _mount_tmpfs(ckpt, "4m")
        if not mounted:
            kinds.remove("fill-disk")
            notes.append("fill-disk left out: mounting a small tmpfs needs root and mount(8)")
    hosts = 0
    if "cut" in kinds:
        why = missing_requirement()
        if why:
            kinds.remove("cut")
            notes.append(f"cut left out: {why}")
        else:
            hosts = workers  # one worker per simulated host
    faults = plan_faults(kinds, duration_s, every_s, seed)
    log(f"soak: {job} job, {duration_s:g} s, {workers} workers, {len(faults)} faults: "
        + ", ".join(str(f) for f in faults))  # fmt: skip
    launchers: list[Any] = []
    sampler = Sampler(lambda: _live_pids(launchers))
    timer: threading.Thread | None = None

    stop_clock = threading.Event()

    def end_after_duration(la: Any) -> None:
        # Same clock as the fault schedule: from the first committed step.
        while not stop_clock.wait(0.2):
            if int(la.status.get("step", 0)) >= 1:
                break
        if stop_clock.wait(duration_s):
            return
        said = False
        try:
            while waiting := pending_recoveries(
                recoveries(read_events(run_dir / "faulty")), time.time()
            ):
                if not said:
                    log(f"soak: {len(waiting)} fault(s) not recovered yet; waiting for them "
                        f"(at most {max(r['bound_s'] for r in waiting):g} s each)")  # fmt: skip
                    said = True
                if stop_clock.wait(1.0):
                    return
        except Exception as e:  # noqa: BLE001 - the job must end even if this thread fails
            log(f"soak: could not tell which faults recovered ({e!r}); ending the job now")
        la.preempt()

    def started(la: Any) -> None:
        nonlocal timer
        launchers.append(la)
        sampler.start()
        timer = threading.Thread(target=end_after_duration, args=(la,), daemon=True)
        timer.start()

    try:
        la, result = _run_job(job, run_dir / "faulty", workers, None, faults, seed, started, hosts)
    finally:
        stop_clock.set()
        if timer is not None:
            timer.join(timeout=5)
        sampler.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(ckpt)], check=False)
    events = read_events(run_dir / "faulty")
    led = check_exactly_once(events, expected_ids)
    steps = led.committed_steps
    log(f"soak: the faulty job ended ({result.status}) after {steps} steps; "
        "running the failure-free reference")  # fmt: skip
    _, ref = _run_job(job, run_dir / "reference", 1, steps, [], seed)
    ref_events = read_events(run_dir / "reference")
    curve, ref_curve = loss_curve(events), loss_curve(ref_events)
    checks: dict[str, list[str]] = {
        "same state at generation starts": check_same_state(events),
        "exactly-once ledger": led.violations,
        "loss vs failure-free reference": _loss_violations(curve, ref_curve, steps)
        + ([] if ref.status == "done" else [f"the reference run ended {ref.status}"]),
        "leaks (fds, threads, processes)": sampler.violations() + _leftovers(la, run_dir),
    }
    recs = recoveries(events)
    late, unjudged = judge_recoveries(recs, max((float(e["t"]) for e in events), default=0.0))
    checks["recovery within bound"] = late
    notes += unjudged
    notes += [
        f"{r['fault']} at {r['t'] - recs[0]['t']:.0f} s on {r['member']}: injected, but no "
        "failure was recognised from what happened"
        for r in recs
        if r["recognised"] is False
    ]
    summary = {
        "job": str(job),
        "duration_s": duration_s,
        "workers": workers,
        "seed": seed,
        "status": result.status,
        "steps": steps,
        "rolled_back_steps": led.rolled_back,
        "loss_max_rel_diff": _max_rel_diff(curve, ref_curve),
        "faults": recs,
        "checks": checks,
        "notes": notes,
        "violations": sum(len(v) for v in checks.values()),
    }
    (run_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    return summary


def _live_pids(launchers: list[Any]) -> dict[str, int]:
    if not launchers:
        return {}
    la = launchers[-1]
    try:
        out = dict(la.member_pids())
    except RuntimeError:  # the launcher changed its worker table meanwhile; next time
        return {}
    c = la.coordinator
    if c is not None and c.poll() is None:
        out["coordinator"] = c.pid
    return out


def _leftovers(la: Any, run_dir: Path) -> list[str]:
    out = []
    pids = [pid for ps in la.pids.values() for pid in ps]
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(f"process {pid} is still running after the job")
        except ProcessLookupError:
            pass
    out += [f"fill file left behind: {p}" for p in run_dir.rglob(".chaos-fill-*")]
    return out


def _loss_violations(a: dict[int, float], b: dict[int, float], steps: int) -> list[str]:
    out = []
    for s in range(steps):
        if s not in a or s not in b:
            out.append(f"step {s}: no loss in {'the soak' if s not in a else 'the reference'}")
        elif not math.isclose(a[s], b[s], rel_tol=REL_TOL):
            out.append(f"step {s}: loss {a[s]!r} vs reference {b[s]!r}")
    return out[:20] + ([f"... {len(out) - 20} more"] if len(out) > 20 else [])


def _max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest relative loss difference against the reference over the steps both have."""
    diffs = [abs(a[s] - b[s]) / max(abs(b[s]), 1e-30) for s in a.keys() & b.keys()]
    return max(diffs, default=0.0)


def format_table(summary: dict[str, Any]) -> str:
    recs = summary["faults"]
    judged = [r["straggler"] for r in recs if r["fault"] == "slow" and r["straggler"] is not None]
    lines = [
        f"soak: {summary['job']} job, {summary['duration_s']:g} s, {summary['workers']} "
        f"workers, seed "
        f"{summary['seed']}: {summary['steps']} steps committed "
        f"({summary['rolled_back_steps']} rolled back and recomputed), job {summary['status']}",
        "",
        f"{'fault':<18}{'injected':>9}{'skipped':>9}{'recovered':>11}{'median s':>10}"
        f"{'max s':>8}{'bound s':>9}",
    ]
    for kind in sorted({r["fault"] for r in recs}):
        rs = [r for r in recs if r["fault"] == kind]
        done = [r["recovery_s"] for r in rs if not r["skipped"] and r["recovery_s"] is not None]
        skipped = sum(1 for r in rs if r["skipped"])
        med = f"{statistics.median(done):.2f}" if done else "-"
        mx = f"{max(done):.2f}" if done else "-"
        lines.append(
            f"{kind:<18}{len(rs):>9}{skipped:>9}{len(done):>11}{med:>10}{mx:>8}"
            f"{max(r['bound_s'] for r in rs):>9g}"
        )
    if judged:
        lines.append(
            f"slowed members flagged as stragglers: {sum(judged)} of {len(judged)} "
            f"(score >= {STRAGGLER_THRESHOLD:g}x the others' compute per sample)"
        )
    lines += ["", f"{'invariant':<36}{'violations':>11}"]
    for name, vs in summary["checks"].items():
        lines.append(f"{name:<36}{len(vs):>11}")
        lines += [f"    {v}" for v in vs[:10]]
    lines.append(
        f"largest loss difference from the reference: {summary['loss_max_rel_diff']:.3g} relative"
        f" (bound {REL_TOL:g})"
    )
    lines += [f"note: {n}" for n in summary["notes"]]
    lines.append(f"violations: {summary['violations']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="elastrain chaos soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--duration", required=True, help="e.g. 180, 3m, 30m, 1h")
    ap.add_argument(
        "--job",
        type=SoakJob,
        choices=list(SoakJob),
        default=SoakJob.TORCH,
        help="the framework of the job to soak (default torch)",
    )
    ap.add_argument("-n", "--workers", type=int, default=3)
    ap.add_argument("--every", default="9s", help="mean time between faults (default 9s)")
    ap.add_argument(
        "--kinds",
        default=",".join(DEFAULT_KINDS),
        help=f"fault kinds to mix (default all: {','.join(DEFAULT_KINDS)})",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None, help="default runs/soak-<time>")
    args = ap.parse_args(argv)
    try:
        duration = parse_duration(args.duration)
        every = parse_duration(args.every)
    except ValueError as e:
        ap.error(str(e))
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown fault kind(s) {', '.join(bad)}; known: {', '.join(KINDS)}")
    if not duration > 0 or not every > 0:
        ap.error("--duration and --every must be > 0")
    if args.workers < 2:
        ap.error("-n must be >= 2 (survivors are the point)")
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")).resolve()
    summary = soak(
        duration,
        job=args.job,
        workers=args.workers,
        every_s=every,
        kinds=kinds,
        seed=args.seed,
        run_dir=run_dir,
    )
    print(format_table(summary), flush=True)
    print(f"details: {run_dir / 'soak.json'}", file=sys.stderr)
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
