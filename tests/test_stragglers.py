"""Straggler scores from step events (elastrain.observe.stragglers): who computes
slower than its peers, per sample, over a window of steps."""

from __future__ import annotations

import random
from typing import Any

from elastrain.observe.failures import recognise_failures
from elastrain.observe.stragglers import (
    EVICT_AFTER,
    MIN_STEPS,
    THRESHOLD,
    WINDOW,
    StragglerScores,
    choose_evictions,
    current_stragglers,
    format_episodes,
    step_ratios,
    straggler_episodes,
)

PER_SAMPLE_S = 0.004


def run(
    steps: int,
    members: dict[str, int],
    slow: dict[str, tuple[int, int, float]] | None = None,
    gen: int = 1,
    jitter: float = 0.0,
) -> list[dict[str, Any]]:
    """Events of `steps` committed steps: member -> samples it computed per step;
    `slow`: member -> (first step, last step, extra seconds per step)."""
    ev: list[dict[str, Any]] = []
    for s in range(steps):
        for i, (m, n) in enumerate(members.items()):
            extra = 0.0
            if slow and m in slow and slow[m][0] <= s <= slow[m][1]:
                extra = slow[m][2]
            # A little deterministic noise, different per member and step.
            noise = jitter * (((s * 7 + i * 3) % 5) - 2) / 2
            ev.append({"kind": "step_contrib", "proc": m, "step": s, "gen": gen,
                       "samples": list(range(n))})  # fmt: skip
            ev.append({"kind": "step_commit", "proc": m, "step": s, "gen": gen,
                       "compute_s": n * PER_SAMPLE_S * (1 + noise) + extra})  # fmt: skip
    return ev


def test_a_slowed_member_is_one_episode_and_nobody_else_is_flagged() -> None:
    ev = run(60, {"w0": 8, "w1": 8, "w2": 8}, slow={"w1": (20, 39, 0.05)}, jitter=0.1)
    (ep,) = straggler_episodes(ev)
    assert ep.member == "w1"
    # The window's median needs a majority of slow steps before it flags, and
    # as many fast ones after before it clears: the episode sits inside the slow
    # stretch shifted by at most half a window.
    assert 20 <= ep.first <= 20 + WINDOW // 2 and 39 <= ep.last <= 39 + WINDOW // 2
    assert ep.peak > (8 * PER_SAMPLE_S + 0.05) / (8 * PER_SAMPLE_S) * 0.8
    assert "w1 steps" in format_episodes([ep])
    # While it is slow the live view names it; after it recovered, nobody.
    during = [e for e in ev if e["step"] <= 35]
    assert list(current_stragglers(during)) == ["w1"]
    assert current_stragglers(ev) == {}


def test_more_micro_batches_is_not_slowness() -> None:
    # 8 micro-batches over 3 members: 3, 3, 2. The member with 3 spends 1.5x the
    # time of the one with 2, per step; per sample they are even.
    ev = run(40, {"w0": 3, "w1": 3, "w2": 2}, jitter=0.1)
    assert straggler_episodes(ev) == [] and current_stragglers(ev) == {}
    ratios = step_ratios(ev)
    assert ratios and all(abs(r.ratio - 1) < 0.2 for r in ratios)


def test_two_members_compare_with_each_other_and_shadows_are_left_out() -> None:
    # With two computing members the other's time is the reference (a median of
    # both would halve the gap); a member with no sample (a sharded job's shadow)
    # is not scored and not a reference.
    ev = run(30, {"w0": 4, "w1": 4, "w2": 0}, slow={"w0": (0, 29, 4 * PER_SAMPLE_S)})
    assert {r.member for r in step_ratios(ev)} == {"w0", "w1"}
    assert current_stragglers(ev) == {"w0": 2.0}


def test_one_slow_step_is_not_a_straggler_and_a_short_history_gives_no_verdict() -> None:
    ev = run(30, {"w0": 4, "w1": 4, "w2": 4}, slow={"w2": (12, 12, 1.0)})
    assert straggler_episodes(ev) == []
    short = run(MIN_STEPS - 1, {"w0": 4, "w1": 4}, slow={"w1": (0, 99, 1.0)})
    assert current_stragglers(short) == {}
    assert THRESHOLD > 1


def test_only_the_generation_that_committed_a_step_counts() -> None:
    # Step 5 was attempted in generation 1 (w1 slow there, then the attempt was
    # aborted: contributions, no commits) and committed in generation 2.
    ev = run(10, {"w0": 4, "w1": 4}, gen=2)
    ev += [{"kind": "step_contrib", "proc": m, "step": 5, "gen": 1, "samples": [1, 2, 3, 4]}
           for m in ("w0", "w1")]  # fmt: skip
    ev.append({"kind": "step_contrib", "proc": "w1", "step": 5, "gen": 3, "samples": [1]})
    ratios = [r for r in step_ratios(ev) if r.step == 5]
    assert sorted(r.member for r in ratios) == ["w0", "w1"]
    assert all(r.ratio == 1.0 for r in ratios)


def test_the_report_and_the_live_view_name_the_straggler() -> None:
    from elastrain.launch.progress import Progress, observe
    from elastrain.observe.report import (
        format_summary,
        render_html,
        report_from_events,
        report_json,
    )

    ev = run(40, {"w0": 4, "w1": 4, "w2": 4}, slow={"w2": (10, 39, 0.05)})
    for i, e in enumerate(ev):
        e["t"] = 1000.0 + i * 0.01
    rep = report_from_events(ev)
    assert [ep.member for ep in rep.stragglers] == ["w2"]
    assert "stragglers:\n    w2 steps" in format_summary(rep)
    assert "<h2>Stragglers" in render_html(rep)
    assert report_json(rep)["stragglers"][0]["member"] == "w2"
    seen = observe(ev)
    assert [m for m, _ in seen.stragglers] == ["w2"]
    p = Progress(40, plain=True)
    p.observed = seen
    assert "straggling: w2 " in p.health()


def test_the_incremental_scores_equal_the_whole_runs_whatever_the_chunks() -> None:
    # Two generations, a slowed member, an aborted attempt (contributions, no commit),
    # events fed in uneven chunks and with each step's events shuffled.
    rng = random.Random(7)
    ev = run(30, {"w0": 8, "w1": 8, "w2": 8}, slow={"w2": (5, 25, 0.05)}, jitter=0.1)
    ev += [{"kind": "step_contrib", "proc": "w1", "step": 30, "gen": 1, "samples": [1]}]
    later = run(60, {"w0": 8, "w1": 12, "w3": 4}, slow={"w3": (40, 59, 0.08)}, gen=2)
    ev += [e for e in later if e["step"] >= 30]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in ev:
        by_step.setdefault(e["step"], []).append(e)
    fed: list[dict[str, Any]] = []
    for s in sorted(by_step):
        chunk = by_step[s][:]
        rng.shuffle(chunk)
        fed += chunk
    scores = StragglerScores()
    i = 0
    while i < len(fed):
        n = rng.randint(1, 9)
        scores.feed(fed[i : i + n])
        i += n
    scores.flush()
    want = current_stragglers(ev)
    got = {m: s for m, (s, n, _) in scores.scores().items() if n >= MIN_STEPS and s >= THRESHOLD}
    # (w2 left slow: its score stays as of its last step.)
    assert got == want and list(want) == ["w3", "w2"]


def test_evictions_need_a_long_streak_and_a_free_spare() -> None:
    long, short = EVICT_AFTER, EVICT_AFTER - 1
    scores = {"a": (2.5, WINDOW, long), "b": (1.8, WINDOW, long + 5), "c": (3.0, WINDOW, short),
              "d": (1.2, WINDOW, 0)}  # fmt: skip
    members = ["a", "b", "c", "d"]
    # Slowest first, only as many as there are spares not already promised.
    assert choose_evictions(scores, members, spares=1, evicting=[]) == ["a"]
    assert choose_evictions(scores, members, spares=2, evicting=[]) == ["a", "b"]
    assert choose_evictions(scores, members, spares=2, evicting=["a"]) == ["b"]
    assert choose_evictions(scores, members, spares=1, evicting=["a"]) == []
    assert choose_evictions(scores, members, spares=0, evicting=[]) == []
    # "c" is slower but has not straggled long enough; "e" is not a member any more.
    assert choose_evictions({**scores, "e": (9.0, WINDOW, long)}, members, 3, []) == ["a", "b"]


def test_a_streak_counts_whole_windows_over_the_threshold_in_a_row() -> None:
    # w1 slow from step 10 to 49: its streak starts once a window's median is slow,
    # grows by one per step, and drops to 0 once the window's median is fast again.
    ev = run(80, {"w0": 8, "w1": 8, "w2": 8}, slow={"w1": (10, 49, 0.05)})
    scores = StragglerScores()
    streaks = []
    for s in range(80):
        scores.feed([e for e in ev if e["step"] == s])
        scores.flush()
        streaks.append(scores.scores()["w1"][2])
    # 5 slow of 10 at step 14: the median of an even window is the mean of the middle
    # two, (1 + 2.56) / 2 >= 1.5. It stays slow to step 54 (5 of 10 again).
    assert streaks[:14] == [0] * 14 and streaks[14] == 1
    assert streaks[49] == 36 and streaks[54] == 41 and streaks[55] == 0 and streaks[-1] == 0
    assert max(scores.scores()[m][2] for m in ("w0", "w2")) == 0


def test_an_evicted_members_leave_is_not_a_failure() -> None:
    def ev(t: float, kind: str, **kw: Any) -> dict[str, Any]:
        return {"t": t, "kind": kind, "proc": kw.pop("proc", "launcher"), **kw}

    events = [
        ev(0.0, "job_start", target=2),
        ev(0.1, "worker_spawned", member="w0", pid=10, replacement=False, replaces=None),
        ev(0.1, "worker_spawned", member="w1", pid=11, replacement=False, replaces=None),
        ev(5.0, "straggler_evicted", member="w1", pid=11, score=2.0, steps=10),
        ev(5.2, "worker_exit", proc="w1", pid=11, reason="left"),
        ev(5.3, "member_removed", proc="coordinator", member="w1", reason="left"),
        ev(5.4, "worker_exited", member="w1", pid=11, returncode=75),
        # w0 leaving on its own afterwards is a failure as ever.
        ev(9.0, "worker_exited", member="w0", pid=10, returncode=75),
    ]
    assert [(f.kind, f.member) for f in recognise_failures(events)] == [("term", "w0")]
