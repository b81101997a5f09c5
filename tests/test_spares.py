"""Hot spares (`elastrain run --spares K`): promotion, refill, a spare that dies
while it waits, and spares left alone when every member dies.

One job, driven from the launcher's status callback: each stage waits for the
state it needs (a standby registered, a checkpoint loaded), then kills through
the launcher's injector, so the kills are recorded as injected faults."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastrain.chaos.schedule import parse_fault
from elastrain.checkpoint.files import committed_steps
from elastrain.launch.launcher import Launcher
from elastrain.observe.failures import recognise_failures
from elastrain.observe.goodput import goodput
from elastrain.observe.ledger import check_same_state, loss_curve
from elastrain.observe.recovery import recoveries

from .conftest import Job

STEPS, EVERY = 1000, 20


def loaded_steps(run_dir: Path, member: str) -> list[int]:
    """The steps of `member`'s checkpoint_loaded events so far (its own event files)."""
    out = []
    for f in sorted((run_dir / "events").glob(f"{member}-*.jsonl")):
        for line in f.read_text().splitlines():
            if '"checkpoint_loaded"' in line:
                out.append(int(json.loads(line)["step"]))
    return out


class Driver:
    """The stages, one per call of `on_status` that finds what the next one needs."""

    def __init__(self, pace: Path) -> None:
        self.pace = pace
        self.stage = 0
        self.kills: list[dict[str, Any]] = []
        self.spares: list[str] = []

    def kill(self, la: Launcher, st: dict[str, Any], victims: list[str]) -> None:
        step = int(st.get("step", 0))
        for v in victims:
            la.injector.fire(parse_fault(f"kill@0:{v}"), v, la.workers, la.coordinator, step)
        self.kills.append({"victims": victims, "step": step, "members": list(st["members"])})

    def __call__(self, la: Launcher, st: dict[str, Any]) -> None:
        members, standby = list(st.get("members", [])), list(st.get("standby", []))
        ready = bool(st.get("ready")) and len(members) == 2 and standby
        if not ready or self.stage > 3:
            return
        spare = standby[0]
        if self.stage == 0:
            # Promotion: an initial spare, refreshed from a checkpoint while it waited.
            if int(st.get("step", 0)) < EVERY or not loaded_steps(la.run_dir, spare):
                return
            self.spares.append(spare)
            self.kill(la, st, [members[0]])
        elif self.stage == 1:
            # The refill of the first kill is the standby now; it is promoted in turn.
            if self.spares[0] not in members:
                return
            self.spares.append(spare)
            self.kill(la, st, [m for m in members if m != self.spares[0]])
        elif self.stage == 2:
            # A standby dies while it waits: no regroup, and it is refilled.
            if self.spares[1] not in members:
                return
            self.spares.append(spare)
            self.kill(la, st, [spare])
        else:
            # Every member dies at once: the standby goes on alone from the newest
            # checkpoint it took while waiting (a newer one than it started from).
            got = loaded_steps(la.run_dir, spare)
            if (
                spare == self.spares[2]
                or len(got) < 2
                or got[-1] < committed_steps(la.checkpoint_dir)[-1]
            ):
                return
            self.spares.append(spare)
            self.kill(la, st, members)
            self.pace.write_text("0")
        self.stage += 1


def _formed_after(job: Job, t: float, dead: str) -> dict[str, Any]:
    """The first generation formed after time `t` without `dead` (a survivor's
    failure report can form one that still names it before its exit is heard of)."""
    return next(e for e in job.of("generation_formed") if e["t"] > t and dead not in e["members"])


def test_spares_are_promoted_refilled_replaced_and_go_on_alone(
    run_job: Callable[..., Job], tmp_path: Path
) -> None:
    pace = tmp_path / "pace"
    pace.write_text("0.2")  # the budget for the stages; 0 once they are done
    drive = Driver(pace)
    job = run_job(
        steps=STEPS,
        workers=2,
        min_workers=1,
        spares=1,
        checkpoint_every=EVERY,
        script_args=["--pace-file", str(pace)],
        on_status=drive,
    )
    assert job.result.status == "done", job.result.message
    assert drive.stage == 4, f"the job ended in stage {drive.stage}"
    assert check_same_state(job.events) == []
    kills = [e for e in job.of("fault_injected") if e.get("fault") == "kill"]
    assert [k["member"] for k in kills] == [v for k in drive.kills for v in k["victims"]]
    t = [k["t"] for k in kills]
    s0, s1, s2, s3 = drive.spares
    registered = {e["member"]: e["t"] for e in job.of("member_registered")}
    spawned = {e["member"]: e for e in job.of("worker_spawned")}

    # 1. The kill's generation is formed at once with the spare, before the dead
    # member's replacement has even registered; the survivor heals the spare.
    g = _formed_after(job, t[0], kills[0]["member"])
    assert sorted(g["members"]) == sorted(
        [*(set(drive.kills[0]["members"]) - {kills[0]["member"]}), s0]
    )
    refill = next(m for m, e in spawned.items() if e.get("replaces") == kills[0]["member"])
    assert refill == s1 and registered[s1] > g["t"]
    # The refill started only once the spare's generation had committed the step
    # the kill interrupted (its start would take CPU from that recovery).
    first = min(e["t"] for e in job.of("step_commit", gen=g["gen"]))
    assert spawned[s1]["t"] > first
    assert job.of("heal_end", proc=s0, role="recv")
    assert loaded_steps(job.run_dir, s0)[0] >= EVERY  # refreshed while it waited

    # 2. The refill became the standby and is promoted by the next kill.
    g = _formed_after(job, t[1], kills[1]["member"])
    assert s1 in g["members"] and len(g["members"]) == 2
    assert job.of("heal_end", proc=s1, role="recv")

    # The report names the promoted spare of each kill (and the refill as the
    # replacement the launcher spawned); the standby's death has nothing to recover.
    recs = {r.member: r for r in recoveries(job.events)}
    assert recs[kills[0]["member"]].promoted == (s0,)
    assert recs[kills[0]["member"]].replacement == s1
    assert recs[kills[1]["member"]].promoted == (s1,)
    assert recs[s2].gen is None

    # The goodput ledger puts a spare's wait in its own bucket (reserved capacity),
    # not in a failure's badput.
    gp = goodput(job.events)
    mid = (registered[s0] + t[0]) / 2
    (seg,) = [g for g in gp.segments if g.member == s0 and g.start <= mid < g.end]
    assert seg.bucket == "standby" and gp.buckets["standby"] > 0

    # 3. A standby that dies is replaced; the members do not regroup.
    assert kills[2]["member"] == s2
    assert not [e for e in job.of("generation_formed") if t[2] < e["t"] < t[3]]
    assert any(e.get("replaces") == s2 for e in spawned.values())

    # 4. Every member died: the last standby went on alone from the newest checkpoint
    # it had loaded while waiting (more than the one it started with), and the steps
    # it redid give the same losses as the first time.
    assert len(t) == 5 and {kills[3]["member"], kills[4]["member"]} == set(
        drive.kills[3]["members"]
    )
    # (The coordinator may first form one with the member whose death it heard of
    # second; that member never connects, and the standby's state is untouched.)
    assert any(e["members"] == [s3] for e in job.of("generation_formed") if e["t"] > max(t[3:]))
    got = loaded_steps(job.run_dir, s3)
    start = next(e["step"] for e in job.of("generation_start", proc=s3))
    assert len(got) >= 2 and start == got[-1] > got[0]
    curve = loss_curve(job.events)
    assert sorted(curve) == list(range(STEPS))
    firsts = {}
    for e in job.of("step_commit"):
        if e["step"] in firsts and e["gen"] != firsts[e["step"]]["gen"]:
            assert e["loss"] == firsts[e["step"]]["loss"], e["step"]
        firsts.setdefault(e["step"], e)


def test_a_straggler_is_evicted_to_a_spare_and_it_is_no_failure(
    run_job: Callable[..., Job],
) -> None:
    # A seeded-random member of the generation computes 0.1 s more per step from step
    # 10 on, to the end; with --evict-stragglers the launcher sends it SIGTERM once a
    # whole window of its steps says so (a spare waits), and the spare takes its place
    # at that step boundary. Paced, so that the slowed steps outlast the spare's
    # start-up even on a loaded machine (the eviction waits for a spare).
    job = run_job(
        steps=300,
        workers=2,
        min_workers=2,
        spares=1,
        evict_stragglers=True,
        # The slowed member computes ~10-20x its peers' time; 5x keeps a loaded
        # machine's noise (one process starved of CPU for a while) from counting.
        evict_threshold=5.0,
        faults=["slow@10/0.1x100000"],
        script_args=["--min-step-s", "0.03"],
    )
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    (slowed,) = [e["member"] for e in job.of("fault_injected") if e.get("fault") == "slow"]
    (ev,) = job.of("straggler_evicted")
    assert ev["member"] == slowed and ev["score"] >= 1.5 and ev["steps"] >= 10
    left = job.of("worker_exit", proc=slowed)
    assert [e["reason"] for e in left] == ["left"]
    # The generation after the eviction has the same size, with the spare in the
    # straggler's place, and nothing counts as a failure.
    formed = job.of("generation_formed")
    before = next(e for e in reversed(formed) if e["t"] < ev["t"])
    g = next(e for e in formed if e["t"] > ev["t"])
    (spare,) = set(g["members"]) - set(before["members"])
    registered = {e["member"]: e["t"] for e in job.of("member_registered")}
    assert len(g["members"]) == 2 and slowed not in g["members"]
    assert registered[spare] < ev["t"]  # it was waiting, not spawned for this
    assert recognise_failures(job.events) == []
