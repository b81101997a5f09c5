# How fast is the cluster-scale failure simulator?  Run from the repository root:
#
#     .venv/bin/python benchmarks/sim_scale.py            # prints the table, appends to RESULTS.md
#     .venv/bin/python benchmarks/sim_scale.py --no-record
#
# Each row simulates one job (one seed) with the Llama 3 per-component failure rates
# (elastrain.sim.presets) and times it; the bar is a 100,000-accelerator,
# 30-day run in at most 10 s on this machine.
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from elastrain.sim import presets
from elastrain.sim.config import DAY, StrategyConfig, Topology
from elastrain.sim.engine import simulate
from elastrain.sim.report import format_table

# (accelerators, days, accelerators per model replica)
CASES = [(16_384, 54.0, 128), (100_000, 30.0, 160), (200_000, 30.0, 160)]
STRATEGIES = [
    StrategyConfig(kind="restart"),
    StrategyConfig(kind="hot-spare", spare_hosts=64),
    StrategyConfig(kind="elastic"),
]


def machine() -> str:
    uname = " ".join(platform.uname())
    try:
        uname = subprocess.run(
            ["uname", "-a"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"{uname}; {os.cpu_count()} cores; Python {platform.python_version()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    worst = 0.0
    for accelerators, days, per_replica in CASES:
        base = presets.get("llama3-16k")
        topo = Topology(accelerators=accelerators, accelerators_per_replica=per_replica)
        cfg = dataclasses.replace(base, topology=topo, horizon_s=days * DAY, seed=args.seed)
        for strategy in STRATEGIES:
            c = dataclasses.replace(cfg, strategy=strategy)
            start = time.perf_counter()
            r = simulate(c)
            elapsed = time.perf_counter() - start
            if accelerators >= 100_000:
                worst = max(worst, elapsed)
            rows.append(
                [
                    str(topo.accelerators),
                    f"{days:g}",
                    strategy.kind,
                    str(r.failures),
                    f"{r.ettr * 100:.2f}%",
                    f"{elapsed:.3f}",
                ]
            )
    table = format_table(
        ["accelerators", "days", "strategy", "failures", "ETTR", "sim seconds"], rows
    )
    verdict = (
        f"slowest 100k+ run: {worst:.3f} s (bar: <= 10 s) -> {'PASS' if worst <= 10 else 'FAIL'}\n"
    )
    print(table + verdict, end="")
    if not args.no_record:
        record(table + verdict)
    return 0 if worst <= 10 else 1


def record(text: str) -> None:
    path = Path(__file__).resolve().parent / "RESULTS.md"
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    block = (
        f"\n## sim_scale: simulator speed ({stamp})\n\n"
        f"- machine: `{machine()}`\n"
        f"- command: `{command}`\n\n"
        f"```\n{text}```\n"
    )
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by the scripts in this folder.\n")
    with open(path, "a") as f:
        f.write(block)
    print(f"appended to {path}")


if __name__ == "__main__":
    sys.exit(main())
