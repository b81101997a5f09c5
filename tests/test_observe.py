"""Recovery phases, join timings and the exactly-once ledger on hand-built event lists.

Each scenario is written the way the launcher, coordinator and workers emit
events (docs/guide/events.md), with realistic timing on a wall clock near 1.7e9 s, so
absolute times exercise float precision as a real run does.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from elastrain.observe.events import EventKind
from elastrain.observe.goodput import BUCKETS, format_goodput, goodput
from elastrain.observe.ledger import (
    check_exactly_once,
    check_loss_agreement,
    check_same_state,
    loss_curve,
)
from elastrain.observe.recovery import (
    PHASES,
    Recovery,
    format_joins,
    format_recoveries,
    joins,
    recoveries,
)

T = 1_700_000_000.0
B = 8  # global batch
MB = 2  # micro-batch: 4 micro-batches per step


def expected_ids(s: int) -> list[int]:
    return list(range(s * B, (s + 1) * B))


def share(s: int, members: list[str], m: str) -> list[int]:
    """The ids member `m` feeds for step `s`: micro-batch i goes to rank i % n."""
    ids = expected_ids(s)
    rank, n = members.index(m), len(members)
    return [x for i in range(0, B // MB) if i % n == rank for x in ids[i * MB : (i + 1) * MB]]


class Run:
    """Builds a run's events; times are seconds after T."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {"launcher": 100, "coordinator": 101}
        self.committed: dict[str, int] = {}

    def ev(self, t: float, proc: str, kind: str, **fields: Any) -> dict[str, Any]:
        pid = self.pids.setdefault(proc, 1000 + len(self.pids))
        e = {"t": T + t, "mono": 50.0 + t, "proc": proc, "pid": pid, "kind": kind, **fields}
        self.events.append(e)
        return e

    def spawn(self, t: float, m: str, replacement: bool = False) -> None:
        self.pids[m] = 1000 + len(self.pids)
        self.ev(t, "launcher", "worker_spawned", member=m, pid=self.pids[m],
                replacement=replacement)  # fmt: skip
        self.committed.setdefault(m, 0)

    def register(self, t: float, m: str, inc: int = 1) -> None:
        self.ev(t, "coordinator", "member_registered", member=m, incarnation=inc)

    def form(self, t: float, gen: int, members: list[str], reason: str) -> None:
        self.ev(t, "coordinator", "generation_formed", gen=gen, members=members, reason=reason)

    def ready(self, t: float, gen: int, members: list[str]) -> None:
        steps = {m: self.committed[m] for m in members}
        self.ev(t, "coordinator", "generation_ready", gen=gen, members=members, steps=steps,
                start_step=max(steps.values()))  # fmt: skip

    def build(self, t: float, gen: int, members: list[str], heal_s: float = 0.0) -> float:
        """group_built at t (+5 ms per rank), a heal if someone is behind, generation_start."""
        for r, m in enumerate(members):
            self.ev(t + 0.005 * r, m, "group_built", gen=gen, rank=r, size=len(members),
                    build_s=0.1)  # fmt: skip
        t = t + 0.005 * len(members)
        top = max(self.committed[m] for m in members)
        if any(self.committed[m] < top for m in members):
            for m in members:
                role = "recv" if self.committed[m] < top else "send"
                self.ev(t, m, "heal_begin", gen=gen, role=role, bytes=0)
            t += heal_s
            for m in members:
                role = "recv" if self.committed[m] < top else "send"
                nbytes = 40_000_000
                self.ev(t, m, "heal_end", gen=gen, role=role, bytes=nbytes, seconds=heal_s,
                        rate_mb_s=nbytes / 1e6 / heal_s)  # fmt: skip
                self.committed[m] = top
        for m in members:
            self.ev(t + 0.001, m, "generation_start", gen=gen, step=top, state_hash="abc123",
                    members=members)  # fmt: skip
        return t + 0.001

    def step(self, t: float, gen: int, members: list[str], s: int, commit: bool = True,
             dur: float = 0.5) -> float:  # fmt: skip
        """One step from t: contributions at t+0.3, commits at t+dur."""
        for m in members:
            self.ev(t + 0.3, m, "step_contrib", step=s, gen=gen, samples=share(s, members, m))
        if commit:
            for m in members:
                self.ev(t + dur, m, "step_commit", step=s, gen=gen, loss=1.0 / (s + 1),
                        step_s=dur, compute_s=0.3, allreduce_s=dur - 0.3,
                        samples_per_s=B / dur)  # fmt: skip
                self.committed[m] = s + 1
        return t + dur

    def steps(self, t: float, gen: int, members: list[str], first: int, n: int) -> float:
        for s in range(first, first + n):
            t = self.step(t, gen, members, s)
        return t

    def start(self, members: list[str]) -> float:
        self.ev(0.0, "launcher", "job_start", job_id="j", target=len(members), min=1,
                script="train.py")  # fmt: skip
        for i, m in enumerate(members):
            self.spawn(0.01 * i, m)
        for i, m in enumerate(members):
            self.register(0.5 + 0.01 * i, m)
        self.form(0.6, 1, members, "start")
        self.ready(0.8, 1, members)
        return self.build(0.9, 1, members)


def kill_run() -> Run:
    """w1 is SIGKILLed during step 5 of gen 1; gen 2 = {w0, w2}; the replacement w3
    joins in gen 3 and is healed."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)  # ~0.916
    t = r.steps(t, 1, g1, 0, 5)  # steps 0..4 done at ~3.416
    r.step(t, 1, g1, 5, commit=False)  # contributions go out at ~3.716
    r.ev(3.80, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=5)
    r.ev(3.85, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.ev(3.86, "coordinator", "member_removed", member="w1", reason="exited")
    g2 = ["w0", "w2"]
    r.form(3.86, 2, g2, "failure")
    for m in g2:
        r.ev(3.90, m, "step_abort", step=5, gen=1, error="connection reset", phase="allreduce")
    r.spawn(3.95, "w3", replacement=True)
    r.ready(4.00, 2, g2)
    t = r.build(4.20, 2, g2)  # group_built 4.200, 4.205
    t = r.steps(t, 2, g2, 5, 3)  # first commit ~4.711; steps 5..7
    r.register(5.00, "w3")
    # gen 3 is formed at the next step boundary after w3 registered
    g3 = ["w0", "w2", "w3"]
    r.form(t + 0.01, 3, g3, "join")
    for m in g2:
        r.ev(t + 0.02, m, "step_abort", step=8, gen=2, error="regroup", phase="quorum")
    r.ready(t + 0.1, 3, g3)
    t = r.build(t + 0.3, 3, g3, heal_s=0.4)
    t = r.steps(t, 3, g3, 8, 4)
    for m in g3:
        r.ev(t + 0.05, m, "worker_exit", reason="done", committed=12)
    r.ev(t + 0.2, "launcher", "job_end", status="done", steps=12)
    return r


def phases(rec: Recovery) -> dict[str, float]:
    return {p.name: p.seconds for p in rec.phases}


def known_sum(rec: Recovery) -> float:
    return sum(p.seconds for p in rec.phases if not math.isnan(p.seconds))


# ---- recoveries ------------------------------------------------------------------------


def test_kill_phases_follow_the_definition() -> None:
    r = kill_run()
    [rec] = recoveries(r.events)
    assert (rec.fault, rec.member, rec.gen) == ("kill", "w1", 2)
    assert rec.t0 == pytest.approx(T + 3.80)
    assert [p.name for p in rec.phases] == list(PHASES)
    p = phases(rec)
    assert p["detect"] == pytest.approx(0.05, abs=1e-6)  # worker_exited
    assert p["quorum"] == pytest.approx(0.01, abs=1e-6)  # generation_formed gen 2
    assert p["regroup"] == pytest.approx(4.205 - 3.86, abs=1e-6)  # last group_built
    assert p["heal"] == 0.0  # nobody behind
    assert p["first_step"] == pytest.approx(4.711 + 0.5 - 4.205 - 0.5, abs=1e-6)
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)
    assert rec.total_s == pytest.approx(4.711 - 3.80, abs=1e-6)
    assert rec.survivors == ["w0", "w2"]
    assert rec.replacement == "w3"


def test_replacement_join_timing() -> None:
    r = kill_run()
    [j] = joins(r.events)
    assert j.member == "w3"
    assert j.spawned_t == pytest.approx(T + 3.95)
    assert j.registered_s == pytest.approx(5.00 - 3.95, abs=1e-6)
    first_gb = next(e for e in r.events if e["kind"] == "group_built" and e["proc"] == "w3")
    heal_end = next(e for e in r.events if e["kind"] == "heal_end" and e["proc"] == "w3")
    commit = next(e for e in r.events if e["kind"] == "step_commit" and e["proc"] == "w3")
    assert j.group_s == pytest.approx(first_gb["t"] - j.spawned_t)
    assert j.healed_s == pytest.approx(heal_end["t"] - j.spawned_t)
    assert j.first_step_s == pytest.approx(commit["t"] - j.spawned_t)
    assert j.registered_s < j.group_s < j.healed_s < j.first_step_s  # type: ignore[operator]
    assert j.heal_bytes == 40_000_000
    assert j.heal_rate_mb_s == pytest.approx(100.0)


def test_events_in_any_order() -> None:
    r = kill_run()
    shuffled = list(r.events)
    random.Random(1).shuffle(shuffled)
    assert recoveries(shuffled) == recoveries(r.events)
    assert joins(shuffled) == joins(r.events)


def test_superseded_generation_is_skipped() -> None:
    """gen 2 (without the replacement) is formed, then superseded by gen 3 before it
    became ready: the survivors resume in gen 3, and quorum ends at its formation."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 3)
    r.step(t, 1, g1, 3, commit=False)
    t0 = t + 0.35
    r.ev(t0, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=3)
    r.ev(t0 + 0.02, "coordinator", "member_removed", member="w1", reason="exited")
    r.form(t0 + 0.02, 2, ["w0", "w2"], "failure")
    r.ev(t0 + 0.03, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.spawn(t0 + 0.05, "w3", replacement=True)
    r.register(t0 + 0.30, "w3")
    g3 = ["w0", "w2", "w3"]
    r.form(t0 + 0.30, 3, g3, "failure")  # gen 2 never became ready
    r.ready(t0 + 0.40, 3, g3)
    tb = r.build(t0 + 0.50, 3, g3, heal_s=0.25)
    r.steps(tb, 3, g3, 3, 2)
    [rec] = recoveries(r.events)
    assert rec.gen == 3
    p = phases(rec)
    assert p["detect"] == pytest.approx(0.02, abs=1e-6)
    assert p["quorum"] == pytest.approx(0.28, abs=1e-6)
    assert p["regroup"] == pytest.approx(0.205, abs=1e-6)  # w0, w2 built at +0.50, +0.505
    assert p["heal"] == pytest.approx(0.25 + 0.015 - 0.005, abs=1e-6)  # after the last build
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)
    assert rec.survivors == ["w0", "w2"]


def test_ready_generation_broken_before_its_first_step() -> None:
    """gen 2 became ready but broke before committing (a second death); the survivors'
    recovery ends in gen 3, where they actually ran."""
    r = Run()
    g1 = ["w0", "w1", "w2", "w3"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    t0 = t + 0.1
    r.ev(t0, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=2)
    r.ev(t0 + 0.01, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.form(t0 + 0.02, 2, ["w0", "w2", "w3"], "failure")
    r.ready(t0 + 0.1, 2, ["w0", "w2", "w3"])
    r.ev(t0 + 0.15, "w0", "group_built", gen=2, rank=0, size=3, build_s=0.05)
    r.ev(t0 + 0.16, "launcher", "worker_exited", member="w3", pid=r.pids["w3"], returncode=1)
    r.form(t0 + 0.2, 3, ["w0", "w2"], "failure")
    r.ready(t0 + 0.3, 3, ["w0", "w2"])
    tb = r.build(t0 + 0.4, 3, ["w0", "w2"])
    r.steps(tb, 3, ["w0", "w2"], 2, 1)
    rec, crash = recoveries(r.events)  # w3's exit is a failure of its own
    assert (crash.fault, crash.member, crash.how) == ("crash", "w3", "exited with code 1")
    assert rec.gen == 3
    assert phases(rec)["quorum"] == pytest.approx(0.19, abs=1e-6)
    assert rec.survivors == ["w0", "w2"]


def test_fault_written_by_the_victim() -> None:
    """An in-worker fault point: the victim writes fault_injected itself (proc == member)
    and its pid; the launcher knows nothing until the process exits."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    r.step(t, 1, g1, 2, commit=False)
    t0 = t + 0.31
    r.ev(t0, "w1", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=2,
         phase="allreduce")  # fmt: skip
    for m in ("w0", "w2"):
        r.ev(t0 + 0.04, m, "step_abort", step=2, gen=1, error="reset", phase="allreduce")
    r.ev(t0 + 0.06, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.ev(t0 + 0.06, "coordinator", "member_removed", member="w1", reason="exited")
    r.form(t0 + 0.06, 2, ["w0", "w2"], "failure")
    r.ready(t0 + 0.1, 2, ["w0", "w2"])
    tb = r.build(t0 + 0.2, 2, ["w0", "w2"])
    r.steps(tb, 2, ["w0", "w2"], 2, 1)
    [rec] = recoveries(r.events)
    assert (rec.fault, rec.member, rec.gen) == ("kill", "w1", 2)
    assert phases(rec)["detect"] == pytest.approx(0.04, abs=1e-6)  # survivors' abort
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)

    # The same fault reported by the launcher too is still one fault.
    r.ev(t0 + 0.001, "launcher", "fault_injected", fault="kill", member="w1",
         pid=r.pids["w1"], step=2)  # fmt: skip
    assert len(recoveries(r.events)) == 1


def test_faults_close_together_use_only_their_own_events() -> None:
    """w1 dies, then w2 dies 0.1 s later while gen 2 (which still has w2) is forming."""
    r = Run()
    g1 = ["w0", "w1", "w2", "w3"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 3)
    r.step(t, 1, g1, 3, commit=False)
    ta = t + 0.35
    r.ev(ta, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=3)
    for m in ("w0", "w2", "w3"):
        r.ev(ta + 0.02, m, "step_abort", step=3, gen=1, error="reset", phase="allreduce")
    r.ev(ta + 0.03, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.form(ta + 0.03, 2, ["w0", "w2", "w3"], "failure")
    r.spawn(ta + 0.04, "w4", replacement=True)
    tb = ta + 0.1
    r.ev(tb, "launcher", "fault_injected", fault="kill", member="w2", pid=r.pids["w2"], step=3)
    r.ev(tb + 0.05, "launcher", "worker_exited", member="w2", pid=r.pids["w2"], returncode=-9)
    r.ev(tb + 0.05, "coordinator", "member_removed", member="w2", reason="exited")
    r.spawn(tb + 0.06, "w5", replacement=True)
    g3 = ["w0", "w3"]
    r.form(tb + 0.05, 3, g3, "failure")
    r.ready(tb + 0.15, 3, g3)
    tc = r.build(tb + 0.25, 3, g3)
    r.steps(tc, 3, g3, 3, 2)
    ra, rb = recoveries(r.events)
    assert (ra.member, rb.member) == ("w1", "w2")
    assert ra.gen == rb.gen == 3
    assert phases(ra)["detect"] == pytest.approx(0.02, abs=1e-6)
    # w2's detect must not borrow the aborts at ta+0.02 (before its own t0).
    assert phases(rb)["detect"] == pytest.approx(0.05, abs=1e-6)
    assert phases(rb)["quorum"] == pytest.approx(0.0, abs=1e-6)
    first_commit = next(e["t"] for e in r.events if e["kind"] == "step_commit" and e["gen"] == 3)
    assert ra.total_s == pytest.approx(first_commit - (T + ta), abs=1e-6)
    assert rb.total_s == pytest.approx(first_commit - (T + tb), abs=1e-6)
    assert ra.survivors == ["w0", "w3"]
    assert rb.survivors == ["w0", "w3"]
    assert (ra.replacement, rb.replacement) == ("w4", "w5")


def test_replacement_belongs_to_the_fault_whose_victim_exited() -> None:
    """A hung victim never exits, so the replacement spawned after a later kill is the
    kill's, not the hang's; a `replaces` field settles it outright."""
    r = Run()
    t = r.start(["w0", "w1", "w2"])
    r.ev(t + 1, "launcher", "fault_injected", fault="hang", member="w2", pid=r.pids["w2"], step=1)
    r.ev(t + 3, "coordinator", "member_removed", member="w2", reason="suspected")
    r.ev(t + 5, "launcher", "fault_injected", fault="kill", member="w0", pid=r.pids["w0"], step=3)
    r.ev(t + 5.1, "launcher", "worker_exited", member="w0", pid=r.pids["w0"], returncode=-9)
    r.spawn(t + 5.2, "w3", replacement=True)
    hang, kill = recoveries(r.events)
    assert (hang.replacement, kill.replacement) == (None, "w3")
    r.events[-1]["replaces"] = "w2"  # the launcher's record says otherwise: nobody's
    hang, kill = recoveries(r.events)
    assert (hang.replacement, kill.replacement) == (None, None)
    r.events[-1]["replaces"] = "w0"
    hang, kill = recoveries(r.events)
    assert (hang.replacement, kill.replacement) == (None, "w3")


def test_replacement_follows_the_launchers_record_when_a_member_fails_twice() -> None:
    """Issue 15: w1 hangs, is expelled and rejoins; later it is SIGTERMed and replaced by
    w3. The hang row has no replacement (a hung process is never replaced); the term
    row has w3, as the launcher's `replaces`/`replaces_pid` say."""
    r = Run()
    t = r.start(["w0", "w1", "w2"])
    w1 = r.pids["w1"]
    r.ev(t + 1, "launcher", "fault_injected", fault="hang", member="w1", pid=w1, step=1)
    r.ev(t + 3, "coordinator", "member_removed", member="w1", reason="suspected")
    r.register(t + 8, "w1", inc=2)
    r.ev(t + 20, "launcher", "fault_injected", fault="term", member="w1", pid=w1, step=30)
    r.ev(t + 20.2, "coordinator", "member_removed", member="w1", reason="left")
    r.ev(t + 20.3, "launcher", "worker_exited", member="w1", pid=w1, returncode=75)
    r.spawn(t + 22, "w3", replacement=True)
    r.events[-1].update(replaces="w1", replaces_pid=w1)
    hang, term = recoveries(r.events)
    assert (hang.fault, term.fault) == ("hang", "term")
    assert (hang.replacement, term.replacement) == (None, "w3")
    [rejoin, spawn] = joins(r.events)
    assert (rejoin.member, rejoin.rejoined, spawn.member, spawn.rejoined) == (
        "w1",
        True,
        "w3",
        False,
    )


def hang_run() -> Run:
    """w2 is SIGSTOPped; the survivors' watchdog fires, the coordinator expels w2 as
    suspected; 6 s later it is resumed, re-registers and is healed back in."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 3)
    t0 = t + 0.1
    r.ev(t0, "launcher", "fault_injected", fault="hang", member="w2", pid=r.pids["w2"], step=3)
    for m in ("w0", "w1"):
        r.ev(t + 0.3, m, "step_contrib", step=3, gen=1, samples=share(3, g1, m))
    for m in ("w0", "w1"):
        r.ev(t0 + 2.0, m, "watchdog_fired", step=3, gen=1, timeout_s=1.7)
        r.ev(t0 + 2.0, m, "step_abort", step=3, gen=1, error="watchdog", phase="watchdog")
    r.ev(t0 + 2.05, "coordinator", "member_removed", member="w2", reason="suspected")
    g2 = ["w0", "w1"]
    r.form(t0 + 2.05, 2, g2, "failure")
    r.ready(t0 + 2.1, 2, g2)
    tb = r.build(t0 + 2.2, 2, g2)
    t = r.steps(tb, 2, g2, 3, 8)
    r.ev(t0 + 6.0, "launcher", "fault_injected", fault="resume", member="w2", pid=r.pids["w2"],
         step=7)  # fmt: skip
    r.ev(t0 + 6.01, "w2", "step_abort", step=3, gen=1, error="expelled", phase="allreduce")
    r.register(t0 + 6.05, "w2", inc=2)
    g3 = ["w0", "w1", "w2"]
    r.form(t + 0.01, 3, g3, "join")
    r.ready(t + 0.1, 3, g3)
    tb = r.build(t + 0.2, 3, g3, heal_s=0.3)
    t = r.steps(tb, 3, g3, 11, 2)
    r.ev(t + 1, "launcher", "job_end", status="done", steps=13)
    r.ev(t + 0.5, "launcher", "worker_exited", member="w2", pid=r.pids["w2"], returncode=0)
    return r


def test_hang_victim_stays_alive_and_is_left_out() -> None:
    r = hang_run()
    [rec] = recoveries(r.events)  # "resume" is not a fault to recover from
    assert (rec.fault, rec.member, rec.gen) == ("hang", "w2", 2)
    p = phases(rec)
    assert p["detect"] == pytest.approx(2.0, abs=1e-6)  # the watchdog, not the late exit
    assert p["quorum"] == pytest.approx(0.05, abs=1e-6)
    assert p["heal"] == 0.0
    assert rec.survivors == ["w0", "w1"]
    assert rec.replacement is None
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)


def test_hang_with_a_join_in_between() -> None:
    """A joiner arrives while w2 hangs: the join generation (still with w2) makes the
    survivors abort at the quorum, which is not detection; w2 is only dropped when it
    fails to become ready."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    t0 = t + 0.1
    r.ev(t0, "launcher", "fault_injected", fault="hang", member="w2", pid=r.pids["w2"], step=2)
    r.spawn(t0 + 0.05, "w3")
    r.register(t0 + 0.3, "w3")
    g2 = ["w0", "w1", "w2", "w3"]
    r.form(t0 + 0.35, 2, g2, "join")
    for m in ("w0", "w1"):
        r.ev(t0 + 0.36, m, "step_abort", step=2, gen=1, error="regroup", phase="quorum")
    r.ev(t0 + 5.35, "coordinator", "member_removed", member="w2", reason="not_ready")
    g3 = ["w0", "w1", "w3"]
    r.form(t0 + 5.35, 3, g3, "failure")
    r.ready(t0 + 5.4, 3, g3)
    tb = r.build(t0 + 5.5, 3, g3, heal_s=0.2)
    r.steps(tb, 3, g3, 2, 2)
    [rec] = recoveries(r.events)
    assert rec.gen == 3
    p = phases(rec)
    assert p["detect"] == pytest.approx(5.35, abs=1e-6)
    assert p["quorum"] == pytest.approx(0.0, abs=1e-6)
    assert p["heal"] == pytest.approx(0.2 + 0.01, abs=1e-6)
    assert rec.survivors == ["w0", "w1"]
    assert check_exactly_once(r.events, expected_ids).violations == []


def test_reregistration_after_expulsion_is_a_join() -> None:
    r = hang_run()
    [j] = joins(r.events)
    assert j.member == "w2"
    reg = next(e for e in r.events if e["kind"] == "member_registered" and e["incarnation"] == 2)
    assert j.spawned_t == reg["t"]
    assert j.registered_s == 0.0
    assert j.group_s is not None and j.healed_s is not None and j.first_step_s is not None
    assert 0 < j.group_s < j.healed_s < j.first_step_s
    assert j.heal_bytes == 40_000_000
    # Its own pre-expulsion events (the late step_abort) play no part.
    assert j.heal_rate_mb_s == pytest.approx(40 / 0.3)


def term_run(with_removal: bool = True) -> Run:
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 3)
    t0 = t - 0.3
    r.ev(t0, "launcher", "fault_injected", fault="term", member="w1", pid=r.pids["w1"], step=2)
    # w1 announces its leave; it is dropped at the next step boundary (t + 0.02).
    if with_removal:
        r.ev(t + 0.02, "coordinator", "member_removed", member="w1", reason="left")
    g2 = ["w0", "w2"]
    r.form(t + 0.02, 2, g2, "leave")
    for m in g2:
        r.ev(t + 0.03, m, "step_abort", step=3, gen=1, error="regroup", phase="quorum")
    r.ev(t + 0.04, "w1", "worker_exit", reason="left", committed=3)
    r.ev(t + 0.1, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=0)
    r.ready(t + 0.1, 2, g2)
    tb = r.build(t + 0.2, 2, g2)
    r.steps(tb, 2, g2, 3, 2)
    return r


@pytest.mark.parametrize("with_removal", [True, False])
def test_term_is_a_graceful_leave(with_removal: bool) -> None:
    r = term_run(with_removal)
    [rec] = recoveries(r.events)
    assert (rec.fault, rec.member, rec.gen) == ("term", "w1", 2)
    p = phases(rec)
    assert p["detect"] == pytest.approx(0.32, abs=1e-6)  # the removal / the gen without w1
    assert p["quorum"] == pytest.approx(0.0, abs=1e-6)
    assert rec.survivors == ["w0", "w2"]
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)


def test_heal_phase_when_a_survivor_is_behind() -> None:
    """w0 committed step 2 before w1 died, w2's all-reduce failed: w2 is healed in gen 2."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    r.step(t, 1, g1, 2, commit=False)
    r.ev(t + 0.45, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"],
         step=2)  # fmt: skip
    r.ev(t + 0.46, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.ev(t + 0.5, "w0", "step_commit", step=2, gen=1, loss=1 / 3, step_s=0.5, compute_s=0.3,
         allreduce_s=0.2, samples_per_s=16.0)  # fmt: skip
    r.committed["w0"] = 3
    r.ev(t + 0.5, "w2", "step_abort", step=2, gen=1, error="reset", phase="allreduce")
    r.form(t + 0.52, 2, ["w0", "w2"], "failure")
    r.ready(t + 0.6, 2, ["w0", "w2"])
    tb = r.build(t + 0.7, 2, ["w0", "w2"], heal_s=0.2)
    r.steps(tb, 2, ["w0", "w2"], 3, 1)
    [rec] = recoveries(r.events)
    assert phases(rec)["heal"] == pytest.approx(0.2 + 0.005, abs=1e-6)
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)
    assert check_exactly_once(r.events, expected_ids).violations == []


def test_job_ends_before_recovery() -> None:
    r = Run()
    g1 = ["w0", "w1"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    r.ev(t + 0.1, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"],
         step=2)  # fmt: skip
    r.ev(t + 0.15, "launcher", "worker_exited", member="w1", pid=r.pids["w1"], returncode=-9)
    r.form(t + 0.16, 2, ["w0"], "failure")
    r.ev(t + 0.5, "launcher", "job_end", status="interrupted", steps=2)
    [rec] = recoveries(r.events)
    assert rec.gen is None and rec.total_s is None
    p = phases(rec)
    assert p["detect"] == pytest.approx(0.05, abs=1e-6)
    assert p["quorum"] == pytest.approx(0.01, abs=1e-6)
    assert all(math.isnan(p[n]) for n in ("regroup", "heal", "first_step"))
    text = format_recoveries([rec])
    assert "0.050" in text and "nan" not in text


def test_killing_a_waiting_joiner_needs_no_recovery() -> None:
    r = kill_run()
    t = r.events[-1]["t"] - T
    r.ev(t - 1.5, "launcher", "worker_spawned", member="w9", pid=4242, replacement=True)
    r.ev(t - 1.0, "launcher", "fault_injected", fault="kill", member="w9", pid=4242, step=9)
    r.ev(t - 0.9, "launcher", "worker_exited", member="w9", pid=4242, returncode=-9)
    recs = recoveries(r.events)
    [lone] = [x for x in recs if x.member == "w9"]
    assert lone.gen is None and lone.total_s is None
    assert all(math.isnan(p.seconds) for p in lone.phases)


def test_missing_marks_give_nan_and_the_rest_still_sums() -> None:
    r = kill_run()
    evs = [e for e in r.events if not (e["kind"] == "group_built" and e.get("gen") == 2)]
    [rec] = recoveries(evs)
    p = phases(rec)
    assert math.isnan(p["regroup"])
    assert p["first_step"] > 0.5  # measured from the quorum mark
    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)

    # Someone was behind but no heal_end survived: heal is unknown, not zero.
    r2 = kill_run()
    evs = [e for e in r2.events if e["kind"] != "heal_end"]
    [j] = joins(evs)
    assert j.healed_s is None and j.heal_bytes == 0 and j.heal_rate_mb_s is None


def test_never_crashes_on_any_single_missing_event() -> None:
    for run in (kill_run(), hang_run(), term_run()):
        full = run.events
        for i in range(len(full)):
            evs = full[:i] + full[i + 1 :]
            for rec in recoveries(evs):
                assert len(rec.phases) == len(PHASES)
                if rec.total_s is not None:
                    assert rec.total_s == pytest.approx(known_sum(rec), abs=1e-6)
                    assert all(p.seconds >= 0 or math.isnan(p.seconds) for p in rec.phases)
            format_recoveries(recoveries(evs))
            format_joins(joins(evs))


def test_garbage_events_are_tolerated() -> None:
    evs: list[dict[str, Any]] = [
        {"kind": "fault_injected", "fault": "kill"},  # no t
        {"t": T, "kind": "fault_injected", "fault": "kill", "proc": "launcher"},  # no member
        {"t": T + 1, "kind": "generation_formed", "gen": "x", "members": None},
        {"t": T + 2, "kind": "worker_spawned", "replacement": True},
        {"t": T + 3, "kind": "member_registered", "member": "w1", "incarnation": "two"},
    ]
    evs.append({"t": T + 4, "kind": "worker_exited", "member": "w1", "returncode": "x"})
    evs.append({"t": T + 5, "kind": "watchdog_fired", "proc": "w1", "gen": None})
    evs.append({"t": T + 6, "kind": "coordinator_exited", "returncode": -9})
    recs = recoveries(evs)  # a watchdog (suspect unknown) and the coordinator's death
    assert [(r.fault, r.member) for r in recs] == [("hang", "?"), ("coordinator", "coordinator")]
    assert all(r.total_s is None for r in recs)
    assert joins(evs) == []
    assert recoveries([]) == [] and joins([]) == []
    assert format_recoveries([]).startswith("failure")
    assert format_joins([]).startswith("member")


def test_format_tables() -> None:
    r = kill_run()
    recs = recoveries(r.events)
    text = format_recoveries(recs, origin=T)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["failure", "member", "t0", "gen"]
    assert lines[0].split()[-1] == "evidence"
    assert "exited by SIGKILL [injected: kill]" in lines[1]
    assert all(n in lines[0] for n in PHASES)
    assert "kill" in lines[1] and "3.800" in lines[1] and "0.050" in lines[1]
    assert "w0,w2" in lines[1] and "w3" in lines[1]
    jt = format_joins(joins(r.events), origin=T).splitlines()
    assert jt[0].split()[:3] == ["member", "joined", "at"]
    assert jt[1].split()[:4] == ["w3", "spawned", "3.950", "1.050"]
    assert "40.000" in jt[1] and "100.000" in jt[1]


# ---- ledger ----------------------------------------------------------------------------


def test_ledger_clean_run_with_failures() -> None:
    for run in (kill_run(), hang_run(), term_run()):
        rep = check_exactly_once(run.events, expected_ids)
        assert rep.violations == [], rep.violations
        assert rep.ok
        assert check_same_state(run.events) == []
        assert check_loss_agreement(run.events) == []
    rep = check_exactly_once(kill_run().events, expected_ids)
    assert rep.committed_steps == 12
    assert rep.committed_by_step[4] == 1
    assert rep.committed_by_step[5] == 2  # aborted in gen 1, committed in gen 2
    assert rep.committed_by_step[8] == 3


def _contrib(evs: list[dict[str, Any]], step: int, proc: str) -> dict[str, Any]:
    return next(e for e in evs if e["kind"] == "step_contrib" and e["step"] == step
                and e["proc"] == proc)  # fmt: skip


def test_ledger_duplicate_sample() -> None:
    r = kill_run()
    c = _contrib(r.events, 6, "w2")
    c["samples"] = c["samples"] + [_contrib(r.events, 6, "w0")["samples"][0]]
    rep = check_exactly_once(r.events, expected_ids)
    assert len(rep.violations) == 1
    assert "step 6 gen 2" in rep.violations[0] and "duplicated" in rep.violations[0]
    assert "w0" in rep.violations[0] and "w2" in rep.violations[0]


def test_ledger_missing_and_extra_samples() -> None:
    r = kill_run()
    c = _contrib(r.events, 9, "w3")
    lost = c["samples"][0]
    c["samples"] = c["samples"][1:] + [10_000]
    v = check_exactly_once(r.events, expected_ids).violations
    assert any("missing" in x and str(lost) in x and "step 9" in x for x in v)
    assert any("unexpected" in x and "10000" in x for x in v)


def test_ledger_silent_member_and_outsider() -> None:
    r = kill_run()
    c = _contrib(r.events, 2, "w1")
    c["proc"] = "w7"
    v = check_exactly_once(r.events, expected_ids).violations
    assert any("non-members w7" in x for x in v)
    assert any("no step_contrib from member(s) w1" in x for x in v)


def test_ledger_gap() -> None:
    r = kill_run()
    r.events = [e for e in r.events if not (e["kind"] == "step_commit" and e["step"] in (3, 4))]
    rep = check_exactly_once(r.events, expected_ids)
    assert rep.committed_steps == 10
    assert len(rep.violations) == 1 and "3..4" in rep.violations[0]


def test_ledger_step_committed_in_two_generations() -> None:
    r = kill_run()
    # w0 re-runs step 6 in gen 3 as if it had never been committed.
    g3 = ["w0", "w2", "w3"]
    t = max(e["t"] for e in r.events) - T
    r.step(t, 3, g3, 6)
    rep = check_exactly_once(r.events, expected_ids)
    assert any("step 6 was committed in 2 generations" in x for x in rep.violations)
    assert rep.committed_by_step[6] == 2


def test_same_state_mismatch_names_gen_and_members() -> None:
    r = kill_run()
    e = next(e for e in r.events if e["kind"] == "generation_start" and e["gen"] == 3
             and e["proc"] == "w3")  # fmt: skip
    e["state_hash"] = "deadbeef"
    v = check_same_state(r.events)
    assert len(v) == 1
    assert "gen 3" in v[0] and "deadbeef" in v[0] and "w3" in v[0] and "w0, w2" in v[0]
    e["state_hash"] = ""  # hashing off on that member: not compared
    assert check_same_state(r.events) == []
    e["step"] = 7
    assert any("different steps" in x for x in check_same_state(r.events))


def test_loss_curve_and_agreement() -> None:
    r = kill_run()
    curve = loss_curve(r.events)
    assert list(curve) == list(range(12))
    assert curve[3] == pytest.approx(0.25)
    c = next(e for e in r.events if e["kind"] == "step_commit" and e["step"] == 7
             and e["proc"] == "w2")  # fmt: skip
    c["loss"] = c["loss"] * (1 + 1e-8)
    assert check_loss_agreement(r.events) == []
    c["loss"] = c["loss"] * (1 + 1e-5)
    [msg] = check_loss_agreement(r.events)
    assert "step 7" in msg and "w2" in msg
    c["loss"] = float("nan")
    [msg] = check_loss_agreement(r.events)
    assert "non-finite" in msg


# ---- goodput ---------------------------------------------------------------------------


def close_faults_run() -> Run:
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 2)
    for v, dt in (("w1", 0.1), ("w2", 0.2)):
        r.ev(t + dt, "launcher", "fault_injected", fault="kill", member=v, pid=r.pids[v], step=2)
        r.ev(t + dt + 0.02, "launcher", "worker_exited", member=v, pid=r.pids[v], returncode=-9)
    r.ev(t + 0.25, "w0", "step_abort", step=2, gen=1, error="reset", phase="allreduce")
    r.form(t + 0.3, 2, ["w0"], "failure")
    r.ready(t + 0.35, 2, ["w0"])
    tb = r.build(t + 0.4, 2, ["w0"])
    t = r.steps(tb, 2, ["w0"], 2, 2)
    r.ev(t + 0.1, "launcher", "job_end", status="done", steps=4)
    return r


@pytest.mark.parametrize("make", [kill_run, hang_run, term_run, close_faults_run])
def test_goodput_buckets_sum_to_the_total(make: Any) -> None:
    r = make()
    gp = goodput(r.events)
    assert list(gp.buckets) == list(BUCKETS)
    assert all(v >= 0 for v in gp.buckets.values())
    assert sum(gp.buckets.values()) == pytest.approx(gp.total_s, rel=1e-9)
    assert gp.total_s >= gp.capacity * gp.wall_s - 1e-6
    assert 0 < gp.time_goodput < 1
    assert gp.buckets["productive"] > 0 and gp.buckets["startup"] > 0


def test_goodput_puts_a_kill_in_the_right_buckets() -> None:
    r = kill_run()
    gp = goodput(r.events)
    assert gp.capacity == 3
    b = gp.buckets
    # victim: fault -> exit; survivors: fault -> their abort
    assert b["detection"] == pytest.approx(0.05 + 2 * 0.10, abs=1e-5)
    # w1's slot is empty from its exit (3.85) until w3 is spawned (3.95)
    assert b["replacement_wait"] == pytest.approx(0.10, abs=1e-5)
    # the heal of gen 3 (0.4 s) is spent by all three members
    assert b["healing"] == pytest.approx(3 * 0.4, abs=1e-5)
    # step 5 of gen 1 (3 members, from the step-4 commit to the fault) and the
    # join's quorum abort of step 8 in gen 2 (2 members, 0.02 s) were wasted
    last = max(e["t"] for e in r.events if e["kind"] == "step_commit" and e["step"] == 4) - T
    assert b["wasted"] == pytest.approx(3 * (3.80 - last) + 2 * 0.02, abs=1e-5)
    assert gp.committed_samples == 12 * B
    assert gp.nominal_samples_per_s == pytest.approx(B / 0.5)
    assert gp.throughput_goodput is not None and 0 < gp.throughput_goodput < 1
    text = format_goodput(gp)
    assert all(name in text for name in BUCKETS) and "time goodput" in text


def test_the_ledger_under_ml_goodput_measurements_names(tmp_path: Path) -> None:
    """`elastrain report --json`: our buckets in member-seconds, and the same ledger
    as ml-goodput-measurement's workload metrics (job seconds by BadputType name),
    so a dashboard built for it reads an elastrain run: goodput + badput is the
    whole ledger, the kill's recovery is infrastructure recovery, the lost step is
    wasted progress, and the command writes it all as JSON."""
    import json

    from elastrain.cli import main as cli_main
    from elastrain.observe.report import ML_GOODPUT_BADPUT, ml_goodput_metrics, report_from_events

    r = kill_run()
    rep = report_from_events(r.events)
    gp = rep.goodput
    ml = ml_goodput_metrics(rep)
    # Names of ml-goodput-measurement's BadputType (v0.2.x), and nothing else.
    known = {"TPU_INITIALIZATION", "TRAINING_PREP", "PROGRAM_STARTUP", "DATA_LOADING_SYNC",
             "DATA_LOADING_ASYNC", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
             "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME", "WASTED_PROGRESS_FROM_DISRUPTION",
             "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "CUSTOM_BADPUT_EVENTS", "OTHER"}  # fmt: skip
    assert set(ml["badput_time"]) <= known and set(ML_GOODPUT_BADPUT) == set(BUCKETS)
    total = ml["goodput_time"]["TOTAL"] + sum(ml["badput_time"].values())
    assert total == pytest.approx(gp.total_s / gp.capacity, rel=1e-9)
    b = gp.buckets
    recovery = b["detection"] + b["regroup"] + b["healing"] + b["replacement_wait"]
    assert ml["badput_time"]["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == pytest.approx(
        recovery / 3
    )
    assert ml["badput_time"]["WASTED_PROGRESS_FROM_DISRUPTION"] == pytest.approx(b["wasted"] / 3)
    assert ml["disruption_count"] == 1 and ml["max_productive_step"] == 12
    assert ml["total_elapsed_time"] == pytest.approx(gp.wall_s)
    # The command: the run directory's events in, the JSON out.
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    with open(run / "events" / "all.jsonl", "w") as f:
        for e in r.events:
            f.write(json.dumps(e) + "\n")
    out = tmp_path / "ledger.json"
    assert cli_main(["report", str(run), "-o", str(tmp_path / "r.html"), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["member_seconds"] == pytest.approx(b)
    assert got["ml_goodput"]["badput_time"] == pytest.approx(ml["badput_time"])
    assert got["time_goodput"] == pytest.approx(gp.time_goodput)


def test_a_kill_victims_last_gasp_after_the_injection_is_not_a_rejoin() -> None:
    """The launcher records the kill before sending SIGKILL, so the victim can still
    write an event just after the fault's time (seen on CI: a commit 1 ms later).
    A killed process never writes again: from its last event to its exit it is
    detection, not a regroup as for a hung victim that woke up."""
    r = kill_run()
    r.ev(3.81, "w1", "step_contrib", step=5, gen=1, samples=[1, 2])  # alive at 3.81
    r.events.sort(key=lambda e: e["t"])
    gp = goodput(r.events)
    mine = [g for g in gp.segments if g.member == "w1" and g.end > T + 3.80 and g.start < T + 3.85]
    assert [g.bucket for g in mine] == ["wasted", "detection"], mine
    assert mine[1].start == pytest.approx(T + 3.81) and mine[1].end == pytest.approx(T + 3.85)
    assert sum(gp.buckets.values()) == pytest.approx(gp.total_s, rel=1e-9)


def test_goodput_hang_victim_time_is_detection_then_capacity_missing() -> None:
    r = hang_run()
    gp = goodput(r.events)
    # w2: hang (t0) -> expelled (t0 + 2.05) is detection, as is the survivors' wait
    # for the watchdog (2 x 2.0 s); expelled -> resumed (t0 + 6.01) is capacity missing.
    assert gp.buckets["detection"] == pytest.approx(2.05 + 2 * 2.0, abs=1e-5)
    assert gp.buckets["replacement_wait"] == pytest.approx(6.01 - 2.05, abs=1e-5)


def test_goodput_of_nothing() -> None:
    gp = goodput([])
    assert gp.total_s == 0 and sum(gp.buckets.values()) == 0
    format_goodput(gp)


def _ev(t: float, kind: str, proc: str, **kw: Any) -> dict[str, Any]:
    return {"t": t, "mono": t, "proc": proc, "pid": 1, "kind": kind, **kw}


def _thirds(ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    third = len(ids) // 3
    return ids[:third], ids[third : 2 * third], ids[2 * third :]


def _zombie_commit_run(heal_after: bool) -> list[dict[str, Any]]:
    """c completes step 0's all-reduce in gen 1 but a and b do not (c hung right
    after); a and b re-run step 0 in gen 2 without c; c is continued later and
    rejoins them in gen 3, which runs step 1: healed from a and b, or not."""
    ids = expected_ids(0)
    half = len(ids) // 2
    third = len(ids) // 3
    ev = [
        _ev(1.0, "generation_ready", "coordinator", gen=1, members=["a", "b", "c"], start_step=0),
        _ev(2.0, "step_contrib", "a", step=0, gen=1, samples=ids[:third]),
        _ev(2.0, "step_contrib", "b", step=0, gen=1, samples=ids[third : 2 * third]),
        _ev(2.0, "step_contrib", "c", step=0, gen=1, samples=ids[2 * third :]),
        _ev(2.5, "step_commit", "c", step=0, gen=1, loss=1.0),
        _ev(5.0, "generation_ready", "coordinator", gen=2, members=["a", "b"], start_step=0),
        _ev(6.0, "step_contrib", "a", step=0, gen=2, samples=ids[:half]),
        _ev(6.0, "step_contrib", "b", step=0, gen=2, samples=ids[half:]),
        _ev(6.5, "step_commit", "a", step=0, gen=2, loss=1.0),
        _ev(6.5, "step_commit", "b", step=0, gen=2, loss=1.0),
        _ev(8.0, "generation_ready", "coordinator", gen=3, members=["a", "b", "c"], start_step=1),
    ]
    if heal_after:
        for m in ("a", "b"):
            ev.append(_ev(8.5, "heal_end", m, gen=3, role="send", bytes=1, seconds=0.1))
        ev.append(_ev(8.6, "heal_end", "c", gen=3, role="recv", bytes=1, seconds=0.1))
    ids1 = expected_ids(1)
    for m, part in zip("abc", _thirds(ids1), strict=True):
        ev.append(_ev(9.0, "step_contrib", m, step=1, gen=3, samples=part))
    ev += [_ev(9.5, "step_commit", m, step=1, gen=3, loss=1.0) for m in ("a", "b", "c")]
    return ev


def test_ledger_ignores_a_commit_whose_state_was_healed_away() -> None:
    rep = check_exactly_once(_zombie_commit_run(True), expected_ids)
    assert rep.violations == [] and rep.committed_by_step == {0: 2, 1: 3}
    # Not healed: gen 3 mixes the two states of step 0 (the protocol heals c; the
    # same-state check sees it too where states are hashed).
    bad = check_exactly_once(_zombie_commit_run(False), expected_ids).violations
    assert any(
        "gen 3: its members started from step 0 as committed in different generations: "
        "gen 1 at c; gen 2 at a, b" in v
        for v in bad
    ), bad


def test_ledger_ignores_a_late_zombie_commit_that_nothing_used() -> None:
    """c hung inside step 0's all-reduce in gen 1; a and b gave up and re-ran step 0
    in gen 2 without it; c was continued after gen 2 formed, its parked all-reduce
    completed and it committed step 0 in gen 1 (and saved its shard of a checkpoint
    nobody committed: CI's torch soak), then the job ended before it rejoined. The
    job's state is gen 2's: one commit of the step. Had c's state become the
    job's (it sent it in a heal), step 0 would be gen 1's, which also consumed
    every sample once: a complete all-reduce is a complete step."""
    ids = expected_ids(0)
    half, third = len(ids) // 2, len(ids) // 3
    ev = [
        _ev(1.0, "generation_ready", "coordinator", gen=1, members=["a", "b", "c"]),
        _ev(2.0, "step_contrib", "a", step=0, gen=1, samples=ids[:third]),
        _ev(2.0, "step_contrib", "b", step=0, gen=1, samples=ids[third : 2 * third]),
        _ev(2.0, "step_contrib", "c", step=0, gen=1, samples=ids[2 * third :]),
        _ev(5.0, "generation_ready", "coordinator", gen=2, members=["a", "b"]),
        _ev(6.0, "step_contrib", "a", step=0, gen=2, samples=ids[:half]),
        _ev(6.0, "step_contrib", "b", step=0, gen=2, samples=ids[half:]),
        _ev(6.5, "step_commit", "a", step=0, gen=2, loss=1.0),
        _ev(6.5, "step_commit", "b", step=0, gen=2, loss=1.0),
        _ev(9.0, "step_commit", "c", step=0, gen=1, loss=1.0),
        _ev(9.1, "checkpoint_saved", "c", step=1, generation=1, shard=2, num_shards=3),
    ]
    rep = check_exactly_once(ev, expected_ids)
    assert rep.violations == [] and rep.committed_by_step[0] == 2
    ids1 = expected_ids(1)
    used = [
        *ev,
        _ev(9.5, "generation_ready", "coordinator", gen=3, members=["c", "a", "b"], start_step=1),
        _ev(9.6, "heal_end", "c", gen=3, role="send", bytes=1, seconds=0.1),
        *(_ev(9.6, "heal_end", m, gen=3, role="recv", bytes=1, seconds=0.1) for m in "ab"),
        *(
            _ev(9.8, "step_contrib", m, step=1, gen=3, samples=part)
            for m, part in zip("cab", _thirds(ids1), strict=True)
        ),
        *(_ev(9.9, "step_commit", m, step=1, gen=3, loss=1.0) for m in "cab"),
    ]
    rep = check_exactly_once(used, expected_ids)
    assert rep.violations == [] and rep.committed_by_step == {0: 1, 1: 3}


def test_ledger_follows_the_newest_state_back_after_a_generation_ran_from_an_older_one() -> None:
    """The soak with overlapping hangs: gen 2 = {w1} alone commits steps 2..5; w1 is
    stopped past its lease; w0 comes back holding step 2's state (its zombie commit
    of step 1 in gen 1) and gen 3 = {w0, w2} runs steps 2..3 from it; then w1 is
    continued and gen 4 starts from its step 6, healing w0 and w2. The job's
    lineage is gen 1 (0..1), gen 2 (2..5), gen 4 (6..): gen 3's steps and w0's
    zombie commit are thrown away, not a second commit, and nothing is a gap."""
    r = Run()
    g1 = ["w0", "w1", "w2"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 1)
    r.form(t, 2, ["w1"], "failure")
    r.ready(t + 0.01, 2, ["w1"])
    t = r.build(t + 0.02, 2, ["w1"])
    t = r.steps(t, 2, ["w1"], 1, 5)  # w1 alone: steps 1..5
    # w0's zombie commit of step 1 in gen 1 (w2 never finished it).
    r.ev(t, "w0", "step_commit", step=1, gen=1, loss=0.5)
    r.committed["w0"] = 2
    g3 = ["w2", "w0"]
    r.form(t + 0.1, 3, g3, "failure")
    r.ready(t + 0.11, 3, g3)
    t = r.build(t + 0.12, 3, g3, heal_s=0.1)  # w0 sends, w2 receives
    t = r.steps(t, 3, g3, 2, 2)  # steps 2..3, from w0's state
    g4 = ["w2", "w0", "w1"]
    r.form(t + 0.1, 4, g4, "join")
    r.ready(t + 0.11, 4, g4)  # w1 holds 6: it sends
    t = r.build(t + 0.12, 4, g4, heal_s=0.1)
    r.steps(t, 4, g4, 6, 2)
    rep = check_exactly_once(r.events, expected_ids)
    assert rep.violations == [], rep.violations
    assert rep.committed_by_step == {0: 1, 1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 4, 7: 4}
    assert rep.rolled_back == 3  # steps 1 (the zombie's), 2 and 3 (gen 3's)


def test_goodput_checkpoint_blocking_and_data_wait_have_their_buckets() -> None:
    """A checkpoint at committed count 3 blocks each member 0.1 s before step 3
    runs; every committed step spent 0.05 s in the dataset and collate."""
    r = Run()
    g1 = ["w0", "w1"]
    t = r.start(g1)
    t = r.steps(t, 1, g1, 0, 6)
    for e in r.events:
        if e["kind"] == "step_commit":
            e["data_s"] = 0.05
    for m in g1:
        r.ev(t, m, "checkpoint_saved", step=3, shard=g1.index(m), num_shards=2, generation=1,
             path="x", bytes=10, seconds=0.3, blocking_s=0.1)  # fmt: skip
    r.ev(t + 0.1, "launcher", "job_end", status="done", steps=6)
    plain = goodput([e for e in r.events if e["kind"] != "checkpoint_saved"])
    gp = goodput(r.events)
    assert gp.buckets["checkpoint"] == pytest.approx(2 * 0.1, abs=1e-6)
    assert gp.buckets["data_wait"] == pytest.approx(2 * 6 * 0.05, abs=1e-6)
    assert gp.buckets["productive"] == pytest.approx(
        plain.buckets["productive"] - 2 * 0.1, abs=1e-6
    )
    assert sum(gp.buckets.values()) == pytest.approx(gp.total_s, rel=1e-9)
    # the segments cover the same member-seconds as the buckets, bucket by bucket
    for b in BUCKETS:
        seg = sum(g.member_s for g in gp.segments if g.bucket == b)
        assert seg == pytest.approx(gp.buckets[b], abs=1e-6), b
    # the blocking sits at the start of step 3 of each member
    ck = [g for g in gp.segments if g.bucket == "checkpoint"]
    c2 = next(e["t"] for e in r.events if e["kind"] == "step_commit" and e["step"] == 2)
    assert len(ck) == 2 and all(g.start == pytest.approx(c2, abs=0.01) for g in ck)


@pytest.mark.parametrize("make", [kill_run, hang_run, term_run, close_faults_run])
def test_goodput_segments_match_the_buckets(make: Any) -> None:
    gp = goodput(make().events)
    for b in BUCKETS:
        seg = sum(g.member_s for g in gp.segments if g.bucket == b)
        assert seg == pytest.approx(gp.buckets[b], abs=1e-6), b


# ---- live view ---------------------------------------------------------------------------


def test_event_tail_returns_new_complete_lines_only(tmp_path: Any) -> None:
    import json

    from elastrain.observe.events import EventTail

    d = tmp_path / "events"
    d.mkdir()
    tail = EventTail(tmp_path)
    (d / "w0-1.jsonl").write_text(json.dumps({"t": 1.0, "kind": "a"}) + "\n" + '{"t": 2.0, "ki')
    assert [e["kind"] for e in tail.poll()] == ["a"]
    with open(d / "w0-1.jsonl", "a") as f:
        f.write('nd": "b"}\n')
    (d / "w1-2.jsonl").write_text(json.dumps({"t": 3.0, "kind": "c"}) + "\n")
    assert sorted(e["kind"] for e in tail.poll()) == ["b", "c"]
    assert tail.poll() == []


def test_live_view_shows_goodput_eta_and_the_last_failure(tmp_path: Any) -> None:
    import json
    import time

    from elastrain.launch.progress import Progress, observe

    r = kill_run()
    o = observe(r.events)
    assert o.failures == 1 and o.last_failure == "kill w1 at 3.8 s"
    rec = recoveries(r.events)[0]
    assert o.last_recovery_s == pytest.approx(rec.total_s)
    assert o.time_goodput == pytest.approx(goodput(r.events).time_goodput)
    prog = Progress(100, plain=True)
    line = prog.line({"step": 40, "steps_per_s": 2.0, "target": 3, "members": ["a", "b"],
                      "samples_per_s": 64.0, "loss": 0.5})  # fmt: skip
    assert "members 2/3" in line and "eta 30s" in line and "loss 0.5000" in line
    assert prog.health() == ""
    # attached to a run directory, the background thread picks the events up
    d = tmp_path / "events"
    d.mkdir()
    (d / "all-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in r.events))
    with Progress(12, plain=True) as live:
        live.attach(tmp_path)
        deadline = time.monotonic() + 30
        while live.observed.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the thread's result, bounded by the deadline
        h = live.health()
    assert "goodput so far" in h and "last: kill w1 at 3.8 s" in h and "recovered in" in h


def test_events_echo_to_stdout_in_cluster_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from elastrain.observe.events import EventLog as Log

    monkeypatch.setenv("ELASTRAIN_EVENTS_STDOUT", "1")
    log = Log(tmp_path, "w0")
    log.emit(EventKind.WORKER_START, member="w0")
    log.close()
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["kind"] == "worker_start"
    assert (tmp_path / "events").is_dir() and list((tmp_path / "events").iterdir())
    monkeypatch.delenv("ELASTRAIN_EVENTS_STDOUT")
    Log(None, "w1").emit(EventKind.WORKER_START, member="w1")
    assert capsys.readouterr().out == ""
