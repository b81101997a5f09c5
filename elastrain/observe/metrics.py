"""Prometheus text exposition of the coordinator's live status (`GET /metrics`).

The coordinator serves it on its HTTP port at `/metrics`; like every other
path it requires the job token (`Authorization: Bearer <token>`; in Prometheus:
`authorization: {credentials_file: <run_dir>/token}`), so nothing about the job
leaks to whoever can reach the port. Pure: `prometheus_text(status)` formats
the dict that `Coordinator.status()` returns.

`elastrain_failures_total{kind}` counts the failures that
`elastrain.observe.failures.recognise_failures` recognises in what the
coordinator itself saw (`failure_counts` over its own events: removals,
generations, re-registrations, and the exits the launcher reported to it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from elastrain.observe.failures import FailureKind, recognise_failures

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, help, status key (or a function of the status)
_GAUGES: tuple[tuple[str, str, Any], ...] = (
    ("elastrain_step", "Committed steps (the next step to run).", "step"),
    ("elastrain_members", "Members of the current generation.", lambda s: len(s.get("members") or [])),
    ("elastrain_target", "Target member count of the job.", "target"),
    ("elastrain_min_members", "Fewest members that may train.", "min"),
    ("elastrain_registered_members", "Registered (live) members.",
     lambda s: len(s.get("registered") or {})),
    ("elastrain_generation", "Current generation number.", "gen"),
    ("elastrain_generation_ready", "1 when the current generation is ready and not broken.", "ready"),
    ("elastrain_steps_per_second", "Committed steps per second (recent).", "steps_per_s"),
    ("elastrain_samples_per_second", "Committed samples per second (recent).", "samples_per_s"),
    ("elastrain_loss", "Mean loss of the last committed step.", "loss"),
    ("elastrain_waiting", "1 while training is paused waiting for members.",
     lambda s: bool(s.get("waiting"))),
    ("elastrain_finished", "1 once the job has finished.", "finished"),
    ("elastrain_preempting", "1 while the job is being preempted.", "preempting"),
    ("elastrain_uptime_seconds", "Seconds since the coordinator started.", "uptime_s"),
)  # fmt: skip


FAILURES = "elastrain_failures_total"
FAILURE_KINDS = tuple(k for k in FailureKind if k is not FailureKind.COORDINATOR)
"""The kinds `elastrain_failures_total` reports. A coordinator cannot see its own
death: a restarted one starts counting from zero (a counter reset), and the
run's events (`elastrain report`) count coordinator failures."""


def failure_counts(events: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Recognised failures per kind (every kind of FAILURE_KINDS, zeros included)."""
    out = dict.fromkeys(map(str, FAILURE_KINDS), 0)
    for f in recognise_failures(events):
        if f.kind in FAILURE_KINDS:
            out[str(f.kind)] += 1
    return out


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def prometheus_text(status: Mapping[str, Any]) -> str:
    """Every gauge with a numeric value, labelled with the job id; a gauge whose
    value is unknown (e.g. the loss before the first step) is left out. Then
    `elastrain_failures_total`, one sample per kind of `status["failures"]`."""
    job = _label(str(status.get("job_id", "")))
    out: list[str] = []
    for name, help_, key in _GAUGES:
        v = _num(key(status) if callable(key) else status.get(key))
        if v is None:
            continue
        out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f'{name}{{job="{job}"}} {v!r}']
    failures = status.get("failures")
    if isinstance(failures, Mapping) and failures:
        out += [
            f"# HELP {FAILURES} Failures recognised from what the coordinator saw, by kind.",
            f"# TYPE {FAILURES} counter",
        ]
        for kind, n in failures.items():
            v = _num(n)
            if v is not None:
                out.append(f'{FAILURES}{{job="{job}",kind="{_label(str(kind))}"}} {v!r}')
    return "\n".join(out) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """name -> value of each sample line (labels dropped: the last sample of a
    name wins; `parse_samples` keeps them); for tests and `top`."""
    return {name: v for name, _labels, v in parse_samples(text)}


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(m: re.Match[str]) -> str:
    return "\n" if m[1] == "n" else m[1]


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line, in order (label values unescaped)."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        unescaped = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(labels)}
        out.append((name, unescaped, float(value)))
    return out
