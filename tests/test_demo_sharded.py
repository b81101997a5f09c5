"""`elastrain demo --sharded` (issue 16 item 5): its pieces on hand-built events
(layout table, first heal, the driver's phases and pace), then the whole demo."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from elastrain.chaos.schedule import FaultSchedule
from elastrain.demo.sharded import (
    BASE_PACE_S,
    FIRST_KILL_STEP,
    HOLD_S,
    LATE_PACE_S,
    WAIT_PACE_S,
    Driver,
    evaluations,
    first_heal,
    format_first_heal,
    format_layouts,
    format_recipe,
    groups_of,
    layout_sizes,
    problems,
    second_victim,
    shard_size_of,
    state_bytes,
)

L1 = "2x2: r0=[w1,w0] r1=[w2,w3]"
L2 = "2x2: r0=[-,w0] r1=[w2,w3]"
L3 = "2x2: r0=[w4,w0] r1=[w2,w3]"
L4 = "2x2: r0=[w4,w0] r1=[w2,-]"
L5 = "1x3: r0=[w4,w2,w0]"
L6 = "2x2: r0=[w2,w0] r1=[w4,w5]"


def recorded_like() -> list[dict[str, Any]]:
    """The events of a sharded demo run that the tables read (shapes as in
    docs/guide/events.md; gens and layouts as a real run had them)."""
    ev: list[dict[str, Any]] = []
    t = 0.0

    def add(kind: str, **kw: Any) -> None:
        nonlocal t
        t += 1.0
        ev.append({"kind": kind, "t": t, **kw})

    for m in ("w0", "w1", "w2", "w3"):
        add("worker_spawned", proc="launcher", member=m, replacement=False)
    plan = [(1, "start", L1, 8), (2, "failure", L2, 11), (3, "join", L3, 3),
            (4, "failure", L4, 17), (5, "reshard", L5, 12), (6, "join", L6, 29)]  # fmt: skip
    step = 0
    for gen, reason, layout, n in plan:
        if gen == 3:
            add("worker_spawned", proc="launcher", member="w4", replacement=True, replaces="w1")
            add("heal_end", proc="w2", gen=3, role="send", bytes=11_343_000, seconds=0.1)
            add("heal_end", proc="w4", gen=3, role="recv", bytes=11_343_000, seconds=0.114)
        add("generation_formed", proc="coordinator", gen=gen, reason=reason, layout=layout)
        add("generation_ready", proc="coordinator", gen=gen, layout=layout,
            shard_size=shard_size_of(layout))  # fmt: skip
        if gen in (5, 6):
            old = L4 if gen == 5 else L5
            add("layout_changed", proc="coordinator", gen=gen, old=old, new=layout, reason=reason)
            for m in (x for g in groups_of(layout) for x in g):
                got = 11_343_000 if m == "w5" else 1_000_000
                add("reshard_end", proc=m, gen=gen, old_size=2 if gen == 5 else 3,
                    new_size=shard_size_of(layout), sent=0, received=got, seconds=0.2)  # fmt: skip
        for _ in range(n):
            for m in (x for g in groups_of(layout) for x in g if x != "-"):
                add("step_commit", proc=m, gen=gen, step=step, grad_norm=1.5)
            step += 1
            if step % 25 == 0:  # the recipe's evaluation (RECIPE_ARGS), on every member
                for m in (x for g in groups_of(layout) for x in g if x != "-"):
                    add("eval_end", proc=m, gen=gen, step=step, samples=255,
                        sums={"loss": 600.0}, computed=True)  # fmt: skip
    return ev


def test_layout_strings() -> None:
    assert shard_size_of(L1) == 2 and shard_size_of(L5) == 3 and shard_size_of("unsharded") is None
    assert groups_of(L2) == [["-", "w0"], ["w2", "w3"]]
    # The second victim is in the other group than the healed replacement.
    assert second_victim(L3, "w4") == "w3"
    assert second_victim("2x2: r0=[w0,w2] r1=[w4,w3]", "w4") == "w2"
    assert second_victim("1x2: r0=[w4,w0]", "w4") is None


def test_layout_table_and_first_heal_on_recorded_events() -> None:
    ev = recorded_like()
    text = format_layouts(ev)
    rows = [line.split(None, 3) for line in text.splitlines()[3:9]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("1", "start", "8", L1),
        ("2", "failure", "11", L2),
        ("3", "join", "3", L3),
        ("4", "failure", "17", L4),
        ("5", "reshard", "12", L5),
        ("6", "join", "29", L6),
    ]
    assert f"gen 5 (reshard): {L4}  ->  {L5}" in text
    assert "2 -> 3 ways: 3 members, moved 3.000 MB, 0.200 s" in text
    assert f"gen 6 (join): {L5}  ->  {L6}" in text
    assert "3 -> 2 ways: 4 members, moved 14.343 MB" in text
    assert layout_sizes(ev) == [2, 3, 2] and problems(ev) == []
    assert evaluations(ev) == {25: (600.0 / 255, 1), 50: (600.0 / 255, 1), 75: (600.0 / 255, 1)}
    assert "held-out loss: step 25: 2.353, step 50: 2.353, step 75: 2.353" in format_recipe(ev)
    e, senders = first_heal(ev) or ({}, [])
    assert e["proc"] == "w4" and senders == ["w2"]
    heal = format_first_heal(ev, 22_686_000)
    assert "w4 was healed 11.343 MB of the 22.686 MB training state (50%)" in heal
    assert "from its twin w2" in heal
    # What the demo did not show, it says.
    no_reshard = [x for x in ev if x.get("gen") not in (5,)]
    assert problems(no_reshard) == ["shard sizes went [2], not 2 -> 3 -> 2"]


def test_the_first_heal_is_half_the_demo_gpts_state() -> None:
    # 4 blocks of 192: about 1.9M parameters, 4 bytes each, times 3 (AdamW's moments).
    assert 22_000_000 < state_bytes() < 23_000_000


def _emit(run_dir: Path, *events: dict[str, Any]) -> None:
    d = run_dir / "events"
    d.mkdir(exist_ok=True)
    with open(d / "test.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps({"t": 0.0, **e}) + "\n")


def test_the_driver_kills_again_after_the_heal_and_paces_the_waits(tmp_path: Path) -> None:
    pace = tmp_path / "pace"
    sch = FaultSchedule([])
    notes: list[str] = []
    d = Driver(tmp_path, pace, 60, sch, notes.append)

    def status(step: int) -> float:
        d.on_status({"step": step})
        return float(pace.read_text())

    _emit(tmp_path, *({"kind": "worker_spawned", "member": m} for m in ("w0", "w1", "w2", "w3")))
    _emit(tmp_path, {"kind": "generation_ready", "layout": L1})
    assert status(FIRST_KILL_STEP - 1) == BASE_PACE_S
    assert status(FIRST_KILL_STEP) == WAIT_PACE_S  # waiting for the replacement
    _emit(tmp_path, {"kind": "generation_ready", "layout": L3})
    _emit(tmp_path, {"kind": "heal_end", "proc": "w2", "role": "send", "bytes": 5})
    assert status(12) == WAIT_PACE_S and sch.pending == []  # a sender is not the replacement
    _emit(tmp_path, {"kind": "heal_end", "proc": "w4", "role": "recv", "bytes": 5})
    assert status(13) == WAIT_PACE_S and d.phase == "reshard"
    assert [str(f) for f in sch.pending] == [f"kill@15:w3/hold={HOLD_S:g}s"]
    assert status(50) == LATE_PACE_S  # few steps left while a phase is awaited
    _emit(tmp_path, {"kind": "layout_changed", "gen": 5, "old": L4, "new": L5})
    assert status(30) == WAIT_PACE_S and d.phase == "back"
    _emit(tmp_path, {"kind": "layout_changed", "gen": 6, "old": L5, "new": L6})
    assert status(40) == BASE_PACE_S and d.phase == "done"
    assert any("w4 healed" in n for n in notes) and any("back at 2x2" in n for n in notes)


def test_the_sharded_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole demo, as `elastrain demo --sharded` runs it: 2x2, one
    kill healed shard-only, a held kill that regroups as 1x3, back to 2x2; it
    ends with the invariants line (twins bit-identical at every generation start)."""
    from elastrain.demo.show import run_demo
    from elastrain.observe.events import read_events

    rc = run_demo(sharded=True, run_dir=str(tmp_path / "demo"), plain=True)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == (
        "invariants: all members bit-identical at every generation start: yes"
    ), out[-3000:]
    assert rc == 0 and "NOT SHOWN" not in out, out[-3000:]
    ev = read_events(tmp_path / "demo")
    assert layout_sizes(ev) == [2, 3, 2]
    e, _ = first_heal(ev) or ({}, [])
    assert 0.45 < e["bytes"] / state_bytes() < 0.55
    assert "regroups in memory" in out and "first replacement:" in out
    # The recipe: clipping by the global norm, a registered schedule, evaluations.
    assert "global gradient norm over all shards:" in out, out[-3000:]
    assert re.search(r"held-out loss: step 25: \d\.\d{3}.*step 50: .*step 75: ", out), out[-3000:]
