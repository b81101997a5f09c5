"""Sharded replica groups (issue 16): which member holds which slot.

The pure rules (`elastrain.control.layout`), a property test over random deaths
and joins, then the coordinator handing the layout out: in its ready answers,
across a death and a replacement, and to a generation it adopts after a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.layout import Layout, Slot, assign_slots
from elastrain.control.quorum import Membership
from elastrain.control.server import CoordinatorServer
from elastrain.control.server import main as coordinator_main
from elastrain.observe.events import read_events

S0, S1 = Slot(0, 0), Slot(0, 1)
T0, T1 = Slot(1, 0), Slot(1, 1)


# ---------------------------------------------------------------- the rules


def test_a_first_generation_fills_replica_groups_in_rank_order() -> None:
    slots = assign_slots({}, ["a", "b", "c", "d", "e", "f"], 3)
    assert slots == {
        "a": Slot(0, 0),
        "b": Slot(0, 1),
        "c": Slot(0, 2),
        "d": Slot(1, 0),
        "e": Slot(1, 1),
        "f": Slot(1, 2),
    }
    assert list(slots) == ["a", "b", "c", "d", "e", "f"]  # rank order


def test_survivors_keep_their_slots_and_a_joiner_takes_the_dead_ones() -> None:
    g1 = assign_slots({}, ["a", "b", "c", "d"], 2)
    g2 = assign_slots(g1, ["a", "c", "d"], 2)  # b died
    assert g2 == {"a": S0, "c": T0, "d": T1}  # a did not move to fill b's place
    layout = Layout(2, g2)
    assert layout.is_shadow("a") and not layout.is_shadow("c")
    assert layout.describe() == "2x2: r0=[a,-] r1=[c,d]"
    g3 = assign_slots(g2, ["a", "c", "d", "e"], 2)
    assert g3["e"] == S1  # the replacement is healed only shard 1, from its twin d
    assert Layout(2, g3).twins(1) == ["e", "d"]


def test_vacancies_fill_the_group_closest_to_completion_first() -> None:
    previous = {
        "a": Slot(0, 0),  # r0: 1 of 3
        "b": Slot(1, 1),  # r1: 2 of 3
        "c": Slot(1, 2),
        "d": Slot(2, 0),  # r2: 2 of 3
        "e": Slot(2, 2),
    }
    slots = assign_slots(previous, ["a", "b", "c", "d", "e", "x", "y", "z"], 3)
    # r1 and r2 tie at 2 filled: the lower id first; each joiner takes the lowest shard.
    assert (slots["x"], slots["y"], slots["z"]) == (Slot(1, 0), Slot(2, 1), Slot(0, 1))


def test_without_vacancies_joiners_open_groups_with_the_smallest_unused_ids() -> None:
    previous = {"a": Slot(1, 0), "b": Slot(1, 1)}  # r0 died out entirely
    slots = assign_slots(previous, ["a", "b", "c", "d", "e"], 2)
    assert slots == {"a": T0, "b": T1, "c": S0, "d": S1, "e": Slot(2, 0)}
    assert Layout(2, slots).describe() == "3x2: r0=[c,d] r1=[a,b] r2=[e,-]"


def test_unsharded_has_no_slots_and_a_shard_size_below_one_is_refused() -> None:
    assert assign_slots({}, ["a", "b"], 1) == {}
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        assign_slots({}, ["a"], 0)
    assert Layout(1, {}).describe() == "unsharded"


def test_slots_that_cannot_be_kept_are_given_again() -> None:
    # A report after a coordinator restart may be stale or malformed: a slot
    # outside the shard size, or one claimed twice, is not kept.
    previous = {"a": Slot(0, 5), "b": S1, "c": S1, "d": Slot(-1, 0)}
    slots = assign_slots(previous, ["a", "b", "c", "d", "b"], 2)
    assert slots == {"a": S0, "b": S1, "c": T0, "d": T1}


def test_layout_answers_the_workers_questions() -> None:
    layout = Layout(3, {"a": Slot(0, 0), "b": Slot(0, 1), "c": Slot(0, 2), "d": Slot(2, 1)})
    assert layout.complete_replicas() == [0]
    assert layout.replicas() == [0, 2]
    assert layout.group(0) == ["a", "b", "c"] and layout.group(2) == ["d"]
    assert layout.group(1) == []
    assert layout.twins(1) == ["b", "d"] and layout.twins(0) == ["a"]
    assert not layout.is_shadow("a") and layout.is_shadow("d")
    with pytest.raises(KeyError):
        layout.is_shadow("nobody")
    assert layout.describe() == "2x3: r0=[a,b,c] r2=[-,d,-]"


def test_layout_goes_over_the_wire_and_refuses_inconsistent_slots() -> None:
    layout = Layout(2, {"a": S0, "b": S1, "c": T1})
    wire = layout.to_wire()
    assert wire == {"a": [0, 0], "b": [0, 1], "c": [1, 1]}
    assert Layout.from_wire(wire, 2) == layout
    with pytest.raises(ValueError, match="both hold"):
        Layout.from_wire({"a": [0, 0], "b": [0, 0]}, 2)
    with pytest.raises(ValueError, match="shard < 2"):
        Layout.from_wire({"a": [0, 2]}, 2)
    with pytest.raises(ValueError, match=r"\[replica, shard\]"):
        Layout.from_wire({"a": [0]}, 2)


# ---------------------------------------------------------------- random histories


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[str], list[tuple[set[str], int]]]:
    """A shard size, a first generation, then generations of (deaths, joiners)."""
    size = draw(st.integers(1, 4))
    first = [f"m{i}" for i in range(draw(st.integers(1, 12)))]
    steps = []
    alive = list(first)
    n = len(first)
    for _ in range(draw(st.integers(1, 8))):
        dead = set(draw(st.lists(st.sampled_from(alive), unique=True))) if alive else set()
        joiners = draw(st.integers(0, 7))
        steps.append((dead, joiners))
        alive = [m for m in alive if m not in dead] + [f"m{n + i}" for i in range(joiners)]
        n += joiners
    return size, first, steps


def check_layout(layout: Layout, members: list[str]) -> None:
    """Every helper agrees with the slots."""
    slots, size = layout.slots, layout.shard_size
    by_replica: dict[int, list[tuple[int, str]]] = {}
    for m, s in slots.items():
        by_replica.setdefault(s.replica, []).append((s.shard, m))
    complete = sorted(r for r, ms in by_replica.items() if len(ms) == size)
    assert layout.complete_replicas() == complete
    for r, ms in by_replica.items():
        assert layout.group(r) == [m for _, m in sorted(ms)]
    for k in range(size):
        holders = sorted((s.replica, m) for m, s in slots.items() if s.shard == k)
        assert layout.twins(k) == [m for _, m in holders]
    for m in members:
        assert layout.is_shadow(m) == (slots[m].replica not in complete)
    assert Layout.from_wire(layout.to_wire(), size) == layout


@settings(max_examples=300, deadline=None)
@given(histories())
def test_random_deaths_and_joins_keep_the_layout_sound(
    history: tuple[int, list[str], list[tuple[set[str], int]]],
) -> None:
    size, members, steps = history
    slots = assign_slots({}, members, size)
    n = len(members)
    for dead, joining in steps:
        survivors = [m for m in members if m not in dead]
        joiners = [f"m{n + i}" for i in range(joining)]
        n += joining
        members = survivors + joiners
        new = assign_slots(slots, members, size)
        if size == 1:
            assert new == {}
            slots = new
            continue
        # Every member has one slot, no slot is held twice, all fit the shard size.
        assert list(new) == members
        assert len(set(new.values())) == len(new)
        assert all(s.replica >= 0 and 0 <= s.shard < size for s in new.values())
        # Survivors keep their slots.
        assert all(new[m] == slots[m] for m in survivors)
        # Vacancies (in the survivors' incomplete groups) are filled before new groups open.
        held = {slots[m] for m in survivors}
        used = {s.replica for s in held}
        vacant = {Slot(r, k) for r in used for k in range(size)} - held
        given_out = {new[m] for m in joiners}
        if len(joiners) <= len(vacant):
            assert given_out <= vacant
        else:
            assert vacant <= given_out
            opened = sorted({s.replica for s in given_out - vacant})
            # ... with the smallest unused ids, each full but the last.
            free = [r for r in range(len(used) + len(opened) + 1) if r not in used]
            assert opened == free[: len(opened)]
            assert all(len(Layout(size, new).group(r)) == size for r in opened[:-1])
        # The fullest incomplete group is completed first.
        filled = {r: sum(s.replica == r for s in held) for r in used}
        order = sorted((r for r in used if filled[r] < size), key=lambda r: (-filled[r], r))
        got = [r for r in order if any(s.replica == r for s in given_out)]
        assert got == order[: len(got)]
        check_layout(Layout(size, new), members)
        slots = new


# ---------------------------------------------------------------- the coordinator

TOKEN = "s3cret-token"
SIG = [["w", [2, 2], "torch.float32"]]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CoordinatorServer]:
    srv = CoordinatorServer(CoordinatorConfig(target=4, shard_size=2), TOKEN, run_dir=str(tmp_path))
    srv.start()
    yield srv
    srv.stop()


def ready(c: CoordinatorClient, incs: dict[str, int], known_gen: int) -> p.RendezvousResponse:
    """Every member of `incs` calls rendezvous; the last answer, which must be "ready"."""
    answers = [
        c.rendezvous(p.RendezvousRequest(m, inc, known_gen, 0, wait_s=0.0))
        for m, inc in incs.items()
    ]
    out = c.rendezvous(p.RendezvousRequest(next(iter(incs)), incs[next(iter(incs))], known_gen, 0))
    assert out.status == "ready", answers
    return out


def test_the_coordinator_keeps_slots_across_a_death_and_a_replacement(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    incs = {m: c.register(p.RegisterRequest(m, 100 + i, "h", SIG)).incarnation
            for i, m in enumerate(["w0", "w1", "w2", "w3"])}  # fmt: skip
    r1 = ready(c, incs, 0)
    assert r1.shard_size == 2
    assert r1.slots == {"w0": [0, 0], "w1": [0, 1], "w2": [1, 0], "w3": [1, 1]}
    assert Layout.from_wire(r1.slots, r1.shard_size).describe() == "2x2: r0=[w0,w1] r1=[w2,w3]"

    # w1 dies: the others keep their slots; w0, its group-mate, is now a shadow.
    c.exit(p.ExitRequest("w1", 101, -9))
    del incs["w1"]
    r2 = ready(c, incs, r1.gen)
    assert r2.reason == "failure" and r2.members == ["w0", "w2", "w3"]
    assert r2.slots == {"w0": [0, 0], "w2": [1, 0], "w3": [1, 1]}
    l2 = Layout.from_wire(r2.slots, r2.shard_size)
    assert l2.is_shadow("w0") and l2.complete_replicas() == [1]

    # A replacement takes w1's slot at the next step boundary, to be healed from w3.
    incs["w4"] = c.register(p.RegisterRequest("w4", 104, "h", SIG)).incarnation
    q = c.quorum(p.QuorumRequest("w0", incs["w0"], r2.gen, 0))
    assert q.verdict == "regroup"
    r3 = ready(c, incs, r2.gen)
    assert r3.reason == "join"
    assert r3.slots == {"w0": [0, 0], "w2": [1, 0], "w3": [1, 1], "w4": [0, 1]}
    l3 = Layout.from_wire(r3.slots, r3.shard_size)
    assert l3.complete_replicas() == [0, 1] and l3.twins(1) == ["w4", "w3"]
    c.close()

    layouts = {
        e["gen"]: e["layout"]
        for e in read_events(tmp_path)
        if e["kind"] in ("generation_formed", "generation_ready")
    }
    assert layouts == {
        r1.gen: "2x2: r0=[w0,w1] r1=[w2,w3]",
        r2.gen: "2x2: r0=[w0,-] r1=[w2,w3]",
        r3.gen: "2x2: r0=[w0,w4] r1=[w2,w3]",
    }


def test_an_unsharded_ready_answer_carries_no_slots(tmp_path: Path) -> None:
    srv = CoordinatorServer(CoordinatorConfig(target=1), TOKEN, run_dir=str(tmp_path)).start()
    try:
        c = CoordinatorClient(srv.address, TOKEN)
        inc = c.register(p.RegisterRequest("w0", 1, "h", SIG)).incarnation
        r = c.rendezvous(p.RendezvousRequest("w0", inc, 0, 0))
        assert r.status == "ready" and r.slots == {} and r.shard_size == 1
        c.close()
    finally:
        srv.stop()
    assert all("layout" not in e for e in read_events(tmp_path))


def test_an_older_coordinators_ready_answer_reads_as_unsharded() -> None:
    # A coordinator that predates sharding sends neither field.
    r = p.decode(p.RendezvousResponse, {"status": "ready", "gen": 3, "members": ["w0"]})
    assert r.slots == {} and r.shard_size == 1
    with pytest.raises(p.ProtocolError, match=r"\[replica, shard\]"):
        p.decode(p.RendezvousResponse, {"status": "ready", "slots": {"w0": [0, 0, 1]}})


def test_a_restarted_coordinator_adopts_the_slots_the_workers_report() -> None:
    # The layout after w1 died and w4 replaced it: not rank order.
    running = {"w0": S0, "w2": T0, "w3": T1, "w4": S1}
    members = ("w0", "w2", "w3", "w4")
    m = Membership(CoordinatorConfig(target=4, shard_size=2))
    m.register("w2", 1, "h", 0.0, gen=7, gen_members=members, committed=30, gen_slots=running)
    assert m.gen is not None and m.gen.reason == "adopted" and m.gen.slots == running

    # A worker that reports no slots: rank order (the known limitation).
    m = Membership(CoordinatorConfig(target=4, shard_size=2))
    m.register("w2", 1, "h", 0.0, gen=7, gen_members=members, committed=30)
    assert m.gen is not None and m.gen.slots == {"w0": S0, "w2": S1, "w3": T0, "w4": T1}

    # The next generation goes on from the adopted slots.
    m = Membership(CoordinatorConfig(target=4, shard_size=2))
    for pid, mid in enumerate(members):
        m.register(mid, pid, "h", 0.0, gen=7, gen_members=members, committed=30, gen_slots=running)
    m.exited("w0", 0, 1.0)
    assert m.gen is not None and m.gen.gen == 8
    assert m.gen.slots == {"w2": T0, "w3": T1, "w4": S1}


def test_the_wire_refuses_malformed_reported_slots() -> None:
    body = {"member": "w0", "pid": 1, "host": "h", "signature": SIG, "gen_slots": {"w0": [-1, 0]}}
    with pytest.raises(p.ProtocolError, match="replica, shard"):
        p.decode(p.RegisterRequest, body)


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"target": 3, "shard_size": 2}, "target (3) must be a multiple of shard_size (2)"),
        ({"target": 4, "min_members": 3, "shard_size": 2}, "min_members (3)"),
        ({"target": 4, "max_members": 5, "shard_size": 2}, "max_members (5)"),
        ({"target": 4, "shard_size": 0}, "shard_size must be >= 1"),
    ],
)
def test_the_coordinator_config_wants_whole_replica_groups(
    config: dict[str, int], needle: str
) -> None:
    with pytest.raises(ValueError) as e:
        CoordinatorConfig(**config)
    assert needle in str(e.value)
    # Unset, the fewest members is one replica group.
    assert CoordinatorConfig(target=4, shard_size=2).min_members == 2
    assert CoordinatorConfig(target=4).min_members == 1


def test_elastrain_coordinator_takes_a_shard_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        coordinator_main(["--target", "3", "--shard-size", "2"])
    assert e.value.code == 2
    assert "target (3) must be a multiple of shard_size (2)" in capsys.readouterr().err
