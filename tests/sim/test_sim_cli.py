"""`elastrain sim` through add_arguments/run, as the top-level CLI will call it."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from synthetic_run import Fault, SyntheticRun

from elastrain.sim import presets
from elastrain.sim.analytic import job_failure_rate
from elastrain.sim.cli import add_arguments, build_config, run
from elastrain.sim.config import DAY, HOUR


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastrain sim")
    add_arguments(p)
    return p.parse_args(list(argv))


def test_preset_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--preset", "llama3-16k", "--seeds", "1", "--days", "10")) == 0
    out = capsys.readouterr().out
    assert "16384 accelerators = 2048 hosts x 8" in out
    for name in ("restart", "elastic", "hot-spare (16 spares)"):
        assert name in out
    assert "job MTBF 3.09 h" in out


def test_preset_rates_match_llama3() -> None:
    cfg = presets.get("llama3-16k")
    assert job_failure_rate(cfg) * 54 * DAY == pytest.approx(419)
    assert presets.get("tpu-pod-9216").topology.domains == 9216 // 64


def test_flags_override_the_preset() -> None:
    args = parse(
        "--preset", "tpu-pod-9216", "--accelerators", "1024", "--days", "2", "--interruptions", "20",
        "--detect-s", "5", "--checkpoint-interval", "900", "--weibull-shape", "0.8", "--save-s", "7",
    )  # fmt: skip
    cfg = build_config(args)
    assert cfg.topology.accelerators == 1024 and cfg.topology.accelerators_per_host == 4
    assert cfg.horizon_s == 2 * DAY
    assert job_failure_rate(cfg) * 2 * DAY == pytest.approx(20)
    assert (
        cfg.costs.detect_s == 5 and cfg.checkpoint.interval_s == 900 and cfg.checkpoint.save_s == 7
    )
    assert cfg.failures.host.kind == "weibull" and cfg.failures.host.shape == 0.8
    assert build_config(parse("--checkpoint-interval", "none")).checkpoint.interval_s == float(
        "inf"
    )
    assert build_config(parse("--host-mtbf-h", "100")).failures.host.mtbf_s == 100 * HOUR


def test_steps_report_time_to_train(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "--accelerators",
        "256",
        "--steps",
        "20000",
        "--strategy",
        "elastic",
        "--seeds",
        "1",
        "--json",
        "-",
    )
    assert run(args) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["strategies"].values()
    assert row["time_to_train_h"]["mean"] > 20000 * 6 / 3600


def test_bad_input_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--accelerators", "1001")) == 2
    assert "multiple of accelerators_per_host" in capsys.readouterr().err
    assert run(parse("--strategy", "magic")) == 2
    assert "unknown strategy" in capsys.readouterr().err


def test_sweeps_write_svg_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "--accelerators", "1024", "--days", "5", "--seeds", "2", "--strategy", "restart,elastic",
        "--sweep-scale", "512,1024", "--sweep-interval", "auto", "--plot-dir", str(tmp_path),
        "--json", str(tmp_path / "r.json"), "--interruptions", "40",
    )  # fmt: skip
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "goodput vs. scale" in out and "Young" in out
    for name in ("goodput_vs_scale.svg", "goodput_vs_interval.svg"):
        root = ET.parse(tmp_path / name).getroot()
        assert root.tag.endswith("svg")
    assert "Young" in (tmp_path / "goodput_vs_interval.svg").read_text()
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["sweep_scale"]) == 4
    assert len(report["sweep_interval"]["intervals_s"]) == 13


def test_from_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    SyntheticRun(faults=[Fault(at_s=30.0, victim="w2")], steps=400).write(tmp_path)
    assert run(parse("--from-run", str(tmp_path), "--json", str(tmp_path / "c.json"))) == 0
    out = capsys.readouterr().out
    assert "4 members, 400 steps" in out and "predicted" in out
    cal = json.loads((tmp_path / "c.json").read_text())["calibration"]
    for name, measured in cal["measured"].items():
        assert cal["predicted"][name] == pytest.approx(measured, abs=0.02)
    # With a size, the measured recovery costs are projected to that job.
    args = parse(
        "--from-run", str(tmp_path), "--accelerators", "1024", "--days", "1", "--seeds", "1"
    )
    assert run(args) == 0
    assert "projection" in capsys.readouterr().out


def test_cluster_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "--cluster", "--cluster-accelerators", "256", "--cluster-jobs", "30", "--json", "-"
    )
    assert run(args) == 0
    captured = capsys.readouterr()
    assert "rigid" in captured.err and "elastic" in captured.err
    report = json.loads(captured.out)["cluster"]
    assert len(report["elastic"]["jobs"]) == 30
