"""Recovery phases and join timings, computed from a run's events.

Pure functions over the event list that `read_events(run_dir)` returns (any
order is accepted; they sort by wall time `t`). Nothing here does I/O, so the
report, the soak test and the unit tests use the same code on recorded or
hand-built events. Definitions follow docs/guide/events.md, "Recovery phases":

For a failure (one `Failure` that `elastrain.observe.failures.recognise_failures`
recognised from what happened, at wall time t0 = `Failure.t`, victim v; an
injected fault only labels it) the survivors' recovery is split at five marks, each phase being the time from
the previous mark:

  detect      first of: launcher `worker_exited` of v; a survivor's
              `step_abort` (or `watchdog_fired`); coordinator `member_removed`
              of v; the first `generation_formed` without v (a graceful leave
              is detected when the coordinator drops the leaver). Aborts with
              phase `quorum`/`superseded` are the coordinator's doing and come
              after its own marks, so they are not counted: an unrelated join
              must not "detect" a hang.
  quorum      `generation_formed` of the generation the survivors resumed in
  regroup     the last survivor's `group_built` for that generation
  heal        the last `heal_end` for that generation (zero if nobody was behind)
  first_step  the first `step_commit` in that generation

"That generation" is the first one formed after t0 without v in which a step
was committed (else the first that became ready): a generation superseded
before it was ready, or broken before its first step, is skipped, as the
survivors never ran in it. Only events at or after t0 are used, so faults close
together do not borrow each other's marks; aborts by members hit by another
fault do not count as detection. A missing mark gives a NaN phase and the next
phase is measured from the last mark that exists, so the phases that are known
sum to `total_s`. A fault reported twice (launcher and victim) counts once; a
failure of a process that was not in the running generation (a waiting joiner),
or of the coordinator (the workers train on), gives a Recovery with gen None
and NaN phases.

The replacement of a failure is the one the launcher spawned for it: its
`worker_spawned` names the victim (`replaces`, and `replaces_pid` since the
launcher records it) and follows the victim's exit; a process that never
exited (a hang) is never replaced, it rejoins (see `joins`). With hot spares
(`elastrain run --spares`) that process refills the pool, and the member that
took the victim's place is the *promoted* standby: a member of the resumed
generation that was registered before t0 outside the running one. Its first
committed step is the generation's first (`total_s` from the failure).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.observe.failures import (  # the one reading of events
    COORDINATOR,
    Failure,
    _int,
    _sorted,
    _t,
    recognise_failures,
)

Event = Mapping[str, Any]

PHASES = ("detect", "quorum", "regroup", "heal", "first_step")
"""Recovery phase names, in order."""

COORDINATOR_ABORT_PHASES = frozenset({"quorum", "superseded"})
"""`step_abort.phase` values caused by a coordinator decision rather than a failure
the worker saw; they do not count as detecting a fault."""

_NON_WORKER_PROCS = frozenset({"launcher", "coordinator"})


@dataclass(frozen=True)
class Phase:
    """One recovery phase: `seconds` is NaN when its mark was not observed."""

    name: str
    seconds: float


@dataclass(frozen=True)
class Recovery:
    """How the survivors recovered from one recognised failure.

    fault, member: the failure's kind (`FailureKind` value) and victim; t0: its
    wall time (`Failure.t`).
    gen: the generation the survivors resumed in (None if none became ready).
    phases: detect, quorum, regroup, heal, first_step (exactly these, in order).
    total_s: first_step mark - t0; None if no step was committed after the
    fault in the resumed generation (e.g. the job ended first).
    survivors: members of the generation running at t0 (other than the victim)
    that are in the resumed generation; joiners are not survivors.
    replacement: the member id of the replacement worker spawned for this
    failure, if any (see `joins` for its timing).
    promoted: standbys (hot spares) that the resumed generation admitted: they
    were registered before t0 and not members of the running generation.
    how: the evidence that identified it first; injected: the `fault_injected`
    kind that labels it (None: nobody injected it).
    """

    fault: str
    member: str
    t0: float
    gen: int | None
    phases: list[Phase]
    total_s: float | None
    survivors: list[str]
    replacement: str | None = None
    how: str = ""
    injected: str | None = None
    promoted: tuple[str, ...] = ()
    cause: str | None = None
    """The failure's `Failure.cause`: the exception its script raised, if any."""

    def phase(self, name: str) -> float:
        """Seconds of the named phase (NaN if unknown)."""
        for p in self.phases:
            if p.name == name:
                return p.seconds
        raise KeyError(name)


@dataclass(frozen=True)
class JoinTiming:
    """How long a joining worker took to become productive.

    spawned_t: wall time of its `worker_spawned` (or, for a member re-registering
    after expulsion, of that `member_registered`). Every `*_s` is measured from
    spawned_t and is None when the milestone was not observed: registered_s
    (`member_registered`), group_s (its first `group_built`), healed_s (its
    first `heal_end` as receiver, before its first commit), first_step_s (its
    first `step_commit`). heal_bytes and heal_rate_mb_s come from that heal_end.
    rejoined: a member that came back after an expulsion (spawned_t is its
    re-registration), not a newly spawned replacement.
    """

    member: str
    spawned_t: float
    registered_s: float | None
    group_s: float | None
    healed_s: float | None
    first_step_s: float | None
    heal_bytes: int
    heal_rate_mb_s: float | None
    rejoined: bool = False


# ---- helpers -------------------------------------------------------------------------


def _members(e: Event) -> list[str]:
    m = e.get("members")
    return [str(x) for x in m] if isinstance(m, list | tuple) else []


def _is_worker(proc: Any) -> bool:
    return isinstance(proc, str) and proc not in _NON_WORKER_PROCS


@dataclass
class _Gen:
    """What the events say about one generation (first occurrence after some t0)."""

    gen: int
    members: list[str]
    formed_t: float | None
    ready_t: float | None
    ready_steps: dict[str, int]
    first_seen: float


def _candidate_gens(after: Sequence[Event], victim: str, min_gen: int | None) -> list[_Gen]:
    """Generations formed or made ready in `after` that leave out `victim`, in order."""
    gens: dict[int, _Gen] = {}
    excluded: set[int] = set()
    for e in after:
        kind = e.get("kind")
        if kind not in ("generation_formed", "generation_ready"):
            continue
        g = _int(e.get("gen"))
        if g is None or g in excluded or (min_gen is not None and g <= min_gen):
            continue
        members = _members(e)
        if victim in members:
            excluded.add(g)
            gens.pop(g, None)
            continue
        info = gens.get(g)
        if info is None:
            info = gens[g] = _Gen(g, members, None, None, {}, _t(e))
        if kind == "generation_formed" and info.formed_t is None:
            info.formed_t = _t(e)
        elif kind == "generation_ready" and info.ready_t is None:
            info.ready_t = _t(e)
            if members:
                info.members = members
            steps = e.get("steps")
            if isinstance(steps, Mapping):
                info.ready_steps = {
                    str(k): v for k, v in ((k, _int(v)) for k, v in steps.items()) if v is not None
                }
    return sorted(gens.values(), key=lambda x: x.first_seen)


def _first_t(events: Iterable[Event], kind: str, **match: Any) -> float | None:
    for e in events:
        if e.get("kind") == kind and all(e.get(k) == v for k, v in match.items()):
            return _t(e)
    return None


def _phases(t0: float, marks: list[float | None], heal_zero: bool) -> list[Phase]:
    """Turn the five marks into phase durations (see module docstring)."""
    out: list[Phase] = []
    prev = t0
    for name, mark in zip(PHASES, marks, strict=True):
        if name == "heal" and mark is None and heal_zero:
            out.append(Phase(name, 0.0))
        elif mark is None:
            out.append(Phase(name, math.nan))
        else:
            out.append(Phase(name, max(0.0, mark - prev)))
            prev = max(prev, mark)
    return out


# ---- recoveries ----------------------------------------------------------------------


def recoveries(
    events: Sequence[Event], failures: Sequence[Failure] | None = None
) -> list[Recovery]:
    """One `Recovery` per recognised failure, in time order. `failures`: what
    `recognise_failures(events)` returns (computed when not given).

    Pure; never raises on missing or partial events (unknown phases are NaN).
    """
    evs = _sorted(events)
    ts = [_t(e) for e in evs]
    fails = list(recognise_failures(evs) if failures is None else failures)
    claimed: set[int] = set()  # ids of worker_spawned events already matched to a failure
    return [
        dataclasses.replace(_recovery(evs, ts, fails, f, claimed), cause=f.cause) for f in fails
    ]


def by_cause(recs: Sequence[Recovery]) -> list[tuple[Recovery, int]]:
    """The recoveries grouped by cause, in time order: every failure without a
    cause on its own, and each cause (one bug in the script, however many
    members it ended) once, as its first recovery with the count of them."""
    out: list[tuple[Recovery, int]] = []
    at: dict[str, int] = {}
    for r in recs:
        if r.cause is None:
            out.append((r, 1))
        elif r.cause in at:
            first, n = out[at[r.cause]]
            out[at[r.cause]] = (first, n + 1)
        else:
            at[r.cause] = len(out)
            out.append((r, 1))
    return out


def _recovery(
    evs: list[Event], ts: list[float], faults: list[Failure], f: Failure, claimed: set[int]
) -> Recovery:
    t0 = f.t
    v = f.member
    kind = f.kind.value
    nan = [Phase(n, math.nan) for n in PHASES]
    if v == COORDINATOR:
        return Recovery(kind, v, t0, None, nan, None, [], None, f.how, f.injected)
    lo = bisect.bisect_left(ts, t0)
    before = _Reversed(evs, lo)

    # The generation running at t0: the last one the coordinator formed (or made
    # ready) before it; a worker's generation_start only if the coordinator's are lost.
    pre_gen: int | None = None
    pre_members: list[str] | None = None
    pre_formed_t = -math.inf
    for kinds in (("generation_formed", "generation_ready"), ("generation_start",)):
        last = next((e for e in before if e.get("kind") in kinds and _members(e)), None)
        if last is not None:
            pre_gen, pre_members = _int(last.get("gen")), _members(last)
            formed = _first_t(
                (e for e in before if _int(e.get("gen")) == pre_gen),
                "generation_formed",
            )
            pre_formed_t = formed if formed is not None else _t(last)
            break
    replacement = _replacement(evs, f, claimed)
    # A stall nobody removed (only the watchdog saw it) resumes with the victim in.
    stays = not f.exited and not any(ev.event == "member_removed" for ev in f.evidence)
    after = _window(evs, lo, "" if stays else v, pre_gen)
    if pre_members is not None and v not in pre_members:
        # The victim was not a member (e.g. a joiner still waiting): nothing to recover.
        return Recovery(kind, v, t0, None, nan, None, list(pre_members), replacement, f.how,
                        f.injected)  # fmt: skip

    # Members hit by another fault since the running generation formed are casualties,
    # not survivors: their aborts do not detect this fault.
    casualties = {v} | {g.member for g in faults if pre_formed_t <= g.t <= t0 and g is not f}

    def survivor_abort(e: Event) -> bool:
        # Aborts ordered by the coordinator (a quorum verdict, a superseded generation)
        # follow its own removal or new generation, which are marks themselves; counting
        # them would let an unrelated join "detect" a hang.
        if e.get("phase") in COORDINATOR_ABORT_PHASES:
            return False
        proc = e.get("proc")
        if not _is_worker(proc) or proc in casualties:
            return False
        if pre_members is not None and proc not in pre_members:
            return False
        g = _int(e.get("gen"))
        return not (pre_gen is not None and g is not None and g < pre_gen)

    pid = f.pid
    detect: float | None = None
    for e in after:
        k = e.get("kind")
        hit = (
            (k == "worker_exited" and e.get("member") == v
             and (pid is None or e.get("pid") is None or e.get("pid") == pid))
            or (k in ("step_abort", "watchdog_fired") and survivor_abort(e))
            or (k == "member_removed" and e.get("member") == v)
            or (k == "generation_formed" and _members(e) and v not in _members(e)
                and (pre_gen is None or (_int(e.get("gen")) or 0) > pre_gen))
        )  # fmt: skip
        if hit:
            detect = _t(e)
            break

    cands = _candidate_gens(after, "" if stays else v, pre_gen)
    committed: dict[int, float] = {}
    built: dict[int, float] = {}
    for e in after:
        g = _int(e.get("gen"))
        if g is None:
            continue
        if e.get("kind") == "step_commit":
            committed.setdefault(g, _t(e))
        elif e.get("kind") == "group_built":
            built.setdefault(g, _t(e))
    chosen: _Gen | None = None
    for c in cands:  # the generation the survivors actually ran steps in
        if c.gen in committed:
            chosen = c
            break
    if chosen is None:
        for c in cands:  # else the first that became ready
            if c.ready_t is not None or c.gen in built:
                chosen = c
                break
    quorum = chosen.formed_t if chosen is not None else (cands[0].formed_t if cands else None)

    regroup: float | None = None
    heal: float | None = None
    heal_zero = False
    first_step: float | None = None
    survivors = [m for m in (pre_members or []) if m not in casualties]
    if chosen is not None:
        g = chosen.gen
        start = chosen.formed_t if chosen.formed_t is not None else t0
        in_gen = [e for e in after if _int(e.get("gen")) == g and _t(e) >= start]
        survivors = [m for m in chosen.members
                     if (pre_members is None or m in pre_members) and m != v]  # fmt: skip
        who = set(survivors) or set(chosen.members)
        builds = [_t(e) for e in in_gen if e.get("kind") == "group_built" and e.get("proc") in who]
        regroup = max(builds) if builds else None
        heals = [_t(e) for e in in_gen if e.get("kind") == "heal_end"]
        began = any(e.get("kind") == "heal_begin" for e in in_gen)
        behind = len(set(chosen.ready_steps.values())) > 1
        if heals:
            heal = max(heals)
        else:
            heal_zero = not began and not behind
        first_step = _first_t(in_gen, "step_commit")
    promoted: tuple[str, ...] = ()
    if chosen is not None and pre_members is not None:
        newcomers = [m for m in chosen.members if m not in pre_members and m != v]
        promoted = tuple(m for m in newcomers if _registered_before(evs, lo, m))
    marks = [detect, quorum, regroup, heal, first_step]
    phases = _phases(t0, marks, heal_zero)
    total = first_step - t0 if first_step is not None else None
    gen = chosen.gen if chosen is not None else None
    return Recovery(kind, v, t0, gen, phases, total, survivors, replacement, f.how, f.injected,
                    promoted)  # fmt: skip


def _registered_before(evs: list[Event], lo: int, member: str) -> bool:
    """`member` registered before index `lo` (and did not leave since): a standby.
    Scans back from `lo`, so a recently registered spare is found at once."""
    for e in _Reversed(evs, lo):
        k = e.get("kind")
        if e.get("member") == member and k in ("member_registered", "member_removed"):
            return k == "member_registered"
    return False


class _Reversed:
    """Iterates evs[:lo] backwards without copying."""

    def __init__(self, evs: list[Event], lo: int) -> None:
        self.evs, self.lo = evs, lo

    def __iter__(self) -> Iterator[Event]:
        for i in range(self.lo - 1, -1, -1):
            yield self.evs[i]


def _window(evs: list[Event], lo: int, victim: str, pre_gen: int | None) -> list[Event]:
    """Events from t0 (index `lo`) up to the first commit in a generation formed after
    t0 without the victim: every recovery mark lies in it. Keeps the analysis linear
    in the recovery's length rather than the run's."""
    without: dict[int, bool] = {}
    end = len(evs)
    for i in range(lo, len(evs)):
        e = evs[i]
        k = e.get("kind")
        g = _int(e.get("gen"))
        if g is None or (pre_gen is not None and g <= pre_gen):
            continue
        if k in ("generation_formed", "generation_ready"):
            without[g] = without.get(g, True) and victim not in _members(e)
        elif k == "step_commit" and without.get(g):
            end = i + 1
            break
    return evs[lo:end]


def _replacement(evs: list[Event], f: Failure, claimed: set[int]) -> str | None:
    """The replacement the launcher spawned for this failure: the first unclaimed
    `worker_spawned` (replacement=true) after the victim's exit that names the
    victim in `replaces` (and its pid in `replaces_pid`, when recorded); for
    events without `replaces`, the first unclaimed unnamed one after the exit.
    A victim that never exited (a hang) gets none: the launcher replaces exits only."""
    if f.exit_t is None:
        return None
    lo = bisect.bisect_left([_t(e) for e in evs], f.exit_t)
    for e in evs[lo:]:
        if e.get("kind") != "worker_spawned" or not e.get("replacement") or id(e) in claimed:
            continue
        named, rpid = e.get("replaces"), e.get("replaces_pid")
        if (named is None and "replaces_pid" not in e) or (
            named == f.member and (rpid is None or f.pid is None or rpid == f.pid)
        ):
            claimed.add(id(e))
            m = e.get("member")
            return str(m) if m is not None else None
    return None


# ---- joins ---------------------------------------------------------------------------


def joins(events: Sequence[Event]) -> list[JoinTiming]:
    """One `JoinTiming` per replacement spawn and per re-registration after expulsion.

    A join's milestones are the joiner's own events (proc == member) after its
    spawn and before that member's next join, so a later incarnation never lends
    its timings to an earlier one. Pure; never raises on partial events.
    """
    evs = _sorted(events)
    starts: list[tuple[float, str, bool]] = []  # (t, member, spawned)
    for e in evs:
        k = e.get("kind")
        m = e.get("member")
        if m is None:
            continue
        if k == "worker_spawned":
            if e.get("replacement"):
                starts.append((_t(e), str(m), True))
        elif k == "member_registered" and (_int(e.get("incarnation")) or 1) > 1:
            starts.append((_t(e), str(m), False))
    ts = [_t(e) for e in evs]
    out: list[JoinTiming] = []
    for i, (t0, m, from_spawn) in enumerate(starts):
        end = next((t for t, mm, _ in starts[i + 1 :] if mm == m), math.inf)
        reg: float | None = None if from_spawn else t0
        group: float | None = None
        first: float | None = None
        heal_ev: Event | None = None
        # Every milestone precedes the joiner's first commit: scan up to it only.
        for e in evs[bisect.bisect_left(ts, t0) :]:
            t = _t(e)
            if t >= end:
                break
            k = e.get("kind")
            if k == "member_registered" and reg is None and e.get("member") == m:
                reg = t
            if e.get("proc") != m:
                continue
            if k == "group_built" and group is None:
                group = t
            elif k == "heal_end" and heal_ev is None and e.get("role") == "recv":
                heal_ev = e
            elif k == "step_commit":
                first = t
                break
        nbytes = 0
        rate: float | None = None
        healed: float | None = None
        if heal_ev is not None:
            healed = _t(heal_ev) - t0
            nbytes = _int(heal_ev.get("bytes")) or 0
            r = heal_ev.get("rate_mb_s")
            secs = heal_ev.get("seconds")
            if isinstance(r, int | float):
                rate = float(r)
            elif isinstance(secs, int | float) and secs > 0:
                rate = nbytes / 1e6 / float(secs)

        def rel(x: float | None, t0: float = t0) -> float | None:
            return None if x is None else x - t0

        out.append(JoinTiming(m, t0, rel(reg), rel(group), healed, rel(first), nbytes, rate,
                              not from_spawn))  # fmt: skip
    return out


# ---- formatting ----------------------------------------------------------------------


def _s(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]  # fmt: skip
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if c[:1].isdigit() or c[:1] == "-" else c.ljust(w)
                               for c, w in zip(r, widths, strict=True)).rstrip())  # fmt: skip
    return "\n".join(lines)


def format_recoveries(recs: Sequence[Recovery], origin: float | None = None) -> str:
    """Plain-text table, one row per recovery; seconds with 3 decimals, unknown blank.
    Failures with the same cause (`by_cause`) are one row, the first, whose
    evidence says how many times it happened and where.

    `origin` (e.g. the job_start time) makes the t0 column relative to it.
    """
    header = ["failure", "member", "t0", "gen", *PHASES, "total", "survivors", "replacement",
              "promoted", "evidence"]  # fmt: skip
    rows = []
    for r, n in by_cause(recs):
        t0 = r.t0 - origin if origin is not None else r.t0
        how = r.how if n == 1 else f"{r.how} (x{n}, the same error: {r.cause})"
        rows.append(
            [r.fault, r.member, f"{t0:.3f}", "" if r.gen is None else str(r.gen)]
            + [_s(p.seconds) for p in r.phases]
            + [
                _s(r.total_s),
                ",".join(r.survivors),
                r.replacement or "-",
                ",".join(r.promoted) or "-",
                how + (f" [injected: {r.injected}]" if r.injected else ""),
            ]  # fmt: skip
        )
    return _table(header, rows)


def format_joins(js: Sequence[JoinTiming], origin: float | None = None) -> str:
    """Plain-text table, one row per join: `joined` says whether the member is a
    spawned replacement or rejoined after an expulsion; `at` is when (the spawn,
    or the re-registration); the milestones are seconds from then, 3 decimals."""
    header = ["member", "joined", "at", "registered", "group", "healed", "first_step",
              "heal_MB", "heal_MB/s"]  # fmt: skip
    rows = []
    for j in js:
        t = j.spawned_t - origin if origin is not None else j.spawned_t
        rows.append(
            [j.member, "rejoined" if j.rejoined else "spawned", f"{t:.3f}", _s(j.registered_s), _s(j.group_s), _s(j.healed_s),
             _s(j.first_step_s), f"{j.heal_bytes / 1e6:.3f}", _s(j.heal_rate_mb_s)]
        )  # fmt: skip
    return _table(header, rows)
