"""--from-run: measure costs from a (synthetic) recorded run and predict its goodput."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_run import Fault, SyntheticRun

from elastrain.sim.fromrun import calibrate


def recorded(tmp_path: Path, **kw: object) -> tuple[Path, dict[str, float]]:
    faults = [
        Fault(at_s=20.05, victim="w1"),
        Fault(at_s=50.13, victim="w3", detect_s=0.5, regroup_s=0.5),
        Fault(at_s=80.0, victim="w4", spawn_s=1.0),  # w4 replaced w1
    ]
    run = SyntheticRun(faults=faults, **kw)  # type: ignore[arg-type]
    truth = run.write(tmp_path)
    return tmp_path, truth


def test_calibration_measures_the_run(tmp_path: Path) -> None:
    run_dir, truth = recorded(tmp_path)
    cal = calibrate(run_dir)
    assert cal.members == 4 and cal.min_members == 1
    assert cal.steps == 600
    assert cal.step_s == pytest.approx(0.2, rel=0.02)
    assert cal.step_s_by_size[3] == pytest.approx(0.2 * 4 / 3, rel=0.03)
    assert cal.window_s == pytest.approx(truth["window"], rel=1e-6)
    assert cal.startup_s == pytest.approx(2.2, abs=0.01)
    assert [f.member for f in cal.faults] == ["w1", "w3", "w4"]
    assert [f.slot for f in cal.faults] == [1, 3, 1]
    assert [f.detect_s for f in cal.faults] == pytest.approx([0.3, 0.5, 0.3])
    assert [f.recover_s for f in cal.faults] == pytest.approx([0.4, 0.5, 0.4], abs=0.02)
    assert [f.replacement_s for f in cal.faults] == pytest.approx([3.0, 3.0, 3.5])
    # The join pause is regroup + heal (the second replacement joined with 0.5 s regroup).
    assert [f.join_pause_s for f in cal.faults] == pytest.approx([1.0, 1.1, 1.0], abs=0.02)
    cfg = cal.config()
    assert cfg.strategy.kind == "elastic"
    assert cfg.costs.detect_s == pytest.approx(0.3)
    assert cfg.costs.regroup_s == pytest.approx(0.4, abs=0.02)
    assert cfg.costs.heal_s == pytest.approx(0.6, abs=0.03)


def test_prediction_within_two_points_of_measured_goodput(tmp_path: Path) -> None:
    run_dir, _ = recorded(tmp_path)
    cal = calibrate(run_dir)
    predicted = cal.predict()
    assert predicted.interruptions == 3
    assert predicted.wall_s == pytest.approx(cal.window_s)
    assert predicted.ettr == pytest.approx(cal.measured_ettr, abs=0.02)
    assert predicted.time_goodput == pytest.approx(cal.measured_time_goodput, abs=0.02)
    assert cal.measured_ettr < 0.97  # the faults did cost something


def test_a_run_without_faults(tmp_path: Path) -> None:
    SyntheticRun(steps=100).write(tmp_path)
    cal = calibrate(tmp_path)
    assert cal.faults == []
    assert cal.predict().ettr == pytest.approx(cal.measured_ettr, abs=0.02)


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no step_commit"):
        calibrate(tmp_path)


def test_hung_member_that_comes_back_is_its_own_replacement(tmp_path: Path) -> None:
    SyntheticRun(faults=[Fault(at_s=30.0, victim="w2")], steps=400).write(tmp_path)
    # Rewrite the run so that the victim re-registers instead of a new member.
    for path in (tmp_path / "events").glob("*.jsonl"):
        text = path.read_text()
        text = text.replace('"member": "w4"', '"member": "w2"').replace('"w4"', '"w2"')
        text = text.replace('"fault": "kill"', '"fault": "hang"')
        path.write_text(text)
    cal = calibrate(tmp_path)
    (f,) = cal.faults
    assert f.fault == "hang" and f.member == "w2" and f.slot == 2
    assert f.replacement_s == pytest.approx(3.0)
