"""Overhead of event logging and metering on the step time (issue 4: at most 1%).

Run from the repository root:

    .venv/bin/python benchmarks/observe_overhead.py [--rounds 4] [--steps 30] [--interval 1]
        [--no-record]

Two configurations of the same single-member job (the demo GPT, dim 64,
2 layers, global batch 16, micro-batch 4, torch.set_num_threads(1)), both run
in this process, each with its own in-process coordinator, side by side:

  on   events written to a run directory (every worker event, as in a real
       job) + metering: the power/utilisation sampler thread every
       --interval seconds (estimate meter, plus RAPL/NVML where readable)
       and the one-time FLOP count (before the first step; reported apart,
       it is startup, not step time)
  off  no events (EventLog without a directory drops them) and
       ELASTRAIN_METERING=off

The two jobs take turns step by step in ABBA order (on, off, off, on, ...),
--steps steps each per round, --rounds rounds (fresh jobs each round), so a
drift in machine load hits both alike. The sampler is a thread of this
process, so its (tiny) CPU use also lands on the off side's steps: the
cross-check below accounts for it. The first 5 steps of each round are
warm-up and left out. The verdict compares
the median step time (StepResult.step_s: the trainer's own step clock, the
same one step_commit reports) of all rounds of each side; the per-round medians
are printed too, to show the noise. As a cross-check that does not depend on
load, it also times the pieces themselves: one `EventLog.emit` of a
step_commit-sized event, and one sampler tick, and prints the overhead they
imply at the measured step time (3 events per step + ticks per step).

Prints a table and records the run in benchmarks/results/ (unless --no-record)
with date, machine and command. About 1-2 minutes on a 2-core machine.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure, target  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig, env  # noqa: E402
from elastrain.control.config import CoordinatorConfig  # noqa: E402
from elastrain.control.server import CoordinatorServer  # noqa: E402
from elastrain.demo.gpt import GPT, ByteBlocks, loss_fn, stdlib_corpus  # noqa: E402
from elastrain.observe.events import EventKind, EventLog  # noqa: E402
from elastrain.observe.power import Sampler, choose_meters  # noqa: E402

WARMUP = 5
TOKEN = "bench-token"


def make_trainer(
    on: bool, steps: int, interval: float, data: ByteBlocks, root: Path
) -> tuple[CoordinatorServer, ElasticTrainer]:
    """One single-member job with its own in-process coordinator."""
    os.environ[env.METERING] = str(interval) if on else "off"
    srv = CoordinatorServer(CoordinatorConfig(target=1), TOKEN).start()
    torch.manual_seed(0)
    model = GPT(block=64, d=64, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = TrainerConfig(global_batch_size=16, micro_batch_size=4, total_steps=steps, seed=0)
    run_dir = tempfile.mkdtemp(dir=root) if on else None
    trainer = ElasticTrainer(
        model, opt, data, loss_fn, cfg, coordinator=srv.address, token=TOKEN,
        member_id="on" if on else "off", run_dir=run_dir,
    )  # fmt: skip
    return srv, trainer


def paired_steps(
    steps: int, interval: float, data: ByteBlocks, root: Path
) -> dict[bool, list[float]]:
    """Both jobs in this process, taking turns step by step (ABBA: on off off on ...),
    so machine-load drift hits both alike. Returns the step times after warm-up."""
    jobs = {on: make_trainer(on, steps, interval, data, root) for on in (True, False)}
    gens = {on: jobs[on][1].steps() for on in jobs}
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for k in range(steps):
            for on in (True, False) if k % 2 == 0 else (False, True):
                times[on].append(next(gens[on]).step_s)
        for g in gens.values():
            for _ in g:  # finish: leave the job, stop the sampler, close the logs
                pass
    finally:
        for srv, _ in jobs.values():
            srv.stop()
    return {on: t[WARMUP:] for on, t in times.items()}


def micro_costs(n: int = 2000) -> tuple[float, float]:
    """(seconds per EventLog.emit of a step_commit-sized event, seconds per sampler tick)."""
    with tempfile.TemporaryDirectory() as d:
        log = EventLog(d, "bench")
        t = time.perf_counter()
        for i in range(n):
            log.emit(EventKind.STEP_COMMIT, step=i, gen=1, loss=1.2345678, step_s=0.1, compute_s=0.08,
                     allreduce_s=0.01, data_s=0.001, samples=32, samples_per_s=320.0,
                     grad_norm=0.5, skipped=False)  # fmt: skip
        emit = (time.perf_counter() - t) / n
        s = Sampler(log, choose_meters(), 3600.0)
        t = time.perf_counter()
        for _ in range(200):
            s.sample()
        tick = (time.perf_counter() - t) / 200
        log.close()
    return emit, tick


def main(argv: list[str] | None = None) -> int:
    bench = Bench("observe_overhead.py", __doc__)
    ap = bench.ap
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--steps", type=int, default=120, help="steps per side per round (default 120)")
    ap.add_argument("--interval", type=float, default=1.0, help="sampling interval, s")
    args = bench.parse(argv)
    torch.set_num_threads(1)
    data = ByteBlocks(stdlib_corpus(), 64)
    per: dict[bool, list[list[float]]] = {True: [], False: []}
    loads = []
    with tempfile.TemporaryDirectory(dir=HERE) as tmp:
        for k in range(args.rounds):
            loads.append(os.getloadavg()[0])
            got = paired_steps(args.steps, args.interval, data, Path(tmp))
            for on in (True, False):
                per[on].append(got[on])
            print(f"  round {k}: median step on {statistics.median(got[True]) * 1e3:.2f} ms, "
                  f"off {statistics.median(got[False]) * 1e3:.2f} ms", flush=True)  # fmt: skip
    emit, tick = micro_costs()
    med = {k: statistics.median([x for r in v for x in r]) for k, v in per.items()}
    diffs = [a - b for on_r, off_r in zip(per[True], per[False], strict=True)
             for a, b in zip(on_r, off_r, strict=False)]  # fmt: skip
    ratio = statistics.median(diffs) / med[False]
    ratio_medians = med[True] / med[False] - 1
    implied = (3 * emit + tick * med[False] / args.interval) / med[False]
    rows = [
        ("side", "rounds", "steps", "median ms", "mean ms", "p90 ms", "round medians ms"),
    ]
    for k, name in ((False, "off (no events, no metering)"), (True, "on (events + metering)")):
        xs = sorted(x for r in per[k] for x in r)
        rows.append((name, str(len(per[k])), str(len(xs)), f"{med[k] * 1e3:.2f}",
                     f"{statistics.fmean(xs) * 1e3:.2f}", f"{xs[int(0.9 * (len(xs) - 1))] * 1e3:.2f}",
                     " ".join(f"{statistics.median(r) * 1e3:.1f}" for r in per[k])))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    verdict = (
        f"step time on vs off: median of the paired differences {ratio:+.2%} of the off "
        f"median -> {'PASS' if ratio <= 0.01 else 'FAIL'} (target <= +1%); ratio of the "
        f"medians {ratio_medians:+.2%}\n"
        f"cross-check from the parts: EventLog.emit {emit * 1e6:.1f} us x 3 per step + sampler "
        f"tick {tick * 1e3:.3f} ms every {args.interval:g} s -> {implied:.3%} of a "
        f"{med[False] * 1e3:.1f} ms step"
    )
    print()
    print(table)
    print()
    print(verdict)
    bench.finish(
        f"torch {torch.__version__}; meters: {', '.join(m.source for m in choose_meters())}",
        [Figure("overhead_pct", "step time on vs off, median of the paired differences",
                ratio * 100, "%"),
         Figure("overhead_of_medians_pct", "step time on vs off, ratio of the medians",
                ratio_medians * 100, "%"),
         Figure("implied_pct", "cross-check from the parts (emit + sampler tick)",
                implied * 100, "%")],
        [target("step time, events and metering on vs off (median of paired differences)",
                "<= +1%", f"{ratio:+.2%}", ratio <= 0.01)],
        ["demo GPT (dim 64, 2 layers), 1 member per side, global batch 16, micro-batch 4, "
         f"1 thread; sides take turns step by step (ABBA), first {WARMUP} steps of each round "
         f"left out; load average {statistics.fmean(loads):.1f} mean over the rounds",
         verdict.replace("\n", "; ")],
        ["```", table, "```"],
    )  # fmt: skip
    return 0 if ratio <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
