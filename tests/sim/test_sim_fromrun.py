"""--from-run: measure costs from recorded runs and predict their goodput."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from synthetic_run import Fault, SyntheticRun

from elastrain.sim.fromrun import calibrate

DATA = Path(__file__).parent / "data"


def recorded(tmp_path: Path, name: str) -> Path:
    """Unpack a recorded run (events of a real `elastrain` run, step_contrib dropped)."""
    events = tmp_path / name / "events"
    events.mkdir(parents=True)
    (events / "all.jsonl").write_bytes(gzip.decompress((DATA / f"{name}.jsonl.gz").read_bytes()))
    return tmp_path / name


@pytest.mark.parametrize(
    ("name", "faults"),
    [
        # `elastrain demo`: 4 workers, kill w1, hang w2 (3 s watchdog), 80 steps.
        ("demo_kill_hang", ["kill", "hang"]),
        # `elastrain run -n 4 --min 2 --replace-delay 2 --steps 1500 --fault kill@300
        #  --fault hang@800/4 --fault kill@1200 examples/minimal.py`
        ("minimal_kill_hang_kill", ["kill", "hang", "kill"]),
    ],
)
def test_prediction_within_two_points_on_recorded_runs(
    tmp_path: Path, name: str, faults: list[str]
) -> None:
    cal = calibrate(recorded(tmp_path, name))
    assert [f.fault for f in cal.faults] == faults
    hang = next(f for f in cal.faults if f.fault == "hang")
    kill = next(f for f in cal.faults if f.fault == "kill")
    assert hang.detect_s > 2.5 and kill.detect_s < 0.5  # watchdog vs. process exit
    p = cal.predict()
    assert p.result.interruptions == len(faults)
    assert p.time_goodput == pytest.approx(cal.measured_time_goodput, abs=0.02)
    assert p.throughput_goodput == pytest.approx(cal.measured_throughput_goodput, abs=0.02)
    assert p.window_ettr == pytest.approx(cal.measured_window_ettr, abs=0.02)


def test_the_hung_member_is_its_own_replacement(tmp_path: Path) -> None:
    cal = calibrate(recorded(tmp_path, "minimal_kill_hang_kill"))
    kill1, hang, kill2 = cal.faults
    assert (kill1.member, hang.member, kill2.member) == ("w2", "w4", "w4")
    assert kill1.slot == hang.slot == kill2.slot == 2  # w4 replaced w2
    assert hang.replacement_s < 2.0  # it re-registered about a second after expulsion
    assert kill2.replacement_s > 5.0  # w5 had to be spawned and import torch


def synthetic(tmp_path: Path) -> tuple[Path, dict[str, float]]:
    faults = [
        Fault(at_s=20.05, victim="w1"),
        Fault(at_s=50.13, victim="w3", detect_s=0.5, regroup_s=0.5),
        Fault(at_s=80.0, victim="w4", spawn_s=1.0),  # w4 replaced w1
    ]
    truth = SyntheticRun(faults=faults).write(tmp_path)
    return tmp_path, truth


def test_calibration_measures_a_synthetic_run(tmp_path: Path) -> None:
    run_dir, truth = synthetic(tmp_path)
    cal = calibrate(run_dir)
    assert cal.members == 4 and cal.min_members == 1
    assert cal.steps == 600
    assert cal.step_s == pytest.approx(0.2, rel=0.02)
    assert cal.step_s_by_size[3] == pytest.approx(0.2 * 4 / 3, rel=0.02)
    assert cal.window_s == pytest.approx(truth["window"], rel=1e-6)
    assert cal.startup_s == pytest.approx(2.2, abs=0.01)
    assert [f.member for f in cal.faults] == ["w1", "w3", "w4"]
    assert [f.slot for f in cal.faults] == [1, 3, 1]
    assert [f.detect_s for f in cal.faults] == pytest.approx([0.3, 0.5, 0.3])
    assert [f.recover_s for f in cal.faults] == pytest.approx([0.4, 0.5, 0.4], abs=0.03)
    assert [f.replacement_s for f in cal.faults] == pytest.approx([3.0, 3.0, 3.5])
    # A join on its own pauses the job for regroup + heal (0.4 + 0.6 or 0.5 + 0.6).
    assert [f.join_pause_s for f in cal.faults] == pytest.approx([1.0, 1.1, 1.0], abs=0.03)
    cfg = cal.config()
    assert cfg.strategy.kind == "elastic"
    assert cfg.costs.regroup_s == pytest.approx(0.4, abs=0.03)
    assert cfg.costs.heal_s == pytest.approx(0.6, abs=0.05)
    p = cal.predict()
    assert p.time_goodput == pytest.approx(cal.measured_time_goodput, abs=0.02)
    assert p.window_ettr == pytest.approx(cal.measured_window_ettr, abs=0.02)


def test_a_run_without_faults(tmp_path: Path) -> None:
    SyntheticRun(steps=100).write(tmp_path)
    cal = calibrate(tmp_path)
    assert cal.faults == []
    assert cal.predict().window_ettr == pytest.approx(cal.measured_window_ettr, abs=0.02)


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no step_commit"):
        calibrate(tmp_path)
