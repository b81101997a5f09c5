"""The arithmetic of benchmarks/step_cost.py (cycle times, elastrain's step breakdown,
the verdict and the summary) on hand-built records: no jobs, no processes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def sc() -> Any:
    return load_benchmark("step_cost.py")


def commit(proc: str, step: int, t: float, **kw: Any) -> dict[str, Any]:
    e = {"kind": "step_commit", "proc": proc, "step": step, "t": t, "step_s": 0.020,
         "compute_s": 0.012, "data_s": 0.001, "allreduce_s": 0.004, "verdict_s": 0.0005,
         "apply_s": 0.003}  # fmt: skip
    e.update(kw)
    return e


def test_cycle_times_count_only_measured_steps_whose_predecessor_the_rank_finished(sc) -> None:  # type: ignore[no-untyped-def]
    # warm-up 2, blocks of 3: steps 2 and 5 start blocks (their interval holds the gate's
    # wait) and are left out; 3, 4, 6, 7 count.
    measured = sc.measured_step(2, 3)
    rank0 = {s: 10.0 + 0.1 * s for s in range(8)}
    rank0[5] = 99.0  # the long wait for the go before block 2
    rank0[6] = 99.1
    rank0[7] = 99.2
    rank1 = {3: 1.0, 4: 1.25}  # no step 2 (its predecessor): only step 4 counts
    got = sc.cycle_times([rank0, rank1], measured)
    assert got == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.25])


def test_elastrain_ends_group_commits_by_member(sc) -> None:  # type: ignore[no-untyped-def]
    commits = [commit("w1", 0, 5.0), commit("w0", 0, 4.0), commit("w0", 1, 4.5, step_s=0.4)]
    assert sc.elastrain_ends(commits) == [{0: 4.0, 1: 4.5}, {0: 5.0}]
    assert sc.elastrain_ends(commits, "step_s") == [{0: 0.02, 1: 0.4}, {0: 0.02}]


def test_between_steps_is_each_cycle_less_its_own_step(sc) -> None:  # type: ignore[no-untyped-def]
    measured = sc.measured_step(1, 3)  # steps 2, 3, 5, 6 count
    ends = [{s: 1.0 * s for s in range(7)}]
    steps = [{s: 0.9 if s != 5 else 0.7 for s in range(7)}]
    assert sc.between_steps(ends, steps, measured) == pytest.approx([0.1, 0.1, 0.3, 0.1])


def test_breakdown_parts_add_up_to_step_s_and_the_rest_is_the_engines(sc) -> None:  # type: ignore[no-untyped-def]
    parts = sc.step_parts(commit("w0", 3, 1.0))
    assert parts["compute"] == pytest.approx(0.011)  # compute_s without data_s
    assert parts["engine"] == pytest.approx(0.020 - 0.012 - 0.0005 - 0.004 - 0.003)
    assert sum(parts.values()) == pytest.approx(0.020)
    # An older engine's event has no verdict_s / apply_s: they are unknown, in `engine`.
    old = commit("w0", 3, 1.0)
    del old["verdict_s"], old["apply_s"]
    p_old = sc.step_parts(old)
    assert math.isnan(p_old["verdict_s"]) and math.isnan(p_old["apply_s"])
    assert p_old["engine"] == pytest.approx(0.020 - 0.012 - 0.004)
    b = sc.breakdown([commit("w0", s, 1.0, step_s=x) for s, x in enumerate([0.02, 0.03, 0.05])])
    assert b["step_s"] == pytest.approx(0.03) and b["compute"] == pytest.approx(0.011)


def test_verdict_and_summary_judge_the_cycle_ratio_at_each_size(sc) -> None:  # type: ignore[no-untyped-def]
    assert sc.verdict(0.0105, 0.010) == "PASS"
    assert sc.verdict(0.0106, 0.010) == "FAIL"
    assert sc.verdict(math.nan, 0.010) == "n/a" and sc.verdict(0.01, 0.0) == "n/a"
    res = {
        "20ms": {"cycle": {"E": 0.021, "D": 0.020}, "step_s": {"E": 0.020, "D": 0.0195},
                 "cpu": {"E": 0.05, "D": 0.04}, "n": {"E": 38, "D": 38}},
        "1s": {"cycle": {"E": 1.10, "D": 1.0}, "step_s": {"E": 1.09, "D": 0.99},
               "cpu": {"E": 2.0, "D": 2.0}, "n": {"E": 30, "D": 30}},
    }  # fmt: skip
    rows = sc.summary_rows(res)
    assert [r[0] for r in rows] == ["20ms", "1s"]
    assert [r[3] for r in rows] == ["+5.0%", "+10.0%"]
    assert [r[4] for r in rows] == ["PASS", "FAIL"]
    assert rows[0][1] == "21.0 / 20.0" and rows[0][2] == "1.050"
    table = sc.table(sc.SUMMARY_HEADER, rows)
    assert table.count("\n") == 3 and "FAIL" in table
