"""The coordinator's membership decisions, driven directly with a fake clock."""

from __future__ import annotations

import pytest

from elastrain.control.config import CoordinatorConfig
from elastrain.control.quorum import Form, Membership, MembershipView, Wait, plan_generation


def cfg(**kw: object) -> CoordinatorConfig:
    base: dict[str, object] = {"target": 3, "min_members": 2, "start_grace_s": 10.0}
    base.update(kw)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]


def started(m: Membership, ids: list[str], now: float = 0.0) -> None:
    """Register members and make the first generation ready at step 0."""
    for i, mid in enumerate(ids):
        m.register(mid, pid=100 + i, host="h", now=now)
    for mid in ids:
        m.rendezvous(mid, 1, 0, 0, now)
    assert m.gen is not None and m.gen.is_ready


def view(**kw: object) -> MembershipView:
    base: dict[str, object] = dict(
        alive=("a", "b", "c"),
        current=("a", "b", "c"),
        current_broken=False,
        failure_reported=False,
        last_seen={"a": 0.0, "b": 0.0, "c": 0.0},
        first_registration=0.0,
        step_boundary=False,
    )
    base.update(kw)
    return MembershipView(**base)  # type: ignore[arg-type]


def test_start_waits_for_target_then_grace() -> None:
    c = cfg()
    v = view(alive=("a", "b"), current=None)
    assert isinstance(plan_generation(v, 1.0, c), Wait)
    assert plan_generation(v, 10.0, c) == Form(("a", "b"), "start")
    assert plan_generation(view(current=None), 0.0, c) == Form(("a", "b", "c"), "start")


def test_start_below_min_keeps_waiting_after_grace() -> None:
    p = plan_generation(view(alive=("a",), current=None), 100.0, cfg())
    assert isinstance(p, Wait) and "1/3" in p.message


def test_stable_generation_is_kept() -> None:
    assert plan_generation(view(), 5.0, cfg()) is None
    assert plan_generation(view(step_boundary=True), 5.0, cfg()) is None


def test_death_reforms_at_once_without_the_dead() -> None:
    p = plan_generation(view(alive=("a", "c"), current_broken=True), 5.0, cfg())
    assert p == Form(("a", "c"), "failure")


def test_failure_report_leaves_out_silent_members() -> None:
    seen = {"a": 5.0, "b": 2.0, "c": 4.9}  # b silent for 3 s: hung
    p = plan_generation(view(failure_reported=True, last_seen=seen), 5.0, cfg(suspect_s=1.0))
    assert p == Form(("a", "c"), "failure")


def test_below_min_waits_with_a_message() -> None:
    p = plan_generation(view(alive=("a",), current_broken=True), 5.0, cfg())
    assert isinstance(p, Wait) and "--min" in p.message


def test_joiners_enter_only_at_a_step_boundary_and_up_to_max() -> None:
    v = view(alive=("a", "b", "c", "d", "e"), current=("a", "b"))
    assert plan_generation(v, 5.0, cfg()) is None
    p = plan_generation(MembershipView(**{**v.__dict__, "step_boundary": True}), 5.0, cfg())
    assert p == Form(("a", "b", "c"), "join")  # max_members defaults to target=3


def test_config_rejects_bad_combinations() -> None:
    with pytest.raises(ValueError, match="min_members"):
        CoordinatorConfig(target=2, min_members=3)
    with pytest.raises(ValueError, match="suspect_s"):
        CoordinatorConfig(target=2, suspect_s=0.1, heartbeat_s=0.25)
    with pytest.raises(ValueError, match="target"):
        CoordinatorConfig(target=0)
    with pytest.raises(ValueError, match="hang_silence_s"):
        CoordinatorConfig(target=2, hang_silence_s=0.3, heartbeat_s=0.25)


def test_first_quorum_request_decides_the_step_for_everyone() -> None:
    m = Membership(cfg(max_members=4))
    started(m, ["a", "b", "c"])
    g = m.gen.gen  # type: ignore[union-attr]
    assert m.quorum("a", 1, g, 0, False, 1.0) == ("proceed", g)
    m.register("d", pid=9, host="h", now=1.1)  # a joiner arrives mid-step
    # Step 0 was decided: everyone runs it in g, nobody's step is aborted.
    assert m.quorum("b", 1, g, 0, False, 1.2) == ("proceed", g)
    assert m.quorum("c", 1, g, 0, False, 1.2) == ("proceed", g)
    # Step 1 is the boundary: regroup into g+1, for every asker.
    v1 = m.quorum("a", 1, g, 1, False, 1.3)
    assert v1 == ("regroup", g + 1)
    assert m.quorum("c", 1, g, 1, False, 1.3) == ("regroup", g + 1)
    assert m.gen is not None and m.gen.members == ("a", "b", "c", "d") and m.gen.reason == "join"
    assert not m.gen_interrupted(g)  # members still finishing step 0 in g are not aborted


def test_join_to_max_then_standby() -> None:
    m = Membership(cfg(target=2, min_members=1))
    started(m, ["a", "b"])
    g = m.gen.gen  # type: ignore[union-attr]
    m.register("c", pid=3, host="h", now=1.0)
    assert m.quorum("a", 1, g, 0, False, 1.1) == ("proceed", g)  # full: c waits as a standby
    m.exited("b", pid=101, now=2.0)
    assert m.gen is not None and m.gen.members == ("a", "c") and m.gen.reason == "failure"


def test_graceful_leave_at_the_next_boundary_without_breaking_the_step() -> None:
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    g = m.gen.gen  # type: ignore[union-attr]
    assert m.quorum("a", 1, g, 0, False, 1.0)[0] == "proceed"
    assert m.leave("b", 1, "left", 1.1)
    assert not m.gen_interrupted(g)  # nobody's collective is interrupted
    assert m.quorum("b", 1, g, 0, True, 1.1) == ("proceed", g)
    assert m.quorum("a", 1, g, 1, False, 1.2) == ("regroup", g + 1)
    assert m.gen is not None and m.gen.members == ("a", "c") and m.gen.reason == "leave"
    assert not m.gen_interrupted(g)  # a clean hand-off at a step boundary
    assert "b" not in m.members


def test_rendezvous_barrier_and_heal_start_step() -> None:
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    g = m.gen.gen  # type: ignore[union-attr]
    m.exited("c", pid=102, now=2.0)
    assert m.gen_interrupted(g)
    assert m.rendezvous("a", 1, g, 6, 2.1) == "pending"
    assert m.rendezvous("b", 1, g, 5, 2.1) == "ready"  # b's last all-reduce failed: behind
    assert m.gen is not None and m.gen.start_step == 6 and m.gen.ready == {"a": 6, "b": 5}


def test_hung_member_expelled_by_lease_and_not_ready_timeout() -> None:
    m = Membership(cfg(lease_s=3.0, ready_timeout_s=2.0))
    started(m, ["a", "b", "c"])
    for t in (1.0, 2.0, 3.0):
        m.touch("a", 1, t)
        m.touch("b", 1, t)
    m.expire(3.5)
    assert "c" not in m.members and m.gen is not None and m.gen.members == ("a", "b")
    m.rendezvous("a", 1, 1, 3, 3.6)
    m.expire(6.0)  # b never came to the new generation
    assert "b" not in m.members
    assert m.gen.broken or m.waiting  # below min=2: waiting


def test_expelled_member_reregisters_with_new_incarnation() -> None:
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    m.remove("c", "suspected", 1.0)
    assert m.rendezvous("c", 1, 1, 0, 1.1) == "expelled"
    assert m.register("c", pid=102, host="h", now=1.2) == 2
    assert m.quorum("c", 1, m.gen.gen, 0, False, 1.3)[0] == "expelled"  # type: ignore[union-attr]


def test_done_finishes_the_job_without_reforming() -> None:
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    g = m.gen
    m.leave("a", 1, "done", 5.0)
    assert m.finished and m.gen is g
    assert m.rendezvous("b", 1, 1, 10, 5.1) == "finished"


# ---- coordinator restarts: a fresh Membership learns the job from its workers ----


def restarted(gen_members: tuple[str, ...] = ("a", "b", "c"), gen: int = 7) -> Membership:
    """A restarted coordinator to which `a` has registered again, reporting `gen`."""
    m = Membership(cfg(lease_s=3.0))
    m.register("a", pid=100, host="h", now=10.0, gen=gen, gen_members=gen_members, committed=40)
    return m


def test_restart_adopts_the_running_generation_and_steps_go_on() -> None:
    m = restarted()
    assert m.quorum("b", 1, 7, 40, False, 10.1)[0] == "unknown"  # b must register first
    assert m.gen is not None and m.gen.gen == 7 and m.gen.reason == "adopted"
    assert m.gen.is_ready and m.gen.awaiting == {"b", "c"} and not m.gen.broken
    assert m.quorum("a", 1, 7, 40, False, 10.1) == ("proceed", 7)
    for mid, pid in (("b", 101), ("c", 102)):
        m.register(mid, pid=pid, host="h", now=10.2, gen=7, gen_members=("a", "b", "c"))
    assert m.gen.gen == 7 and not m.gen.awaiting
    m.expire(20.0 - 7)  # past the adopted generation's grace, everyone is back
    assert m.gen.gen == 7 and not m.gen.broken
    assert m.quorum("c", 1, 7, 41, False, 13.1) == ("proceed", 7)
    assert m.gen_interrupted(7) is False


def test_restart_fresh_replacements_wait_for_the_survivors_to_report() -> None:
    # The launcher restarted the coordinator (generations up to 7 ran). A fresh
    # replacement registers before the survivors do: it must not form a
    # generation of its own (a second lineage from an older checkpoint).
    m = Membership(cfg(lease_s=3.0, target=3, min_members=1))
    m.restarted(7, now=10.0)
    m.register("r", pid=200, host="h", now=10.01)
    assert m.gen is None and m.waiting is not None and "restarted" in m.waiting
    m.register("a", pid=100, host="h", now=10.02, gen=7, gen_members=("a", "b", "r0"), committed=40)
    assert m.gen is not None and m.gen.gen == 7 and m.gen.reason == "adopted"
    # Nobody reports a generation: after one lease the fresh ones start, numbered after 7.
    m2 = Membership(cfg(lease_s=3.0, target=3, min_members=1))
    m2.restarted(7, now=10.0)
    m2.register("r", pid=200, host="h", now=10.01)
    m2.expire(12.9)
    assert m2.gen is None
    m2.touch("r", 1, 13.0)
    m2.expire(13.1)
    assert m2.gen is not None and m2.gen.gen == 8 and m2.gen.members == ("r",)
    # Target reached by fresh workers (every worker was replaced): no wait.
    m3 = Membership(cfg(lease_s=3.0, target=2, min_members=1))
    m3.restarted(7, now=10.0)
    m3.register("r", pid=200, host="h", now=10.01)
    m3.register("s", pid=201, host="h", now=10.02)
    assert m3.gen is not None and m3.gen.gen == 8 and m3.gen.members == ("r", "s")


def test_restart_a_member_that_never_comes_back_breaks_the_adopted_generation() -> None:
    m = restarted()
    m.register("b", pid=101, host="h", now=10.5, gen=7, gen_members=("a", "b", "c"))
    for t in (11.0, 12.0, 13.0):
        m.touch("a", 1, t)
        m.touch("b", 1, t)
    m.expire(13.5)  # c's grace (lease_s=3) is over
    assert [r.member for r in m.drain_removals()] == ["c"]
    assert m.gen is not None and m.gen.gen == 8 and m.gen.members == ("a", "b")
    assert m.gen_interrupted(7)


def test_restart_exit_reported_for_an_awaited_member_breaks_at_once() -> None:
    m = restarted()
    m.register("b", pid=101, host="h", now=10.1, gen=7, gen_members=("a", "b", "c"))
    assert m.exited("c", pid=102, now=10.2)
    assert m.gen is not None and m.gen.gen == 8 and m.gen.members == ("a", "b")


def test_restart_numbers_generations_after_the_highest_reported() -> None:
    m = Membership(cfg(lease_s=3.0))
    # Nobody runs a generation (all were regrouping when the coordinator died).
    m.register("a", pid=100, host="h", now=10.0, gen=9)
    m.register("b", pid=101, host="h", now=10.0, gen=9)
    assert m.gen is not None and m.gen.gen == 10 and m.gen.members == ("a", "b")
    assert m.rendezvous("a", 1, 9, 40, 10.1) == "pending"
    assert m.rendezvous("b", 1, 9, 40, 10.1) == "ready"


def test_restart_incarnations_keep_growing() -> None:
    m = Membership(cfg())
    assert m.register("a", pid=100, host="h", now=0.0, prev_incarnation=4) == 5


def test_unknown_versus_expelled() -> None:
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    assert m.rendezvous("z", 1, 0, 0, 1.0) == "unknown"
    m.remove("c", "suspected", 1.0)
    assert m.rendezvous("c", 1, 1, 0, 1.1) == "expelled"


def test_heal_senders_prefer_the_newest_lineage_at_the_start_step() -> None:
    from elastrain.control.protocol import RendezvousResponse
    from elastrain.runtime.member import heal_roles

    # c completed step 9 in gen 4 after a and b had abandoned it and re-run it in gen 5.
    r = RendezvousResponse(
        "ready",
        6,
        ["a", "b", "c", "d"],
        {"a": 10, "b": 10, "c": 10, "d": 0},
        10,
        commit_gens={"a": 5, "b": 5, "c": 4, "d": 0},
    )
    assert heal_roles(tuple(r.members), r.committed, r.commit_gens, r.start_step) == (
        (0, 1),
        (2, 3),
        5,
    )
    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    m.exited("c", pid=102, now=1.0)
    m.rendezvous("a", 1, 1, 7, 1.2, commit_gen=1)
    m.rendezvous("b", 1, 1, 6, 1.2)
    assert m.gen is not None and m.gen.is_ready and m.gen.commit_gens == {"a": 1, "b": 0}


def test_a_kept_step_rolls_forward_only_on_a_commit_of_it_in_its_generation() -> None:
    """A sharded member that reduced step 9 in generation 4 and lost the vote's answer
    reports pending generation 4 at 9: it applies the step when a member of the new
    generation committed it there (at 10 with commit_gen 4), not on a commit of the
    same count from another generation, and not with nobody ahead of it."""
    from elastrain.control.plan import roll_forwards
    from elastrain.runtime.member import heal_roles

    members = ("a", "b", "c", "d")
    assert roll_forwards(members, dict(a=9, b=9, c=10, d=0), dict(c=4), dict(a=4, b=4)) == (
        "a",
        "b",
    )
    # c's 10 came from generation 5 (a re-run without a and b): not their step.
    assert roll_forwards(members, dict(a=9, b=9, c=10, d=0), dict(c=5), dict(a=4, b=4)) == ()
    # Nobody ahead: step 9 is run again.
    assert roll_forwards(members, dict(a=9, b=9, c=9), dict(a=3, b=3, c=3), dict(a=4)) == ()
    # The evidence must be in the generation: a member at 10 of gen 4 that is gone
    # (not in `members`) proves nothing the others can heal from.
    assert roll_forwards(("a", "b"), dict(a=9, b=9, c=10), dict(c=4), dict(a=4)) == ()

    m = Membership(cfg())
    started(m, ["a", "b", "c"])
    m.exited("b", pid=101, now=1.0)
    m.rendezvous("a", 1, 1, 9, 1.2, commit_gen=1, pending_gen=1)
    m.rendezvous("c", 1, 1, 10, 1.2, commit_gen=1)
    g = m.gen
    assert g is not None and g.is_ready and g.rolls_forward == ("a",)
    committed, gens = g.answer_counts()
    assert committed == {"a": 10, "c": 10} and gens == {"a": 1, "c": 1}
    assert g.ready == {"a": 9, "c": 10}  # what was reported stays as reported
    assert heal_roles(g.members, committed, gens, g.start_step) == ((0, 1), (), 1)


def test_a_silent_member_does_not_hold_up_an_unready_generation_until_its_lease() -> None:
    # A node died: its members were heard from just before the failure generation
    # formed (so they are in it), then never again.
    m = Membership(cfg(target=4, lease_s=5.0, suspect_s=1.0))
    started(m, ["a", "b", "c", "d"])
    for t in (0.5, 1.0):
        for mid in "abcd":
            m.touch(mid, 1, t)
    m.rendezvous("a", 1, 1, 10, 1.2)  # a's all-reduce failed: re-formed with everyone
    assert m.gen is not None and m.gen.gen == 2 and set(m.gen.members) == set("abcd")
    m.rendezvous("b", 1, 1, 10, 1.3)
    for t in (1.5, 2.0, 2.3):
        m.touch("a", 1, t)
        m.touch("b", 1, t)
        m.expire(t)
    assert m.gen.gen == 3 and m.gen.members == ("a", "b")  # c, d suspected at 2.3 s, not 6 s


def test_an_overdue_collective_expels_only_peers_that_stopped_heartbeating() -> None:
    """`confirm_hang`: a member whose all-reduce is overdue asks; peers silent for
    longer than `hang_silence_s` are hung (expelled, generation re-formed without
    them at once), live ones are not, however slow their step."""
    m = Membership(cfg(hang_silence_s=0.5))
    started(m, ["a", "b", "c"])
    g = m.gen.gen  # type: ignore[union-attr]
    for mid in ("a", "b", "c"):
        m.touch(mid, 1, 1.0)
    # 0.4 s of silence: a slow step, not a hang. Nothing changes.
    assert m.confirm_hang("a", 1, g, 1.4) == ("alive", ())
    assert m.gen is not None and m.gen.gen == g and not m.gen.broken
    m.touch("b", 1, 1.45)
    # c has now been silent 0.6 s, b 0.15 s: c alone is hung.
    assert m.confirm_hang("a", 1, g, 1.6) == ("confirmed", ("c",))
    assert "c" not in m.members and m.drain_removals()[-1].reason == "suspected"
    assert m.gen is not None and m.gen.gen == g + 1 and m.gen.members == ("a", "b")
    assert m.gen_interrupted(g)
    # b asks about the old generation a moment later: it learns it from its heartbeat.
    assert m.confirm_hang("b", 1, g, 1.65) == ("stale", ())
    # An expelled member's question changes nothing.
    assert m.confirm_hang("c", 1, g + 1, 1.7) == ("stale", ())
    assert m.gen.gen == g + 1
