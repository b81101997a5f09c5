"""Failures recognised from what happened, not from what was injected.

`recognise_failures(events)` is the one place that decides which failures a
run had. The recovery table, the report, the goodput ledger, the live
progress line, the chaos soak and the simulator's `--from-run` all use it, so
a `kill -9` sent from outside counts exactly as a `--fault kill` does.

A failure is recognised from evidence (docs/guide/events.md, "Failures"):

  kill         the launcher saw the worker exit by a signal other than SIGTERM
               or SIGINT (`worker_exited.returncode` < 0; the coordinator's
               `exit_reported`, what the launcher told it, says the same)
  term         the worker left: it exited by SIGTERM/SIGINT or with EXIT_LEFT,
               announced `worker_exit` reason `left`, or the coordinator
               removed it as `left`
  crash        the worker exited with a non-zero code (other than EXIT_LEFT and
               EXIT_PREEMPTED; EXIT_DEVICE_POISONED says its device failed); when
               its script raised, the coordinator's `exit_reported` names the
               exception (`error_type`, `error_where`): that is its `cause`, and
               failures with the same cause are one bug, tables show them once
  hang         the worker stayed alive but went silent: the coordinator removed
               it (`lease_expired`, `suspected`, `not_ready`), or the others'
               watchdog fired in a generation that no other failure explains
               (the suspect is the member whose watchdog did not fire)
  coordinator  the coordinator process died (`coordinator_exited` with a
               non-zero status) and the launcher restarted it

Everything seen about one member until it is healthy again (it re-registers
after an expulsion) is one failure; each piece is kept as `Evidence`.
Nothing after a whole-job preemption notice or an agent's drain is a
failure (members leave on purpose then), nor is an exit with status 0, nor
the leave of a member the launcher evicted as a straggler
(`straggler_evicted`: it was sent SIGTERM on purpose, a hot spare took its
place).

A `fault_injected` event only labels a recognised failure (`Failure.injected`)
and gives its exact time; it never makes one. Without a label the failure's
time `t` is the best the evidence allows: the exit for kill/crash/term, the
victim's last sign of life (its last event) for a hang, the moment the
others started waiting (first watchdog minus its timeout) for a stall seen
only by the watchdog. Pure: no I/O, any event order, never raises on partial
events.

`EVIDENCE_KINDS` are the event kinds it reads; besides them only a worker's own
events count (the time of its last sign of life). A process that recognises
failures live (the coordinator, for `/metrics`) keeps those kinds of what it
emits and passes them here: the same recogniser over what it saw.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from elastrain.exitcodes import EXIT_DEVICE_POISONED, EXIT_LEFT, EXIT_PREEMPTED, EXIT_STATE_TORN
from elastrain.observe.events import EventKind

Event = Mapping[str, Any]

__all__ = [
    "COORDINATOR",
    "EVIDENCE_KINDS",
    "Evidence",
    "Failure",
    "FailureKind",
    "LABEL_WINDOW_S",
    "recognise_failures",
]


class FailureKind(StrEnum):
    """What a recognised failure was (the value is what tables print)."""

    KILL = "kill"
    TERM = "term"
    CRASH = "crash"
    HANG = "hang"
    COORDINATOR = "coordinator"


COORDINATOR = "coordinator"
"""`Failure.member` of a coordinator failure."""

LABEL_WINDOW_S = 120.0
"""A `fault_injected` event labels a failure first evidenced at most this long after it
(a hang is only noticed once a watchdog or a lease runs out)."""

_LABELS: dict[str, frozenset[FailureKind]] = {
    "kill": frozenset({FailureKind.KILL, FailureKind.CRASH}),
    "kill-all": frozenset({FailureKind.KILL, FailureKind.CRASH}),
    "hang": frozenset({FailureKind.HANG}),
    "cut": frozenset({FailureKind.HANG, FailureKind.KILL, FailureKind.CRASH}),
    "term": frozenset({FailureKind.TERM}),
    "kill-coordinator": frozenset({FailureKind.COORDINATOR}),
}
"""Injected fault kind -> the recognised kinds it may label."""

_JOB_WIDE = frozenset({"kill-all"})
"""Injected kinds aimed at the whole job: they label every matching failure."""

_EXITS = frozenset({EventKind.WORKER_EXITED, EventKind.EXIT_REPORTED})
"""A worker process's exit status: as the launcher saw it, or as the coordinator
was told it (the same exit: both join one failure)."""
_GENERATIONS = frozenset(
    {EventKind.GENERATION_FORMED, EventKind.GENERATION_READY, EventKind.GENERATION_START}
)

EVIDENCE_KINDS: frozenset[EventKind] = frozenset(
    {
        EventKind.JOB_START,
        EventKind.PREEMPT_NOTICE,
        EventKind.DRAIN,
        EventKind.STRAGGLER_EVICTED,
        EventKind.WORKER_SPAWNED,
        EventKind.MEMBER_REGISTERED,
        EventKind.COORDINATOR_EXITED,
        EventKind.MEMBER_REMOVED,
        EventKind.WORKER_EXIT,
        EventKind.WATCHDOG_FIRED,
        EventKind.FAULT_INJECTED,
        *_EXITS,
        *_GENERATIONS,
    }
)
"""Every event kind `recognise_failures` reads (see the module docstring)."""

_HANG_REMOVALS = {
    "lease_expired": "its lease expired",
    "suspected": "the coordinator suspected it (silent while others waited)",
    "not_ready": "it never became ready in a new generation",
}
_NON_WORKER = frozenset({"launcher", "coordinator"})


@dataclass(frozen=True)
class Evidence:
    """One observation that identified (or confirmed) a failure."""

    t: float
    event: str
    """The event kind it comes from, e.g. `worker_exited`."""
    detail: str
    """What it says, e.g. "exited by SIGKILL"."""


@dataclass(frozen=True)
class Failure:
    """One recognised failure.

    kind: what it was; member: the victim (`coordinator` for the coordinator);
    pid: its process, when known. t: when it happened, as well as the evidence
    tells (the injection time when labelled). detected_t: its first evidence.
    evidence: everything that identified it, in time order. injected: the
    `fault_injected` kind that labels it, None for a failure nobody injected.
    exited: the process is known to have exited (the launcher replaces only
    those); exit_t: when the launcher saw it exit.
    """

    kind: FailureKind
    member: str
    pid: int | None
    t: float
    detected_t: float
    evidence: tuple[Evidence, ...]
    injected: str | None = None
    exit_t: float | None = None
    cause: str | None = None
    """The exception the script raised, ``ValueError at train.py:66`` (None: it
    raised none, or its exit record was not reported)."""

    @property
    def exited(self) -> bool:
        return self.exit_t is not None

    @property
    def how(self) -> str:
        """The first evidence, short, for tables."""
        return self.evidence[0].detail if self.evidence else ""


@dataclass
class _Open:
    kind: FailureKind
    member: str
    pid: int | None
    evidence: list[Evidence] = field(default_factory=list)
    exit_t: float | None = None
    cause: str | None = None
    closed: bool = False
    stall_t: float | None = None

    @property
    def detected_t(self) -> float:
        return min(e.t for e in self.evidence)


def _t(e: Event) -> float:
    return float(e["t"])


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _sorted(events: Iterable[Event]) -> list[Event]:
    out = [e for e in events if isinstance(e.get("t"), int | float) and math.isfinite(e["t"])]
    out.sort(key=_t)
    return out


def _first(t0: float | None, t: float) -> float:
    """The earlier of an exit time seen before (if any) and `t`."""
    return t if t0 is None else min(t0, t)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def classify_exit(returncode: int) -> tuple[FailureKind, str] | None:
    """What a worker's exit status says: None for a clean end (0, EXIT_PREEMPTED)."""
    if returncode == 0 or returncode == EXIT_PREEMPTED:
        return None
    if returncode < 0:
        name = _signame(-returncode)
        if -returncode in (signal.SIGTERM, signal.SIGINT):
            return FailureKind.TERM, f"exited by {name}"
        return FailureKind.KILL, f"exited by {name}"
    if returncode == EXIT_LEFT:
        return FailureKind.TERM, f"left (exit {EXIT_LEFT}, e.g. after SIGTERM)"
    if returncode == EXIT_DEVICE_POISONED:
        return FailureKind.CRASH, f"its device failed (exit {EXIT_DEVICE_POISONED}, replaced)"
    if returncode == EXIT_STATE_TORN:
        return FailureKind.CRASH, f"a heal into it failed midway (exit {EXIT_STATE_TORN}, replaced)"
    return FailureKind.CRASH, f"exited with code {returncode}"


def recognise_failures(events: Sequence[Event]) -> list[Failure]:
    """Every failure the events show, in time order (see the module docstring)."""
    evs = _sorted(events)
    opened: list[_Open] = []
    current: dict[str, _Open] = {}
    pid_of: dict[str, int] = {}
    ending = False
    evicted: dict[str, int | None] = {}
    """member -> the pid the launcher evicted (its leave is on purpose)."""

    def on_purpose(member: str, pid: int | None) -> bool:
        if member not in evicted:
            return False
        was = evicted[member]
        return pid is None or was is None or pid == was

    def note(member: str, pid: int | None, kind: FailureKind | None, ev: Evidence) -> _Open | None:
        o = current.get(member)
        if o is not None and not o.closed and (pid is None or o.pid in (None, pid)):
            o.evidence.append(ev)
            return o
        if kind is None:
            return None  # confirms a failure only (e.g. the coordinator's "exited")
        o = _Open(kind, member, pid if pid is not None else pid_of.get(member), [ev])
        opened.append(o)
        current[member] = o
        return o

    for e in evs:
        k = e.get("kind")
        t = _t(e)
        if k == EventKind.JOB_START:
            ending = False
            continue
        if k in (EventKind.PREEMPT_NOTICE, EventKind.DRAIN):
            ending = True
            continue
        if k == EventKind.STRAGGLER_EVICTED and e.get("member") is not None:
            evicted[str(e["member"])] = _int(e.get("pid"))
            continue
        if k == EventKind.WORKER_SPAWNED and e.get("member") is not None:
            pid = _int(e.get("pid"))
            if pid is not None:
                pid_of[str(e["member"])] = pid
            continue
        if k == EventKind.MEMBER_REGISTERED and (_int(e.get("incarnation")) or 1) > 1:
            o = current.get(str(e.get("member")))
            if o is not None:
                o.closed = True  # healthy again: what comes next is a new failure
            continue
        if k == EventKind.COORDINATOR_EXITED:
            rc = _int(e.get("returncode"))
            if rc not in (None, 0) and not ending:
                why = f"exited by {_signame(-rc)}" if rc < 0 else f"exited with code {rc}"
                ev = Evidence(t, k, f"coordinator {why}")
                opened.append(_Open(FailureKind.COORDINATOR, COORDINATOR, _int(e.get("pid")), [ev]))
            continue
        if ending:
            continue
        if k in _EXITS:
            rc = _int(e.get("returncode"))
            verdict = classify_exit(rc) if rc is not None else None
            member, pid = str(e.get("member")), _int(e.get("pid"))
            if verdict is not None and verdict[0] is FailureKind.TERM and on_purpose(member, pid):
                continue
            if verdict is None:
                o = current.get(member)
                if o is not None and not o.closed and o.kind is FailureKind.TERM:
                    o.exit_t = _first(o.exit_t, t)  # a leave that ended with status 0
                continue
            how, cause = verdict[1], None
            if e.get("error_type"):
                cause = f"{e['error_type']} at {e.get('error_where', '?')}"
                first = str(e.get("error_message", "")).strip().splitlines()[:1]
                how = f"raised {e['error_type']}: {first[0] if first else ''}".rstrip(": ")
            o = note(member, pid, verdict[0], Evidence(t, k, how))
            if o is not None:
                o.exit_t = _first(o.exit_t, t)
                o.cause = o.cause or cause
        elif k == EventKind.MEMBER_REMOVED:
            member, reason = str(e.get("member")), str(e.get("reason"))
            if reason == "left" and on_purpose(member, None):
                continue
            if reason == "left":
                note(
                    member,
                    None,
                    FailureKind.TERM,
                    Evidence(t, k, "the coordinator dropped it: it left"),
                )
            elif reason in _HANG_REMOVALS:
                note(member, None, FailureKind.HANG, Evidence(t, k, _HANG_REMOVALS[reason]))
            elif reason == "exited":
                note(member, None, None, Evidence(t, k, "the coordinator dropped it: it exited"))
        elif k == EventKind.WORKER_EXIT and e.get("reason") == "left":
            proc = e.get("proc")
            if (
                isinstance(proc, str)
                and proc not in _NON_WORKER
                and not on_purpose(proc, _int(e.get("pid")))
            ):
                note(
                    proc,
                    _int(e.get("pid")),
                    FailureKind.TERM,
                    Evidence(t, k, "it announced a leave"),
                )

    opened += _watchdog_failures(evs, opened, pid_of)
    failures = [_finish(o, evs) for o in opened]
    failures.sort(key=lambda f: (f.detected_t, f.member))
    return _label(failures, evs)


def _generations(evs: Sequence[Event]) -> tuple[dict[int, list[str]], list[tuple[float, int]]]:
    """gen -> members (as formed, or as ready), and (t, gen) of every generation_formed."""
    members: dict[int, list[str]] = {}
    formed: list[tuple[float, int]] = []
    for e in evs:
        if e.get("kind") not in _GENERATIONS:
            continue
        g = _int(e.get("gen"))
        m = e.get("members")
        if g is None:
            continue
        if isinstance(m, list | tuple) and g not in members:
            members[g] = [str(x) for x in m]
        if e.get("kind") == EventKind.GENERATION_FORMED:
            formed.append((_t(e), g))
    return members, formed


def _watchdog_failures(
    evs: Sequence[Event], opened: list[_Open], pid_of: Mapping[str, int]
) -> list[_Open]:
    """Watchdog firings a recognised failure explains join it as evidence; the others
    are failures of their own: the member that never reached the collective stalled."""
    groups: dict[tuple[int | None, int | None], list[Event]] = {}
    for e in evs:
        if e.get("kind") == EventKind.WATCHDOG_FIRED and isinstance(e.get("proc"), str):
            groups.setdefault((_int(e.get("gen")), _int(e.get("step"))), []).append(e)
    if not groups:
        return []
    members, formed = _generations(evs)
    out: list[_Open] = []
    for (gen, step), fired in groups.items():
        t1 = _t(fired[0])
        in_gen = members.get(gen, []) if gen is not None else []
        start = max((t for t, g in formed if g == gen), default=-math.inf)
        end = min(
            (t for t, g in formed if gen is not None and g > gen and t >= t1), default=math.inf
        )
        firing = sorted({str(e["proc"]) for e in fired})
        timeout = fired[0].get("timeout_s")
        wait = f" (timeout {timeout:g} s)" if isinstance(timeout, int | float) else ""
        where = f"step {step} of generation {gen}"
        explained = [
            o for o in opened + out
            if o.member in in_gen
            and any(start <= ev.t <= end for ev in o.evidence)
        ]  # fmt: skip
        if explained:
            for o in explained:
                if o.kind is FailureKind.HANG:
                    o.evidence.append(
                        Evidence(t1, "watchdog_fired", f"watchdog fired on {', '.join(firing)} at {where}{wait}")
                    )  # fmt: skip
            continue
        suspects = [m for m in in_gen if m not in firing]
        who = suspects[0] if suspects else "?"
        detail = (
            f"watchdog fired on {', '.join(firing)} at {where}{wait}; "
            + (f"{', '.join(suspects)} never reached the step's all-reduce" if suspects else "suspect unknown")
        )  # fmt: skip
        o = _Open(FailureKind.HANG, who, pid_of.get(who), [Evidence(t1, "watchdog_fired", detail)])
        if isinstance(timeout, int | float):
            o.stall_t = t1 - float(timeout)  # when the others began to wait for it
        out.append(o)
    return out


def _finish(o: _Open, evs: Sequence[Event]) -> Failure:
    o.evidence.sort(key=lambda ev: ev.t)
    detected = o.detected_t
    t = detected
    if o.kind is FailureKind.HANG:
        if o.stall_t is not None:
            t = min(t, o.stall_t)
        else:
            t = _last_sign_of_life(evs, o.member, o.pid, detected) or detected
    evidence = tuple(o.evidence)
    return Failure(o.kind, o.member, o.pid, t, detected, evidence, None, o.exit_t, o.cause)


def _last_sign_of_life(
    evs: Sequence[Event], member: str, pid: int | None, before: float
) -> float | None:
    last: float | None = None
    for e in evs:
        t = _t(e)
        if t >= before:
            break
        if e.get("proc") == member and (pid is None or e.get("pid") in (None, pid)):
            last = t
    return last


def _label(failures: list[Failure], evs: Sequence[Event]) -> list[Failure]:
    """Attach each `fault_injected` to the failure it caused (see the module docstring)."""
    injected = [
        e for e in evs if e.get("kind") == EventKind.FAULT_INJECTED and e.get("fault") in _LABELS
    ]
    used: set[int] = set()
    out: list[Failure] = []
    prev_detected: dict[str, float] = {}
    for f in failures:
        since = prev_detected.get(f.member, -math.inf)
        pick: Event | None = None
        for i, e in reversed(list(enumerate(injected))):  # the latest one that fits
            kind = str(e.get("fault"))
            t = _t(e)
            if (i in used and kind not in _JOB_WIDE) or not (since < t <= f.detected_t):
                continue
            if f.detected_t - t > LABEL_WINDOW_S or f.kind not in _LABELS[kind]:
                continue
            if kind not in _JOB_WIDE and kind != "kill-coordinator":
                victim = e.get("member") or e.get("proc")
                pid = _int(e.get("pid"))
                if str(victim) != f.member or (pid is not None and f.pid not in (None, pid)):
                    continue
            pick = e
            used.add(i)
            break
        prev_detected[f.member] = f.detected_t
        if pick is None:
            out.append(f)
        else:
            out.append(
                Failure(
                    f.kind,
                    f.member,
                    f.pid,
                    _t(pick),
                    f.detected_t,
                    f.evidence,
                    str(pick.get("fault")),
                    f.exit_t,
                    f.cause,
                )  # fmt: skip
            )
    out.sort(key=lambda f: (f.t, f.member))
    return out
