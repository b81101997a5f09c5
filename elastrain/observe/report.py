"""`elastrain report RUN_DIR [-o FILE]`: one self-contained HTML file and a
terminal summary of a run, built from its events alone.

The HTML has no external references (inline CSS and SVG; one inline script
only records where each plot landed, for the headless-browser test), so it
opens offline. Contents: headline numbers; a timeline of membership, committed
steps and failures with recovery phases as bands; the step-time distribution;
the goodput breakdown (time and energy); per-failure recovery breakdown; power
and energy over time; the tables behind them. Figures from an estimate power
meter are marked ESTIMATE wherever they appear.
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.observe import plots
from elastrain.observe.efficiency import Efficiency, efficiency
from elastrain.observe.events import read_events
from elastrain.observe.goodput import BUCKETS, Goodput, goodput
from elastrain.observe.recovery import PHASES, JoinTiming, Recovery, by_cause, joins, recoveries
from elastrain.observe.scalars import last_scalars
from elastrain.observe.stragglers import Episode, format_episodes, straggler_episodes

Event = dict[str, Any]

ML_GOODPUT = {
    "productive": "productive training time",
    "wasted": "wasted progress from disruption",
    "detection": "disruption (badput from failures)",
    "regroup": "disruption (badput from failures)",
    "healing": "disruption (badput from failures)",
    "replacement_wait": "disruption (badput from failures)",
    "checkpoint": "checkpoint save (blocking)",
    "startup": "accelerator initialization + training prep",
    "standby": "other/unknown (hot spares standing by: reserved capacity)",
    "data_wait": "data loading",
    "other": "other/unknown",
}
"""Our buckets -> the categories of Google's ml-goodput-measurement (the HTML's words)."""

ML_GOODPUT_BADPUT: dict[str, str | None] = {
    "productive": None,  # goodput_time["TOTAL"]
    "wasted": "WASTED_PROGRESS_FROM_DISRUPTION",
    "detection": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "regroup": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "healing": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "replacement_wait": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "checkpoint": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "startup": "TRAINING_PREP",
    "standby": "OTHER",
    "data_wait": "DATA_LOADING_SYNC",
    "other": "OTHER",
}
"""Our buckets -> ml-goodput-measurement's `BadputType` member names (its
`goodput_utils.BadputType`, v0.2.x); "productive" is its goodput ``TOTAL``. A
checkpoint restore happens inside our "startup" (a resumed worker loads before
its first generation), so UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME is not split out."""


def ml_goodput_metrics(rep: Report) -> dict[str, Any]:
    """The run's ledger in the shape of ml-goodput-measurement's workload metrics
    (`WorkloadMetricDetails`: goodput_time, badput_time by `BadputType` name,
    max_productive_step, total_elapsed_time, disruption_count, ideal_step_time),
    so dashboards built for it read elastrain's numbers. Seconds are job seconds:
    our member-seconds divided by the job's capacity (its target member count),
    which is how a job-level ledger counts a stretch when every member is in it."""
    gp = rep.goodput
    cap = max(gp.capacity, 1)
    badput: dict[str, float] = {}
    for bucket, seconds in gp.buckets.items():
        name = ML_GOODPUT_BADPUT[bucket]
        if name is not None:
            badput[name] = badput.get(name, 0.0) + seconds / cap
    return {
        "goodput_time": {"TOTAL": gp.buckets["productive"] / cap},
        "badput_time": badput,
        "max_productive_step": max((n for _, n in rep.commits), default=0),
        "total_elapsed_time": gp.wall_s,
        "disruption_count": len(rep.recoveries),
        "ideal_step_time": statistics.median(rep.step_times) if rep.step_times else None,
    }


def report_json(rep: Report) -> dict[str, Any]:
    """What `elastrain report --json` writes: the ledger in member-seconds (our
    buckets), the goodput ratios, and `ml_goodput_metrics`."""
    gp = rep.goodput
    return {
        "run_dir": rep.run_dir,
        "job_id": rep.job_id,
        "status": rep.status,
        "capacity": gp.capacity,
        "wall_s": gp.wall_s,
        "member_seconds": dict(gp.buckets),
        "time_goodput": gp.time_goodput,
        "throughput_goodput": gp.throughput_goodput,
        "committed_samples": gp.committed_samples,
        "ml_goodput": ml_goodput_metrics(rep),
        "scalars": {k: {"value": v, "step": st} for k, (v, st) in rep.scalars.items()},
        "stragglers": [dataclasses.asdict(ep) for ep in rep.stragglers],
    }


@dataclass(frozen=True)
class Report:
    """Everything the report shows, computed from a run's events."""

    run_dir: str
    job_id: str
    status: str
    started: float | None
    goodput: Goodput
    efficiency: Efficiency
    recoveries: list[Recovery]
    joins: list[JoinTiming]
    step_times: list[float]
    members: list[tuple[float, int]]
    commits: list[tuple[float, int]]
    faults: list[tuple[float, str]]
    scalars: dict[str, tuple[float, int]] = field(default_factory=dict)
    """The script's own scalars (`trainer.log`): the last (value, step) per name."""
    stragglers: list[Episode] = field(default_factory=list)
    """Stretches of steps in which a member computed slower than its peers
    (`elastrain.observe.stragglers`)."""

    @property
    def estimate_label(self) -> str | None:
        """The estimate meter's label when any energy figure is an estimate."""
        if not self.efficiency.energy_estimate:
            return None
        return next((x for x in self.efficiency.power_labels if x.startswith("ESTIMATE")),
                    "ESTIMATE")  # fmt: skip


def build_report(
    run_dir: str | os.PathLike[str],
    *,
    peak_tflops: float | None = None,
    grid_gco2_per_kwh: float | None = None,
) -> Report:
    ev = read_events(run_dir)
    return report_from_events(ev, str(run_dir), peak_tflops=peak_tflops,
                              grid_gco2_per_kwh=grid_gco2_per_kwh)  # fmt: skip


def report_from_events(
    ev: Sequence[Event],
    run_dir: str = "",
    *,
    peak_tflops: float | None = None,
    grid_gco2_per_kwh: float | None = None,
) -> Report:
    ev = sorted((e for e in ev if isinstance(e.get("t"), int | float)), key=lambda e: e["t"])
    gp = goodput(ev)
    ef = efficiency(ev, gp, peak_tflops=peak_tflops, grid_gco2_per_kwh=grid_gco2_per_kwh)
    js = next((e for e in ev if e.get("kind") == "job_start"), None)
    je = next((e for e in reversed(ev) if e.get("kind") == "job_end"), None)
    t0 = float(js["t"]) if js else float(ev[0]["t"]) if ev else 0.0
    members: list[tuple[float, int]] = []
    commits: list[tuple[float, int]] = []
    step_times: list[float] = []
    seen: set[int] = set()
    for e in ev:
        k = e.get("kind")
        if k == "generation_ready" and isinstance(e.get("members"), list):
            members.append((float(e["t"]) - t0, len(e["members"])))
        elif k == "step_commit" and isinstance(e.get("step"), int) and e["step"] not in seen:
            seen.add(e["step"])
            commits.append((float(e["t"]) - t0, e["step"] + 1))
            if isinstance(e.get("step_s"), int | float):
                step_times.append(float(e["step_s"]))
        elif k == "job_end":
            members.append((float(e["t"]) - t0, 0))
    recs = recoveries(ev)
    return Report(
        run_dir=run_dir,
        job_id=str(js.get("job_id", "")) if js else "",
        status=str(je.get("status", "running?")) if je else "running (no job_end yet)",
        started=float(js["t"]) if js else None,
        goodput=gp,
        efficiency=ef,
        recoveries=recs,
        joins=joins(ev),
        step_times=step_times,
        members=members,
        commits=commits,
        faults=[(r.t0 - t0, f"{r.fault} {r.member}") for r in recs],
        scalars=last_scalars(ev),
        stragglers=straggler_episodes(ev),
    )


# ---- formatting helpers --------------------------------------------------------------


def si(v: float | None, unit: str, digits: int = 3) -> str:
    """1234.5, "J" -> "1.23 kJ"; None -> "n/a"."""
    if v is None or not math.isfinite(v):
        return "n/a"
    if v == 0:
        return f"0 {unit}"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""),
                           (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):  # fmt: skip
        if abs(v) >= factor or factor == 1e-9:
            return f"{v / factor:.{digits}g} {prefix}{unit}"
    return f"{v:.{digits}g} {unit}"


def pct(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.1%}"


def headline(rep: Report) -> list[tuple[str, str, bool]]:
    """(name, value, is_estimate) of the headline numbers, in display order."""
    gp, ef = rep.goodput, rep.efficiency
    est = ef.energy_estimate
    totals = [r.total_s for r in rep.recoveries if r.total_s is not None]
    out = [
        ("time goodput", pct(gp.time_goodput), False),
        ("throughput goodput", pct(gp.throughput_goodput), False),
        ("committed steps", str(ef.committed_steps), False),
        ("wall time", f"{gp.wall_s:.1f} s", False),
        ("failures", str(len(rep.recoveries)), False),
        ("median recovery", f"{statistics.median(totals):.2f} s" if totals else "n/a", False),
        ("energy", si(ef.energy_j, "J"), est),
        ("energy on badput", si(ef.badput_j, "J"), est),
        ("energy on failures", si(ef.failure_j, "J"), est),
        ("mean power", si(ef.mean_watts, "W"), est),
        ("joules per step", si(ef.joules_per_step, "J"), est),
        ("joules per sample", si(ef.joules_per_sample, "J"), est),
        ("achieved TFLOPS", f"{ef.achieved_tflops:.3g}" if ef.achieved_tflops else "n/a", False),
        ("MFU", _mfu(ef.mfu), ef.peak_estimate),
        ("TFLOPS per watt", f"{ef.tflops_per_watt:.3g}" if ef.tflops_per_watt else "n/a", est),
        ("CO2e", si(ef.co2e_g, "g"), est),
    ]
    if ef.joules_per_token is not None:
        out.insert(12, ("joules per token", si(ef.joules_per_token, "J"), est))
    return out


def _mfu(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3%}" if v < 0.01 else f"{v:.1%}"


def format_summary(rep: Report) -> str:
    """The terminal summary: headline numbers, buckets, and the estimate label."""
    gp, ef = rep.goodput, rep.efficiency
    lines = [f"run {rep.job_id or rep.run_dir}: {rep.status}; {ef.committed_steps} steps in "
             f"{gp.wall_s:.1f} s on {gp.capacity} members"]  # fmt: skip
    for name, value, est in headline(rep):
        lines.append(f"  {name:<20}{value}{'  (ESTIMATE)' if est else ''}")
    lines.append(f"  {'bucket':<18}{'member-s':>10}{'share':>8}{'energy':>12}")
    for b in BUCKETS:
        s = gp.buckets[b]
        e = ef.energy_by_bucket.get(b, 0.0) if ef.energy_j is not None else None
        share = s / gp.total_s if gp.total_s > 0 else 0.0
        lines.append(f"  {b:<18}{s:>10.2f}{share:>8.1%}{si(e, 'J'):>12}")
    if rep.estimate_label:
        lines.append(f"  power: {rep.estimate_label}")
    elif ef.power_labels:
        lines.append("  power: " + "; ".join(ef.power_labels))
    if ef.peak_tflops:
        lines.append(f"  MFU peak: {ef.peak_tflops:.4g} TFLOPS x {ef.devices} device(s) "
                     f"({ef.device}; {ef.peak_source})")  # fmt: skip
    lines.append(f"  CO2e at {ef.grid_gco2_per_kwh:g} gCO2e/kWh")
    if rep.scalars:
        logged = ", ".join(f"{n} {v:.4g} (step {s})" for n, (v, s) in rep.scalars.items())
        lines.append(f"  logged (last): {logged}")
    causes = [(r, n) for r, n in by_cause(rep.recoveries) if r.cause is not None]
    if causes:
        lines.append("  script errors (each one bug, shown once):")
        lines.extend(f"    {n} x {r.how} (at {str(r.cause).split(' at ', 1)[-1]}; first: {r.member})"
                     for r, n in causes)  # fmt: skip
    if rep.stragglers:
        lines.append("  stragglers:")
        lines.extend(f"    {line}" for line in format_episodes(rep.stragglers).splitlines())
    return "\n".join(lines)


# ---- HTML ----------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1300px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:26px 0 8px}
.meta{color:#555;font-size:13px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:8px;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 10px;background:#fafafa}
.card .v{font-size:19px;font-weight:600} .card .n{font-size:12px;color:#555}
.est{color:#b35806;font-size:11px;font-weight:700}
.banner{background:#fff3e0;border:1px solid #f0a14a;padding:8px 12px;border-radius:6px;margin:8px 0}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:12px}
figure{margin:0;border:1px solid #eee;border-radius:6px;padding:6px;background:#fff}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
"""

RECORD_RECTS = """
addEventListener('load',function(){document.querySelectorAll('figure[data-plot]').forEach(
function(f){var r=f.getBoundingClientRect();f.setAttribute('data-rect',
[Math.round(r.left+scrollX),Math.round(r.top+scrollY),Math.round(r.width),Math.round(r.height)].join(','));});});
"""


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{html.escape(x)}</th>" for x in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{h}</tr>{body}</table>"


def _n(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def recovery_bands(rep: Report) -> list[plots.Band]:
    t0 = rep.started or 0.0
    out = []
    for r in rep.recoveries:
        t = r.t0 - t0
        for ph in r.phases:
            if not math.isnan(ph.seconds):
                out.append(plots.Band(t, t + ph.seconds, ph.name))
                t += ph.seconds
    return out


def render_html(rep: Report) -> str:
    gp, ef = rep.goodput, rep.efficiency
    est_label = rep.estimate_label
    cards = "".join(
        f'<div class="card"><div class="v">{html.escape(v)}</div><div class="n">'
        f"{html.escape(n)}{' <span class=est>ESTIMATE</span>' if est else ''}</div></div>"
        for n, v, est in headline(rep)
    )
    banner = (f'<div class="banner"><b>Energy figures are an ESTIMATE</b>: '
              f"{html.escape(est_label)}. No power meter (NVML, RAPL) was readable.</div>"
              if est_label else "")  # fmt: skip
    util = ef.series.get("gpu_util") or ef.series.get("cpu_util") or []
    power_label = est_label or ("; ".join(ef.power_labels) or "no meter")
    figs = {
        "timeline": plots.timeline(rep.members, rep.commits, rep.faults, recovery_bands(rep),
                                   gp.wall_s, gp.capacity),  # fmt: skip
        "steptime": plots.histogram(rep.step_times),
        "goodput": plots.stacked_bars(
            [("time", gp.buckets)]
            + ([("energy", ef.energy_by_bucket)] if ef.energy_j else []),
            plots.BUCKET_COLORS, "Goodput breakdown (share of member-seconds and of energy)",
            "member-s"),  # fmt: skip
        "recovery": plots.stacked_bars(
            [(f"{r.fault} {r.member} @{r.t0 - (rep.started or 0):.1f}s",
              {p.name: p.seconds for p in r.phases if not math.isnan(p.seconds)})
             for r in rep.recoveries],
            plots.PHASE_COLORS, "Recovery breakdown per failure (seconds)", "s", share=False),
        "power": plots.power(ef.series.get("watts", []), ef.series.get("joules", []), util,
                             power_label),
    }  # fmt: skip
    fig = {k: f'<figure data-plot="{k}">{v}</figure>' for k, v in figs.items()}
    bucket_rows = [
        [b, f"{gp.buckets[b]:.2f}", pct(gp.buckets[b] / gp.total_s if gp.total_s else 0.0),
         si(ef.energy_by_bucket.get(b), "J") if ef.energy_j is not None else "n/a",
         ML_GOODPUT[b]]
        for b in BUCKETS
    ]  # fmt: skip
    rec_rows = [
        [r.fault if n == 1 else f"{r.fault} x{n}: {r.cause}", r.member,
         _n(r.t0 - (rep.started or 0.0), ".2f"), str(r.gen)]
        + [_n(r.phase(p)) for p in PHASES] + [_n(r.total_s), ",".join(r.survivors),
                                              r.replacement or "-", ",".join(r.promoted) or "-"]
        for r, n in by_cause(rep.recoveries)
    ]  # fmt: skip
    join_rows = [
        [j.member, _n(j.spawned_t - (rep.started or 0.0), ".2f"), _n(j.registered_s),
         _n(j.group_s), _n(j.healed_s), _n(j.first_step_s), si(float(j.heal_bytes), "B")]
        for j in rep.joins
    ]  # fmt: skip
    eff_rows = [
        ["FLOPs per step", si(float(ef.flops_per_step), "FLOP") if ef.flops_per_step else "n/a",
         "torch.utils.flop_counter, one micro-batch forward+backward, scaled to the global batch"],
        ["achieved TFLOPS (job)", _n(ef.achieved_tflops, ".4g"), "committed FLOPs / wall time"],
        ["achieved TFLOPS (stepping)", _n(ef.achieved_tflops_stepping, ".4g"),
         "FLOPs per step / median committed step time"],
        ["peak TFLOPS per device", _n(ef.peak_tflops, ".4g"),
         f"{ef.device or '?'} x {ef.devices}; {ef.peak_source or 'unknown'}"],
        ["MFU (job / stepping)", f"{_mfu(ef.mfu)} / {_mfu(ef.mfu_stepping)}",
         "achieved / (peak x devices)" + (" - peak is an ESTIMATE" if ef.peak_estimate else "")],
        ["energy", si(ef.energy_j, "J"), power_label],
        ["TFLOPS per watt", _n(ef.tflops_per_watt, ".3g"), "committed TFLOP / joules"],
        ["CO2e (all / badput)", f"{si(ef.co2e_g, 'g')} / {si(ef.badput_co2e_g, 'g')}",
         f"at {ef.grid_gco2_per_kwh:g} gCO2e/kWh"],
    ]  # fmt: skip
    if est_label:
        for row in eff_rows:
            if row[0] in ("energy", "TFLOPS per watt", "CO2e (all / badput)"):
                row[0] += " (ESTIMATE)"
    scalar_rows = [[n, f"{v:.6g}", str(s)] for n, (v, s) in rep.scalars.items()]
    scalars = (
        "<h2>Logged scalars (trainer.log, last value)</h2>"
        + _table(["name", "value", "step"], scalar_rows)
        if scalar_rows
        else ""
    )
    straggler_rows = [[ep.member, f"{ep.first}-{ep.last}", f"{ep.peak:.2f}x"]
                      for ep in rep.stragglers]  # fmt: skip
    stragglers = (
        "<h2>Stragglers (compute per sample against the other members')</h2>"
        + _table(["member", "steps", "up to"], straggler_rows)
        if straggler_rows
        else ""
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep.started)) if rep.started else "?"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>elastrain report {html.escape(rep.job_id)}</title>
<style>{CSS}</style></head><body>
<h1>elastrain run report</h1>
<div class="meta">job <b>{html.escape(rep.job_id)}</b> &middot; {html.escape(rep.status)} &middot;
started {when} &middot; {gp.capacity} members target &middot; {html.escape(rep.run_dir)}</div>
{banner}
<div class="cards" id="headline">{cards}</div>
<h2>Timeline</h2>{fig["timeline"]}
<div class="grid2"><div><h2>Step times</h2>{fig["steptime"]}</div>
<div><h2>Goodput</h2>{fig["goodput"]}</div></div>
<div class="grid2"><div><h2>Recoveries</h2>{fig["recovery"]}</div>
<div><h2>Goodput buckets</h2>{_table(["bucket", "member-s", "share", "energy", "ml-goodput category"], bucket_rows)}
<p class="meta">time goodput {pct(gp.time_goodput)}; throughput goodput {pct(gp.throughput_goodput)}
({gp.committed_samples} samples committed; nominal {_n(gp.nominal_samples_per_s, ".1f")} samples/s)</p></div></div>
{scalars}
{stragglers}
<h2>Power and energy</h2>{fig["power"]}
<h2>Efficiency</h2>{_table(["figure", "value", "how"], eff_rows)}
<h2>Recovery phases (seconds)</h2>{_table(["fault", "member", "t0", "gen", *PHASES, "total", "survivors", "replacement", "promoted spare"], rec_rows)}
<h2>Joiners (seconds from spawn)</h2>{_table(["member", "spawned", "registered", "group", "healed", "first step", "healed bytes"], join_rows)}
<script>{RECORD_RECTS}</script>
</body></html>
"""


def write_report(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    **kw: Any,
) -> tuple[Path, Report]:
    """Build the report of `run_dir` and write it (default `<run_dir>/report.html`)."""
    rep = build_report(run_dir, **kw)
    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    path.write_text(render_html(rep), encoding="utf-8")
    return path, rep
