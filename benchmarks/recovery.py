"""Recovery and steady-state benchmark of elastrain (issue 2's benchmark acceptance).

Run from the repository root:

    .venv/bin/python benchmarks/recovery.py [--kills 5] [--quick]

What it does, with a GPT of about 10M parameters (the demo GPT at dim 320,
8 layers, context 64; exact count printed) on 4 workers, global batch 8,
micro-batch 1 (each worker computes 2 micro-batches per step):

1. Recovery: one `elastrain run` through the Python API (`Launcher`) with
   `--kills` SIGKILLs (`kill@K` faults; the first in LaunchConfig.faults, each
   next one added to the launcher's schedule only once the previous kill's
   replacement has joined and its generation committed `--settle` steps, so
   recoveries and joins never overlap) and `replace_delay_s` 1. From the
   run's events (`elastrain.observe.recovery`): time from each kill to the
   survivors' next committed step and its phases (detect, quorum, regroup,
   heal, first_step); for each replacement, the time from its spawn to
   registered, group built, healed and first step, and the heal transfer rate.
   Each generation's first step against that generation's steady steps (issue
   18): the survivors' generation after each kill, and the replacement's first
   generation after each join, from the last `group_built` to the first commit
   (the heal, the generation start with its state hash, and the step itself),
   divided by the median step_s of its later steps (the same members, the same
   share of the batch; a step's step_s is its slowest member's).
1b. The heal's reference, right after the recovery run: a plain gloo broadcast
   of the heal's bytes (the replacements' median) between two processes over
   loopback (_jobs/loopback_bcast.py), --bcast-reps times into memory touched
   before and as many into fresh memory. The job has stopped by then, so the
   reference runs on a quieter machine than the heals did (their peers' data
   loaders and the coordinator were alive).
2. Steady state: a failure-free elastrain job (Python API again) against plain
   `DistributedDataParallel` on gloo (4 processes spawned here, joined through
   a TCPStore, no torch.distributed.run) with the same model, data pipeline,
   global batch and micro-batch (`no_sync` on all but each rank's last
   micro-batch), one thread per process, the same warm-up steps excluded and
   the same number of steps measured. A second DDP, tuned like elastrain's
   reduction (gradient_as_bucket_view, one big bucket), is shown beside it.
   All three are alive at once and take turns in blocks of steps (D E T |
   T E D | ...; the others wait idle between steps), so that the shared
   machine's changing load hits every side alike.
3. Prints the tables and records the run, with date, machine and command, in
   benchmarks/results/ (unless --no-record), with PASS/FAIL against the
   targets: median kill-to-next-commit <= 2 s, steady-state overhead <= 5%
   (issue 2); heal rate >= 50% of the warm loopback broadcast, and the median
   first step after a kill and after a join <= 1.2 steady steps (issue 18).

--quick is a smoke run (2 kills, 2 blocks per side); it does not meet the
acceptance's "at least 5 kills" and is never recorded.
Run directories are kept under benchmarks/runs/<stamp>/ (git-ignored).
Takes about 5 minutes on a busy 2-core machine (--quick: about 2.5).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = HERE / "_jobs"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(JOBS))

from _harness import (  # noqa: E402
    Bench,
    Figure,
    Target,
    Verdict,
    at_least,
    at_most,
    fmt,
    log,
    med,
    pct,
    table,
    verdict,
)
from _kills import KillPacer, first_step_breakdown, run_bounded  # noqa: E402
from _loopback import measure_loopback  # noqa: E402
from _steady import (  # noqa: E402
    block_stats,
    elastic_config,
    loss_deviation,
    steady_anomalies,
    steady_elastrain_vs,
)
from common import Shape, build, param_count  # noqa: E402

from elastrain.chaos.injector import register as register_chaos  # noqa: E402
from elastrain.chaos.schedule import parse_fault  # noqa: E402
from elastrain.launch.launcher import Launcher  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402
from elastrain.observe.recovery import (  # noqa: E402
    PHASES,
    format_joins,
    format_recoveries,
    joins,
    recoveries,
)

WORKERS = 4
TARGET_RECOVERY_S = 2.0
TARGET_OVERHEAD = 0.05
TARGET_HEAL_VS_LOOPBACK = 0.5
TARGET_FIRST_STEP = 1.2
DDP_SIDES = {"D": [], "T": ["--grad-as-bucket-view", "--bucket-cap-mb", "1000"]}
"""The baselines: D is plain DistributedDataParallel (defaults: 25 MB buckets overlapped
with backward); T is DDP tuned like elastrain's reduction (gradients as views of one
bucket, reduced once after backward). The target is judged against D."""


# ---- elastrain runs --------------------------------------------------------------------


def elastrain_run(
    shape: Shape,
    steps: int,
    run_dir: Path,
    faults: list[str],
    timeout_s: float,
    pacer: KillPacer | None = None,
) -> tuple[str, list[dict[str, Any]], Launcher]:
    cfg = elastic_config(
        shape, run_dir, steps, WORKERS, faults=[parse_fault(f) for f in faults], seed=0
    )
    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=pacer)
    if pacer is not None:
        pacer.launcher = launcher
    result, _ = run_bounded(launcher, timeout_s)
    events = read_events(run_dir)
    return result.status, events, launcher


@dataclass(frozen=True)
class FirstStep:
    """A generation's first step against its steady steps (issue 18: the first step
    after a recovery costs at most 1.2 steady steps)."""

    gen: int
    after: str
    """What formed the generation: "kill" (the survivors resumed in it) or "join" (a
    replacement trained in it for the first time)."""
    first_s: float
    """From the last `group_built` of the generation to its first `step_commit`: the
    heal if any, the generation start (the state hash) and the step itself. Wall
    time, so it also holds what `step_s` leaves out (the loop between steps): a
    steady step's cycle is a little longer than its `step_s`."""
    first_step_s: float
    """That first step's own `step_s` (its slowest member's)."""
    steady_s: float
    """Median over the generation's later steps (all but its first `skip`) of each
    step's slowest member's `step_s`: the same members, the same share of the batch."""
    n_steady: int

    @property
    def ratio(self) -> float:
        return self.first_s / self.steady_s if self.steady_s > 0 else math.nan


def first_step_costs(
    events: list[dict[str, Any]], gens: dict[int, str], skip: int = 1, min_steady: int = 3
) -> list[FirstStep]:
    """For each generation of ``gens`` (gen -> what formed it), its `FirstStep`; a
    generation with fewer than ``min_steady`` steady steps (the next fault or join
    came first) is left out. Pure: hand-built events in tests."""
    out = []
    for gen, after in sorted(gens.items()):
        built = [e["t"] for e in events if e["kind"] == "group_built" and e.get("gen") == gen]
        by_step: dict[int, list[dict[str, Any]]] = {}
        for e in events:
            if e["kind"] == "step_commit" and e.get("gen") == gen:
                by_step.setdefault(int(e["step"]), []).append(e)
        if not built or not by_step:
            continue
        steps = sorted(by_step)
        first = by_step[steps[0]]
        steady = [max(e["step_s"] for e in by_step[s]) for s in steps[skip:]]
        if len(steady) < min_steady:
            continue
        out.append(
            FirstStep(
                gen,
                after,
                min(e["t"] for e in first) - max(built),
                max(e["step_s"] for e in first),
                med(steady),
                len(steady),
            )
        )
    return out


def join_gens(events: list[dict[str, Any]], members: list[str]) -> dict[int, str]:
    """The generation of each member's first committed step, as ``{gen: "join"}``
    (the caller labels a generation that a kill formed as well "kill")."""
    out: dict[int, str] = {}
    for m in members:
        mine = [e for e in events if e["kind"] == "step_commit" and e["proc"] == m]
        if mine:
            out[int(min(mine, key=lambda e: e["t"])["gen"])] = "join"
    return out


# ---- main ------------------------------------------------------------------------------


def main() -> int:
    bench = Bench("recovery.py", __doc__, quick="smoke run: 2 kills, short steady state")
    ap = bench.ap
    ap.add_argument("--kills", type=int, default=None, help="SIGKILLs in the recovery run (5)")
    ap.add_argument(
        "--settle", type=int, default=5,
        help="steps a replacement's generation must commit before the next kill (5: enough "
        "steady steps to compare its first step with)",
    )  # fmt: skip
    ap.add_argument("--warmup", type=int, default=4, help="steady-state warm-up steps (4)")
    ap.add_argument("--block-steps", type=int, default=4, help="steps per steady-state block (4)")
    ap.add_argument(
        "--blocks", type=int, default=None, help="steady-state blocks per side (8; --quick 2)"
    )
    ap.add_argument(
        "--bcast-reps", type=int, default=10, help="loopback broadcasts of the heal's bytes (10)"
    )
    args = bench.parse()
    kills = args.kills if args.kills is not None else (2 if args.quick else 5)
    warmup, block = args.warmup, args.block_steps
    blocks = args.blocks if args.blocks is not None else (2 if args.quick else 8)
    if kills < 1 or warmup < 1 or block < 2 or blocks < 1 or args.bcast_reps < 1:
        ap.error(
            "need --kills >= 1, --warmup >= 1, --block-steps >= 2, --blocks >= 1, --bcast-reps >= 1"
        )

    t_wall0 = time.time()
    load = bench.load
    assert load is not None
    cores = os.cpu_count()

    shape = Shape()
    import torch

    torch.set_num_threads(1)
    model, _, data = build(shape)
    n_params = param_count(model)
    state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    del model, data
    base = bench.run_dir("recovery")
    log(f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    log(f"model: demo GPT dim={shape.dim} layers={shape.layers} heads={shape.heads} "
        f"block={shape.block}: {n_params:,} parameters ({state_mb:.1f} MB fp32)")  # fmt: skip
    log(f"workers {WORKERS}, global batch {shape.global_batch}, micro-batch "
        f"{shape.micro_batch}, 1 thread per process; run dirs under {base}")  # fmt: skip

    # ---- 1. recovery run ---------------------------------------------------------------
    first_kill = 8
    pacer = KillPacer(kills, first_kill, args.settle, WORKERS)
    kill_dir = base / "kills"
    log(f"recovery run: {kills} SIGKILLs, the first at step {first_kill}, each next one once "
        f"the previous replacement trains ({args.settle} steps); replace delay 1 s")  # fmt: skip
    t = time.monotonic()
    t_kill0 = time.time()
    status, events, launcher = elastrain_run(
        shape, 100_000, kill_dir, [f"kill@{first_kill}"], timeout_s=420, pacer=pacer
    )
    kill_wall = time.monotonic() - t
    kill_steps = pacer.kill_steps[: len(launcher.fault_log)]
    log(f"recovery run {status} in {kill_wall:.1f} s, kills at steps {kill_steps} ({kill_dir})")
    recs = [r for r in recoveries(events) if r.fault == "kill"]
    js = joins(events)
    if pacer.stalled or not recs:
        why = "no step committed for 90 s" if pacer.stalled else "no kill was injected"
        print(
            f"\nFATAL: the recovery run is unusable ({why}); nothing recorded. Run dir: {kill_dir}"
        )
        aborts = [e for e in events if e["kind"] == "step_abort"]
        for e in aborts[:5]:
            print(f"  {e['proc']} step_abort phase={e.get('phase')}: {str(e.get('error'))[:200]}")
        for lf in sorted((kill_dir / "logs").glob("w*.log"))[:2]:
            print(f"--- tail of {lf}:")
            print("\n".join(lf.read_text(errors="replace").splitlines()[-8:]))
        load.stop()
        return 1
    origin = next((e["t"] for e in events if e["kind"] == "job_start"), None)
    detail_rec = format_recoveries(recs, origin)
    detail_join = format_joins(js, origin)
    print(detail_rec)
    print(detail_join)
    totals = [r.total_s for r in recs if r.total_s is not None]
    anomalies: list[str] = []
    if not pacer.done:
        anomalies.append(
            f"recovery run ended {status!r} before its last replacement trained ({kill_dir})"
        )
    if len(recs) < kills:
        anomalies.append(f"only {len(recs)} of {kills} kills were injected ({kill_dir})")
    if len(totals) < len(recs):
        anomalies.append(f"{len(recs) - len(totals)} kill(s) without a next commit ({kill_dir})")
    m_tot = med(totals)
    for r in recs:
        if r.total_s is not None and r.total_s > 1.5 * m_tot:
            anomalies.append(
                f"kill of {r.member} at t={r.t0 - (origin or 0):.1f}s: {r.total_s:.3f} s to next "
                f"commit (median {m_tot:.3f}); phases "
                + ", ".join(f"{p.name} {fmt(p.seconds)}" for p in r.phases)
                + f" ({kill_dir})"
            )
    # Spacing check: each kill must come after the previous replacement trained.
    by_member = {j.member: j for j in js}
    for prev, nxt in zip(recs, recs[1:], strict=False):
        j = by_member.get(prev.replacement or "")
        done_t = j.spawned_t + j.first_step_s if j and j.first_step_s is not None else None
        if done_t is None or done_t > nxt.t0:
            anomalies.append(
                f"kill of {nxt.member} at t={nxt.t0 - (origin or 0):.1f}s came before the "
                f"previous replacement ({prev.replacement}) committed a step: raise --spacing"
            )
    pids = launcher.pids
    summary_rec = [
        ["kill -> next commit (s)", fmt(med(totals)), fmt(min(totals) if totals else None),
         fmt(max(totals) if totals else None), str(len(totals))],
    ] + [
        [f"  {name}", fmt(med([r.phase(name) for r in recs])),
         fmt(min((r.phase(name) for r in recs), default=None)),
         fmt(max((r.phase(name) for r in recs), default=None)), str(len(recs))]
        for name in PHASES
    ]  # fmt: skip
    gs_delay, retried = first_step_breakdown(events, recs)
    summary_rec += [
        ["    within first_step: generation start (heal + state hash)", fmt(med(gs_delay)),
         fmt(min(gs_delay, default=None)), fmt(max(gs_delay, default=None)), str(len(gs_delay))],
        ["    within first_step: the retried step's step_s", fmt(med(retried)),
         fmt(min(retried, default=None)), fmt(max(retried, default=None)), str(len(retried))],
    ]  # fmt: skip
    jn = [j for j in js if j.first_step_s is not None]
    join_rows = [
        [f"spawn -> {lab} (s)", fmt(med([getattr(j, attr) for j in js if getattr(j, attr) is not None])),
         fmt(min((getattr(j, attr) for j in js if getattr(j, attr) is not None), default=None)),
         fmt(max((getattr(j, attr) for j in js if getattr(j, attr) is not None), default=None)),
         str(sum(getattr(j, attr) is not None for j in js))]
        for lab, attr in (("registered", "registered_s"), ("group built", "group_s"),
                          ("healed", "healed_s"), ("first step", "first_step_s"))
    ]  # fmt: skip
    rates = [j.heal_rate_mb_s for j in js if j.heal_rate_mb_s]
    nbytes = [j.heal_bytes for j in js if j.heal_bytes]
    join_rows.append(
        ["heal transfer rate (MB/s)", fmt(med(rates), 1),
         fmt(min(rates) if rates else None, 1), fmt(max(rates) if rates else None, 1),
         str(len(rates))]
    )  # fmt: skip
    join_rows.append(
        ["heal bytes (MB)", fmt(med([b / 1e6 for b in nbytes]), 1),
         fmt(min(nbytes) / 1e6 if nbytes else None, 1),
         fmt(max(nbytes) / 1e6 if nbytes else None, 1), str(len(nbytes))]
    )  # fmt: skip
    heal_secs = [
        e["seconds"] for e in events
        if e["kind"] == "heal_end" and e.get("role") == "recv"
        and e["proc"] in {j.member for j in js}
    ]  # fmt: skip
    join_rows.append(
        ["heal transfer time (s)", fmt(med(heal_secs)),
         fmt(min(heal_secs) if heal_secs else None), fmt(max(heal_secs) if heal_secs else None),
         str(len(heal_secs))]
    )  # fmt: skip
    if len(jn) < len(js):
        anomalies.append(f"{len(js) - len(jn)} replacement(s) never committed a step ({kill_dir})")
    gens = join_gens(events, [j.member for j in js])
    gens.update({r.gen: "kill" for r in recs if r.gen is not None})
    firsts = first_step_costs(events, gens)
    fs_ratio = {
        after: med([f.ratio for f in firsts if f.after == after]) for after in ("kill", "join")
    }

    # ---- 1b. the heal's reference: a plain gloo broadcast of its bytes ---------------------
    heal_nbytes = int(med(nbytes)) if nbytes else 0
    lb: dict[str, Any] | None = None
    if heal_nbytes:
        log(f"loopback gloo broadcast of {heal_nbytes / 1e6:.1f} MB (a heal's bytes) between 2 "
            f"processes, {args.bcast_reps} times warm and as many into fresh memory")  # fmt: skip
        try:
            lb = measure_loopback(heal_nbytes, args.bcast_reps, base / "loopback", timeout_s=120)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            anomalies.append(f"loopback broadcast failed: {err}")
    lb_med = lb["median"] if lb else math.nan
    lb_fresh = lb["fresh_median"] if lb else math.nan
    heal_vs_lb = med(rates) / lb_med if rates and lb_med > 0 else math.nan
    join_rows += [
        ["loopback gloo broadcast of the heal's bytes, 2 processes (MB/s)", fmt(lb_med, 1),
         fmt(min(lb["rates"], default=None) if lb else None, 1),
         fmt(max(lb["rates"], default=None) if lb else None, 1),
         str(len(lb["rates"]) if lb else 0)],
        ["  the same into fresh memory each time (MB/s)", fmt(lb_fresh, 1),
         fmt(min(lb["fresh"], default=None) if lb else None, 1),
         fmt(max(lb["fresh"], default=None) if lb else None, 1),
         str(len(lb["fresh"]) if lb else 0)],
        ["heal rate / loopback broadcast rate (medians)", fmt(heal_vs_lb, 2), "", "", ""],
        ["heal rate / fresh-memory loopback rate (medians)",
         fmt(med(rates) / lb_fresh if rates and lb_fresh > 0 else math.nan, 2), "", "", ""],
    ]  # fmt: skip

    # ---- 2. steady state: elastrain vs DDP, interleaved in blocks ------------------------
    log(f"steady state: elastrain job and DDP baselines together, {warmup} warm-up steps, "
        f"then {blocks} blocks of {block} steps each, taking turns D E T | T E D | ...")  # fmt: skip
    t = time.monotonic()
    steady_dir = base / "steady"
    try:
        st = steady_elastrain_vs(
            shape, WORKERS, DDP_SIDES, warmup, block, blocks, steady_dir, timeout_s=360
        )
    except (RuntimeError, TimeoutError) as err:
        print(f"\nFATAL: steady-state comparison failed: {err}; nothing recorded.")
        load.stop()
        return 1
    steady_wall = time.monotonic() - t
    sides = ["E", *DDP_SIDES]
    ev = st["E"]
    anomalies += steady_anomalies(st, WORKERS, blocks * (block - 1), steady_dir)
    step_s = {"E": [e["step_s"] for e in ev["commits"]]}
    step_s.update({x: st[x]["step_s"] for x in DDP_SIDES})
    meds = {side: med(step_s[side]) for side in sides}
    e_med, d_med = meds["E"], meds["D"]
    overhead = e_med / d_med - 1 if d_med > 0 else math.nan
    bl = st["blocks"]
    bs = block_stats(bl, sides, block, blocks)
    bw, cps, idle_share = bs["wall"], bs["cpu"], bs["idle"]
    loss_dev, agree = loss_deviation(st, list(DDP_SIDES), warmup + block * blocks)
    log(f"steady state done in {steady_wall:.0f} s: median step_s elastrain {fmt(e_med)}, "
        f"DDP {fmt(d_med)} ({overhead * 100:+.1f}%), DDP tuned {fmt(meds['T'])}")  # fmt: skip

    # ---- 3. report ---------------------------------------------------------------------
    rec_pass = "PASS" if totals and m_tot <= TARGET_RECOVERY_S else "FAIL"
    ovh_pass = "PASS" if overhead <= TARGET_OVERHEAD else "FAIL"
    t1 = table(["recovery (" + str(len(recs)) + " SIGKILLs)", "median", "min", "max", "n"],
               summary_rec)  # fmt: skip
    t2 = table([f"replacement join ({len(js)} joins)", "median", "min", "max", "n"], join_rows)

    t3 = table(
        ["steady state (4 workers, interleaved)", "elastrain", "DDP (plain)",
         "elastrain vs DDP", "DDP tuned", "elastrain vs tuned"],
        [
            ["median step_s, all ranks (s)", fmt(e_med), fmt(d_med), pct(e_med, d_med),
             fmt(meds["T"]), pct(e_med, meds["T"])],
            ["wall per step, median over blocks (s)", fmt(bw["E"]), fmt(bw["D"]),
             pct(bw["E"], bw["D"]), fmt(bw["T"]), pct(bw["E"], bw["T"])],
            ["CPU s per step, all processes of the side (median over blocks)", fmt(cps["E"]),
             fmt(cps["D"]), pct(cps["E"], cps["D"]), fmt(cps["T"]), pct(cps["E"], cps["T"])],
            ["step_s samples (ranks x steps)", str(len(step_s["E"])),
             str(len(step_s["D"])), "", str(len(step_s["T"])), ""],
            ["elastrain compute_s / allreduce_s (median)",
             f"{fmt(med([e['compute_s'] for e in ev['commits']]))} / "
             f"{fmt(med([e['allreduce_s'] for e in ev['commits']]))}", "", "", "", ""],
            ["DDP last micro-batch (fwd+bwd+reduce) / optimizer", "",
             f"{fmt(med(st['D']['last_s']))} / {fmt(med(st['D']['opt_s']))}", "",
             f"{fmt(med(st['T']['last_s']))} / {fmt(med(st['T']['opt_s']))}", ""],
            ["CPU used while idle, waiting its turn (% of a core)",
             fmt(idle_share["E"] * 100, 1), fmt(idle_share["D"] * 100, 1), "",
             fmt(idle_share["T"] * 100, 1), ""],
        ],
    )  # fmt: skip
    names = {"E": "elastrain", "D": "DDP", "T": "DDP tuned"}
    t4 = table(
        ["block", "side", "wall per step (s)", "CPU s per step", "load avg (1 min)"],
        [[str(b["k"]), names[b["side"]], fmt((b["t1"] - b["t0"]) / block),
          fmt(b["cpu_s"] / block), fmt(load.mean(b["t0"] - 2, b["t1"] + 2), 1)]
         for b in bl],
    )  # fmt: skip
    targets = [
        Target("median kill -> next commit", f"<= {TARGET_RECOVERY_S:g} s", f"{fmt(m_tot)} s",
               Verdict(rec_pass)),
        Target("steady-state overhead vs DDP", f"<= {TARGET_OVERHEAD:.0%}",
               f"{overhead * 100:+.1f}%", Verdict(ovh_pass)),
        Target("heal rate", f">= {TARGET_HEAL_VS_LOOPBACK:.0%} of a loopback broadcast of its bytes",
               f"{fmt(heal_vs_lb, 2)}",
               Verdict(verdict(at_least(heal_vs_lb, TARGET_HEAL_VS_LOOPBACK)))),
    ] + [
        Target(f"first step after a {after} (median)", f"<= {TARGET_FIRST_STEP:g} x a steady step",
               f"{fmt(fs_ratio[after], 2)} x (of {sum(f.after == after for f in firsts)})",
               Verdict(verdict(at_most(fs_ratio[after], TARGET_FIRST_STEP))))
        for after in ("kill", "join")
    ]  # fmt: skip
    target_rows = [[f"{t.target} {t.threshold}", t.measured, t.verdict.value] for t in targets]
    t5 = table(["target", "measured", "verdict"], target_rows)
    t6 = table(
        ["generation", "formed after a", "group built -> first commit (s)", "its step_s (s)",
         "steady step_s (s)", "steady steps", "first / steady"],
        [[str(f.gen), f.after, fmt(f.first_s), fmt(f.first_step_s), fmt(f.steady_s),
          str(f.n_steady), fmt(f.ratio, 2)] for f in firsts],
    )  # fmt: skip
    ev_pids: dict[str, set[int]] = {}
    for e in events:
        if e["proc"] not in ("launcher", "coordinator"):
            ev_pids.setdefault(e["proc"], set()).add(e["pid"])
    killed = {r.member for r in recs}
    kept = [
        m for m in ev_pids if m not in killed and len(ev_pids[m]) == 1 and len(pids.get(m, [])) == 1
    ]
    survivor_note = (
        f"PIDs: {len(kept)} of {len(ev_pids) - len(killed & set(ev_pids))} members never killed "
        "kept a single PID for the whole recovery run (survivors are not restarted)"
    )
    notes = [
        f"model: demo GPT (dim {shape.dim}, {shape.layers} layers, {shape.heads} heads, "
        f"block {shape.block}, vocab 256): {n_params:,} parameters; AdamW",
        f"{WORKERS} workers, global batch {shape.global_batch}, micro-batch "
        f"{shape.micro_batch} ({shape.global_batch // shape.micro_batch} micro-batches/step), "
        "torch.set_num_threads(1) in every process",
        f"recovery run: kill@{','.join(map(str, kill_steps))} (each next kill added once the "
        f"previous replacement's generation committed {args.settle} steps), replace_delay_s 1, "
        f"{kill_wall:.0f} s, run dir {kill_dir.relative_to(ROOT)}",
        "steady state: a failure-free elastrain job (launched with the Python API) and two "
        "DDP baselines (4 processes each) alive together, taking turns: "
        f"{warmup} warm-up steps each (excluded), then {blocks} blocks of {block} steps per "
        "side in the order D E T | T E D | ...; an idle side waits between steps. step_s "
        "medians leave out the first step of every block on every side; wall per step is a "
        "block's wall time / its steps. DDP (plain) is DistributedDataParallel with its "
        "defaults (25 MB buckets reduced during backward); DDP tuned has "
        "gradient_as_bucket_view=True and bucket_cap_mb=1000 (one bucket, after DDP's fixed "
        "1 MB first one, reduced at the end of backward like elastrain's flat all-reduce). "
        "The target is judged against plain DDP. Same computation on every side: the "
        f"per-step losses of elastrain and both DDPs agree within {loss_dev:.0e} (relative) "
        f"over the first {agree} steps. On a machine shared with other work, wall times "
        "swing from block to block (see the per-block table); CPU s per step (all of a "
        "side's processes, elastrain's coordinator included) is the load-robust cross-check. "
        f"{steady_wall:.0f} s, run dir "
        f"{steady_dir.relative_to(ROOT)}",
        survivor_note,
        f"machine load (1-min load average, {cores} cores): {load.mean(t_wall0, time.time()):.1f} "
        f"mean over the benchmark, {load.mean(t_kill0, t_kill0 + kill_wall):.1f} during the "
        "recovery run",
    ]
    if kills < 5:
        notes.append(f"{kills} kills: fewer than the 5 the acceptance asks for")
    text = "\n\n".join([t1, t2, t6, t3, t4, t5])
    print()
    print(text)
    print()
    details = [
        t1, "", t2, "",
        "First step of each generation after a kill or a join, against its steady steps:", "",
        t6, "", t3, "", t4, "", "Per kill (seconds; t0 from job start):", "", "```",
        detail_rec, "```", "", "Per replacement (seconds from its spawn):", "", "```",
        detail_join, "```",
    ]  # fmt: skip
    figures = [
        Figure("kill_to_next_commit_s", "kill -> next commit, median", m_tot, "s"),
        Figure("steady_overhead_pct", "steady step_s vs plain DDP", overhead * 100, "%"),
        Figure("heal_over_loopback", "heal rate / loopback broadcast rate", heal_vs_lb, ""),
        *(Figure(f"first_step_ratio[{a}]", f"first step after a {a} / a steady step (median)",
                 fs_ratio[a], "x") for a in ("kill", "join")),
    ]  # fmt: skip
    bench.finish(f"torch {torch.__version__}, gloo over loopback",
                 [f for f in figures if f.value is not None and math.isfinite(f.value)],
                 targets, notes, details, anomalies)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
