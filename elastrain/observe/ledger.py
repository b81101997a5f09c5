"""Exactly-once, same-state and loss checks over a run's events.

These are the invariant checks of DESIGN.md ("Invariants") as pure functions of
the event list (`read_events(run_dir)`, any order), used by the unit tests, the
chaos tests and the soak. Each returns human-readable violation strings; an
empty list means the invariant held. None of them raises on partial events.

Exactly-once (`check_exactly_once`): for every step s with a `step_commit`,
  - all commits of s are in one generation g;
  - the `step_contrib` events of (s, g), one per member of g, partition
    `expected_ids(s)`: no id twice, none missing, none extra;
  - the committed steps are exactly 0..S-1.
Rolled-back commits are not part of the job's lineage and are left out: a
commit of step s is rolled back when a later generation became ready with a
start step <= s (every member that held it died and the job resumed from an
older checkpoint, so s is committed again). They are counted in
`LedgerReport.rolled_back` (work lost, recomputed).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]

_MAX_IDS_SHOWN = 8


@dataclass(frozen=True)
class LedgerReport:
    """Result of `check_exactly_once`.

    committed_steps: number of distinct committed steps.
    violations: one message per problem (empty: exactly-once held).
    committed_by_step: step -> the generation that committed it (the first
    committing generation when there were several, which is itself a violation).
    """

    committed_steps: int
    violations: list[str]
    committed_by_step: dict[int, int]
    rolled_back: int = 0
    """Distinct steps whose commits were rolled back and committed again."""

    @property
    def ok(self) -> bool:
        return not self.violations


def _sorted(events: Iterable[Event]) -> list[Event]:
    out = [e for e in events if isinstance(e.get("t"), int | float)]
    out.sort(key=lambda e: float(e["t"]))
    return out


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _ids(xs: Iterable[int]) -> str:
    xs = sorted(xs)
    more = f", ... ({len(xs)} in all)" if len(xs) > _MAX_IDS_SHOWN else ""
    return "[" + ", ".join(str(x) for x in xs[:_MAX_IDS_SHOWN]) + more + "]"


def _ranges(steps: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3..5, 9'."""
    out: list[str] = []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}..{steps[j]}")
        i = j + 1
    return ", ".join(out)


def _gen_members(evs: Sequence[Event]) -> dict[int, list[tuple[float, list[str]]]]:
    """gen -> [(t, members)] from generation_ready (preferred) or generation_formed."""
    ready: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)
    formed: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)
    for e in evs:
        k = e.get("kind")
        g = _int(e.get("gen"))
        m = e.get("members")
        if g is None or not isinstance(m, list | tuple):
            continue
        if k == "generation_ready":
            ready[g].append((float(e["t"]), [str(x) for x in m]))
        elif k == "generation_formed":
            formed[g].append((float(e["t"]), [str(x) for x in m]))
    out = dict(formed)
    out.update(ready)
    return out


def _members_at(
    table: Mapping[int, list[tuple[float, list[str]]]], gen: int, t: float
) -> list[str] | None:
    """Members of `gen` as last announced at or before `t` (gen numbers may repeat
    after a coordinator restart); the first announcement if all are later."""
    entries = table.get(gen)
    if not entries:
        return None
    best = entries[0][1]
    for et, members in entries:
        if et <= t:
            best = members
    return best


def check_exactly_once(
    events: Sequence[Event], expected_ids: Callable[[int], list[int]]
) -> LedgerReport:
    """Check that every sample of every committed step was consumed exactly once.

    `expected_ids(s)` is the ground truth: the sample ids of step s in the global
    order (e.g. ``lambda s: order.ids(s * B, (s + 1) * B)``). Pure; for tests and
    the soak, not called on the training path.
    """
    evs = _sorted(events)
    violations: list[str] = []
    commits: dict[int, list[Event]] = defaultdict(list)
    contribs: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in evs:
        k = e.get("kind")
        s, g = _int(e.get("step")), _int(e.get("gen"))
        if s is None or g is None:
            continue
        if k == "step_commit":
            commits[s].append(e)
        elif k == "step_contrib":
            contribs[(s, g)].append(e)
    members_of = _gen_members(evs)
    fates = _StateFates(evs)
    # A generation that started below steps already committed rolls them back,
    # if it went on to commit anything: one that broke first left the newer
    # state with the members that had it, and the next generation heals from them.
    trained = {_int(e.get("gen")) for e in evs if e.get("kind") == "step_commit"}
    later_start = _LaterStart(
        (float(e["t"]), int(e["start_step"]))
        for e in evs
        if e.get("kind") == "generation_ready"
        and _int(e.get("start_step")) is not None
        and _int(e.get("gen")) in trained
    )
    rolled_back: set[int] = set()
    for s in list(commits):
        kept = [e for e in commits[s] if later_start.min_after(float(e["t"])) > s]
        if len(kept) < len(commits[s]):
            rolled_back.add(s)
            commits[s] = kept
        if not kept:
            del commits[s]
    committed_by_step: dict[int, int] = {}
    for s in sorted(commits):
        cs = [e for e in commits[s] if not fates.discarded(e)]
        if not cs:
            # Nothing built on any of them (the job's last step, say): the newest
            # generation's commits are the job's.
            top = max(int(e["gen"]) for e in commits[s])
            cs = [e for e in commits[s] if int(e["gen"]) == top]
        gens: dict[int, list[str]] = {}
        for e in cs:
            gens.setdefault(int(e["gen"]), []).append(str(e.get("proc")))
        committed_by_step[s] = int(cs[0]["gen"])
        if len(gens) > 1:
            detail = "; ".join(f"gen {g} by {', '.join(sorted(set(p)))}" for g, p in gens.items())
            violations.append(f"step {s} was committed in {len(gens)} generations: {detail}")
        expected = Counter(int(x) for x in expected_ids(s))
        for g in gens:
            t_commit = min(float(e["t"]) for e in cs if int(e["gen"]) == g)
            violations.extend(
                _check_partition(s, g, contribs.get((s, g), []), expected,
                                 _members_at(members_of, g, t_commit))
            )  # fmt: skip
    steps = sorted(commits)
    if steps:
        missing = sorted(set(range(steps[-1] + 1)) - set(steps))
        if missing:
            violations.append(
                f"steps never committed (gap): {_ranges(missing)} "
                f"(committed {len(steps)} steps up to {steps[-1]})"
            )
    return LedgerReport(len(steps), violations, committed_by_step, len(rolled_back))


class _LaterStart:
    """The lowest start step of the generations that became ready after a time."""

    def __init__(self, starts: Iterable[tuple[float, int]]) -> None:
        pairs = sorted(starts)
        self.times = [t for t, _ in pairs]
        self.suffix_min = [0] * len(pairs)
        low = math.inf
        for i in range(len(pairs) - 1, -1, -1):
            low = min(low, pairs[i][1])
            self.suffix_min[i] = int(low)

    def min_after(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t)
        return self.suffix_min[i] if i < len(self.times) else math.inf


class _StateFates:
    """What became of each member's state after each of its commits: used (the
    member committed again, sent its state in a heal, or saved its part of a
    checkpoint that was committed), replaced by a heal, or never used (the
    member exited or the job ended)."""

    def __init__(self, evs: Sequence[Event]) -> None:
        self._after: dict[str, list[tuple[float, bool]]] = defaultdict(list)
        """member -> (t, used) for each event that uses (True) or replaces (False)
        its state, in time order."""
        # A saved shard is part of the job only once its checkpoint is committed:
        # a zombie commit that lands on a checkpoint step saves its shard too,
        # into a step its peers committed long ago (retention has deleted it by
        # then) or never, and nobody ever commits that generation's checkpoint.
        durable = {
            (_int(e.get("step")), _int(e.get("generation")))
            for e in evs
            if e.get("kind") == "checkpoint_committed"
        }
        formed: dict[int, float] = {}
        for e in evs:
            k = e.get("kind")
            used = (
                k == "step_commit"
                or (k == "heal_end" and e.get("role") == "send")
                or (
                    k == "checkpoint_saved"
                    and (_int(e.get("step")), _int(e.get("generation"))) in durable
                )
            )
            if used or (k == "heal_end" and e.get("role") == "recv"):
                self._after[str(e.get("proc"))].append((float(e["t"]), used))
            g = _int(e.get("gen"))
            if k in ("generation_formed", "generation_ready") and g is not None:
                formed[g] = min(formed.get(g, math.inf), float(e["t"]))
        # gen -> when the first generation newer than it formed.
        self._newer: dict[int, float] = {}
        first = math.inf
        for g in sorted(formed, reverse=True):
            self._newer[g] = first
            first = min(first, formed[g])

    def discarded(self, commit: Event) -> bool:
        """A commit whose state is not part of the job's lineage. Its member
        completed an all-reduce its peers did not (a hung one continued after the
        others had re-run the step without it), and then either a heal replaced
        its state before anything used it, or nothing ever used it and it came
        after a newer generation had formed (the job ended, or the member left,
        before it rejoined)."""
        proc, t = str(commit.get("proc")), float(commit["t"])
        nxt = next(((tt, used) for tt, used in self._after.get(proc, []) if tt > t), None)
        if nxt is not None:
            return not nxt[1]
        g = _int(commit.get("gen"))
        return g is not None and self._newer.get(g, math.inf) < t


def _check_partition(
    s: int, g: int, cs: Sequence[Event], expected: Counter[int], members: list[str] | None
) -> list[str]:
    """The contributions of (s, g) must partition the expected ids."""
    out: list[str] = []
    where = f"step {s} gen {g}"
    by_member: dict[str, list[int]] = defaultdict(list)
    n_events: Counter[str] = Counter()
    for e in cs:
        p = str(e.get("proc"))
        n_events[p] += 1
        samples = e.get("samples")
        if isinstance(samples, list | tuple):
            by_member[p].extend(int(x) for x in samples)
    for p, n in sorted(n_events.items()):
        if n > 1:
            out.append(f"{where}: {p} wrote {n} step_contrib events")
    if members is not None:
        extra_members = sorted(set(by_member) - set(members))
        if extra_members:
            out.append(f"{where}: contributions from non-members {', '.join(extra_members)}")
        silent = [m for m in members if m not in n_events]
        if silent:
            out.append(f"{where}: no step_contrib from member(s) {', '.join(silent)}")
    got: Counter[int] = Counter()
    for ids in by_member.values():
        got.update(ids)
    over = got - expected
    under = expected - got
    dup = [i for i in over if i in expected]
    extra = [i for i in over if i not in expected]
    if dup:
        feeders = sorted({p for p, ids in by_member.items() if set(ids) & set(dup)})
        out.append(f"{where}: duplicated sample id(s) {_ids(dup)} (fed by {', '.join(feeders)})")
    if extra:
        out.append(f"{where}: unexpected sample id(s) {_ids(extra)}")
    if under:
        out.append(f"{where}: missing sample id(s) {_ids(under)}")
    return out


def check_same_state(events: Sequence[Event]) -> list[str]:
    """Every member of a generation starts it with the same state.

    For each gen, all `generation_start` events must carry the same
    `state_hash` and the same committed step count. Empty or absent hashes
    (hashing turned off) are not compared. A sharded job's members hash their
    own shard (the event's `shard`): there, members with the same shard index
    (twins) must carry the same hash.
    """
    out: list[str] = []
    by_gen: dict[int, list[Event]] = defaultdict(list)
    for e in _sorted(events):
        g = _int(e.get("gen"))
        if e.get("kind") == "generation_start" and g is not None:
            by_gen[g].append(e)
    for g in sorted(by_gen):
        hashes: dict[int | None, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        steps: dict[int | None, list[str]] = defaultdict(list)
        for e in by_gen[g]:
            who = str(e.get("proc"))
            steps[_int(e.get("step"))].append(who)
            h = e.get("state_hash")
            if h:
                hashes[_int(e.get("shard"))][str(h)].append(who)
        for shard, seen in sorted(hashes.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if len(seen) > 1:
                which = "members" if shard is None else f"holders of shard {shard}"
                detail = "; ".join(f"{h[:16]} at {', '.join(ms)}" for h, ms in seen.items())
                out.append(f"gen {g}: {which} started with different state: {detail}")
        if len(steps) > 1:
            detail = "; ".join(f"step {s} at {', '.join(ms)}" for s, ms in steps.items())
            out.append(f"gen {g}: members started at different steps: {detail}")
    return out


def loss_curve(events: Sequence[Event]) -> dict[int, float]:
    """step -> loss of its first commit, in step order."""
    out: dict[int, float] = {}
    for e in _sorted(events):
        s = _int(e.get("step"))
        loss = e.get("loss")
        if e.get("kind") != "step_commit" or s is None or s in out:
            continue
        if isinstance(loss, int | float):
            out[s] = float(loss)
    return dict(sorted(out.items()))


def check_loss_agreement(events: Sequence[Event], rel_tol: float = 1e-6) -> list[str]:
    """Every commit of a step (all members, all generations) reports the same loss
    within `rel_tol` relative; a non-finite or missing loss is a violation."""
    out: list[str] = []
    by_step: dict[int, list[tuple[str, int | None, float]]] = defaultdict(list)
    for e in _sorted(events):
        s = _int(e.get("step"))
        if e.get("kind") != "step_commit" or s is None:
            continue
        loss = e.get("loss")
        who, g = str(e.get("proc")), _int(e.get("gen"))
        if not isinstance(loss, int | float) or not math.isfinite(loss):
            out.append(f"step {s}: {who} (gen {g}) committed a non-finite loss {loss!r}")
            continue
        by_step[s].append((who, g, float(loss)))
    for s in sorted(by_step):
        vals = by_step[s]
        lo = min(vals, key=lambda x: x[2])
        hi = max(vals, key=lambda x: x[2])
        if not math.isclose(lo[2], hi[2], rel_tol=rel_tol, abs_tol=0.0) and lo[2] != hi[2]:
            out.append(
                f"step {s}: members disagree on the loss: {lo[0]} (gen {lo[1]}) {lo[2]!r} "
                f"vs {hi[0]} (gen {hi[1]}) {hi[2]!r}"
            )
    return out
