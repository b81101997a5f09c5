"""Stragglers: which member computes slower than its peers, from the step events.

A synchronous step runs at the pace of its slowest member: everyone else waits
in the all-reduce. That wait hides the cause, so the score looks at what each
member spent *before* the all-reduce: `step_commit.compute_s` (data, forward,
backward of its micro-batches), per sample it computed (`step_contrib.samples`),
so that a member given one micro-batch more is not called slow.

Per committed step, a member's *ratio* is its compute seconds per sample over
the median of the other computing members' (members with no sample, such as a
sharded job's shadows, are left out; a step with one computing member says
nothing). Its *score* is the median of its ratios over the last `WINDOW` steps
it computed in: one slow step (a page fault storm, a GC pause) does not make a
straggler, a node that is slower for a while does. A member whose score is at
least `THRESHOLD` over at least `MIN_STEPS` steps is *straggling*.

Pure functions of the events, like the rest of `elastrain.observe`: the live
view shows the members straggling now (`current_stragglers`), the report the
stretches of steps in which each one was (`straggler_episodes`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]

WINDOW = 10
"""Steps a score looks back over (the member's own computing steps)."""
MIN_STEPS = 5
"""Fewer ratios than this in the window: no verdict yet."""
THRESHOLD = 1.5
"""Score from which a member is straggling: 1.5 x the others' time per sample."""


@dataclass(frozen=True)
class StepRatio:
    """One member's compute seconds per sample at `step`, over the others' median."""

    step: int
    member: str
    ratio: float


@dataclass(frozen=True)
class Episode:
    """Steps `first`..`last` during which `member`'s score stayed >= the threshold;
    `peak` is its highest score then."""

    member: str
    first: int
    last: int
    peak: float


def _take(
    e: Event,
    samples: dict[tuple[int, int, str], int],
    compute: dict[tuple[int, int], dict[str, float]],
) -> int | None:
    """Record what `e` says: a `step_contrib`'s sample count or a `step_commit`'s
    compute seconds. Returns the step of a commit it recorded, else None."""
    kind, step, gen, member = e.get("kind"), e.get("step"), e.get("gen"), e.get("proc")
    if not (isinstance(step, int) and isinstance(gen, int) and isinstance(member, str)):
        return None
    if kind == "step_contrib" and isinstance(e.get("samples"), list):
        samples[(step, gen, member)] = len(e["samples"])
    elif kind == "step_commit" and isinstance(e.get("compute_s"), int | float):
        compute.setdefault((step, gen), {})[member] = float(e["compute_s"])
        return step
    return None


def _member_ratios(
    compute: Mapping[str, float], counts: Mapping[str, int]
) -> list[tuple[str, float]]:
    """One committed step's (member, ratio) pairs, by member: compute seconds per
    sample over the other computing members' median ([] with fewer than two)."""
    per_sample = {m: s / n for m, s in compute.items() if (n := counts.get(m, 0)) > 0 and s > 0}
    if len(per_sample) < 2:
        return []
    return [
        (m, v / statistics.median(x for o, x in per_sample.items() if o != m))
        for m, v in sorted(per_sample.items())
    ]


def step_ratios(events: Iterable[Event]) -> list[StepRatio]:
    """Every (step, member) ratio the events allow, in step order. Only steps
    committed in the generation their contributions name are used (an aborted
    attempt of a step leaves contributions but no commit)."""
    samples: dict[tuple[int, int, str], int] = {}
    compute: dict[tuple[int, int], dict[str, float]] = {}
    for e in events:
        _take(e, samples, compute)
    out: list[StepRatio] = []
    for (step, gen), by_member in sorted(compute.items()):
        counts = {m: samples.get((step, gen, m), 0) for m in by_member}
        out += [StepRatio(step, m, r) for m, r in _member_ratios(by_member, counts)]
    return out


def _scores(ratios: Iterable[StepRatio], window: int) -> Iterable[tuple[StepRatio, float, int]]:
    """(ratio, the member's rolling score after it, ratios in the window)."""
    recent: dict[str, deque[float]] = {}
    for r in ratios:
        w = recent.setdefault(r.member, deque(maxlen=window))
        w.append(r.ratio)
        yield r, statistics.median(w), len(w)


def current_stragglers(
    events: Iterable[Event],
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    min_steps: int = MIN_STEPS,
) -> dict[str, float]:
    """Members straggling as of their latest step, with their score (highest first)."""
    last: dict[str, tuple[float, int]] = {}
    for r, score, n in _scores(step_ratios(events), window):
        last[r.member] = (score, n)
    out = {m: s for m, (s, n) in last.items() if n >= min_steps and s >= threshold}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def straggler_episodes(
    events: Iterable[Event],
    *,
    window: int = WINDOW,
    threshold: float = THRESHOLD,
    min_steps: int = MIN_STEPS,
) -> list[Episode]:
    """Each stretch of steps over which a member's score was >= `threshold` (with
    at least `min_steps` ratios in its window), in the order they began."""
    open_: dict[str, Episode] = {}
    done: list[Episode] = []
    for r, score, n in _scores(step_ratios(events), window):
        ep = open_.get(r.member)
        if n >= min_steps and score >= threshold:
            if ep is None:
                open_[r.member] = Episode(r.member, r.step, r.step, score)
            else:
                open_[r.member] = Episode(r.member, ep.first, r.step, max(ep.peak, score))
        elif ep is not None:
            done.append(open_.pop(r.member))
    done.extend(open_.values())
    return sorted(done, key=lambda ep: (ep.first, ep.member))


class StragglerScores:
    """`current_stragglers`, kept up to date from events fed as they arrive (the
    launcher's eviction loop): each call of `feed` costs what it is given, not a
    pass over the run. A step's ratios are taken once every member that will
    commit it has: when a commit two steps later (in any generation) arrives, or
    at `flush` (a member's commit of step s precedes every commit of s + 1, but
    files read one after the other can show them in the other order). Gives the
    same scores as `current_stragglers` over the same events once flushed."""

    def __init__(self, window: int = WINDOW, threshold: float = THRESHOLD) -> None:
        self.window = window
        self.threshold = threshold
        self._samples: dict[tuple[int, int, str], int] = {}
        self._compute: dict[tuple[int, int], dict[str, float]] = {}
        self._recent: dict[str, deque[float]] = {}
        self._streak: dict[str, int] = {}
        """member -> its latest ratios in a row after which its score, over a whole
        window, was >= the threshold (how long it has been straggling)."""
        self._top = -1

    def feed(self, events: Iterable[Event]) -> None:
        """Take new events (any kinds, in time order)."""
        for e in events:
            step = _take(e, self._samples, self._compute)
            if step is not None and step > self._top:
                self._top = step
                self._settle(below=step - 1)

    def flush(self) -> None:
        """Score every step seen (the run ended, or a test wants all of them)."""
        self._settle(below=None)

    def _settle(self, below: int | None) -> None:
        done = sorted(k for k in self._compute if below is None or k[0] < below)
        for key in done:
            by_member = self._compute.pop(key)
            step, gen = key
            counts = {m: self._samples.pop((step, gen, m), 0) for m in by_member}
            for m, ratio in _member_ratios(by_member, counts):
                w = self._recent.setdefault(m, deque(maxlen=self.window))
                w.append(ratio)
                slow = len(w) == self.window and statistics.median(w) >= self.threshold
                self._streak[m] = self._streak.get(m, 0) + 1 if slow else 0
        if below is not None:
            # Contributions of steps nobody committed (aborted attempts) are dropped.
            for k in [k for k in self._samples if k[0] < below - 1]:
                del self._samples[k]

    def scores(self) -> dict[str, tuple[float, int, int]]:
        """member -> (its score, ratios in its window, its straggling streak: ratios
        in a row with a whole window's score >= the threshold)."""
        return {
            m: (statistics.median(w), len(w), self._streak.get(m, 0))
            for m, w in self._recent.items()
            if w
        }


EVICT_AFTER = 2 * WINDOW
"""Ratios in a row a member must have straggled for (a whole window's score >= the
threshold after each) before `choose_evictions` evicts it: one slow window (a
loaded machine's start-up, a burst of paging) is noise, a node slow for three
windows' worth of steps is not."""


def choose_evictions(
    scores: Mapping[str, tuple[float, int, int]],
    members: Iterable[str],
    spares: int,
    evicting: Iterable[str],
    *,
    after: int = EVICT_AFTER,
) -> list[str]:
    """Members to evict now: those of the running generation that have straggled
    for `after` ratios in a row (`StragglerScores.scores`), slowest first, no more
    than the hot spares not already promised to an eviction in progress
    (`evicting`), so that the generation keeps its size. Pure."""
    busy = set(evicting)
    free = spares - len(busy)
    if free <= 0:
        return []
    slow = [
        (sns[0], m)
        for m in members
        if m not in busy and (sns := scores.get(m)) is not None and sns[2] >= after
    ]
    return [m for _, m in sorted(slow, key=lambda x: (-x[0], x[1]))][:free]


def format_episodes(episodes: Iterable[Episode]) -> str:
    """One line per episode: 'w1 steps 20-49: up to 3.2x the others' compute per sample'."""
    return "\n".join(
        f"{ep.member} steps {ep.first}-{ep.last}: up to {ep.peak:.1f}x the others' "
        "compute per sample"
        for ep in episodes
    )
