"""Straggler scores from step events (elastrain.observe.stragglers): who computes
slower than its peers, per sample, over a window of steps."""

from __future__ import annotations

from typing import Any

from elastrain.observe.stragglers import (
    MIN_STEPS,
    THRESHOLD,
    WINDOW,
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
