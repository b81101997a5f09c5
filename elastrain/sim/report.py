"""Plain-text tables and SVG charts of simulation results."""

from __future__ import annotations

import math
from collections.abc import Sequence

from elastrain.sim.metrics import Stat
from elastrain.sim.svg import Chart, Marker, Series
from elastrain.sim.sweep import IntervalSweep, ScalePoint

# (metric key, column title, kind) — kind: pct, num1, num0, hours
JOB_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("time_goodput", "time goodput", "pct"),
    ("ettr", "ETTR", "pct"),
    ("throughput_goodput", "thru goodput", "pct"),
    ("interruptions", "interruptions", "num0"),
    ("rollbacks", "rollbacks", "num0"),
    ("lost_work_h", "lost work h", "num1"),
    ("checkpoint_h", "ckpt h", "num1"),
    ("badput_energy_mwh", "badput MWh", "num1"),
    ("time_to_train_h", "time-to-train h", "num1"),
)


def _cell(stat: Stat, kind: str) -> str:
    if stat.n == 0 or math.isnan(stat.mean):
        return "-"
    if kind == "pct":
        v, e, unit = stat.mean * 100, stat.std * 100, "%"
        body = f"{v:.2f}"
        err = f" ±{e:.2f}" if stat.n > 1 else ""
        return body + unit + err
    digits = 0 if kind == "num0" else 1
    body = f"{stat.mean:.{digits}f}"
    err = f" ±{stat.std:.{digits}f}" if stat.n > 1 else ""
    return body + err


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned text table (first column left-aligned)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)]) + "\n"


def strategy_table(summaries: dict[str, dict[str, Stat]]) -> str:
    """One row per strategy (mean ± std over seeds)."""
    cols = [c for c in JOB_COLUMNS if any(s[c[0]].n for s in summaries.values())]
    headers = ["strategy", *(title for _, title, _ in cols)]
    rows = [
        [name, *(_cell(s[key], kind) for key, _, kind in cols)] for name, s in summaries.items()
    ]
    return format_table(headers, rows)


def scale_table(points: Sequence[ScalePoint]) -> str:
    headers = [
        "accelerators",
        "strategy",
        "time goodput",
        "ETTR",
        "thru goodput",
        "interrupts",
        "badput MWh",
    ]
    rows = []
    for p in points:
        s = p.summary
        rows.append(
            [
                str(p.accelerators),
                p.strategy,
                _cell(s["time_goodput"], "pct"),
                _cell(s["ettr"], "pct"),
                _cell(s["throughput_goodput"], "pct"),
                _cell(s["interruptions"], "num0"),
                _cell(s["badput_energy_mwh"], "num1"),
            ]
        )
    return format_table(headers, rows)


def interval_table(sweep: IntervalSweep) -> str:
    rows = [
        [f"{x:.0f}", _cell(g, "pct")] for x, g in zip(sweep.intervals_s, sweep.goodput, strict=True)
    ]
    table = format_table(["interval s", "time goodput"], rows)
    return table + (
        f"optimum: swept best {sweep.best_s:.0f} s, fitted {sweep.fitted_s:.0f} s; "
        f"Young {sweep.young_s:.0f} s, Daly {sweep.daly_s:.0f} s\n"
    )


def scale_chart(points: Sequence[ScalePoint], metric: str = "throughput_goodput") -> Chart:
    by_strategy: dict[str, list[ScalePoint]] = {}
    for p in points:
        by_strategy.setdefault(p.strategy, []).append(p)
    series = [
        Series(
            label=name,
            xs=[p.accelerators for p in pts],
            ys=[p.summary[metric].mean for p in pts],
            err=[p.summary[metric].std for p in pts],
        )
        for name, pts in by_strategy.items()
    ]
    title = metric.replace("_", " ")
    return Chart(
        title=f"{title} vs. scale",
        x_label="accelerators",
        y_label=title,
        series=series,
        log_x=True,
        y_percent=True,
    )


def interval_chart(sweep: IntervalSweep, label: str = "simulated") -> Chart:
    return Chart(
        title="time goodput vs. checkpoint interval",
        x_label="checkpoint interval (compute seconds)",
        y_label="time goodput",
        series=[
            Series(
                label=label,
                xs=sweep.intervals_s,
                ys=[g.mean for g in sweep.goodput],
                err=[g.std for g in sweep.goodput],
            )
        ],
        markers=[
            Marker(sweep.young_s, f"Young {sweep.young_s:.0f} s", "6 4"),
            Marker(sweep.daly_s, f"Daly {sweep.daly_s:.0f} s", "2 3"),
            Marker(sweep.fitted_s, f"fitted {sweep.fitted_s:.0f} s", "10 3 2 3"),
        ],
        log_x=True,
        y_percent=True,
    )
