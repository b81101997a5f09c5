"""The arithmetic of benchmarks/recovery.py's first-step rows on hand-built events:
no jobs, no processes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def rb() -> Any:
    return load_benchmark("recovery.py")


def built(proc: str, gen: int, t: float) -> dict[str, Any]:
    return {"kind": "group_built", "proc": proc, "gen": gen, "t": t}


def commit(proc: str, gen: int, step: int, t: float, step_s: float) -> dict[str, Any]:
    return {"kind": "step_commit", "proc": proc, "gen": gen, "step": step, "t": t, "step_s": step_s}


def gen_events(gen: int, procs: list[str], t0: float, first: float, steps: list[float]) -> list:
    """Groups built at t0 and t0 + 0.1 (the last counts), a first step committed
    ``first`` s after the last, then one step per entry of ``steps``."""
    evs = [built(p, gen, t0 + 0.1 * i) for i, p in enumerate(procs)]
    t = t0 + 0.1 * (len(procs) - 1) + first
    for p in procs:
        evs.append(commit(p, gen, 10 * gen, t, first * (0.5 if p == procs[0] else 0.9)))
    for k, s in enumerate(steps, start=1):
        t += s
        for j, p in enumerate(procs):
            evs.append(commit(p, gen, 10 * gen + k, t, s - 0.01 * j))
    return evs


def test_first_step_against_the_same_generations_steady_steps(rb: Any) -> None:
    evs = gen_events(3, ["w0", "w2"], 100.0, 2.4, [9.0, 1.0, 1.2, 1.1])
    evs += gen_events(4, ["w0", "w2", "w4"], 200.0, 1.5, [3.0, 1.3, 1.3, 1.3])
    assert rb.first_step_costs(evs, {3: "kill"})[0].n_steady == 4  # all but the first
    got = rb.first_step_costs(evs, {3: "kill", 4: "join"}, skip=2)
    assert [(f.gen, f.after) for f in got] == [(3, "kill"), (4, "join")]
    kill, join = got
    # From the last group_built to the first commit; its step_s is the slowest member's.
    assert kill.first_s == pytest.approx(2.4) and kill.first_step_s == pytest.approx(2.16)
    # The generation's second step (9.0, a warm-up) is left out; the median of the
    # slowest member's step_s over the rest.
    assert kill.n_steady == 3 and kill.steady_s == pytest.approx(1.1)
    assert kill.ratio == pytest.approx(2.4 / 1.1)
    assert join.steady_s == pytest.approx(1.3) and join.ratio == pytest.approx(1.5 / 1.3)


def test_a_generation_cut_short_is_left_out(rb: Any) -> None:
    evs = gen_events(5, ["w0", "w1"], 10.0, 1.0, [1.0, 1.0])  # 2 steady steps only
    assert rb.first_step_costs(evs, {5: "kill"}) == []
    assert rb.first_step_costs(evs, {5: "kill"}, min_steady=2)[0].n_steady == 2
    assert rb.first_step_costs(evs, {6: "kill"}) == []  # no such generation


def test_join_generation_is_the_one_of_the_joiners_first_commit(rb: Any) -> None:
    evs = gen_events(7, ["w0", "w5"], 50.0, 1.0, [1.0]) + gen_events(6, ["w0"], 40.0, 1.0, [1.0])
    evs.reverse()  # events come in any order
    assert rb.join_gens(evs, ["w5", "w9"]) == {7: "join"}
    assert math.isnan(rb.FirstStep(1, "kill", 1.0, 1.0, 0.0, 3).ratio)
