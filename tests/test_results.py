"""benchmarks/RESULTS.md, HISTORY.md and README.md's headline table are exactly what
benchmarks/render.py renders from the run records in benchmarks/results/, and every
record there is well formed."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest

from .conftest import ROOT, load_benchmark

render = load_benchmark("render.py")
records = importlib.import_module("_records")  # the module render.py uses, not a second copy
BENCH = ROOT / "benchmarks"
RERENDER = "run `python benchmarks/render.py` and commit what it writes"


def _all() -> list:
    return records.load_records(BENCH / "results")


def test_every_record_is_well_formed_and_in_its_canonical_form() -> None:
    recs = _all()
    assert recs
    for p in sorted((BENCH / "results").glob("*.json")):
        rec = records.parse_record(json.loads(p.read_text()), p.name)
        assert records.to_json(rec) == p.read_text(), f"{p.name} is not as to_json writes it"


def test_results_and_history_are_what_the_records_render() -> None:
    pages = render.render_all(_all(), root=ROOT, readme=ROOT / "no-such-readme.md")
    for path, text in pages.files.items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: {RERENDER}"


def test_results_md_is_short_and_shows_every_benchmark() -> None:
    text = (BENCH / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= 600
    scripts = {p.name for p in BENCH.glob("[a-z]*.py")} - {"render.py"}
    assert scripts == set(render.latest(_all())), "a benchmark without a record, or a stray one"
    for name in scripts:
        assert f"## {name}, " in text


def test_readme_headline_block_agrees_with_the_records() -> None:
    """README.md's table between the headline markers is the rendered one. Skipped only
    while README.md has no such markers (nothing in it then claims a measured figure
    from the records)."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    if render.HEADLINE_START not in text and render.HEADLINE_END not in text:
        pytest.skip("README.md has no results:headline markers")
    want = render.replace_block(text, render.render_headline(_all()))
    assert text == want, f"README.md's headline table disagrees with the records: {RERENDER}"


def _versus(date: str, **figs: float | None) -> object:
    return records.Record(
        benchmark="versus.py", date=date, machine="m", software="s", command="c",
        commit="abc1234", load="", targets=(),
        figures=tuple(records.Figure(k, k, v, "s") for k, v in figs.items()),
    )  # fmt: skip


def test_the_headline_quotes_the_latest_run_that_measured_each_cell(tmp_path: Path) -> None:
    k = render.figure_key
    old = _versus("2026-12-01 00:33 UTC", **{
        k("kill_to_next_commit_s", "elastrain"): 0.25,
        k("kill_to_next_commit_s", "torchft flat, hb 5 s"): 5.15,
    })  # fmt: skip
    new = _versus("2026-12-04 20:06 UTC", **{
        k("kill_to_next_commit_s", "elastrain"): 0.174,
        k("kill_to_next_commit_s", "torchft flat, hb 5 s"): None,
    })  # fmt: skip
    block = render.render_headline([old, new])
    row = next(line for line in block.splitlines() if line.startswith("| kill -> survivors'"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    anchor_new, anchor_old = (render.slug(render.title(r)) for r in (new, old))
    assert cells[1] == f"[0.174 s](benchmarks/RESULTS.md#{anchor_new})"
    assert cells[2] == "not measured"
    assert cells[3] == f"[5.15 s](benchmarks/RESULTS.md#{anchor_old})"
    # both runs are on the page the links point at
    page = render.render_results([old, new])
    for r in (old, new):
        assert f"## {render.title(r)}" in page


def test_a_readme_with_markers_is_rewritten_and_a_stale_one_is_caught(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\nintro\n{render.HEADLINE_START}\n| old | table |\n{render.HEADLINE_END}\nrest\n"
    )
    recs = _all()
    pages = render.render_all(recs, root=ROOT, readme=readme)
    assert readme in render.stale(pages)
    readme.write_text(pages.files[readme])
    assert readme not in render.stale(render.render_all(recs, root=ROOT, readme=readme))
    text = readme.read_text()
    assert text.startswith("# x\n\nintro\n") and text.endswith(f"{render.HEADLINE_END}\nrest\n")
    assert "| old | table |" not in text
    # every number in the block links to a run section RESULTS.md has
    results = render.render_results(recs)
    anchors = {render.slug(h[3:]) for h in results.splitlines() if h.startswith("## ")}
    links = re.findall(r"\]\(benchmarks/RESULTS\.md#([^)]+)\)", text)
    assert links and set(links) <= anchors
    # a record's figure changing makes the README disagree
    last = recs[-1] if recs[-1].benchmark == "versus.py" else render.latest(recs)["versus.py"]
    f = next(f for f in last.figures if f.key.startswith("kill_to_next_commit_s[elastrain]"))
    changed = dataclasses.replace(f, value=(f.value or 0) + 1.0)
    moved = dataclasses.replace(last, figures=tuple(changed if x is f else x for x in last.figures))
    recs2 = [moved if r is last else r for r in recs]
    assert readme in render.stale(render.render_all(recs2, root=ROOT, readme=readme))


def test_a_readme_without_markers_is_left_alone_and_broken_markers_refused() -> None:
    assert render.replace_block("no markers\n", "block") == "no markers\n"
    with pytest.raises(ValueError):
        render.replace_block(f"{render.HEADLINE_END}\n{render.HEADLINE_START}\n", "b")
    with pytest.raises(ValueError):
        render.replace_block(f"{render.HEADLINE_START}\n", "b")


GOOD = {
    "benchmark": "digest.py", "date": "2026-12-04 16:18 UTC", "machine": "m",
    "software": "s", "command": "python benchmarks/digest.py", "commit": "bfa4a69", "load": "",
    "figures": [{"key": "k", "label": "l", "value": 1.5, "unit": "ms"}],
    "targets": [{"target": "t", "threshold": "<= 2 ms", "measured": "1.5 ms", "verdict": "PASS"}],
    "notes": [], "details": [], "imported": False, "source": "", "schema": 1, "extra": {},
}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"schema": 2},
        {"date": "2026-12-04T16:18"},
        {"benchmark": "digest"},
        {"command": " "},
        {"commit": None},
        {"figures": [{"key": "k", "label": "l", "value": "1.5", "unit": "ms"}]},
        {"figures": [{"key": "k", "label": "l", "value": float("nan"), "unit": "ms"}]},
        {"figures": [{"key": "k", "label": "l", "value": 1, "unit": "s"}] * 2},
        {"targets": [{"target": "t", "threshold": "", "measured": "1", "verdict": "ok"}]},
        {"targets": [{"target": "t", "measured": "1", "verdict": "PASS"}]},
        {"notes": "one note"},
        {"surprise": 1},
    ],
)
def test_a_malformed_record_is_refused(tmp_path: Path, change: dict) -> None:
    assert records.parse_record(GOOD).benchmark == "digest.py"
    (tmp_path / "digest-20261204-1618.json").write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(records.MalformedRecord):
        records.load_records(tmp_path)


def test_a_record_named_other_than_its_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "digest-20261204-1619.json").write_text(json.dumps(GOOD))
    with pytest.raises(records.MalformedRecord, match="named other"):
        records.load_records(tmp_path)


def test_two_runs_in_one_minute_get_two_files_in_run_order(tmp_path: Path) -> None:
    rec = records.parse_record(GOOD)
    a = records.write_record(rec, tmp_path)
    b = records.write_record(dataclasses.replace(rec, commit="2nd"), tmp_path)
    assert (a.name, b.name) == ("digest-20261204-1618.json", "digest-20261204-1618-2.json")
    assert [r.commit for r in records.load_records(tmp_path)] == ["bfa4a69", "2nd"]
