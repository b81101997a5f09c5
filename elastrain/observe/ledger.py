"""Exactly-once, same-state and loss checks over a run's events.

These are the invariant checks of DESIGN.md ("Invariants") as pure functions of
the event list (`read_events(run_dir)`, any order), used by the unit tests, the
chaos tests and the soak. Each returns human-readable violation strings; an
empty list means the invariant held. None of them raises on partial events.

Exactly-once (`check_exactly_once`) is checked along the job's *lineage*: the
chain of generations its final state descends from, followed back from the
newest generation that committed (`_Lineage`: a generation starts from the state
its members held, each one's last commit, a heal's senders' or a loaded
checkpoint's, so the generation of that commit is its predecessor and
contributed the steps below its start). Along the lineage:
  - every step 0..S-1 has a commit (no gap), by exactly one generation g: a
    generation of the lineage that commits a step its start state already held
    is a violation ("committed in 2 generations");
  - the `step_contrib` events of (s, g), one per member of g, partition
    `expected_ids(s)`: no id twice, none missing, none extra;
  - the members of a generation started from one state: the same generation's
    commit of the step below (the protocol heals a member whose count matches
    but whose commit is another generation's).
Commits outside the lineage are work the job threw away, counted in
`LedgerReport.rolled_back` (steps recomputed): those rolled back by a resume
from an older checkpoint, a zombie's (a member that completed an all-reduce its
peers had given up on, then was healed or left), and those of a generation that
ran from an older state while the only holder of the newest one was stopped,
superseded when that holder came back.
"""

from __future__ import annotations

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
    committed_by_step: step -> the generation of the lineage that committed it.
    """

    committed_steps: int
    violations: list[str]
    committed_by_step: dict[int, int]
    rolled_back: int = 0
    """Distinct steps also committed outside the lineage (rolled back, a zombie's,
    a superseded generation's): work thrown away and done again."""

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
    """Check that every sample of every step in the job's lineage was consumed
    exactly once.

    `expected_ids(s)` is the ground truth: the sample ids of step s in the global
    order (e.g. ``lambda s: order.ids(s * B, (s + 1) * B)``). Pure; for tests and
    the soak, not called on the training path.
    """
    evs = _sorted(events)
    violations: list[str] = []
    by_gen: dict[int, list[Event]] = defaultdict(list)
    contribs: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in evs:
        k = e.get("kind")
        s, g = _int(e.get("step")), _int(e.get("gen"))
        if s is None or g is None:
            continue
        if k == "step_commit":
            by_gen[g].append(e)
        elif k == "step_contrib":
            contribs[(s, g)].append(e)
    if not by_gen:
        return LedgerReport(0, [], {})
    lineage = _Lineage(evs, by_gen)
    violations.extend(lineage.violations)
    kept: dict[int, list[Event]] = defaultdict(list)
    thrown: set[int] = set()
    for g, cs in by_gen.items():
        lo, end = lineage.ranges.get(g, (0, 0))
        for e in cs:
            s = int(e["step"])
            if lo <= s < end:
                kept[s].append(e)
            else:
                thrown.add(s)
    for g, (lo, _) in lineage.ranges.items():
        for s in sorted({int(e["step"]) for e in by_gen[g] if int(e["step"]) < lo}):
            if s not in kept:
                continue
            # A generation of the lineage committed a step that the state it
            # started from already held: no rollback explains that.
            again = sorted({str(e.get("proc")) for e in by_gen[g] if int(e["step"]) == s})
            before = sorted({str(e.get("proc")) for e in kept[s]})
            violations.append(
                f"step {s} was committed in 2 generations: gen {int(kept[s][0]['gen'])} by "
                f"{', '.join(before)}; gen {g} by {', '.join(again)}"
            )
    members_of = _gen_members(evs)
    committed_by_step: dict[int, int] = {}
    for s in sorted(kept):
        g = int(kept[s][0]["gen"])
        committed_by_step[s] = g
        t_commit = min(float(e["t"]) for e in kept[s])
        expected = Counter(int(x) for x in expected_ids(s))
        violations.extend(
            _check_partition(
                s, g, contribs.get((s, g), []), expected, _members_at(members_of, g, t_commit)
            )
        )
    steps = sorted(kept)
    if steps:
        missing = sorted(set(range(steps[-1] + 1)) - set(steps))
        if missing:
            violations.append(
                f"steps never committed (gap): {_ranges(missing)} "
                f"(committed {len(steps)} steps up to {steps[-1]})"
            )
    return LedgerReport(len(steps), violations, committed_by_step, len(thrown & set(steps)))


class _Lineage:
    """The generations the job's final state descends from, and the steps each one
    contributed to it (`ranges`: gen -> [first step, end)).

    Followed backwards from the newest generation that committed: a generation
    starts from the state its members held (each one's own last commit, the heal
    that replaced it, or the checkpoint it loaded), and the generation of that
    commit is its predecessor, which contributed the steps below the start. Commits
    outside the lineage are work the job threw away: a zombie's (a member that
    completed an all-reduce its peers had given up on), those of a generation that
    started from an older state and was superseded by one that held the newer
    state again (the only holder of the newest state was stopped for longer than
    its lease, then came back), and those rolled back by a resume from an older
    checkpoint."""

    def __init__(self, evs: Sequence[Event], by_gen: Mapping[int, Sequence[Event]]) -> None:
        self.violations: list[str] = []
        self.ranges: dict[int, tuple[int, float]] = {}
        starts = self._starts(evs)
        announced: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for e in evs:
            g, s = _int(e.get("gen")), _int(e.get("start_step"))
            if e.get("kind") == "generation_ready" and g is not None and s is not None:
                announced[g].append((float(e["t"]), s))
        gen: int | None = max(by_gen)
        end = math.inf
        first = {g: min(float(e["t"]) for e in cs) for g, cs in by_gen.items()}
        while gen is not None and gen not in self.ranges:
            t_first = first[gen]
            # Where the coordinator said it starts (its last word before the first
            # commit), else its first committed step (a log without that word).
            said = [s for t, s in announced.get(gen, []) if t <= t_first]
            lo = said[-1] if said else min(int(e["step"]) for e in by_gen[gen])
            self.ranges[gen] = (lo, end)
            # Ranges never overlap, even for a predecessor that said it started
            # above its successor (a log that makes no sense gets gaps, not two
            # generations' commits of one step).
            end = min(end, lo)
            if lo <= 0:
                break
            gen = self._predecessor(gen, lo, starts.get(gen, {}), by_gen, t_first)
            if gen is not None and not (gen in by_gen and first[gen] < t_first):
                # A checkpoint of another run (a requeued job numbers its generations
                # from 1 again) or of a generation whose commits are not in this
                # log: the lineage starts here, and the steps below are a gap.
                gen = None

    @staticmethod
    def _starts(evs: Sequence[Event]) -> dict[int, dict[str, tuple[int, int]]]:
        """gen -> member -> (step count, gen) of the state the member held when it
        first committed in gen: what its own last commit made, a heal's senders'
        state, a kept step it applied, or a loaded checkpoint's. Members whose
        state is not known (a log without those events) are left out."""
        origin: dict[str, tuple[int, int]] = {}
        senders: dict[int, list[str]] = defaultdict(list)
        out: dict[int, dict[str, tuple[int, int]]] = defaultdict(dict)
        seen: set[tuple[int, str]] = set()
        for e in evs:
            k = e.get("kind")
            p = str(e.get("proc"))
            g, s = _int(e.get("gen")), _int(e.get("step"))
            if k in ("step_commit", "step_rolled_forward") and s is not None and g is not None:
                if k == "step_commit" and (g, p) not in seen:
                    seen.add((g, p))
                    if p in origin:
                        out[g][p] = origin[p]
                origin[p] = (s + 1, g)
            elif k == "checkpoint_loaded" and s is not None:
                ck = _int(e.get("generation"))
                if ck is not None:
                    origin[p] = (s, ck)
            elif k in ("heal_begin", "heal_end") and g is not None:
                if e.get("role") == "send":
                    senders[g].append(p)
                elif e.get("role") == "recv" and k == "heal_end":
                    src = next((origin[q] for q in senders[g] if q in origin), None)
                    if src is None:
                        origin.pop(p, None)
                    else:
                        origin[p] = src
        return out

    def _predecessor(
        self,
        gen: int,
        lo: int,
        starts: Mapping[str, tuple[int, int]],
        by_gen: Mapping[int, Sequence[Event]],
        t_first: float,
    ) -> int | None:
        """The generation whose commit of step lo - 1 `gen` started from."""
        froms = sorted({g for s, g in starts.values() if s == lo})
        if len(froms) > 1:
            detail = "; ".join(
                f"gen {g} at {', '.join(sorted(m for m, o in starts.items() if o == (lo, g)))}"
                for g in froms
            )
            self.violations.append(
                f"gen {gen}: its members started from step {lo - 1} as committed in "
                f"different generations: {detail}"
            )
        if froms:
            return froms[-1]
        # Its members' state is known but not at the step it started from: that
        # state's generation all the same (the steps in between are a gap).
        known = sorted({g for _, g in starts.values()})
        if known:
            return known[-1]
        # Nothing known of its members' state (a log without those events): the
        # newest commit of the step below, before it started.
        best: tuple[float, int] | None = None
        for g, cs in by_gen.items():
            for e in cs:
                t = float(e["t"])
                if int(e["step"]) == lo - 1 and t < t_first and (best is None or t > best[0]):
                    best = (t, g)
        return None if best is None else best[1]


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
