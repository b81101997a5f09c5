"""Self-contained SVG line charts (no plotting dependency)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from elastrain.ticks import nice_ticks

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    err: Sequence[float] | None = None
    """Optional half-width of an error bar at each point."""


@dataclass(frozen=True)
class Marker:
    """A vertical line at x, labelled."""

    x: float
    label: str
    dash: str = "6 4"


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    markers: Sequence[Marker] = field(default_factory=tuple)
    log_x: bool = False
    y_percent: bool = False
    width: int = 760
    height: int = 460


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
                ticks.append(v)
    return ticks


def _fmt(v: float, percent: bool = False) -> str:
    if percent:
        return f"{v * 100:.4g}%"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.6g}"


def render(chart: Chart) -> str:
    """The chart as a standalone SVG document."""
    w, h = chart.width, chart.height
    left, right, top, bottom = 78, 190, 40, 58
    pw, ph = w - left - right, h - top - bottom
    xs = [x for s in chart.series for x in s.xs] + [
        m.x for m in chart.markers if math.isfinite(m.x)
    ]
    ys = []
    for s in chart.series:
        errs = s.err if s.err is not None else [0.0] * len(s.ys)
        for y, e in zip(s.ys, errs, strict=True):
            if math.isfinite(y):
                ys += [y - e, y + e]
    if not xs or not ys:
        raise ValueError("a chart needs at least one finite point")
    xlo, xhi = min(xs), max(xs)
    if chart.log_x:
        if xlo <= 0:
            raise ValueError("log_x needs positive x values")
        xlo, xhi = xlo / 1.1, xhi * 1.1
        xticks = _log_ticks(xlo, xhi) or [xlo, xhi]
    else:
        pad = (xhi - xlo) * 0.05 or 1.0
        xlo, xhi = xlo - pad, xhi + pad
        xticks = nice_ticks(xlo, xhi)
    ylo, yhi = min(ys), max(ys)
    pad = (yhi - ylo) * 0.08 or 0.01
    yticks = nice_ticks(ylo - pad, yhi + pad)
    ylo, yhi = min(yticks[0], ylo - pad), max(yticks[-1], yhi + pad)

    def px(x: float) -> float:
        if chart.log_x:
            f = (math.log(x) - math.log(xlo)) / (math.log(xhi) - math.log(xlo))
        else:
            f = (x - xlo) / (xhi - xlo)
        return left + f * pw

    def py(y: float) -> float:
        return top + (1 - (y - ylo) / (yhi - ylo)) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left + pw / 2}" y="22" text-anchor="middle" font-size="15">'
        f"{escape(chart.title)}</text>",
    ]
    for t in yticks:
        y = py(t)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t, chart.y_percent)}</text>'
        )
    for t in xticks:
        x = px(t)
        if left - 1 <= x <= left + pw + 1:
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#e5e5e5"/>'
            )
            out.append(
                f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(t)}</text>'
            )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(
        f'<text x="{left + pw / 2}" y="{h - 14}" text-anchor="middle">{escape(chart.x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(18,{top + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(chart.y_label)}</text>"
    )
    legend_y = top + 8
    for i, s in enumerate(chart.series):
        color = PALETTE[i % len(PALETTE)]
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=True) if math.isfinite(y)]
        if pts:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
        errs = s.err if s.err is not None else [0.0] * len(s.ys)
        for x, y, e in zip(s.xs, s.ys, errs, strict=True):
            if not math.isfinite(y):
                continue
            cx, cy = px(x), py(y)
            if e > 0:
                out.append(
                    f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{py(y - e):.1f}" y2="{py(y + e):.1f}" '
                    f'stroke="{color}"/>'
                )
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}"/>')
        lx = left + pw + 14
        out.append(
            f'<line x1="{lx}" x2="{lx + 22}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" '
            f'stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 28}" y="{legend_y + 4}">{escape(s.label)}</text>')
        legend_y += 20
    for m in chart.markers:
        if not math.isfinite(m.x):
            continue
        x = px(m.x)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#555" '
            f'stroke-dasharray="{m.dash}"/>'
        )
        lx = left + pw + 14
        out.append(
            f'<line x1="{lx}" x2="{lx + 22}" y1="{legend_y}" y2="{legend_y}" stroke="#555" '
            f'stroke-dasharray="{m.dash}"/>'
        )
        out.append(f'<text x="{lx + 28}" y="{legend_y + 4}">{escape(m.label)}</text>')
        legend_y += 20
    out.append("</svg>")
    return "\n".join(out) + "\n"
