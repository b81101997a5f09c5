"""How fast is the cluster-scale failure simulator?

Run from the repository root:

    .venv/bin/python benchmarks/sim_scale.py            # prints the table, records the run
    .venv/bin/python benchmarks/sim_scale.py --no-record

Each row simulates one job (one seed) with the Llama 3 per-component failure rates
(elastrain.sim.presets) and times it; the issue's bar is a 100,000-accelerator,
30-day run in at most 10 s on this machine.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Bench, Figure, target  # noqa: E402

from elastrain.sim import presets  # noqa: E402
from elastrain.sim.config import DAY, StrategyConfig, Topology  # noqa: E402
from elastrain.sim.engine import simulate  # noqa: E402
from elastrain.sim.report import format_table  # noqa: E402

BAR_S = 10.0
"""The issue's bar: a 100,000-accelerator, 30-day simulation in at most this long."""

# (accelerators, days, accelerators per model replica)
CASES = [(16_384, 54.0, 128), (100_000, 30.0, 160), (200_000, 30.0, 160)]
STRATEGIES = [
    StrategyConfig(kind="restart"),
    StrategyConfig(kind="hot-spare", spare_hosts=64),
    StrategyConfig(kind="elastic"),
]


def main() -> int:
    bench = Bench("sim_scale.py", __doc__)
    bench.ap.add_argument("--seed", type=int, default=0)
    args = bench.parse()
    rows, figures = [], []
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
            figures.append(Figure(f"sim_s[{accelerators}, {strategy.kind}]",
                                  f"{accelerators} accelerators, {days:g} days, {strategy.kind}",
                                  elapsed, "s"))  # fmt: skip
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
    ok = worst <= BAR_S
    print(f"{table}slowest 100k+ run: {worst:.3f} s (bar: <= {BAR_S:g} s) -> "
          f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    bench.finish(
        f"Python {platform.python_version()}", figures,
        [target("slowest simulation of 100,000+ accelerators", f"<= {BAR_S:g} s",
                f"{worst:.3f} s", ok)],
        [f"seed {args.seed}; Llama 3 per-component failure rates (elastrain.sim.presets)"],
        table,
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
