"""The fault injector's pieces: schedule grammar and timing, checkpoint damage,
disk filling, the straggler inbox, and the ledger's view of rolled-back steps."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from elastrain.chaos.inject import DiskFiller, damage_checkpoint, send_slow
from elastrain.chaos.points import FaultPoints
from elastrain.chaos.schedule import (
    COORDINATOR,
    JOB,
    Fault,
    FaultSchedule,
    parse_duration,
    parse_fault,
    read_faults_file,
)
from elastrain.checkpoint import latest_verified
from elastrain.launch.config import LaunchConfig
from elastrain.observe.ledger import check_exactly_once

from .test_checkpoint import make_state, save


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("kill@15", Fault("kill", at_step=15)),
        ("kill@15:w2", Fault("kill", at_step=15, member="w2")),
        ("hang@30/6", Fault("hang", at_step=30, duration_s=6.0)),
        ("kill@90s", Fault("kill", at_s=90.0)),
        ("term@2m:w1", Fault("term", at_s=120.0, member="w1")),
        ("kill@every45s~15s", Fault("kill", every_s=45.0, jitter_s=15.0)),
        ("slow@20:w1/0.2x30", Fault("slow", at_step=20, member="w1", delay_s=0.2, steps=30)),
        ("kill-all@50", Fault("kill-all", at_step=50)),
        ("kill-coordinator@every1m", Fault("kill-coordinator", every_s=60.0)),
        ("corrupt-ckpt@60", Fault("corrupt-ckpt", at_step=60)),
        ("truncate-ckpt@1h", Fault("truncate-ckpt", at_s=3600.0)),
        ("fill-disk@70", Fault("fill-disk", at_step=70, duration_s=10.0)),
        ("fill-disk@70/3", Fault("fill-disk", at_step=70, duration_s=3.0)),
        ("cut@30:w1/8", Fault("cut", at_step=30, member="w1", duration_s=8.0)),
        ("cut@2m", Fault("cut", at_s=120.0, duration_s=10.0)),
        ("kill@30:w2/hold=20s", Fault("kill", at_step=30, member="w2", hold_s=20.0)),
        ("term@1m/hold=1.5m", Fault("term", at_s=60.0, hold_s=90.0)),
    ],
)
def test_fault_specs_parse_and_print_back(spec: str, want: Fault) -> None:
    got = parse_fault(spec)
    assert got == want
    assert parse_fault(str(got)) == got


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("explode@3", "kind must be one of"),
        ("kill", "expected KIND@WHEN"),
        ("kill@3/5", "only hang, fill-disk and cut"),
        ("hang@3/hold=2s", "only kill and term take /hold"),
        ("kill@3/hold=soon", "expected KIND@WHEN"),
        ("kill-all@3:w1", "takes no member"),
        ("slow@3:w1", "DELAYxSTEPS"),
        ("slow@3/0x5", "DELAYxSTEPS"),
        ("kill@every10s~10s", "jitter must be smaller"),
        ("kill@every0s", "period must be > 0"),
    ],
)
def test_bad_fault_specs_say_what_is_wrong(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_fault(spec)


def test_a_cut_needs_simulated_hosts(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match="--hosts N"):
        LaunchConfig(script=str(script), faults=[parse_fault("cut@5/3")])
    with pytest.raises(ValueError, match="--hosts must be >= 0"):
        LaunchConfig(script=str(script), hosts=-1)
    with pytest.raises(ValueError, match="an agent already runs on a host"):
        LaunchConfig(script=str(script), hosts=2, coordinator="10.0.0.1:1", token="t")
    assert LaunchConfig(script=str(script), hosts=3, faults=[parse_fault("cut@5/3")]).hosts == 3


def test_durations() -> None:
    assert (
        parse_duration("90") == 90 and parse_duration("1.5m") == 90 and parse_duration("2h") == 7200
    )
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration("soon")


def test_faults_file_with_comments_and_line_numbers(tmp_path: Path) -> None:
    f = tmp_path / "faults.txt"
    f.write_text("# a soak\nkill@10   # one kill\n\nhang@every30s~5s/4\n")
    assert [str(x) for x in read_faults_file(f)] == ["kill@10", "hang@every30s~5s/4"]
    f.write_text("kill@10\nkill@\n")
    with pytest.raises(ValueError, match=r"faults.txt:2: bad fault"):
        read_faults_file(f)


def test_schedule_by_step_by_time_and_repeating_with_seeded_jitter() -> None:
    faults = [parse_fault(s) for s in ("kill@5", "term@30s", "hang@every10s~2s/1")]

    def fire_times(seed: int) -> list[tuple[float, str]]:
        sch = FaultSchedule(faults, seed)
        out = []
        for i in range(0, 600):
            t = i * 0.1
            for f in sch.due(step=i // 10, elapsed_s=t):
                out.append((round(t, 1), f.kind))
        return out

    a = fire_times(1)
    assert a == fire_times(1), "the same seed gives the same schedule"
    assert a != fire_times(2)
    assert (5.0, "kill") in a and (30.0, "term") in a
    hangs = [t for t, k in a if k == "hang"]
    assert 5 <= len(hangs) <= 6  # 60 s at one every 10 +- 2 s
    gaps = [b - x for x, b in zip([0.0, *hangs], hangs, strict=False)]
    assert all(8.0 - 0.11 <= g <= 12.0 + 0.11 for g in gaps), gaps
    sch = FaultSchedule([parse_fault("kill@5")])
    assert sch.due(step=3, elapsed_s=None) == [] and not sch.exhausted
    assert len(sch.due(step=5)) == 1 and sch.exhausted


def test_a_fault_added_while_the_job_runs_is_due_like_the_others() -> None:
    sch = FaultSchedule([parse_fault("kill@5")])
    sch.add(parse_fault("kill@9:w2/hold=20s"))
    assert [str(f) for f in sch.due(step=5)] == ["kill@5"] and not sch.exhausted
    assert [str(f) for f in sch.due(step=9)] == ["kill@9:w2/hold=20s"] and sch.exhausted


def test_a_held_kill_delays_only_its_victims_replacement(tmp_path: Path) -> None:
    """`kill@S:wN/hold=H`: the launcher asks `replace_delay` when it replaces a dead
    process; the held victim's replacement waits H, any other death the default."""
    from elastrain.chaos.injector import Injector
    from elastrain.observe.events import EventLog, read_events

    class P:
        def __init__(self) -> None:
            self.proc = subprocess.Popen(["sleep", "60"])

    held, plain = P(), P()
    inj = Injector(
        [],
        0,
        events=EventLog(tmp_path, "launcher"),
        run_dir=tmp_path,
        checkpoint_dir=tmp_path / "ckpt",
        at=lambda *_: None,
    )
    try:
        inj.fire(parse_fault("kill@1:w1/hold=20s"), "w1", {"w1": held}, None, 1)
        inj.fire(parse_fault("kill@1:w2"), "w2", {"w2": plain}, None, 1)
        assert held.proc.wait(10) == -9 and plain.proc.wait(10) == -9
    finally:
        for w in (held, plain):
            w.proc.kill()
            w.proc.wait()
    assert inj.replace_delay(held.proc.pid, 0.5) == 20.0
    assert inj.replace_delay(held.proc.pid, 0.5) == 0.5  # once: a later death is not held
    assert inj.replace_delay(plain.proc.pid, 0.5) == 0.5
    kills = [e for e in read_events(tmp_path) if e["kind"] == "fault_injected"]
    assert [(e["member"], e.get("hold_s")) for e in kills] == [("w1", 20.0), ("w2", None)]


def test_victims() -> None:
    sch = FaultSchedule([], seed=0)
    assert sch.pick(parse_fault("kill-coordinator@1"), ["w0"]) == COORDINATOR
    assert sch.pick(parse_fault("kill-all@1"), ["w0"]) == JOB
    assert sch.pick(parse_fault("kill@1:w3"), ["w0", "w1"]) is None  # not alive
    assert sch.pick(parse_fault("kill@1"), ["w0", "w1"]) in ("w0", "w1")
    assert sch.pick(parse_fault("kill@1"), []) is None


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_damaged_newest_checkpoint_is_skipped_on_resume(tmp_path: Path, how: str) -> None:
    d = tmp_path / "ckpt"
    assert damage_checkpoint(d, random.Random(0), how) == {"skipped": "no committed checkpoint yet"}
    save(d, 5, make_state(1), num_shards=2)
    save(d, 10, make_state(2), num_shards=2)
    info = damage_checkpoint(d, random.Random(0), how)
    assert info["checkpoint_step"] == 10 and Path(info["path"]).exists()
    skipped: list[int] = []
    got = latest_verified(d, on_skip=lambda step, _p, _r: skipped.append(step))
    assert got is not None and got.step == 5 and skipped == [10]
    # Damage is never undone by more damage (a soak may hit the same file again).
    rng = random.Random(1)
    for _ in range(4):
        damage_checkpoint(d, rng, how)
        got = latest_verified(d)
        assert got is not None and got.step == 5


def test_disk_filler_refuses_a_big_filesystem(tmp_path: Path) -> None:
    info = DiskFiller(tmp_path, limit_bytes=1 << 20).fill()
    assert "skipped" in info and "dedicated filesystem" in info["skipped"]


def test_disk_filler_fills_a_small_filesystem_then_frees_it(small_fs: Path) -> None:
    filler = DiskFiller(small_fs, limit_bytes=8 << 20)
    info = filler.fill()
    assert info["bytes"] > 0
    with pytest.raises(OSError, match="No space left"):
        (small_fs / "x").write_bytes(b"\0" * 65536)
    filler.release()
    (small_fs / "x").write_bytes(b"\0" * 65536)
    assert not [p for p in small_fs.iterdir() if p.name.startswith(".chaos-fill")]


def test_straggler_order_slows_the_next_steps_once(tmp_path: Path) -> None:
    slept: list[float] = []
    inbox = tmp_path / "chaos" / "w1.json"
    points = FaultPoints("w1", [], inbox=inbox, sleep=slept.append)
    points.hit(0, "compute")
    assert slept == []
    send_slow(tmp_path, "w1", 0.25, 3)
    for step in range(1, 8):
        points.hit(step, "compute")
        points.hit(step, "allreduce")  # only the compute phase is slowed
    assert slept == [0.25, 0.25, 0.25]


def test_a_lost_answer_is_injected_once_and_only_at_the_commit_vote() -> None:
    """The "fail" action loses this member's answer of a completed collective (the engine then
    waits on as for one that never comes): once, and only at the commit vote."""
    from elastrain.chaos.points import FaultPoint
    from elastrain.runtime.hooks import InjectedFailure

    fired: list[FaultPoint] = []
    point = FaultPoint("w1", 4, "vote", "fail")
    points = FaultPoints("w1", [point, FaultPoint("w2", 4, "vote", "fail")], on_fire=fired.append)
    points.hit(3, "vote")
    points.hit(4, "allreduce")
    points.hit(4, "commit")
    with pytest.raises(InjectedFailure, match="vote answer lost at step 4"):
        points.hit(4, "vote")
    points.hit(4, "vote")  # once per process
    assert fired == [point]
    with pytest.raises(ValueError, match="'fail' is injected at phase vote, got 'allreduce'"):
        FaultPoint("w1", 4, "allreduce", "fail")
    with pytest.raises(ValueError, match="'poison' is injected at phase compute or allreduce"):
        FaultPoint("w1", 4, "commit", "poison")


def _commit(t: float, step: int, gen: int, proc: str) -> list[dict[str, object]]:
    return [
        {"t": t - 0.01, "kind": "step_contrib", "step": step, "gen": gen, "proc": proc,
         "samples": [step]},
        {"t": t, "kind": "step_commit", "step": step, "gen": gen, "proc": proc},
    ]  # fmt: skip


def test_ledger_counts_rolled_back_steps_after_a_resume_from_an_older_checkpoint() -> None:
    ev: list[dict[str, object]] = [
        {"t": 0.0, "kind": "generation_ready", "gen": 1, "members": ["w0"], "start_step": 0}
    ]
    for s in range(6):
        ev += _commit(1.0 + s, s, 1, "w0")
    # Everyone died; the replacement resumed from the checkpoint at step 4.
    ev.append({"t": 10.0, "kind": "generation_ready", "gen": 2, "members": ["w1"], "start_step": 4})
    for s in range(4, 8):
        ev += _commit(11.0 + s, s, 2, "w1")
    rep = check_exactly_once(ev, lambda s: [s])
    assert rep.violations == [] and rep.committed_steps == 8 and rep.rolled_back == 2
    assert rep.committed_by_step[4] == 2 and rep.committed_by_step[3] == 1
