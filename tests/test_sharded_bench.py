"""The torchft recovery arithmetic of benchmarks/sharded.py (`tft_recovery_figures`) on
hand-built records: no jobs, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def sharded() -> Any:
    return load_benchmark("sharded.py")


def rec(t: float, kind: str, group: int, rank: int, inc: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "kind": kind, "group": group, "rank": rank, "inc": inc, **kw}


def commit(t: float, g: int, r: int, step: int, quorum: int, parts: int, inc: int = 0,
           took: bool = True) -> dict[str, Any]:  # fmt: skip
    return rec(t, "commit", g, r, inc, step=step, step_s=1.0, quorum=quorum,
               participants=parts, participating=took)  # fmt: skip


def run_records() -> dict[str, Any]:
    """Two groups commit steps 0..7 a second apart; rank 1 of group 1 is killed at 17.5;
    group 0 aborts step 8, waits for a quorum without group 1, commits 8..10 alone; group
    1 is respawned at 19.0, heals during step 10 (taking no part) and takes part from 11."""
    recs = []
    for s in range(8):
        for g in (0, 1):
            for r in (0, 1):
                recs.append(commit(10 + s + 0.1 * r, g, r, s, quorum=1, parts=2))
    recs += [rec(18.0, "abort", 0, r, step=8) for r in (0, 1)]
    recs += [commit(23.1 + 0.1 * r, 0, r, 8, quorum=2, parts=1) for r in (0, 1)]
    recs += [commit(24.1 + 0.1 * r, 0, r, 9, quorum=2, parts=1) for r in (0, 1)]
    recs += [commit(25.1 + 0.1 * r, 0, r, 10, quorum=3, parts=1) for r in (0, 1)]
    recs += [commit(26.1 + 0.1 * r, 0, r, 11, quorum=4, parts=2) for r in (0, 1)]
    for r in (0, 1):
        recs += [
            rec(20.0 + 0.1 * r, "imported", 1, r, 1),
            rec(20.9, "built", 1, r, 1),
            rec(21.0 + 0.2 * r, "ready", 1, r, 1),
            rec(24.05 + 0.1 * r, "heal_recv", 1, r, 1, t0=24.0, bytes=1000 + r, step=10, src=r),
            rec(24.3, "healed", 1, r, 1, bytes=1000 + r),
            commit(25.2, 1, r, 10, quorum=3, parts=1, inc=1, took=False),
            commit(26.1 + 0.1 * r, 1, r, 11, quorum=4, parts=2, inc=1),
        ]
    return {
        "recs": sorted(recs, key=lambda x: x["t"]),
        "kill": {"t": 17.5, "pid": 1, "committed": 8},
        "spawns": [{"group": g, "inc": 0, "t": 1.0, "join": False} for g in (0, 1)]
        + [{"group": 1, "inc": 1, "t": 19.0, "join": True}],
        "downs": [{"group": 1, "inc": 0, "t": 17.53, "exits": {0: None, 1: -9}}],
    }


def test_tft_recovery_figures_measure_the_stall_restart_and_heal(sharded: Any) -> None:
    f = sharded.tft_recovery_figures(run_records())
    # The survivors' next step is committed when its last rank committed it (23.2).
    assert f["next_commit_s"] == pytest.approx(23.2 - 17.5)
    assert f["new_quorum_s"] == pytest.approx(23.2 - 17.5)
    assert f["next_commit_participants"] == 1
    assert f["survivor_aborts"] == 1
    assert f["group_stopped_s"] == pytest.approx(0.03)
    assert f["spawn_s"] == pytest.approx(1.5)
    assert f["imported_s"] == pytest.approx(1.1)  # the slower rank
    assert f["built_s"] == pytest.approx(1.9)
    assert f["ready_s"] == pytest.approx(2.2)
    assert f["heal_recv_s"] == pytest.approx(24.15 - 19.0)
    assert f["healed_s"] == pytest.approx(24.3 - 19.0)
    # Step 10 (healing, not taking part) does not count as training again.
    assert f["first_step_s"] == pytest.approx(26.2 - 19.0)
    assert f["kill_to_trains_s"] == pytest.approx(26.2 - 17.5)
    assert f["heal_bytes"] == {0: 1000, 1: 1001}
    assert f["heal_seconds"] == pytest.approx({0: 0.05, 1: 0.15})
    # Steps 8, 9 and 10 were committed over group 0's share of the batch only.
    assert f["alone_steps"] == 3
    assert f["step_s_before"] == pytest.approx(1.0)


def test_tft_recovery_figures_new_quorum_differs_from_a_step_finished_in_flight(
    sharded: Any,
) -> None:
    """A step the survivors finish right after the kill (their all-reduce was done) is
    their next commit, but the stall shows in the first commit of a new quorum."""
    run = run_records()
    for x in run["recs"]:
        if x["t"] > 17.5 and "step" in x:
            x["step"] += 1  # the survivors' later steps move up by the one finished in flight
    run["recs"] += [commit(17.6 + 0.1 * r, 0, r, 8, quorum=1, parts=2) for r in (0, 1)]
    run["recs"].sort(key=lambda x: x["t"])
    f = sharded.tft_recovery_figures(run)
    assert f["next_commit_s"] == pytest.approx(0.2)
    assert f["new_quorum_s"] == pytest.approx(23.2 - 17.5)


def test_tft_recovery_figures_without_a_kill_or_a_restart(sharded: Any) -> None:
    run = run_records()
    assert sharded.tft_recovery_figures({**run, "kill": {}}) == {"killed": False}
    f = sharded.tft_recovery_figures({**run, "spawns": run["spawns"][:2]})
    assert f["spawn_s"] is None and "first_step_s" not in f
    assert f["next_commit_s"] == pytest.approx(23.2 - 17.5)
