"""The arithmetic of benchmarks/versus.py, as pure functions (unit-tested in
tests/test_versus.py; no I/O apart from `read_steplogs`).

Each system's logs become one list of `Commit`s and one list of `FaultMark`s:

- elastrain: `step_commit` events (lineage = generation; the loss is already
  the global batch's mean) and `fault_injected` events (`from_elastrain`);
- torchrun and torchft: the JSON lines of `_versus/steplog.py`
  (`commits_from_steplog`; lineage = restart attempt for torchrun, quorum id
  for torchft) and the faults the benchmark itself injected.

Definitions (docs/design/versus.md explains the choices):

- A step's commit time is its earliest commit in the lineage that committed it
  last (a torchrun step re-run after a restart counts when it is re-run).
- Fault -> next commit on survivors: the first commit, after the fault, by a
  process other than the victim, that could only happen once the system had
  dealt with the fault: for elastrain the first commit in the generation the
  survivors resumed in (elastrain.observe.recovery); for torchrun after a kill
  the first commit of the next restart attempt (`next_lineage_commit`); for
  torchft the first commit in a quorum formed after the fault
  (`next_lineage_commit`); for a hang that torchrun simply waits out, the first
  commit of a step the victim had not committed before the fault
  (`next_progress_commit`).
- Steps recomputed: per step, the number of lineages that committed it, less
  one (`recomputed_steps`).
- Samples dropped: per committed step, the global batch less the samples
  behind the update that was applied (`samples_dropped`).
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Commit:
    """One process's record that a step's update was applied.

    proc: the logical worker ("w1", "r1", "g1"; a replacement may reuse the id);
    lineage: elastrain generation, torchrun restart attempt or torchft quorum id;
    loss: for elastrain the global mean, else this process's mean over its `n`
    samples; step_samples: samples behind the applied update (all replicas
    together; None when unknown); participating: torchft's flag (False while a
    replica heals: its gradient was zeroed); global_loss: `loss` is already the
    global batch's mean (elastrain).
    """

    t: float
    step: int
    proc: str
    pid: int
    lineage: int
    loss: float | None
    n: int = 0
    step_samples: int | None = None
    participating: bool = True
    global_loss: bool = False
    expect: int | None = None
    """How many participating processes took part in the step (torchft: its number
    of participants; torchrun: the world size): a step with fewer of their commits
    in the logs (one died before writing its line) has no known global loss."""


@dataclass(frozen=True)
class FaultMark:
    """A fault as injected: kind "kill" or "hang", wall time, victim, its PID, and
    the number of committed steps when it fired."""

    kind: str
    t: float
    victim: str
    pid: int
    step: int


@dataclass
class Plan:
    """The fault schedule and length of one run (the same for every case of a repeat)."""

    steps: int
    kill_at: int | None
    hang_at: int | None
    hang_s: float
    replace_delay_s: float
    seed: int

    def offsets(self) -> Callable[[float], float]:
        """Draws the signal's delay after the step boundary: the same seeded
        uniform(0.2, 0.8) x step time that elastrain's FaultSchedule uses, in firing order."""
        rng = random.Random(self.seed)
        return lambda step_s: rng.uniform(0.2, 0.8) * step_s


# ---- parsing ---------------------------------------------------------------------------


def read_steplogs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """All records of the given JSON-lines files; a torn last line is skipped."""
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            text = p.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    out.sort(key=lambda r: float(r.get("t", 0.0)))
    return out


def commits_from_steplog(
    recs: Iterable[Mapping[str, Any]], lineage_key: str, world: int
) -> list[Commit]:
    """`commit` records -> Commits. lineage_key: "attempt" (torchrun) or "quorum"
    (torchft). step_samples: torchft's `participants` x this group's share;
    torchrun's `n` x world (DDP commits only with every rank)."""
    out: list[Commit] = []
    for r in recs:
        if r.get("kind") != "commit":
            continue
        n = int(r.get("n", 0))
        part = r.get("participants")
        if lineage_key == "quorum":
            samples = int(part) * n if isinstance(part, int) else None
        else:
            samples = n * world
        out.append(
            Commit(
                t=float(r["t"]), step=int(r["step"]), proc=str(r["proc"]), pid=int(r["pid"]),
                lineage=int(r.get(lineage_key, 0)), loss=_f(r.get("loss")), n=n,
                step_samples=samples, participating=bool(r.get("participating", True)),
                expect=int(part) if isinstance(part, int) else world,
            )
        )  # fmt: skip
    out.sort(key=lambda c: c.t)
    return out


def from_elastrain(
    events: Sequence[Mapping[str, Any]], global_batch: int
) -> tuple[list[Commit], list[FaultMark]]:
    """elastrain events -> Commits (lineage = gen; loss = the global mean; step_samples
    = the distinct sample ids the committing generation's members contributed) and
    the kill/hang FaultMarks the launcher injected."""
    contrib: dict[tuple[int, int], set[int]] = defaultdict(set)
    for e in events:
        if e.get("kind") == "step_contrib" and isinstance(e.get("samples"), list):
            contrib[(int(e["step"]), int(e["gen"]))].update(int(x) for x in e["samples"])
    commits = []
    for e in events:
        if e.get("kind") != "step_commit":
            continue
        s, g = int(e["step"]), int(e["gen"])
        ids = contrib.get((s, g))
        commits.append(
            Commit(
                t=float(e["t"]), step=s, proc=str(e["proc"]), pid=int(e.get("pid", 0)), lineage=g,
                loss=_f(e.get("loss")), n=0, step_samples=len(ids) if ids is not None else None,
                global_loss=True,
            )
        )  # fmt: skip
    commits.sort(key=lambda c: c.t)
    faults = [
        FaultMark(str(e["fault"]), float(e["t"]), str(e["member"]), int(e.get("pid", 0)),
                  int(e.get("step", 0)))
        for e in events
        if e.get("kind") == "fault_injected" and e.get("proc") == "launcher"
        and e.get("fault") in ("kill", "hang")
    ]  # fmt: skip
    faults.sort(key=lambda f: f.t)
    return commits, faults


def _f(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(float(x)) else None


# ---- per-step views --------------------------------------------------------------------


def final_lineage(commits: Sequence[Commit]) -> dict[int, int]:
    """step -> the lineage that committed it last (by time)."""
    out: dict[int, tuple[float, int]] = {}
    for c in commits:
        prev = out.get(c.step)
        if prev is None or c.t > prev[0]:
            out[c.step] = (c.t, c.lineage)
    return {s: lin for s, (_, lin) in sorted(out.items())}


def step_times(commits: Sequence[Commit]) -> dict[int, float]:
    """step -> its commit time: the earliest commit in its final lineage."""
    fin = final_lineage(commits)
    out: dict[int, float] = {}
    for c in commits:
        if fin.get(c.step) == c.lineage and (c.step not in out or c.t < out[c.step]):
            out[c.step] = c.t
    return dict(sorted(out.items()))


def step_time_s(commits: Sequence[Commit], lo: int, hi: int) -> float:
    """Median interval between consecutive steps' commit times over steps lo..hi-1
    (both of a pair in range): the failure-free step time. NaN if none."""
    ts = step_times(commits)
    d = [ts[s] - ts[s - 1] for s in range(lo + 1, hi) if s in ts and s - 1 in ts]
    return statistics.median(d) if d else math.nan


def global_loss_curve(commits: Sequence[Commit]) -> dict[int, float]:
    """step -> the mean loss over the samples behind the applied update: elastrain's
    own global loss; else the sample-weighted mean of the participating processes'
    local losses in the step's final lineage (one per process; a step with fewer of
    them than it `expect`s is left out)."""
    fin = final_lineage(commits)
    acc: dict[int, dict[int, tuple[float, int]]] = defaultdict(dict)
    expect: dict[int, int] = {}
    direct: dict[int, float] = {}
    for c in commits:
        if fin.get(c.step) != c.lineage or c.loss is None:
            continue
        if c.global_loss:
            direct.setdefault(c.step, c.loss)
        elif c.participating:
            acc[c.step].setdefault(c.pid, (c.loss, max(1, c.n)))
            if c.expect is not None:
                expect[c.step] = max(expect.get(c.step, 0), c.expect)
    out = dict(direct)
    for s, by_pid in acc.items():
        xs = list(by_pid.values())
        if s not in out and len(xs) >= expect.get(s, 0):
            out[s] = sum(x * w for x, w in xs) / sum(w for _, w in xs)
    return dict(sorted(out.items()))


def max_rel_dev(curve: Mapping[int, float], ref: Mapping[int, float], upto: int) -> float:
    """Largest |curve - ref| / |ref| over steps < upto present in both (NaN if none)."""
    d = [
        abs(curve[s] - ref[s]) / abs(ref[s])
        for s in range(upto)
        if s in curve and s in ref and ref[s] != 0
    ]
    return max(d) if d else math.nan


def recomputed_steps(commits: Sequence[Commit]) -> int:
    """Sum over steps of (lineages that committed the step) - 1."""
    by: dict[int, set[int]] = defaultdict(set)
    for c in commits:
        by[c.step].add(c.lineage)
    return sum(len(v) - 1 for v in by.values())


def samples_dropped(commits: Sequence[Commit], global_batch: int, upto: int) -> int:
    """Sum over committed steps < upto of global_batch - the samples behind the
    applied update (its final lineage's largest step_samples; a step without one
    counts as complete)."""
    fin = final_lineage(commits)
    best: dict[int, int] = {}
    for c in commits:
        if c.step < upto and fin.get(c.step) == c.lineage and c.step_samples is not None:
            best[c.step] = max(best.get(c.step, 0), c.step_samples)
    return sum(max(0, global_batch - n) for n in best.values())


def short_steps(commits: Sequence[Commit], global_batch: int, upto: int) -> int:
    """Committed steps < upto whose update used fewer samples than the global batch."""
    fin = final_lineage(commits)
    best: dict[int, int] = {}
    for c in commits:
        if c.step < upto and fin.get(c.step) == c.lineage and c.step_samples is not None:
            best[c.step] = max(best.get(c.step, 0), c.step_samples)
    return sum(1 for n in best.values() if n < global_batch)


# ---- recovery --------------------------------------------------------------------------


def _last_before(commits: Sequence[Commit], t0: float) -> Commit | None:
    prev = [c for c in commits if c.t < t0]
    return prev[-1] if prev else None


def next_lineage_commit(commits: Sequence[Commit], fault: FaultMark) -> float | None:
    """Seconds from the fault to the first commit, by a process other than the
    victim, in a lineage newer than the newest one committed before the fault
    (torchrun: the next restart attempt; torchft: a quorum formed after it)."""
    before = [c.lineage for c in commits if c.t < fault.t]
    lin0 = max(before) if before else -1
    for c in commits:
        if c.t >= fault.t and c.lineage > lin0 and c.pid != fault.pid:
            return c.t - fault.t
    return None


def next_progress_commit(commits: Sequence[Commit], fault: FaultMark) -> float | None:
    """Seconds from the fault to the first commit, by another process, of a step
    beyond the last one the victim committed before the fault (the step it was in
    the middle of, or later)."""
    mine = [c.step for c in commits if c.t < fault.t and c.pid == fault.pid]
    s_v = max(mine) if mine else -1
    for c in commits:
        if c.t >= fault.t and c.pid != fault.pid and c.step > s_v:
            return c.t - fault.t
    return None


def back_to_reached(commits: Sequence[Commit], fault: FaultMark) -> float | None:
    """Seconds from the fault until a step at least as far as the highest one
    committed before it is committed again in a newer lineage (torchrun: the
    restarted job has re-run what it lost)."""
    before = [c for c in commits if c.t < fault.t]
    if not before:
        return None
    reached = max(c.step for c in before)
    lin0 = max(c.lineage for c in before)
    for c in commits:
        if c.t >= fault.t and c.lineage > lin0 and c.step >= reached:
            return c.t - fault.t
    return None


def first_commit_of(
    commits: Sequence[Commit], proc: str, after: float, exclude_pid: int, participating: bool
) -> float | None:
    """Wall time of the first commit by logical worker `proc` in a process other
    than `exclude_pid` after `after` (with participating=True: one that took part
    in the step, i.e. trained rather than healed)."""
    for c in commits:
        if c.t < after or c.proc != proc or c.pid == exclude_pid:
            continue
        if participating and not c.participating:
            continue
        return c.t
    return None


# ---- summaries -------------------------------------------------------------------------


def span(xs: Iterable[float | None]) -> tuple[float, float, float, int]:
    """(min, median, max, count) of the known values; NaNs when there are none."""
    v = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not v:
        return (math.nan, math.nan, math.nan, 0)
    return (min(v), statistics.median(v), max(v), len(v))


def goodput(
    ref_span_s: float, run_span_s: float, dropped: int, steps: int, global_batch: int
) -> float:
    """Useful work per second relative to the failure-free run: the failure-free
    run's wall time from step 0 to the last step over this run's, times the share
    of the samples that were trained on."""
    if not (run_span_s > 0 and ref_span_s > 0 and steps > 0):
        return math.nan
    useful = 1.0 - dropped / (steps * global_batch)
    return ref_span_s / run_span_s * useful


Spans = Mapping[str, Mapping[str, Sequence[float]]]
"""case -> metric -> (min, median, max, count), as `span` gives them."""


def metric_noise(stats: Spans) -> dict[str, float]:
    """A run's noise per metric: the median, over the cases that measured it at
    least twice, of its relative spread over the repeats, (max - min) / median.

    Three repeats of one case can land close together by chance (two runs of
    the same case once agreed to 0.01%), so one case's own range understates
    what a second run on the same shared machine may see. All cases run the same
    model on the same machine in the same interleaved order, so the typical
    spread across them is the steadier estimate; the median keeps one erratic
    case from widening it for all."""
    rel: dict[str, list[float]] = {}
    for metrics in stats.values():
        for metric, (lo, med, hi, n) in metrics.items():
            if n >= 2 and med > 0 and not math.isnan(lo):
                rel.setdefault(metric, []).append((hi - lo) / med)
    return {m: statistics.median(v) for m, v in rel.items()}


FAMILY_ALPHA = 0.05
"""The chance that a benchmark whose every metric truly reproduces is still
reported as not reproducing (over all its metrics together)."""


@functools.cache
def tolerance_factor(repeats: int, metrics: int, alpha: float = FAMILY_ALPHA) -> float:
    """How many times a metric's noise (its expected relative range over
    `repeats` repeats) two runs' medians may differ by before the difference is
    called real, when `metrics` metrics are compared at once.

    For a quantity with normal noise of spread sigma, the range of n repeats is
    about d(n) x sigma on average and the difference of two runs' medians is
    normal with spread s(n) x sigma; both factors are computed here by a seeded
    simulation (n = 3: d = 1.69, s = 0.94). A difference beyond z x s(n) x sigma,
    with z the normal quantile for alpha / metrics two-sided, happens by chance
    with probability alpha / metrics per metric, so at most alpha for all of them
    together. k = z x s(n) / d(n): 1.72 for 3 repeats and 25 metrics. (Without
    the division by `metrics`, k = 1.09: one metric in 13 would miss by chance,
    one or two of 25 in every comparison, as the first quiet runs did.)"""
    if repeats < 2 or metrics < 1:
        raise ValueError("need repeats >= 2 and metrics >= 1")
    rng = random.Random(20261201)
    medians, ranges = [], []
    for _ in range(20_000):
        xs = [rng.gauss(0.0, 1.0) for _ in range(repeats)]
        medians.append(statistics.median(xs))
        ranges.append(max(xs) - min(xs))
    z = statistics.NormalDist().inv_cdf(1 - alpha / (2 * metrics))
    return z * math.sqrt(2) * statistics.pstdev(medians) / statistics.fmean(ranges)


class Agreement(NamedTuple):
    case: str
    metric: str
    previous: str
    current: str
    agrees: bool
    how: str


def compare_runs(prev: Spans, cur: Spans, alpha: float = FAMILY_ALPHA) -> list[Agreement]:
    """Does a second run of the benchmark reproduce the first within the noise
    each reports? Per case and metric measured in both, they agree when the two
    runs' [min, max] ranges over the repeats overlap, or when their medians
    differ (relative to the mean of the two) by no more than the tolerance: the
    metric's noise (`metric_noise`, the mean of the two runs' estimates) times
    `tolerance_factor` for the fewer repeats of the two and the number of
    metrics compared. Metrics without a value in either run are left out."""
    noise_p, noise_c = metric_noise(prev), metric_noise(cur)
    pairs = []
    for case, metrics in cur.items():
        for metric, now in metrics.items():
            p = prev.get(case, {}).get(metric)
            if p is None or not now[3] or not p[3] or math.isnan(now[0]) or math.isnan(p[0]):
                continue
            pairs.append((case, metric, p, now))
    out: list[Agreement] = []
    for case, metric, p, (lo, med, hi, n) in pairs:
        est = [x[metric] for x in (noise_p, noise_c) if metric in x]
        noise = statistics.fmean(est) if est else 0.0
        n_min = int(min(n, p[3]))
        tol = noise * tolerance_factor(n_min, len(pairs), alpha) if n_min >= 2 else 0.0
        scale = (abs(med) + abs(p[1])) / 2
        diff = abs(med - p[1]) / scale if scale > 0 else 0.0
        if lo <= p[2] and p[0] <= hi:
            agrees, how = True, "ranges overlap"
        elif diff <= tol:
            agrees, how = True, f"medians {diff:.0%} apart <= {tol:.0%}"
        else:
            agrees, how = False, f"medians {diff:.0%} apart > {tol:.0%}"
        out.append(
            Agreement(case, metric, f"{p[1]:.3g} ({p[0]:.3g}-{p[2]:.3g})",
                      f"{med:.3g} ({lo:.3g}-{hi:.3g})", agrees, how)
        )  # fmt: skip
    return out
