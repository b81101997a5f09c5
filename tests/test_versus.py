"""The arithmetic of benchmarks/versus.py (benchmarks/_versus/analysis.py) on hand-built
logs: no jobs, no processes."""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "_versus"))

from analysis import (  # noqa: E402
    Commit,
    FaultMark,
    Plan,
    back_to_reached,
    commits_from_steplog,
    compare_runs,
    first_commit_of,
    from_elastrain,
    global_loss_curve,
    goodput,
    max_rel_dev,
    metric_noise,
    next_lineage_commit,
    next_progress_commit,
    read_steplogs,
    recomputed_steps,
    samples_dropped,
    short_steps,
    span,
    step_time_s,
    step_times,
    tolerance_factor,
)

B = 32
W = 4


def tr(t: float, step: int, rank: int, attempt: int, pid: int, loss: float = 1.0) -> dict:
    """A torchrun worker's commit line."""
    return {"t": t, "kind": "commit", "proc": f"r{rank}", "pid": pid, "attempt": attempt,
            "step": step, "loss": loss, "n": B // W}  # fmt: skip


def ft(
    t: float, step: int, g: int, pid: int, q: int, parts: int = 4, part: bool = True,
    loss: float = 1.0,
) -> dict:  # fmt: skip
    """A torchft replica's commit line."""
    return {"t": t, "kind": "commit", "proc": f"g{g}", "pid": pid, "quorum": q, "step": step,
            "loss": loss, "n": B // W, "participants": parts, "participating": part}  # fmt: skip


def torchrun_log() -> list[dict]:
    """Steps 0..6 at 1 s each by 4 ranks (attempt 0); rank 1 (pid 101) killed at 6.5 s;
    checkpoint at step 5, so the restart (attempt 1, from 20 s) re-runs 5 and 6."""
    recs = []
    for s in range(7):
        for r in range(W):
            recs.append(tr(float(s) + 0.01 * r, s, r, 0, 100 + r, loss=5.0 - s * 0.1))
    for k, s in enumerate(range(5, 10)):
        for r in range(W):
            recs.append(tr(20.0 + k + 0.01 * r, s, r, 1, 200 + r, loss=5.0 - s * 0.1))
    return recs


def test_torchrun_kill_restart_figures() -> None:
    commits = commits_from_steplog(torchrun_log(), "attempt", W)
    kill = FaultMark("kill", 6.5, "r1", 101, 7)
    # Survivors' next commit: the restarted round's first (rank 0 at 20.0).
    assert next_lineage_commit(commits, kill) == pytest.approx(13.5)
    # Back to step 6 (the highest committed before the kill) at 21.0.
    assert back_to_reached(commits, kill) == pytest.approx(14.5)
    # Steps 5 and 6 were committed twice: recomputed.
    assert recomputed_steps(commits) == 2
    assert samples_dropped(commits, B, 10) == 0
    # A re-run step's commit time is its re-run's.
    ts = step_times(commits)
    assert ts[4] == pytest.approx(4.0) and ts[5] == pytest.approx(20.0)
    # The restarted rank 1 trains at 20.01.
    t = first_commit_of(commits, "r1", kill.t, kill.pid, participating=False)
    assert t == pytest.approx(20.01)
    assert step_time_s(commits, 0, 5) == pytest.approx(1.0)


def test_hang_waited_out_counts_to_the_step_in_flight() -> None:
    """torchrun waits for a hung rank: the next commit is of the step in flight."""
    recs = [tr(float(s) + 0.01 * r, s, r, 0, 100 + r) for s in range(3) for r in range(W)]
    # Rank 2 (pid 102) stopped at 2.5 during step 3; everyone commits step 3 at 8.5.
    recs += [tr(8.5 + 0.01 * r, 3, r, 0, 100 + r) for r in range(W)]
    commits = commits_from_steplog(recs, "attempt", W)
    hang = FaultMark("hang", 2.5, "r2", 102, 3)
    assert next_progress_commit(commits, hang) == pytest.approx(6.0)
    assert recomputed_steps(commits) == 0


def torchft_log() -> list[dict]:
    """4 groups commit steps 0..4 (quorum 1) at 1 s each; group 1 (pid 11) killed at 4.5;
    quorum 2 of 3 groups from 10 s (steps 5..9); the replacement (pid 21) heals at
    step 10 (quorum 3, not participating) and trains from step 11."""
    recs = []
    for s in range(5):
        for g in range(W):
            recs.append(ft(float(s) + 0.01 * g, s, g, 10 + g, 1))
    for k, s in enumerate(range(5, 10)):
        for g in (0, 2, 3):
            recs.append(ft(10.0 + k + 0.01 * g, s, g, 10 + g, 2, parts=3))
    for g in (0, 2, 3):
        recs.append(ft(15.0 + 0.01 * g, 10, g, 10 + g, 3, parts=3))
    recs.append(ft(15.02, 10, 1, 21, 3, parts=3, part=False))
    for g in range(W):
        recs.append(ft(16.0 + 0.01 * g, 11, g, 21 if g == 1 else 10 + g, 3, parts=4))
    return recs


def test_torchft_quorum_recovery_and_dropped_samples() -> None:
    commits = commits_from_steplog(torchft_log(), "quorum", W)
    kill = FaultMark("kill", 4.5, "g1", 11, 5)
    assert next_lineage_commit(commits, kill) == pytest.approx(5.5)
    assert recomputed_steps(commits) == 0
    # Steps 5..10 used 3 of 4 groups' samples: 8 dropped each.
    assert samples_dropped(commits, B, 100) == 6 * 8
    assert samples_dropped(commits, B, 8) == 3 * 8
    assert short_steps(commits, B, 100) == 6
    # The replacement healed at step 10 (not taking part) and trained at step 11.
    healed = first_commit_of(commits, "g1", kill.t, kill.pid, participating=False)
    trained = first_commit_of(commits, "g1", kill.t, kill.pid, participating=True)
    assert healed == pytest.approx(15.02) and trained == pytest.approx(16.01)


def test_global_loss_weights_participants_and_skips_incomplete_steps() -> None:
    recs = [
        ft(1.0, 0, 0, 10, 1, parts=2, loss=1.0),
        ft(1.0, 0, 1, 11, 1, parts=2, loss=3.0),
        ft(1.0, 0, 2, 12, 1, parts=2, part=False, loss=100.0),  # healing: not counted
        ft(2.0, 1, 0, 10, 1, parts=2, loss=1.0),  # its partner never logged step 1
    ]
    curve = global_loss_curve(commits_from_steplog(recs, "quorum", W))
    assert curve == {0: pytest.approx(2.0)}


def test_loss_deviation_and_goodput() -> None:
    ref = {0: 2.0, 1: 1.0, 2: 4.0}
    assert max_rel_dev({0: 2.0, 1: 1.1, 2: 4.0}, ref, 3) == pytest.approx(0.1)
    assert max_rel_dev({0: 2.0, 1: 1.1}, ref, 1) == 0.0
    assert math.isnan(max_rel_dev({}, ref, 3))
    # Half as fast as failure-free and a quarter of the samples dropped: 37.5%.
    assert goodput(10.0, 20.0, dropped=8 * 10, steps=10, global_batch=32) == pytest.approx(0.375)
    assert math.isnan(goodput(10.0, 0.0, 0, 10, 32))
    assert span([3.0, None, 1.0, math.nan, 2.0]) == (1.0, 2.0, 3.0, 3)
    assert span([])[3] == 0


def test_from_elastrain_events() -> None:
    ev = [
        {"t": 0.0, "kind": "job_start", "proc": "launcher"},
        {"t": 1.0, "kind": "step_commit", "proc": "w0", "pid": 1, "step": 0, "gen": 1, "loss": 2.5},
        {"t": 1.0, "kind": "step_contrib", "proc": "w0", "step": 0, "gen": 1, "samples": [1, 2]},
        {"t": 1.0, "kind": "step_contrib", "proc": "w1", "step": 0, "gen": 1, "samples": [3]},
        {"t": 1.5, "kind": "fault_injected", "proc": "launcher", "fault": "kill", "member": "w1",
         "pid": 2, "step": 1},
        {"t": 1.5, "kind": "fault_injected", "proc": "launcher", "fault": "resume",
         "member": "w1", "pid": 2, "step": 1},
        {"t": 2.0, "kind": "step_commit", "proc": "w0", "pid": 1, "step": 1, "gen": 2, "loss": 2.0},
    ]  # fmt: skip
    commits, faults = from_elastrain(ev, 3)
    assert [(c.step, c.lineage, c.step_samples) for c in commits] == [(0, 1, 3), (1, 2, None)]
    assert faults == [FaultMark("kill", 1.5, "w1", 2, 1)]
    assert global_loss_curve(commits) == {0: 2.5, 1: 2.0}
    assert samples_dropped(commits, 3, 10) == 0
    assert samples_dropped(commits, 4, 10) == 1


def test_read_steplogs_skips_torn_lines(tmp_path: Path) -> None:
    p = tmp_path / "r0.jsonl"
    p.write_text('{"t": 2, "kind": "commit"}\n{"t": 1, "kind": "start"}\n{"t": 3, "ki')
    recs = read_steplogs([p, tmp_path / "missing.jsonl"])
    assert [r["t"] for r in recs] == [1, 2]


def test_fault_offsets_match_elastrain_schedule() -> None:
    """The torchrun/torchft injector draws the same mid-step offsets as elastrain's
    launcher for the same seed (victims are named, so no other draws intervene)."""
    from elastrain.chaos.schedule import FaultSchedule, parse_fault

    plan = Plan(steps=50, kill_at=15, hang_at=30, hang_s=6, replace_delay_s=2, seed=3)
    draw = plan.offsets()
    sched = FaultSchedule([parse_fault("kill@15:w1"), parse_fault("hang@30:w2/6")], seed=3)
    assert sched.pick(sched.pending[0], ["w0", "w1"]) == "w1"
    assert draw(0.25) == sched.offset(0.25)
    assert draw(0.3) == sched.offset(0.3)


def test_commit_is_a_value() -> None:
    c = Commit(1.0, 0, "w0", 1, 1, 2.0)
    assert c.participating and c.expect is None and not c.global_loss


def test_a_second_run_reproduces_when_ranges_overlap_or_medians_are_within_noise() -> None:
    nan = math.nan
    prev = {
        "elastrain": {"kill": (0.4, 0.6, 0.7, 3), "hang": (3.6, 3.6, 3.7, 3)},
        "torchrun": {"kill": (21.0, 29.0, 47.0, 3), "replacement": (nan, nan, nan, 0)},
    }
    cur = {
        "elastrain": {"kill": (0.65, 0.9, 1.0, 3), "hang": (3.8, 3.9, 4.0, 3)},
        "torchrun": {"kill": (25.0, 26.0, 30.0, 3), "replacement": (20.0, 21.0, 22.0, 3)},
        "torchft": {"kill": (5.0, 5.5, 6.0, 3)},
    }
    got = {(r.case, r.metric): r.agrees for r in compare_runs(prev, cur)}
    # Overlapping ranges agree. elastrain's hang medians are 8% apart; the hang
    # noise is 4% (3% and 5%), the tolerance for 3 metrics 1.5x that: they do
    # not. A metric or case that one run lacks is not compared.
    assert got == {
        ("elastrain", "kill"): True,
        ("elastrain", "hang"): False,
        ("torchrun", "kill"): True,
    }


def test_disjoint_ranges_agree_when_the_medians_differ_by_less_than_the_tolerance() -> None:
    # Case a's three repeats happened to land within 1% of each other; b and c
    # spread by 20% and 30%. The run's step-time noise is the median, 20%.
    prev = {
        "a": {"step": (1.00, 1.005, 1.01, 3)},
        "b": {"step": (0.9, 1.0, 1.1, 3)},
        "c": {"step": (0.85, 1.0, 1.15, 3)},
    }
    assert metric_noise(prev) == pytest.approx({"step": 0.2}, rel=0.05)
    # The second run measured a alone, spread 4%: the noise is the mean of the two
    # runs' estimates, 12%, and with one metric compared the tolerance is 1.1x it.
    near = {"a": {"step": (1.08, 1.10, 1.12, 3)}}  # 9% above: disjoint, within tolerance
    far = {"a": {"step": (1.30, 1.32, 1.34, 3)}}  # 27% above: beyond it
    (r,) = compare_runs(prev, near)
    assert r.agrees and r.how == "medians 9% apart <= 13%"
    (r,) = compare_runs(prev, far)
    assert not r.agrees and r.how == "medians 27% apart > 13%"
    # A metric measured once per case has no spread to go by: only overlap counts.
    once = {"a": {"step": (1.0, 1.0, 1.0, 1)}, "b": {"step": (2.0, 2.0, 2.0, 1)}}
    assert metric_noise(once) == {}
    (r,) = compare_runs({"a": {"step": (1.0, 1.0, 1.0, 1)}}, {"a": {"step": (1.01,) * 3 + (1,)}})
    assert not r.agrees


def test_the_tolerance_grows_with_the_number_of_metrics_and_shrinks_with_repeats() -> None:
    # One metric at 5%: about the expected range of 3 repeats (the plain overlap rule).
    assert tolerance_factor(3, 1) == pytest.approx(1.09, abs=0.03)
    # 25 metrics, 5% for all together: each may differ by more before it counts.
    assert tolerance_factor(3, 25) == pytest.approx(1.72, abs=0.04)
    assert tolerance_factor(5, 25) < tolerance_factor(4, 25) < tolerance_factor(3, 25)
    with pytest.raises(ValueError):
        tolerance_factor(1, 25)


def test_a_true_difference_is_caught_and_pure_noise_rarely_is() -> None:
    """The rule applied to simulated runs: 25 metrics with 10% normal noise and 3
    repeats each. Identical systems are called different in about 5% of run
    pairs (the family-wise rate); one metric 60% higher is caught nearly always."""
    rng = random.Random(7)

    def run(shift: float) -> dict[str, dict[str, tuple[float, float, float, int]]]:
        out = {}
        for c in range(25):
            xs = [(1 + (shift if c == 0 else 0)) * (1 + 0.1 * rng.gauss(0, 1)) for _ in range(3)]
            out[f"case{c}"] = {"m": (min(xs), statistics.median(xs), max(xs), 3)}
        return out

    false_alarms = sum(any(not r.agrees for r in compare_runs(run(0), run(0))) for _ in range(200))
    caught = sum(
        any(not r.agrees and r.case == "case0" for r in compare_runs(run(0), run(0.6)))
        for _ in range(100)
    )
    assert false_alarms <= 25  # about 11 of 200 expected (5.7% in 1000 pairs)
    assert caught >= 90


def test_the_recorded_figures_are_each_cases_medians_under_the_headlines_keys() -> None:
    """versus.py's record names each case's medians `<metric>[<case>]`: the keys
    benchmarks/render.py's headline table looks its cells up by."""
    from .conftest import load_benchmark

    v = load_benchmark("versus.py")
    render = load_benchmark("render.py")
    from job import CASES, Run  # noqa: E402

    ela = next(c for c in CASES if c.name == "elastrain")
    ft = next(c for c in CASES if c.name == "torchft flat, hb 5 s")
    runs = {ela.name: [], ft.name: []}
    for i, (kill, hang, repl) in enumerate([(0.2, 0.7, 4.0), (0.1, 0.6, None), (0.3, 0.9, 5.0)]):
        r = Run(ela.name, i, True, Path("/nonexistent"))
        r.kill_s, r.hang_s, r.repl_s, r.recomputed, r.dropped = kill, hang, repl, 0, 8 * i
        runs[ela.name].append(r)
    lost = Run(ft.name, 0, True, Path("/nonexistent"))
    lost.survived, lost.state_lost = False, True
    runs[ft.name].append(lost)
    figs = {f.key: f for f in v.case_figures([ela, ft], runs, kill_at=15)}
    assert figs["kill_to_next_commit_s[elastrain]"].value == 0.2
    assert figs["hang_to_next_commit_s[elastrain]"].value == 0.7
    assert figs["replacement_training_s[elastrain]"].value == 4.5  # the unknown one left out
    assert figs["samples_dropped[elastrain]"].value == 8
    assert figs["state_lost_runs[elastrain]"].value == 0
    assert figs["kill_to_next_commit_s[torchft flat, hb 5 s]"].value is None
    assert (figs["state_lost_runs[torchft flat, hb 5 s]"].value,
            figs["state_lost_runs[torchft flat, hb 5 s]"].unit) == (1, "of 1 runs")  # fmt: skip
    wanted = {render.figure_key(row.metric, side.case) for row in render.ROWS
              for side in render.SIDES}  # fmt: skip
    assert {k for k in wanted if k.endswith("[elastrain]")} <= set(figs)
