"""`elastrain demo`: 4 workers train a small GPT; one is SIGKILLed mid-step and
replaced, another is hung (SIGSTOP) and later continued. Prints the survivors'
PIDs before and after, the recovery phases of each failure, and the loss.

    elastrain demo [--steps 80] [--run-dir DIR] [--plain] [--spares K]

With --spares K, K hot spares wait beside the 4 workers: the kill promotes one
at once (the failures table names it) and the replacement refills the pool.

`elastrain demo --sharded` is the sharded one: 2 replica groups x 2 shards, a
kill healed shard-only, a reshard to 1x3 in memory and back
(`elastrain.demo.sharded`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastrain.chaos.injector import register as register_chaos
from elastrain.chaos.schedule import parse_fault
from elastrain.launch.launcher import LaunchConfig, Launcher, RunResult
from elastrain.launch.progress import Progress
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve
from elastrain.observe.report import format_summary, write_report
from elastrain.observe.summary import committed_steps, format_run_tables, last_pids

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def run_demo(
    *,
    steps: int | None = None,
    run_dir: str | None = None,
    plain: bool = False,
    sharded: bool = False,
    spares: int = 0,
) -> int:
    """The plain demo (100 steps unless `steps`), or with `sharded` the sharded one
    (`elastrain.demo.sharded`)."""
    if sharded:
        from elastrain.demo.sharded import STEPS, run_sharded_demo

        return run_sharded_demo(steps=steps or STEPS, run_dir=run_dir, plain=plain)
    steps = steps or 100
    script = str(Path(__file__).with_name("gpt.py"))
    kill_at, hang_at = max(1, steps // 4), max(2, steps // 2)
    cfg = LaunchConfig(
        script=script,
        # At least 0.2 s a step: the hung member (6 s) must have time to rejoin and
        # heal before the job ends, however fast the machine.
        script_args=["--min-step-s", "0.2"],
        workers=4,
        min_workers=2,
        spares=spares,
        replace_delay_s=2.0,
        run_dir=run_dir,
        steps=steps,
        faults=[parse_fault(f"kill@{kill_at}"), parse_fault(f"hang@{hang_at}/6")],
        seed=1,
    )
    spare_s = f" beside {spares} hot spare(s)" if spares else ""
    replaced = (
        "a waiting spare takes its place at once, a new spare starts 2 s later"
        if spares
        else "a replacement starts 2 s later"
    )
    print(
        f"elastrain demo: 4 workers{spare_s} train a small GPT on the Python standard "
        "library's source.\n"
        f"At step {kill_at} one worker is SIGKILLed mid-step ({replaced});\n"
        f"at step {hang_at} another is hung with SIGSTOP for 6 s, then continued.\n"
    )
    with Progress(steps, plain=plain or None) as prog:
        register_chaos()  # its faults reach the launcher through the fault seam
        launcher = Launcher(cfg, on_status=prog.update)
        prog.note(f"run directory: {launcher.run_dir}")
        prog.attach(launcher.run_dir)
        result = launcher.run()
    return report(result, launcher)


def report(
    result: RunResult,
    launcher: Launcher,
    *,
    sections: Callable[[list[dict[str, Any]]], str] | None = None,
    ok: Callable[[list[dict[str, Any]]], bool] | None = None,
) -> int:
    """Print the end of a demo: status, the run tables, `sections` (more tables,
    after the run tables), the loss, the invariants and the goodput. With
    `sections` (the sharded demo) the invariants line comes last. Exit status 0
    when the job is done, the invariants hold and `ok` (what the demo set out to
    show) is true."""
    ev = read_events(result.run_dir)
    final = committed_steps(ev)
    print(f"\njob {result.status} after {final} steps; run directory {result.run_dir}")
    if result.message:
        print(result.message)
    print()
    print(format_run_tables(ev, healed_only=True))
    if sections is not None:
        print()
        print(sections(ev))
    curve = loss_curve(ev)
    if curve:
        ks = sorted(curve)
        every = max(1, len(ks) // 10)
        print("\nloss (mean over the global batch):")
        print("  " + "  ".join(f"{k}:{curve[k]:.3f}" for k in ks[::every]))
        print(
            f"  {sparkline([curve[k] for k in ks])}  ppl {math.exp(curve[ks[0]]):.0f} -> {math.exp(curve[ks[-1]]):.1f}"
        )
    same = check_same_state(ev)
    line = "invariants: all members bit-identical at every generation start: " + (
        "yes" if not same else f"NO ({len(same)} violations)"
    )
    if sections is None:
        print("\n" + line)
    path, rep = write_report(result.run_dir)
    print("\ngoodput and energy:")
    print(format_summary(rep))
    print(f"\nreport (open in a browser, works offline): {path}")
    if sections is not None:
        for v in same:
            print(f"  {v}")
        print("\n(sharded: each member hashes its own shard; twins, the holders of the same shard,")
        print(" must be equal)")
        print(line)
    good = result.status == "done" and not same and (ok is None or ok(ev))
    return 0 if good else 1


__all__ = ["run_demo", "check_exactly_once", "last_pids"]
