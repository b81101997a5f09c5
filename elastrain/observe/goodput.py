"""Goodput ledger: every member-second of the job in exactly one bucket.

A first version of issue 4, item 2, computed from the events alone (pure; the
report and the tests call it on `read_events(run_dir)`).

Capacity is the job's target member count (`job_start.target`). The ledger
covers the wall interval [job_start, job_end] times the capacity; when more
processes than the target are alive at once (a hung victim next to its
replacement) the capacity at that moment is the live count, so the total is
the integral of max(target, live) and the buckets always sum to it.

Each worker process (one `worker_spawned` member/pid, alive until its
`worker_exited`) walks through states driven by its own events:

  startup           spawn -> first `generation_start` (an original worker), or
                    spawn -> `member_registered` (a replacement, or a worker that
                    registered after the job's first generation formed)
  standby           registered and waiting outside the generation, until its
                    first `group_built` (or heal, or `generation_start`): a hot
                    spare (`elastrain run --spares`), a replacement waiting to be
                    admitted at the next step boundary. Reserved capacity, not
                    badput from a failure; a spare costs the job its time.
  regroup           quorum + regroup: after an abort (or registration) until the
                    next `generation_start`, except the heal
  healing           `heal_begin` -> `heal_end`, every role
  productive        a step that was committed (previous mark -> `step_commit`)
  wasted            a step that was aborted, up to the failure that broke it
  detection         failure -> the abort that noticed it (survivors); failure ->
                    expulsion (a hung or killed victim)

Failures are the recognised ones (`elastrain.observe.failures`), whether or
not anybody injected them; a failure's time is `Failure.t`.
  replacement_wait  capacity missing: empty slots (below target) between the
                    first generation_start and the last step_commit (before:
                    startup, after: other), and an expelled, still-hung victim
  checkpoint        checkpoint blocking: the training thread's snapshot time,
                    its wait for the deferred copy included
                    (`blocking_s` of the member's checkpoint_saved/failed/skipped
                    event for that step count), carved from the start of the
                    step that followed it; an emergency checkpoint (commit ->
                    `checkpoint_emergency`)
  data_wait         time the step spent in the dataset and collate function
                    (`step_commit.data_s`), carved from the committed step
  other             the rest: shutdown after the last step, unknown states

Mapping to ml-goodput-measurement (Google): productive = productive training
time; wasted = "wasted progress from disruption"; detection + regroup +
healing + replacement_wait = "disruption / badput from failures"; startup =
"TPU/accelerator initialization + training prep"; checkpoint = "checkpoint
save (blocking)"; data_wait = "data loading"; other = "other/unknown".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.observe.failures import Failure, FailureKind, recognise_failures

Event = Mapping[str, Any]

BUCKETS = (
    "productive",
    "wasted",
    "detection",
    "regroup",
    "healing",
    "replacement_wait",
    "checkpoint",
    "startup",
    "standby",
    "data_wait",
    "other",
)
"""Goodput buckets, in report order; `Goodput.buckets` has exactly these keys."""


@dataclass(frozen=True)
class Goodput:
    """The ledger of one run.

    total_s: member-seconds covered (see module docstring); the buckets sum to it.
    wall_s: job_end - job_start. capacity: target member count.
    buckets: member-seconds per bucket (every name in BUCKETS).
    time_goodput: productive / total_s.
    committed_samples: samples of all committed steps (each step counted once).
    nominal_samples_per_s: median step throughput while the job ran at full
    size (None when it never did and no commit says otherwise).
    throughput_goodput: committed_samples / (nominal_samples_per_s * wall_s).
    segments: where the member-seconds went over time, for plots and energy
    attribution: one `Segment` per stretch of a process in one bucket, plus
    empty-slot segments (member None, `slots` missing members).
    """

    total_s: float
    wall_s: float
    capacity: int
    buckets: dict[str, float]
    time_goodput: float
    committed_samples: int
    nominal_samples_per_s: float | None
    throughput_goodput: float | None
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class Segment:
    """[start, end] wall seconds of `slots` member slots in `bucket`: a worker
    process (member, pid) or, with member None, capacity nobody filled."""

    member: str | None
    pid: Any
    bucket: str
    start: float
    end: float
    slots: int = 1

    @property
    def member_s(self) -> float:
        return (self.end - self.start) * self.slots


class _Acc:
    """Adds the time from a moving cursor to named buckets, clipped to [start, end],
    and records it as segments of process `p` (adjacent ones of a bucket merged)."""

    def __init__(
        self, start: float, end: float, into: dict[str, float], p: _Proc | None = None
    ) -> None:
        self.cursor, self.end, self.into, self.p = start, end, into, p
        self.segments: list[Segment] = []

    def to(self, t: float, bucket: str) -> None:
        t = min(t, self.end)
        if t > self.cursor:
            self.into[bucket] += t - self.cursor
            last = self.segments[-1] if self.segments else None
            if last is not None and last.bucket == bucket and last.end == self.cursor:
                self.segments[-1] = Segment(last.member, last.pid, bucket, last.start, t)
            else:
                m, pid = (self.p.member, self.p.pid) if self.p is not None else (None, None)
                self.segments.append(Segment(m, pid, bucket, self.cursor, t))
            self.cursor = t


def _sorted(events: Iterable[Event]) -> list[Event]:
    out = [e for e in events if isinstance(e.get("t"), int | float)]
    out.sort(key=lambda e: float(e["t"]))
    return out


@dataclass
class _Proc:
    member: str
    pid: Any
    start: float
    end: float
    replacement: bool


def _processes(evs: Sequence[Event], t_start: float, t_end: float) -> list[_Proc]:
    """Worker processes and their lifetimes, from the launcher or (without one)
    from the workers' own events."""
    procs: list[_Proc] = []
    for e in evs:
        if e.get("kind") == "worker_spawned" and e.get("member") is not None:
            procs.append(_Proc(str(e["member"]), e.get("pid"), float(e["t"]), t_end,
                               bool(e.get("replacement"))))  # fmt: skip
    if procs:
        for e in evs:
            if e.get("kind") != "worker_exited":
                continue
            for p in procs:
                same_pid = p.pid is None or e.get("pid") in (None, p.pid)
                open_ = p.end == t_end and float(e["t"]) >= p.start
                if p.member == e.get("member") and same_pid and open_:
                    p.end = float(e["t"])
                    break
    else:
        seen: dict[tuple[str, Any], _Proc] = {}
        for e in evs:
            proc = e.get("proc")
            if proc in ("launcher", "coordinator") or not isinstance(proc, str):
                continue
            key = (proc, e.get("pid"))
            if key not in seen:
                seen[key] = _Proc(proc, e.get("pid"), float(e["t"]), float(e["t"]), False)
            seen[key].end = float(e["t"])
        procs = list(seen.values())
    for p in procs:
        p.start, p.end = max(p.start, t_start), min(p.end, t_end)
    return [p for p in procs if p.end > p.start]


def goodput(events: Sequence[Event], failures: Sequence[Failure] | None = None) -> Goodput:
    """Build the goodput ledger of a run from its events. Pure; never raises on
    partial events (an empty list gives an all-zero ledger). `failures`: what
    `recognise_failures(events)` returns (computed when not given)."""
    evs = _sorted(events)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    if not evs:
        return Goodput(0.0, 0.0, 0, buckets, 0.0, 0, None, None)
    segments: list[Segment] = []
    js = next((e for e in evs if e.get("kind") == "job_start"), None)
    je = next((e for e in reversed(evs) if e.get("kind") == "job_end"), None)
    t_start = float(js["t"]) if js is not None else float(evs[0]["t"])
    t_end = float(je["t"]) if je is not None else float(evs[-1]["t"])
    wall = max(0.0, t_end - t_start)
    sizes = [
        len(e["members"])
        for e in evs
        if e.get("kind") == "generation_ready" and isinstance(e.get("members"), list)
    ]
    target = js.get("target") if js is not None else None
    capacity = int(target) if isinstance(target, int) and target > 0 else max(sizes, default=1)

    fails = list(recognise_failures(evs) if failures is None else failures)
    fault_ts = sorted(f.t for f in fails)
    by_member: dict[str, list[Event]] = {}
    for e in evs:
        proc = e.get("proc")
        if isinstance(proc, str) and proc not in ("launcher", "coordinator"):
            by_member.setdefault(proc, []).append(e)
        elif e.get("kind") in ("member_registered", "member_removed"):
            by_member.setdefault(str(e.get("member")), []).append(e)
    for f in fails:
        if f.kind in _VICTIM_KINDS:
            # The victim's own mark: from here its time is the failure's, not its step's.
            t = f.t
            if f.kind in _DEAD_KINDS:
                # A dead process writes nothing: an event of its own after the
                # failure's time (a commit written while the launcher was sending
                # the SIGKILL it records first) shows it was alive until then.
                own = [float(e["t"]) for e in by_member.get(f.member, ()) if e.get("pid") == f.pid]
                t = max([t, *(x for x in own if f.exit_t is None or x <= f.exit_t)])
            mark = {"t": t, "kind": "@victim", "pid": f.pid}
            by_member.setdefault(f.member, []).append(mark)
    for v in by_member.values():
        v.sort(key=lambda e: float(e["t"]))
    procs = _processes(evs, t_start, t_end)
    blocking = _checkpoint_blocking(evs)
    first_formed = next(
        (float(e["t"]) for e in evs if e.get("kind") == "generation_formed"), math.inf
    )
    for p in procs:
        segments += _walk(
            p,
            by_member.get(p.member, []),
            fault_ts,
            buckets,
            blocking.get((p.member, p.pid), {}),
            first_formed,
        )

    # Empty slots: capacity missing below the target. Before the first generation
    # starts that is the job's startup; after the last commit, its shutdown.
    first_start = next((float(e["t"]) for e in evs if e.get("kind") == "generation_start"), t_end)
    last_commit = next(
        (float(e["t"]) for e in reversed(evs) if e.get("kind") == "step_commit"), t_end
    )
    cuts = {t_start, t_end, first_start, last_commit, *(p.start for p in procs)}
    points = sorted(x for x in cuts | {p.end for p in procs} if t_start <= x <= t_end)
    total = 0.0
    for a, b in zip(points, points[1:], strict=False):
        mid = (a + b) / 2
        live = sum(1 for p in procs if p.start <= mid < p.end)
        empty = "startup" if mid < first_start else "other" if mid > last_commit else None
        missing = max(0, capacity - live)
        buckets[empty or "replacement_wait"] += missing * (b - a)
        total += max(capacity, live) * (b - a)
        if missing:
            segments.append(Segment(None, None, empty or "replacement_wait", a, b, missing))

    committed: dict[int, int] = {}
    full_rates: list[float] = []
    all_rates: list[float] = []
    ready_size: dict[Any, int] = {}
    for e in evs:
        if e.get("kind") == "generation_ready" and isinstance(e.get("members"), list):
            ready_size[e.get("gen")] = len(e["members"])
        if e.get("kind") != "step_commit":
            continue
        rate, step_s, s = e.get("samples_per_s"), e.get("step_s"), e.get("step")
        if not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            continue
        all_rates.append(float(rate))
        if ready_size.get(e.get("gen")) == capacity:
            full_rates.append(float(rate))
        if isinstance(s, int) and s not in committed and isinstance(step_s, int | float):
            committed[s] = round(float(rate) * float(step_s))
    rates = full_rates or all_rates
    nominal = statistics.median(rates) if rates else None
    samples = sum(committed.values())
    tput = samples / (nominal * wall) if nominal and wall > 0 else None
    tg = buckets["productive"] / total if total > 0 else 0.0
    segments.sort(key=lambda g: g.start)
    return Goodput(total, wall, capacity, buckets, tg, samples, nominal, tput, tuple(segments))


_BLOCKING_KINDS = frozenset({"checkpoint_saved", "checkpoint_failed", "checkpoint_skipped"})


def _checkpoint_blocking(evs: Sequence[Event]) -> dict[tuple[str, Any], dict[int, float]]:
    """(member, pid) -> {committed step count: seconds the training thread spent
    snapshotting the checkpoint taken at that count}."""
    out: dict[tuple[str, Any], dict[int, float]] = {}
    for e in evs:
        b, s = e.get("blocking_s"), e.get("step")
        if e.get("kind") not in _BLOCKING_KINDS or not isinstance(s, int):
            continue
        if isinstance(b, int | float) and math.isfinite(b) and b > 0:
            out.setdefault((str(e.get("proc")), e.get("pid")), {}).setdefault(s, float(b))
    return out


def _walk(
    p: _Proc,
    evs: Sequence[Event],
    fault_ts: Sequence[float],
    buckets: dict[str, float],
    blocking: Mapping[int, float],
    first_formed: float = math.inf,
) -> list[Segment]:
    """Put one process's lifetime into buckets (see the module docstring). `evs`:
    the events written by or about this member, in time order; `blocking`: its
    checkpoint blocking per committed step count; `first_formed`: when the job's
    first generation formed (a worker registering after it waits as a standby).
    Returns its segments."""
    acc = _Acc(p.start, p.end, buckets, p)
    carved: set[int] = set()
    count: int | None = None  # committed step count while stepping

    def checkpoint_first(t: float) -> None:
        """A step interval begins with the blocking of the checkpoint taken at its count."""
        if count is not None and count in blocking and count not in carved:
            carved.add(count)
            acc.to(min(t, acc.cursor + blocking[count]), "checkpoint")

    mine: list[tuple[float, str, Event]] = []
    for e in evs:
        t = float(e["t"])
        if t < p.start or t > p.end:
            continue
        k = str(e.get("kind"))
        same_pid = p.pid is None or e.get("pid") in (None, p.pid)
        if k == "@victim":
            if same_pid:
                mine.append((t, "@victim", e))
        elif e.get("proc") == p.member and same_pid:
            mine.append((t, k, e))
        elif k == "member_registered" and e.get("member") == p.member:
            mine.append((t, "@registered", e))
        elif k == "member_removed" and e.get("member") == p.member:
            mine.append((t, "@removed", e))

    def aborted(t: float) -> None:
        """The step running since the cursor was lost at t: wasted up to the last
        fault inside it, detection after."""
        checkpoint_first(t)
        t0 = max((x for x in fault_ts if acc.cursor - SIGN_OF_LIFE_SLACK_S < x <= t), default=None)
        if t0 is not None:
            acc.to(max(t0, acc.cursor), "wasted")
            acc.to(t, "detection")
        else:
            acc.to(t, "wasted")

    state = "startup"
    for t, k, e in mine:
        if k == "generation_start" and isinstance(e.get("step"), int):
            count = int(e["step"])
        if k == "@victim":
            if state == "step":
                checkpoint_first(t)
                acc.to(t, "wasted")
            else:
                acc.to(t, _STATE_BUCKET[state])
            state = "victim"
        elif state == "victim":
            if k == "@removed":
                acc.to(t, "detection")
                state = "expelled"
            elif not k.startswith("@"):
                acc.to(t, "detection")
                state = "regroup"
        elif state == "expelled":
            if not k.startswith("@"):
                acc.to(t, "replacement_wait")
                state = "regroup"
        elif state == "startup":
            if k == "@registered" and (p.replacement or t > first_formed):
                acc.to(t, "startup")
                state = "standby"
            elif k == "generation_start":
                acc.to(t, "startup")
                state = "step"
        elif state == "standby":
            if k in ("group_built", "heal_begin", "generation_start", "worker_exit"):
                acc.to(t, "standby")
                state = {"heal_begin": "heal", "generation_start": "step"}.get(
                    k, "other" if k == "worker_exit" else "regroup"
                )
        elif state in ("regroup", "heal"):
            if k == "heal_begin":
                acc.to(t, _STATE_BUCKET[state])
                state = "heal"
            elif k in ("heal_end", "rendezvous_begin") and state == "heal":
                acc.to(t, "healing")
                state = "regroup"
            elif k == "generation_start":
                acc.to(t, _STATE_BUCKET[state])
                state = "step"
            elif k == "worker_exit":
                acc.to(t, _STATE_BUCKET[state])
                state = "other"
        elif state == "step":
            if k == "step_commit":
                checkpoint_first(t)
                data_s = e.get("data_s")
                if isinstance(data_s, int | float) and math.isfinite(data_s) and data_s > 0:
                    acc.to(min(t, acc.cursor + float(data_s)), "data_wait")
                acc.to(t, "productive")
                if isinstance(e.get("step"), int):
                    count = int(e["step"]) + 1
            elif k == "checkpoint_emergency":
                acc.to(t, "checkpoint")
            elif k in ("step_abort", "watchdog_fired", "rendezvous_begin"):
                aborted(t)
                state = "regroup"
            elif k == "worker_exit":
                acc.to(t, "other")
                state = "other"
    acc.to(p.end, _STATE_BUCKET[state])
    return acc.segments


_VICTIM_KINDS = frozenset({FailureKind.KILL, FailureKind.HANG, FailureKind.CRASH})
"""Failures whose victim stops at the failure's time (a leave finishes its step first)."""
_DEAD_KINDS = frozenset({FailureKind.KILL, FailureKind.CRASH})
"""... and never writes again (a hung victim may wake up and rejoin)."""

SIGN_OF_LIFE_SLACK_S = 1.0
"""A failure up to this long before an aborted step began still broke it: a hang
nobody injected is dated by the victim's last event, its commit of the previous
step, which can precede the survivors' own commit of it by a little."""

_STATE_BUCKET = {
    "startup": "startup",
    "standby": "standby",
    "regroup": "regroup",
    "heal": "healing",
    "step": "other",
    "victim": "detection",
    "expelled": "replacement_wait",
    "other": "other",
}


def format_goodput(gp: Goodput) -> str:
    """Plain-text summary: one line per bucket with seconds and share of the total."""
    lines = [
        f"capacity {gp.capacity} x wall {gp.wall_s:.3f} s -> {gp.total_s:.3f} member-s",
        f"time goodput {gp.time_goodput:.1%}"
        + (
            f", throughput goodput {gp.throughput_goodput:.1%}"
            if gp.throughput_goodput is not None
            else ""
        ),
    ]
    for b in BUCKETS:
        s = gp.buckets[b]
        share = s / gp.total_s if gp.total_s > 0 else 0.0
        lines.append(f"  {b:<17}{s:>12.3f} s {share:>7.1%}")
    return "\n".join(lines)
