"""Compute and energy efficiency of a run, from its events (pure, like the ledger).

Inputs: the `flops_measured` events (FLOPs per step, the device and its peak),
the `power_sample` events (energy per power domain over time), the committed
steps and the goodput ledger's segments. Definitions (docs/guide/observability.md):

  achieved TFLOPS      FLOPs of the committed steps / job wall time (the job's
                       rate, badput included); "while stepping": FLOPs per
                       step / median committed step time
  MFU                  achieved FLOP/s / (peak FLOP/s per device x devices);
                       CPU workers on one host share one device (the host)
  energy               every power domain counted once (two workers reading
                       the same GPU or CPU package measure the same joules)
  energy per bucket    each domain's energy over an interval is split over the
                       goodput buckets of the member-seconds in it (a process's
                       own estimate: over that process's buckets only)
  badput energy        energy - energy of the productive bucket; failure
                       energy: of wasted, detection, regroup, healing, replacement_wait
  TFLOPS per watt      committed FLOPs / joules / 1e12 (= TFLOP per joule)
  CO2e                 kWh x grid intensity (gCO2e/kWh, configurable)

Anything computed from an estimate meter carries `is_estimate` and its label.
"""

from __future__ import annotations

import bisect
import math
import os
import re
import socket
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastrain import env
from elastrain.observe.goodput import BUCKETS, Goodput, Segment

Event = Mapping[str, Any]

FAILURE_BUCKETS = ("wasted", "detection", "regroup", "healing", "replacement_wait")
"""The buckets a failure costs; their energy is what failures cost in joules."""

DEFAULT_GRID_GCO2_PER_KWH = 400.0
"""Default grid carbon intensity (a round figure near the world average); set
your grid's with --grid-intensity or $ELASTRAIN_GRID_GCO2_PER_KWH."""

# Dense peak TFLOPS per device, from the vendors' data sheets (no sparsity).
# Matched in order against the device name (case-insensitive); first match wins.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)

CPU_FLOPS_PER_CYCLE = 32
"""fp32 FLOPs per cycle per core for the CPU peak ESTIMATE (2 x 8-wide AVX2 FMA)."""


def dtype_name(dtype: Any) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float": "fp32", "float64": "fp64"}.get(s, s)  # fmt: skip


def table_peak(device: str, dtype: str) -> float | None:
    """Peak TFLOPS of `device` (a name such as "NVIDIA H200") for `dtype` from the table."""
    for pattern, peaks in PEAK_TFLOPS:
        if pattern.lower() in device.lower():
            return peaks.get(dtype, peaks.get("fp32"))
    return None


def cpu_peak_estimate(cpus: int | None = None, cpuinfo: str = "/proc/cpuinfo") -> float | None:
    """ESTIMATE of this host's fp32 peak: logical CPUs x clock x CPU_FLOPS_PER_CYCLE."""
    cpus = cpus or os.cpu_count() or 1
    try:
        with open(cpuinfo) as f:
            mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", f.read(), re.M)]
    except OSError:
        return None
    if not mhz:
        return None
    return cpus * max(mhz) * 1e6 * CPU_FLOPS_PER_CYCLE / 1e12


def device_info(model: Any) -> dict[str, Any]:
    """Where `model` runs and that device's peak: the fields `flops_measured` carries.
    device_key names the physical device (GPUs: its UUID; CPU: the host), so
    workers sharing one are counted once in MFU."""
    import torch

    p = next(iter(model.parameters()), None)
    dev = p.device if p is not None else torch.device("cpu")
    dtype = dtype_name(p.dtype if p is not None else torch.float32)
    override = os.environ.get(env.PEAK_TFLOPS)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = str(props.name)
        key = f"cuda:{getattr(props, 'uuid', '') or socket.gethostname() + ':' + str(dev.index)}"
        peak, src, est = table_peak(name, dtype), "table", False
    else:
        name, key = _cpu_name(), f"cpu:{socket.gethostname()}"
        peak, src, est = cpu_peak_estimate(), "ESTIMATE: CPUs x clock x 32 fp32 FLOP/cycle", True
    if override:
        peak, src, est = float(override), f"${env.PEAK_TFLOPS}", False
    return {"device": name, "device_key": key, "dtype": dtype, "peak_tflops": peak,
            "peak_source": src, "peak_estimate": est}  # fmt: skip


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        return f"CPU {m.group(1).strip()}" if m else "CPU"
    except OSError:
        return "CPU"


# ---- energy -------------------------------------------------------------------------


@dataclass(frozen=True)
class EnergyInterval:
    """Energy one sampler saw in one domain over [start, end] (wall seconds)."""

    domain: str
    scope: str
    proc: str
    pid: Any
    start: float
    end: float
    joules: float
    estimate: bool
    label: str


def energy_intervals(events: Sequence[Event]) -> list[EnergyInterval]:
    """The `power_sample` events as energy intervals, each domain counted once:
    samplers of a domain are taken longest-covering first, and another
    sampler's interval only where none taken so far covers its midpoint."""
    by_sampler: dict[tuple[str, Any, str], list[EnergyInterval]] = defaultdict(list)
    last: dict[tuple[str, Any, str], float] = {}
    ps = [e for e in events if e.get("kind") == "power_sample" and isinstance(e.get("t"), float)]
    for e in sorted(ps, key=lambda x: float(x["t"])):
        j, dt = e.get("joules"), e.get("interval_s")
        if not isinstance(j, int | float) or not isinstance(dt, int | float) or dt <= 0:
            continue
        key = (str(e.get("proc")), e.get("pid"), str(e.get("domain")))
        dj = float(j) - last.get(key, 0.0)
        last[key] = float(j)
        t = float(e["t"])
        by_sampler[key].append(
            EnergyInterval(key[2], str(e.get("scope")), key[0], key[1], t - float(dt), t,
                           max(0.0, dj), bool(e.get("estimate")), str(e.get("label"))))  # fmt: skip
    out: list[EnergyInterval] = []
    domains: dict[str, list[list[EnergyInterval]]] = defaultdict(list)
    for key, ivs in by_sampler.items():
        domains[key[2]].append(ivs)
    for samplers in domains.values():
        samplers.sort(key=lambda ivs: -sum(i.end - i.start for i in ivs))
        starts: list[float] = []
        ends: list[float] = []
        for ivs in samplers:
            taken = []
            for iv in ivs:
                mid = (iv.start + iv.end) / 2
                k = bisect.bisect_right(starts, mid) - 1
                if k < 0 or ends[k] < mid:
                    taken.append(iv)
            out.extend(taken)
            merged = sorted(
                list(zip(starts, ends, strict=True)) + [(i.start, i.end) for i in taken]
            )
            starts, ends = [a for a, _ in merged], [b for _, b in merged]
    out.sort(key=lambda i: i.start)
    return out


class _Timeline:
    """The ledger's per-process segments, for "which buckets in [a, b]" queries."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.by_proc: dict[tuple[str, Any], list[Segment]] = defaultdict(list)
        for g in segments:
            if g.member is not None:
                self.by_proc[(g.member, g.pid)].append(g)
        self.starts = {}
        for k, gs in self.by_proc.items():
            gs.sort(key=lambda g: g.start)
            self.starts[k] = [g.start for g in gs]

    def mix(self, a: float, b: float, who: tuple[str, Any] | None = None) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        keys = [who] if who is not None else list(self.by_proc)
        for k in keys:
            gs = self.by_proc.get(k, [])
            i = max(0, bisect.bisect_right(self.starts.get(k, []), a) - 1)
            while i < len(gs) and gs[i].start < b:
                ov = min(b, gs[i].end) - max(a, gs[i].start)
                if ov > 0:
                    out[gs[i].bucket] += ov
                i += 1
        return out


def energy_by_bucket(intervals: Sequence[EnergyInterval], gp: Goodput) -> dict[str, float]:
    """Joules per goodput bucket (see the module docstring); sums to the total energy."""
    tl = _Timeline(gp.segments)
    out = dict.fromkeys(BUCKETS, 0.0)
    for iv in intervals:
        who = (iv.proc, iv.pid) if iv.scope == "process" else None
        mix = tl.mix(iv.start, iv.end, who)
        total = sum(mix.values())
        if total <= 0:
            out["other"] += iv.joules
            continue
        for b, s in mix.items():
            out[b] += iv.joules * s / total
    return out


# ---- the summary --------------------------------------------------------------------


@dataclass(frozen=True)
class Efficiency:
    """Compute and energy figures of a run (None: not measurable from its events).
    Every field derived from an estimate meter is flagged by `energy_estimate`
    and labelled by `power_labels`."""

    flops_per_step: int | None
    flops_per_sample: float | None
    tokens_per_sample: int | None
    device: str | None
    devices: int
    peak_tflops: float | None
    peak_source: str | None
    peak_estimate: bool
    committed_steps: int
    achieved_tflops: float | None
    achieved_tflops_stepping: float | None
    mfu: float | None
    mfu_stepping: float | None
    energy_j: float | None
    energy_by_bucket: dict[str, float]
    badput_j: float | None
    failure_j: float | None
    mean_watts: float | None
    joules_per_step: float | None
    joules_per_sample: float | None
    joules_per_token: float | None
    tflops_per_watt: float | None
    grid_gco2_per_kwh: float
    co2e_g: float | None
    badput_co2e_g: float | None
    energy_estimate: bool
    power_labels: list[str]
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Over time (seconds from job start): "watts", "joules" (cumulative),
    "cpu_util" (mean of the workers' own shares, summed), "host_cpu_util", "gpu_util"."""


def grid_intensity(value: float | None = None) -> float:
    if value is None:
        raw = os.environ.get(env.GRID_GCO2_PER_KWH)
        value = float(raw) if raw else DEFAULT_GRID_GCO2_PER_KWH
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"grid intensity must be >= 0 gCO2e/kWh, got {value}")
    return value


def efficiency(
    events: Sequence[Event],
    gp: Goodput,
    *,
    peak_tflops: float | None = None,
    grid_gco2_per_kwh: float | None = None,
    bins: int = 200,
) -> Efficiency:
    """Compute and energy figures of a run from its events and its ledger. Pure
    (reads no files); `peak_tflops` overrides the workers' per-device peak."""
    grid = grid_intensity(grid_gco2_per_kwh)
    evs = sorted((e for e in events if isinstance(e.get("t"), int | float)), key=lambda e: e["t"])
    fl = [e for e in evs if e.get("kind") == "flops_measured"]
    f0 = fl[0] if fl else {}
    fps = f0.get("flops_per_step")
    fps = int(fps) if isinstance(fps, int | float) and fps > 0 else None
    steps: dict[int, float] = {}
    for e in evs:
        if e.get("kind") == "step_commit" and isinstance(e.get("step"), int):
            s = e.get("step_s")
            if e["step"] not in steps and isinstance(s, int | float):
                steps[int(e["step"])] = float(s)
    n = len(steps)
    peak = peak_tflops if peak_tflops is not None else f0.get("peak_tflops")
    peak_src = "override" if peak_tflops is not None else f0.get("peak_source")
    peak_est = bool(f0.get("peak_estimate")) and peak_tflops is None
    keys = {str(e.get("device_key")) for e in fl}
    devices = max(1, min(len(keys), gp.capacity or len(keys))) if keys else 0
    total_flops = fps * n if fps else None
    tf = total_flops / gp.wall_s / 1e12 if total_flops and gp.wall_s > 0 else None
    med = statistics.median(steps.values()) if steps else None
    tf_step = fps / med / 1e12 if fps and med else None
    peak_all = peak * devices if isinstance(peak, int | float) and peak > 0 and devices else None

    ivs = energy_intervals(evs)
    energy = sum(i.joules for i in ivs) if ivs else None
    by_bucket = energy_by_bucket(ivs, gp) if ivs else dict.fromkeys(BUCKETS, 0.0)
    badput = energy - by_bucket["productive"] if energy is not None else None
    failure = sum(by_bucket[b] for b in FAILURE_BUCKETS) if energy is not None else None
    covered = _covered(ivs)
    samples = gp.committed_samples
    tps = f0.get("tokens_per_sample")
    labels = sorted({i.label for i in ivs})

    def per(x: float | None, d: float | None) -> float | None:
        return x / d if x is not None and d else None

    t0 = _job_start(evs)
    return Efficiency(
        flops_per_step=fps,
        flops_per_sample=f0.get("flops_per_sample"),
        tokens_per_sample=tps if isinstance(tps, int) else None,
        device=f0.get("device"),
        devices=devices,
        peak_tflops=float(peak) if isinstance(peak, int | float) else None,
        peak_source=peak_src,
        peak_estimate=peak_est,
        committed_steps=n,
        achieved_tflops=tf,
        achieved_tflops_stepping=tf_step,
        mfu=per(tf, peak_all),
        mfu_stepping=per(tf_step, peak_all),
        energy_j=energy,
        energy_by_bucket=by_bucket,
        badput_j=badput,
        failure_j=failure,
        mean_watts=per(energy, covered),
        joules_per_step=per(energy, n),
        joules_per_sample=per(energy, samples),
        joules_per_token=per(energy, samples * tps if isinstance(tps, int) else None),
        tflops_per_watt=per(total_flops / 1e12 if total_flops else None, energy),
        grid_gco2_per_kwh=grid,
        co2e_g=energy / 3.6e6 * grid if energy is not None else None,
        badput_co2e_g=badput / 3.6e6 * grid if badput is not None else None,
        energy_estimate=any(i.estimate for i in ivs),
        power_labels=labels,
        series=_series(evs, ivs, t0, bins),
    )


def _job_start(evs: Sequence[Event]) -> float:
    js = next((e for e in evs if e.get("kind") == "job_start"), None)
    return float((js or evs[0])["t"]) if evs else 0.0


def _covered(ivs: Sequence[EnergyInterval]) -> float | None:
    """Wall seconds covered by any interval (the union)."""
    if not ivs:
        return None
    total, end = 0.0, -math.inf
    for i in sorted(ivs, key=lambda x: x.start):
        if i.end > end:
            total += i.end - max(i.start, end)
            end = i.end
    return total


def _series(
    evs: Sequence[Event], ivs: Sequence[EnergyInterval], t0: float, bins: int
) -> dict[str, list[tuple[float, float]]]:
    ps = [e for e in evs if e.get("kind") == "power_sample"]
    if not ivs and not ps:
        return {}
    lo = min([i.start for i in ivs] + [float(e["t"]) for e in ps])
    hi = max([i.end for i in ivs] + [float(e["t"]) for e in ps])
    width = max((hi - lo) / bins, 1e-3)
    nb = max(1, math.ceil((hi - lo) / width))
    joules = [0.0] * nb
    for i in ivs:
        a, b = i.start, i.end
        if b <= a:
            continue
        k = max(0, int((a - lo) / width))
        while k < nb and lo + k * width < b:
            x0, x1 = lo + k * width, lo + (k + 1) * width
            joules[k] += i.joules * max(0.0, min(b, x1) - max(a, x0)) / (b - a)
            k += 1
    mid = [lo + (k + 0.5) * width - t0 for k in range(nb)]
    cum, acc = [], 0.0
    for k in range(nb):
        acc += joules[k]
        cum.append((lo + (k + 1) * width - t0, acc))
    out = {"watts": [(mid[k], joules[k] / width) for k in range(nb)], "joules": cum}
    for field_, name, how in (("cpu_util", "cpu_util", "sum"), ("host_cpu_util",
                              "host_cpu_util", "mean"), ("util", "gpu_util", "mean")):  # fmt: skip
        per_bin: dict[int, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
        for e in ps:
            v = e.get(field_)
            if isinstance(v, int | float):
                k = min(nb - 1, int((float(e["t"]) - lo) / width))
                per_bin[k][(e.get("proc"), e.get("pid"), e.get("domain"))].append(float(v))
        pts = []
        for k in sorted(per_bin):
            means = [statistics.fmean(v) for v in per_bin[k].values()]
            if field_ == "cpu_util":  # one value per process (not per domain)
                by_proc: dict[Any, float] = {}
                for (pr, pid, _d), v in per_bin[k].items():
                    by_proc[(pr, pid)] = statistics.fmean(v)
                means = list(by_proc.values())
            pts.append((mid[k], sum(means) if how == "sum" else statistics.fmean(means)))
        if pts:
            out[name] = pts
    return out
