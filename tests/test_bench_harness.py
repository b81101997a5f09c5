"""benchmarks/_harness.py: the arguments every benchmark shares, and a run's ending —
a record written under results/ and the pages rendered from it — in a scratch
checkout (never the real benchmarks/results/)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from .conftest import load_benchmark

harness = load_benchmark("_harness.py")
records = importlib.import_module("_records")
render = importlib.import_module("render")


def _bench(root: Path, **kw: object) -> object:
    (root / "benchmarks" / "results").mkdir(parents=True)
    return harness.Bench("digest.py", "A test benchmark.\n\nMore.", root=root, **kw)


def test_the_shared_arguments(tmp_path: Path) -> None:
    b = _bench(tmp_path, quick="tiny", repeats=3, runs_dir=True)
    a = b.parse([])
    assert (a.no_record, a.quick, a.repeats, a.runs_dir) == (False, False, 3, harness.RUNS)
    assert b.recording
    b.load.stop()
    a = b.parse(["--quick", "--repeats", "5", "--runs-dir", str(tmp_path / "r")])
    assert (a.quick, a.repeats) == (True, 5) and not b.recording  # a smoke run never records
    b.load.stop()
    d = b.run_dir("digest")
    assert d.parent == tmp_path / "r" and d.is_dir()
    assert not b.parse(["--no-record"]).quick and not b.recording
    b.load.stop()
    with pytest.raises(SystemExit):
        b.parse(["--repeats", "0"])
    plain = harness.Bench("digest.py", None, root=tmp_path)
    assert not hasattr(plain.parse([]), "quick")  # only where the script has a smoke mode
    plain.load.stop()


def test_finish_writes_a_record_and_renders_the_pages(tmp_path: Path) -> None:
    b = _bench(tmp_path)
    b.parse([])
    t = harness.target("x", "<= 1 s", "0.5 s", True)
    path = b.finish(
        "torch x", [harness.Figure("x_s", "x", 0.5, "s")], [t], ["a note"], "| a |\n|---|",
        ["something odd"],
    )  # fmt: skip
    assert path is not None and path.parent == tmp_path / "benchmarks" / "results"
    rec = records.parse_record(json.loads(path.read_text()))
    assert rec.benchmark == "digest.py" and rec.command.endswith("benchmarks/digest.py")
    assert rec.targets == (t,) and rec.details == ("| a |", "|---|")
    assert "ANOMALY: something odd" in rec.notes and "(min / mean / max)" in rec.load
    page = (tmp_path / "benchmarks" / "RESULTS.md").read_text()
    assert page == render.render_results([rec])
    assert f"## {render.title(rec)}" in page and "| x | <= 1 s | 0.5 s | PASS |" in page
    assert (tmp_path / "benchmarks" / "HISTORY.md").exists()


def test_no_record_writes_nothing(tmp_path: Path) -> None:
    b = _bench(tmp_path)
    b.parse(["--no-record"])
    assert b.finish("", [], []) is None
    assert not list((tmp_path / "benchmarks").rglob("*.json"))
    assert not (tmp_path / "benchmarks" / "RESULTS.md").exists()


def test_a_printed_target_table_becomes_targets_and_reported_rows_notes() -> None:
    got, reported = harness.targets_from_rows([
        ["overhead vs HSDP <= 5%: elastrain 2x2 (float64)", "+15%", "FAIL"],
        ["kill -> next commit <= 0.5 s + one step (= 1.5 s), 1 hot spare", "1.2 s", "PASS"],
        ["peak RSS (no threshold set)", "4x", "report"],
        ["torchft beside ours", "not run", "n/a"],
    ])  # fmt: skip
    assert [(t.target, t.threshold, t.verdict.value) for t in got] == [
        ("overhead vs HSDP: elastrain 2x2 (float64)", "<= 5%", "FAIL"),
        ("kill -> next commit (= 1.5 s), 1 hot spare", "<= 0.5 s + one step", "PASS"),
        ("torchft beside ours", "", "n/a"),
    ]
    assert reported == ["peak RSS (no threshold set): 4x"]
