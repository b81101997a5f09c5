"""Inline SVG plots for the run report (no plotting dependency, no JavaScript).

Each function returns one `<svg>` element as a string, sized in CSS pixels,
ready to be inlined into the report's HTML. Inputs are plain numbers; times
are seconds from the job's start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from elastrain.ticks import nice_ticks

BUCKET_COLORS = {
    "productive": "#2ca02c",
    "wasted": "#d62728",
    "detection": "#ff7f0e",
    "regroup": "#bcbd22",
    "healing": "#17becf",
    "replacement_wait": "#e377c2",
    "checkpoint": "#8c564b",
    "startup": "#7f7f7f",
    "standby": "#aec7e8",
    "data_wait": "#9467bd",
    "other": "#c7c7c7",
}
PHASE_COLORS = {
    "detect": "#e6550d",
    "quorum": "#fd8d3c",
    "regroup": "#fdbe85",
    "heal": "#31a354",
    "first_step": "#3182bd",
}
MEMBERS_FILL = "#c6dbef"
STEPS_LINE = "#08519c"
FAULT_LINE = "#d62728"
HIST_FILL = "#6a51a3"
POWER_FILL = "#fdae6b"
ENERGY_LINE = "#a63603"
UTIL_LINE = "#3182bd"


def _f(v: float) -> str:
    return f"{v:.1f}"


def _num(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
        return f"{v:.2g}"
    return f"{v:.4g}"


@dataclass
class _Frame:
    """A plot area with linear axes: data -> pixel mapping and axis drawing."""

    width: int
    height: int
    xlo: float
    xhi: float
    ylo: float
    yhi: float
    left: int = 64
    right: int = 24
    top: int = 30
    bottom: int = 44

    def x(self, v: float) -> float:
        span = (self.xhi - self.xlo) or 1.0
        return self.left + (v - self.xlo) / span * (self.width - self.left - self.right)

    def y(self, v: float) -> float:
        span = (self.yhi - self.ylo) or 1.0
        return self.top + (1 - (v - self.ylo) / span) * (self.height - self.top - self.bottom)

    def axes(self, title: str, xlabel: str, ylabel: str, yticks: bool = True) -> list[str]:
        w, h, lft, t = self.width, self.height, self.left, self.top
        x1, y1 = w - self.right, h - self.bottom
        out = [
            f'<text x="{lft}" y="18" font-weight="bold">{escape(title)}</text>',
            f'<line x1="{lft}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#333"/>',
            f'<line x1="{lft}" y1="{t}" x2="{lft}" y2="{y1}" stroke="#333"/>',
            f'<text x="{(lft + x1) / 2:.0f}" y="{y1 + 30}" text-anchor="middle">{escape(xlabel)}</text>',
            f'<text x="14" y="{(t + y1) / 2:.0f}" text-anchor="middle" '
            f'transform="rotate(-90 14 {(t + y1) / 2:.0f})">{escape(ylabel)}</text>',
        ]
        for v in nice_ticks(self.xlo, self.xhi):
            if self.xlo <= v <= self.xhi:
                px = self.x(v)
                out.append(
                    f'<line x1="{_f(px)}" y1="{y1}" x2="{_f(px)}" y2="{y1 + 4}" stroke="#333"/>'
                )
                out.append(
                    f'<text x="{_f(px)}" y="{y1 + 16}" text-anchor="middle">{_num(v)}</text>'
                )
        if yticks:
            for v in nice_ticks(self.ylo, self.yhi, 5):
                if self.ylo <= v <= self.yhi:
                    py = self.y(v)
                    out.append(
                        f'<line x1="{lft - 4}" y1="{_f(py)}" x2="{x1}" y2="{_f(py)}" stroke="#eee"/>'
                    )
                    out.append(
                        f'<text x="{lft - 6}" y="{_f(py + 4)}" text-anchor="end">{_num(v)}</text>'
                    )
        return out


def _svg(w: int, h: int, body: Sequence[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'font-family="sans-serif" font-size="11" role="img" aria-label="{escape(label)}">'
        + "".join(body)
        + "</svg>"
    )


def _legend(items: Sequence[tuple[str, str]], x: float, y: float, w: int) -> list[str]:
    out, cx, cy = [], x, y
    for label, color in items:
        width = 22 + 7 * len(label)
        if cx + width > w - 10:
            cx, cy = x, cy + 16
        out.append(f'<rect x="{_f(cx)}" y="{_f(cy - 9)}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{_f(cx + 14)}" y="{_f(cy)}">{escape(label)}</text>')
        cx += width
    return out


def _empty(w: int, h: int, title: str, why: str) -> str:
    return _svg(w, h, [f'<text x="10" y="18" font-weight="bold">{escape(title)}</text>',
                       f'<text x="10" y="44" fill="#666">{escape(why)}</text>'], title)  # fmt: skip


@dataclass(frozen=True)
class Band:
    """A recovery phase of one failure: [start, end] seconds, its phase name."""

    start: float
    end: float
    phase: str


def timeline(
    members: Sequence[tuple[float, int]],
    commits: Sequence[tuple[float, int]],
    faults: Sequence[tuple[float, str]],
    bands: Sequence[Band],
    end: float,
    capacity: int,
    width: int = 1240,
    height: int = 300,
) -> str:
    """Membership (filled steps, left axis), committed steps (line, right axis),
    failures (red lines) and recovery phases (bands)."""
    title = "Timeline: members, committed steps, failures and recovery phases"
    if not members and not commits:
        return _empty(width, height, title, "no generation ever started")
    top_m = max([capacity, *(m for _, m in members)]) or 1
    fr = _Frame(width, height, 0.0, max(end, 1e-3), 0.0, top_m * 1.15, right=64, bottom=64)
    out = fr.axes(title, "seconds since job start", "members")
    y0, y1 = fr.y(fr.yhi), fr.y(0)
    for b in bands:
        xa, xb = fr.x(b.start), fr.x(b.end)
        out.append(f'<rect x="{_f(xa)}" y="{_f(y0)}" width="{_f(max(1.5, xb - xa))}" '
                   f'height="{_f(y1 - y0)}" fill="{PHASE_COLORS.get(b.phase, "#ccc")}" '
                   f'fill-opacity="0.45"><title>{escape(b.phase)}</title></rect>')  # fmt: skip
    if members:
        pts = [(fr.x(0), y1)]
        for i, (t, m) in enumerate(members):
            nxt = members[i + 1][0] if i + 1 < len(members) else end
            pts += [(fr.x(t), y1), (fr.x(t), fr.y(m)), (fr.x(nxt), fr.y(m)), (fr.x(nxt), y1)]
        d = " ".join(f"{_f(a)},{_f(b)}" for a, b in pts)
        out.append(f'<polygon points="{d}" fill="{MEMBERS_FILL}" stroke="#6baed6"/>')
    if commits:
        smax = max(s for _, s in commits) or 1
        sy = _Frame(width, height, fr.xlo, fr.xhi, 0, smax * 1.05, right=64, bottom=64)
        d = " ".join(f"{_f(fr.x(t))},{_f(sy.y(s))}" for t, s in commits)
        out.append(f'<polyline points="{d}" fill="none" stroke="{STEPS_LINE}" stroke-width="2"/>')
        xr = width - fr.right
        for v in nice_ticks(0, smax * 1.05, 5):
            if v <= smax * 1.05:
                out.append(
                    f'<text x="{xr + 6}" y="{_f(sy.y(v) + 4)}" fill="{STEPS_LINE}">{_num(v)}</text>'
                )
        out.append(f'<text x="{xr + 6}" y="{fr.top - 8}" fill="{STEPS_LINE}">steps</text>')
    for t, label in faults:
        x = fr.x(t)
        out.append(f'<line x1="{_f(x)}" y1="{_f(y0)}" x2="{_f(x)}" y2="{_f(y1)}" '
                   f'stroke="{FAULT_LINE}" stroke-width="2" stroke-dasharray="5 3"/>')  # fmt: skip
        out.append(
            f'<text x="{_f(x + 3)}" y="{_f(y0 + 12)}" fill="{FAULT_LINE}">{escape(label)}</text>'
        )
    leg = [("members", MEMBERS_FILL), ("committed steps", STEPS_LINE), ("failure", FAULT_LINE)]
    leg += [(p, c) for p, c in PHASE_COLORS.items()]
    out += _legend(leg, fr.left, height - 8, width)
    return _svg(width, height, out, title)


def histogram(values: Sequence[float], width: int = 610, height: int = 280, bins: int = 30) -> str:
    """Distribution of committed step times (seconds)."""
    title = "Step time distribution (committed steps)"
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return _empty(width, height, title, "no committed step")
    lo, hi = vals[0], vals[-1]
    if hi <= lo:
        lo, hi = lo * 0.9, hi * 1.1 + 1e-6
    nb = max(1, min(bins, len(vals)))
    wd = (hi - lo) / nb
    counts = [0] * nb
    for v in vals:
        counts[min(nb - 1, int((v - lo) / wd))] += 1
    fr = _Frame(width, height, lo, hi, 0, max(counts) * 1.1)
    out = fr.axes(title, "step time (s)", "steps")
    for i, c in enumerate(counts):
        if c:
            xa, xb = fr.x(lo + i * wd), fr.x(lo + (i + 1) * wd)
            out.append(f'<rect x="{_f(xa)}" y="{_f(fr.y(c))}" width="{_f(max(1.0, xb - xa - 1))}" '
                       f'height="{_f(fr.y(0) - fr.y(c))}" fill="{HIST_FILL}"/>')  # fmt: skip
    med = vals[len(vals) // 2]
    x = fr.x(med)
    out.append(
        f'<line x1="{_f(x)}" y1="{fr.top}" x2="{_f(x)}" y2="{_f(fr.y(0))}" stroke="#000" stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{_f(x + 4)}" y="{fr.top + 10}">median {med:.3g} s</text>')
    return _svg(width, height, out, title)


def stacked_bars(
    rows: Sequence[tuple[str, Mapping[str, float]]],
    colors: Mapping[str, str],
    title: str,
    unit: str,
    width: int = 610,
    height: int | None = None,
    share: bool = True,
) -> str:
    """One horizontal stacked bar per row (label, {part: value}); `share`: each bar
    spans the full width (parts as shares of its total), else a common scale."""
    height = height or 70 + 34 * max(1, len(rows))
    if not rows or not any(sum(v for v in p.values() if v > 0) for _, p in rows):
        return _empty(width, height, title, "nothing to show")
    left, right = 130, 20
    pw = width - left - right
    scale = max(sum(v for v in p.values() if v > 0) for _, p in rows)
    out = [f'<text x="10" y="18" font-weight="bold">{escape(title)}</text>']
    y = 34
    for label, parts in rows:
        total = sum(v for v in parts.values() if v > 0)
        denom = total if share else scale
        x = float(left)
        out.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
        for name, v in parts.items():
            if v <= 0 or not math.isfinite(v):
                continue
            w = v / denom * pw
            out.append(f'<rect x="{_f(x)}" y="{y}" width="{_f(max(w, 0.8))}" height="22" '
                       f'fill="{colors.get(name, "#999")}"><title>{escape(name)}: {_num(v)} {unit}'
                       f'</title></rect>')  # fmt: skip
            if w > 44:
                out.append(f'<text x="{_f(x + w / 2)}" y="{y + 15}" text-anchor="middle" fill="#fff">'
                           f'{_num(v / total * 100) if share else _num(v)}{"%" if share else ""}</text>')  # fmt: skip
            x += w
        out.append(f'<text x="{_f(min(x + 4, width - 4))}" y="{y + 15}" text-anchor="'
                   f'{"start" if x + 60 < width else "end"}" fill="#000">'
                   f'{"" if share else _num(total) + " " + unit}</text>')  # fmt: skip
        y += 34
    used = [n for n in colors if any(p.get(n, 0) > 0 for _, p in rows)]
    out += _legend([(n, colors[n]) for n in used], 10, y + 14, width)
    return _svg(width, height + 16, out, title)


def power(
    watts: Sequence[tuple[float, float]],
    joules: Sequence[tuple[float, float]],
    util: Sequence[tuple[float, float]],
    label: str,
    width: int = 1240,
    height: int = 280,
) -> str:
    """Power (filled, left axis), cumulative energy (line, right axis) and CPU
    or accelerator utilisation (line, as a share of the left axis' height)."""
    title = f"Power and energy over time ({label})"
    if not watts:
        return _empty(width, height, title, "no power samples (metering off?)")
    xs = [t for t, _ in watts] + [t for t, _ in joules]
    wmax = max(w for _, w in watts) or 1.0
    fr = _Frame(width, height, min(0.0, *xs), max(xs), 0, wmax * 1.15, right=72, bottom=60)
    out = fr.axes(title, "seconds since job start", "watts")
    pts = [(fr.x(watts[0][0]), fr.y(0))] + [(fr.x(t), fr.y(w)) for t, w in watts]
    pts.append((fr.x(watts[-1][0]), fr.y(0)))
    out.append('<polygon points="' + " ".join(f"{_f(a)},{_f(b)}" for a, b in pts)
               + f'" fill="{POWER_FILL}" stroke="#e6550d"/>')  # fmt: skip
    if joules:
        jmax = max(j for _, j in joules) or 1.0
        jf = _Frame(width, height, fr.xlo, fr.xhi, 0, jmax * 1.05, right=72, bottom=60)
        d = " ".join(f"{_f(fr.x(t))},{_f(jf.y(j))}" for t, j in joules)
        out.append(f'<polyline points="{d}" fill="none" stroke="{ENERGY_LINE}" stroke-width="2"/>')
        xr = width - fr.right
        for v in nice_ticks(0, jmax * 1.05, 5):
            if v <= jmax * 1.05:
                out.append(
                    f'<text x="{xr + 6}" y="{_f(jf.y(v) + 4)}" fill="{ENERGY_LINE}">{_num(v)}</text>'
                )
        out.append(f'<text x="{xr + 4}" y="{fr.top - 8}" fill="{ENERGY_LINE}">joules</text>')
    if util:
        uf = _Frame(width, height, fr.xlo, fr.xhi, 0, 1.0, right=72, bottom=60)
        d = " ".join(f"{_f(fr.x(t))},{_f(uf.y(min(1.0, u)))}" for t, u in util)
        out.append(
            f'<polyline points="{d}" fill="none" stroke="{UTIL_LINE}" stroke-dasharray="4 2"/>'
        )
    leg = [("power (W)", POWER_FILL), ("energy (J, right axis)", ENERGY_LINE)]
    if util:
        leg.append(("utilisation (0-100% of the height)", UTIL_LINE))
    out += _legend(leg, fr.left, height - 8, width)
    return _svg(width, height, out, title)
