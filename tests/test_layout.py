"""Sharded replica groups (issue 16): which member holds which slot.

The pure rules (`elastrain.control.layout`), a property test over random deaths
and joins, then the coordinator handing the layout out: in its ready answers,
across a death and a replacement, and to a generation it adopts after a restart.
Then resharding in memory: the shard size chosen, who takes which shard of it
(the fewest bytes move), and the coordinator regrouping 2x2 -> 1x3 -> 2x2.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.layout import (
    Holding,
    Layout,
    Slot,
    assign_slots,
    choose_shard_size,
    reshard_slots,
    state_bytes,
)
from elastrain.control.plan import Generation
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


# ---------------------------------------------------------------- resharding: the rules


def every(size: int) -> bool:
    return True


@pytest.mark.parametrize(
    "alive, preferred, fits, want",
    [
        (4, 2, every, 2),  # the job's own shape
        (3, 2, every, 3),  # 1x3: no member holds more than with 2
        (5, 2, every, 5),
        (6, 4, every, 6),  # 3 (2x3) would hold more than the 1/4 the job ran with
        (3, 4, every, 3),  # below the preferred size: the least memory per member
        (2, 4, every, 2),
        (4, 2, lambda s: s >= 4, 4),  # 2 does not fit: 1x4
        (6, 2, lambda s: s >= 3, 3),  # the smallest that fits: 2x3, not 1x6
        (3, 2, lambda s: s >= 4, None),  # nothing fits: refused
    ],
)
def test_the_shard_size_for_the_members_left(
    alive: int, preferred: int, fits: Callable[[int], bool], want: int | None
) -> None:
    assert choose_shard_size(alive, preferred, fits) == want


def test_the_shard_size_rule_holds_for_any_budget() -> None:
    for alive in range(1, 25):
        divisors = [d for d in range(1, alive + 1) if alive % d == 0]
        for preferred in range(1, 9):
            for smallest_fit in range(1, 26):

                def fits(s: int, k: int = smallest_fit) -> bool:
                    return s >= k

                got = choose_shard_size(alive, preferred, fits)
                ok = [d for d in divisors if fits(d)]
                if not ok:
                    assert got is None
                    continue
                assert got is not None and alive % got == 0 and fits(got)
                at_least = [d for d in ok if d >= preferred]
                assert got == (min(at_least) if at_least else max(ok))
    with pytest.raises(ValueError):
        choose_shard_size(0, 2, every)


def kept(previous: Mapping[str, Slot], old: int, new: Mapping[str, Slot], size: int) -> Fraction:
    """The rows (as a fraction of the model) the members keep in place: the sum
    of each member's old shard's overlap with its new one."""
    return sum(
        (
            Holding(old, previous[m].shard).overlap(Holding(size, s.shard))
            for m, s in new.items()
            if m in previous
        ),
        Fraction(0),
    )


def test_three_survivors_of_2x2_regroup_as_1x3_keeping_most_of_their_rows() -> None:
    g = {"w0": S0, "w2": T0, "w3": T1}  # w1 (r0, shard 1) died
    new = reshard_slots(g, 2, ["w0", "w2", "w3"], 3)
    assert Layout(3, new).describe() == "1x3: r0=[w0,w2,w3]"
    # w0 keeps all of new shard 0 (rows [0, 1/3) of its [0, 1/2)); w3 all of new
    # shard 2; w2 half of new shard 1. Any other placement keeps less.
    assert kept(g, 2, new, 3) == Fraction(1, 3) + Fraction(1, 6) + Fraction(1, 3)


def test_back_to_2x2_when_a_replacement_joins() -> None:
    g = {"w0": S0, "w2": S1, "w3": Slot(0, 2)}  # 1x3
    new = reshard_slots(g, 3, ["w0", "w2", "w3", "w4"], 2)
    layout = Layout(2, new)
    assert layout.complete_replicas() == [0, 1]
    # w0 ([0, 1/3)) stays on shard 0, w3 ([2/3, 1)) on shard 1: nothing of theirs moves;
    # w2 ([1/3, 2/3)) keeps half of either; the joiner takes what is left.
    assert new["w0"].shard == 0 and new["w3"].shard == 1
    assert kept(g, 3, new, 2) == Fraction(1, 3) + Fraction(1, 3) + Fraction(1, 6)
    assert layout.describe() == "2x2: r0=[w0,w3] r1=[w2,w4]"


def test_broken_groups_of_the_same_size_merge_without_moving_bytes() -> None:
    # 2x2 lost w1 (r0, shard 1) and w2 (r1, shard 0): no group is complete, yet
    # w0 holds shard 0 and w3 shard 1, which together are one whole group.
    new = reshard_slots({"w0": S0, "w3": T1}, 2, ["w0", "w3"], 2)
    assert new == {"w0": S0, "w3": S1}


def test_resharding_to_or_from_unsharded() -> None:
    assert reshard_slots({"a": S0, "b": S1}, 2, ["a", "b"], 1) == {}
    # Unsharded, every member held the whole model: any placement keeps it; rank order.
    assert reshard_slots({}, 1, ["a", "b", "c"], 3) == {"a": S0, "b": S1, "c": Slot(0, 2)}
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        reshard_slots({}, 0, ["a"], 2)


def test_stale_or_duplicate_slots_count_as_holding_nothing() -> None:
    previous = {"a": Slot(0, 7), "b": S1, "c": S1}  # a: outside size 2; c: b's slot
    new = reshard_slots(previous, 2, ["a", "b", "c", "b"], 3)
    assert list(new) == ["a", "b", "c"]
    assert new["b"].shard == 2  # b's rows [1/2, 1) keep most on new shard 2, [2/3, 1)
    assert Layout(3, new).complete_replicas() == [0]


def test_a_models_bytes_from_its_signature() -> None:
    sig = [
        ["w", [1000, 10], "torch.float32"],
        ["b", [10], "torch.bfloat16"],
        ["step", [], "torch.int64"],
        ["mask", [3], "torch.bool"],
        ["jax", [2, 2], "float16"],  # numpy/JAX names too
    ]
    assert state_bytes(sig) == 1000 * 10 * 4 + 10 * 2 + 8 + 3 + 4 * 2
    with pytest.raises(ValueError, match="cannot size dtype"):
        state_bytes([["x", [1], "torch.mystery"]])


def test_every_torch_dtype_is_sized_as_torch_sizes_it() -> None:
    torch = pytest.importorskip("torch")
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    for dt in dtypes:
        assert state_bytes([["x", [3, 5], str(dt)]]) == 15 * dt.itemsize, dt


@st.composite
def reshards(draw: st.DrawFn) -> tuple[dict[str, Slot], int, list[str], int]:
    """A layout of some shard size after random deaths, the survivors plus joiners, and
    a new shard size."""
    old = draw(st.integers(1, 5))
    first = [f"m{i}" for i in range(draw(st.integers(1, 10)))]
    slots = assign_slots({}, first, old)
    survivors = [m for m in first if draw(st.booleans())]
    joiners = [f"j{i}" for i in range(draw(st.integers(0, 4)))]
    members = draw(st.permutations(survivors + joiners))
    return slots, old, list(members), draw(st.integers(1, 5))


def best_kept(previous: Mapping[str, Slot], old: int, members: list[str], size: int) -> Fraction:
    """The most rows any valid layout keeps, by trying every placement."""
    full, rest = divmod(len(members), size)
    best = Fraction(0)
    for partial in itertools.combinations(range(size), rest):
        shards = [j for j in range(size) for _ in range(full)] + list(partial)
        for order in set(itertools.permutations(shards)):
            new = {m: Slot(0, j) for m, j in zip(members, order, strict=True)}
            best = max(best, kept(previous, old, new, size))
    return best


def check_reshard(previous: Mapping[str, Slot], old: int, members: list[str], size: int) -> None:
    new = reshard_slots(previous, old, members, size)
    if size == 1:
        assert new == {}
        return
    # A valid layout: every member once, no slot twice, complete groups 0..full-1
    # and at most one incomplete group after them.
    assert list(new) == members
    assert len(set(new.values())) == len(new)
    layout = Layout(size, new)
    full, rest = divmod(len(members), size)
    assert layout.complete_replicas() == list(range(full))
    assert layout.replicas() == list(range(full + (1 if rest else 0)))
    check_layout(layout, members)
    # Nobody could keep more of their rows by trading places (or, in the incomplete
    # group, by moving to a shard it lacks): in particular a member sits on a
    # shard that shares no rows with its old one only when every slot of the
    # shards that do is held by a member that keeps at least as much there.
    if old == 1:
        return  # every holder held everything

    def keeps(m: str, shard: int) -> Fraction:
        s = previous.get(m)
        return Holding(old, s.shard).overlap(Holding(size, shard)) if s else Fraction(0)

    for a, b in itertools.combinations(members, 2):
        sa, sb = new[a].shard, new[b].shard
        assert keeps(a, sa) + keeps(b, sb) >= keeps(a, sb) + keeps(b, sa), (a, b, new)
    if rest:
        lacking = set(range(size)) - {new[m].shard for m in layout.group(full)}
        for m in layout.group(full):
            assert all(keeps(m, new[m].shard) >= keeps(m, j) for j in lacking)


@settings(max_examples=300, deadline=None)
@given(reshards())
def test_a_reshard_is_a_valid_layout_that_keeps_most_rows_in_place(
    case: tuple[dict[str, Slot], int, list[str], int],
) -> None:
    previous, old, members, size = case
    check_reshard(previous, old, members, size)
    if size > 1 and old > 1 and len(members) <= 6:
        # The fewest bytes move: no placement at all keeps more rows.
        new = reshard_slots(previous, old, members, size)
        assert kept(previous, old, new, size) == best_kept(previous, old, members, size)


def test_a_reshard_of_many_members_is_sound_and_costs_little() -> None:
    previous = assign_slots({}, [f"m{i}" for i in range(40_000)], 8)
    members = [f"m{i}" for i in range(40_000) if i % 7] + [f"j{i}" for i in range(50)]
    check_reshard(previous, 8, members[::200], 6)  # (the check is quadratic)
    new = reshard_slots(previous, 8, members, 6)  # the flow is over shard indices only
    assert len(new) == len(members) and len(set(new.values())) == len(new)
    assert Layout(6, new).complete_replicas() == list(range(len(members) // 6))


# ---------------------------------------------------------------- resharding: the coordinator

RESHARD_AFTER = 30.0
MODEL = [["w", [1000], "torch.float32"]]  # 4000 bytes: 16000 of training state at factor 4


def sharded_job(n: int = 4, **kw: object) -> Membership:
    """n members as n/2 x 2, ready in generation 1 at t=0, resharding after 30 s."""
    cfg: dict[str, object] = {"target": n, "shard_size": 2, "reshard_after_s": RESHARD_AFTER}
    cfg.update(kw)
    m = Membership(CoordinatorConfig(**cfg))  # type: ignore[arg-type]
    m.signature = MODEL  # type: ignore[assignment]
    for i in range(n):
        m.register(f"w{i}", 100 + i, "h", 0.0)
    all_ready(m, 0, 0.0)
    return m


def all_ready(m: Membership, known_gen: int, now: float) -> Generation:
    """Every member of the current generation calls rendezvous; it must be ready."""
    g = m.gen
    assert g is not None
    for mid in g.members:
        m.rendezvous(mid, m.members[mid].incarnation, known_gen, 0, now)
    assert m.gen is g and g.is_ready, m.waiting
    return g


def step(m: Membership, step: int, now: float) -> p.Verdict:
    """Every member heartbeats at `now`; the first member of the current generation
    asks for the verdict of `step`."""
    g = m.gen
    assert g is not None
    for mid in m.members:
        m.touch(mid, m.members[mid].incarnation, now)
    first = g.members[0]
    verdict, _ = m.quorum(first, m.members[first].incarnation, g.gen, step, False, now)
    return verdict


def held(g: Generation) -> dict[str, tuple[int, int]]:
    return {mid: (h.shard_size, h.shard) for mid, h in g.held.items()}


def test_three_survivors_regroup_as_1x3_after_the_limit_and_back_when_a_replacement_comes() -> None:
    m = sharded_job()
    m.exited("w1", 101, 10.0)  # no replacement comes
    g2 = all_ready(m, 1, 10.0)
    assert g2.reason == "failure" and g2.shard_size == 2
    assert Layout(2, g2.slots).describe() == "2x2: r0=[w0,-] r1=[w2,w3]"

    # Before the limit, steps proceed with w0 as a shadow.
    assert step(m, 1, 10.0 + RESHARD_AFTER - 0.1) == "proceed"
    assert m.gen is g2
    # After it, the next step boundary regroups the same members as 1x3.
    assert step(m, 2, 10.0 + RESHARD_AFTER + 0.1) == "regroup"
    g3 = m.gen
    assert g3 is not None and g3 is not g2
    assert (g3.reason, g3.shard_size, g3.members) == ("reshard", 3, g2.members)
    assert Layout(3, g3.slots).describe() == "1x3: r0=[w0,w2,w3]"
    assert held(g3) == {"w0": (2, 0), "w2": (2, 0), "w3": (2, 1)}
    # At a step boundary: nobody's step in flight is aborted.
    assert not m.gen_interrupted(g2.gen)
    [change] = m.drain_layout_changes()
    assert (change.gen, change.old, change.new, change.reason) == (
        g3.gen,
        "2x2: r0=[w0,-] r1=[w2,w3]",
        "1x3: r0=[w0,w2,w3]",
        "reshard",
    )
    all_ready(m, g2.gen, 41.0)
    assert step(m, 2, 41.0) == "proceed"  # no vacancy left: nothing more to do

    # A replacement registers: the next step boundary goes back to 2x2.
    m.register("w4", 104, "h", 50.0)
    assert step(m, 3, 50.0) == "regroup"
    g4 = m.gen
    assert g4 is not None and (g4.reason, g4.shard_size) == ("join", 2)
    assert Layout(2, g4.slots).complete_replicas() == [0, 1]
    assert held(g4) == {"w0": (3, 0), "w2": (3, 1), "w3": (3, 2)}  # w4 holds nothing
    [back] = m.drain_layout_changes()
    assert (back.old, back.new, back.reason) == (
        "1x3: r0=[w0,w2,w3]",
        Layout(2, g4.slots).describe(),
        "join",
    )
    assert not m.gen_interrupted(g3.gen)


def test_a_reshard_that_does_not_fit_the_memory_budget_is_refused_once() -> None:
    # 1x3 would need 16000 / 3 bytes per member, 3x1 all 16000: over 5000.
    m = sharded_job(memory_per_member=5000)
    m.exited("w1", 101, 10.0)
    g2 = all_ready(m, 1, 10.0)
    assert step(m, 1, 100.0) == "proceed" and m.gen is g2  # the job keeps its layout
    [refused] = m.drain_refusals()
    assert (refused.alive, refused.preferred, refused.shard_size) == (3, 2, 2)
    assert (refused.needed, refused.budget) == (5334, 5000)
    assert "5,334 bytes" in refused.message and "5,000 bytes of --memory-per-member" in (
        refused.message
    )
    for s in range(2, 5):
        assert step(m, s, 100.0 + s) == "proceed"
    assert m.drain_refusals() == []  # once per vacancy, not every step


def test_a_reshard_fits_a_budget_that_the_thinner_layout_meets() -> None:
    m = sharded_job(memory_per_member=5400)  # 1x3: 5334 bytes per member
    m.exited("w1", 101, 10.0)
    all_ready(m, 1, 10.0)
    assert step(m, 1, 100.0) == "regroup"
    assert m.gen is not None and m.gen.shard_size == 3 and m.drain_refusals() == []


def test_the_vacancy_is_timed_from_its_start_across_generations() -> None:
    m = sharded_job(6)  # 3x2
    m.exited("w1", 101, 10.0)  # the vacancy starts
    all_ready(m, 1, 10.0)
    m.exited("w3", 103, 20.0)  # a second one, in another group
    g3 = all_ready(m, 2, 20.0)
    assert Layout(2, g3.slots).describe() == "3x2: r0=[w0,-] r1=[w2,-] r2=[w4,w5]"
    assert step(m, 1, 10.0 + RESHARD_AFTER + 0.1) == "regroup"
    g4 = m.gen
    # 4 members make whole groups of 2 again: the same size, two complete groups,
    # w0 and w2 (both shard 0) on the two shard-0 slots, one of the r2 pair moving.
    assert g4 is not None and (g4.reason, g4.shard_size) == ("reshard", 2)
    assert Layout(2, g4.slots).complete_replicas() == [0, 1]
    assert m.drain_layout_changes() == []  # the shard size did not change


def test_broken_groups_merge_when_the_shard_size_still_divides() -> None:
    m = sharded_job()
    m.exited("w1", 101, 10.0)
    m.exited("w2", 102, 10.0)
    g = all_ready(m, 1, 10.0)
    assert Layout(2, g.slots).describe() == "2x2: r0=[w0,-] r1=[-,w3]"  # nobody computes
    assert step(m, 1, 10.0 + RESHARD_AFTER + 1) == "regroup"
    assert m.gen is not None and m.gen.slots == {"w0": S0, "w3": S1}  # nothing moves


def test_a_failure_that_makes_the_configured_size_divide_returns_to_it_at_once() -> None:
    m = sharded_job()
    m.exited("w1", 101, 10.0)
    all_ready(m, 1, 10.0)
    step(m, 1, 45.0)  # 1x3
    g3 = all_ready(m, 2, 45.0)
    assert g3.shard_size == 3
    m.drain_layout_changes()
    m.exited("w3", 103, 50.0)  # 2 left: whole groups of 2 again
    g4 = m.gen
    assert g4 is not None and (g4.reason, g4.shard_size) == ("failure", 2)
    assert Layout(2, g4.slots).complete_replicas() == [0]
    assert held(g4) == {"w0": (3, 0), "w2": (3, 1)}
    [change] = m.drain_layout_changes()
    assert change.reason == "failure" and change.new == Layout(2, g4.slots).describe()


def test_without_a_limit_the_job_waits_for_replacements() -> None:
    m = sharded_job(reshard_after_s=None)
    m.exited("w1", 101, 10.0)
    g2 = all_ready(m, 1, 10.0)
    assert step(m, 1, 10_000.0) == "proceed" and m.gen is g2


def test_held_counts_only_generations_that_became_ready() -> None:
    m = sharded_job()
    m.exited("w1", 101, 10.0)
    all_ready(m, 1, 10.0)
    step(m, 1, 45.0)  # the reshard forms (1x3) ...
    m.exited("w3", 103, 45.5)  # ... and breaks before it is ready: nobody moved rows
    g = m.gen
    assert g is not None and g.reason == "failure"
    assert held(g) == {"w0": (2, 0), "w2": (2, 0)}


def test_a_restarted_coordinator_adopts_a_resharded_generation() -> None:
    running = {"w0": S0, "w2": S1, "w3": Slot(0, 2)}
    members = ("w0", "w2", "w3")
    m = Membership(CoordinatorConfig(target=4, shard_size=2, reshard_after_s=RESHARD_AFTER))
    m.register("w2", 1, "h", 0.0, gen=9, gen_members=members, gen_slots=running, gen_shard_size=3)
    g = m.gen
    assert g is not None and (g.reason, g.shard_size, g.slots) == ("adopted", 3, running)
    assert held(g) == {"w0": (3, 0), "w2": (3, 1), "w3": (3, 2)}
    # Without the size (an older worker) the configured one: the 1x3 slots do not fit it.
    m = Membership(CoordinatorConfig(target=4, shard_size=2, reshard_after_s=RESHARD_AFTER))
    m.register("w2", 1, "h", 0.0, gen=9, gen_members=members, gen_slots=running)
    assert m.gen is not None and m.gen.shard_size == 2


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"target": 4, "reshard_after_s": 5.0}, "needs shard_size > 1"),
        ({"target": 4, "shard_size": 2, "reshard_after_s": -1.0}, "reshard_after_s must be"),
        ({"target": 4, "shard_size": 2, "memory_per_member": 10}, "set reshard_after_s too"),
        (
            {"target": 4, "shard_size": 2, "reshard_after_s": 1.0, "memory_per_member": 0},
            "memory_per_member must be a positive",
        ),
        ({"target": 4, "state_factor": 0.0}, "state_factor must be > 0"),
    ],
)
def test_the_resharding_policy_is_checked(config: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        CoordinatorConfig(**config)  # type: ignore[arg-type]
    assert needle in str(e.value)


class Clock:
    """The coordinator's `now`, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def reshard_server(tmp_path: Path, clock: Clock, **kw: object) -> CoordinatorServer:
    cfg: dict[str, object] = {"target": 4, "shard_size": 2, "reshard_after_s": RESHARD_AFTER}
    cfg.update(kw)
    config = CoordinatorConfig(**cfg)  # type: ignore[arg-type]
    return CoordinatorServer(config, TOKEN, run_dir=str(tmp_path), clock=clock).start()


def test_the_coordinator_reshards_2x2_to_1x3_and_back_over_the_wire(tmp_path: Path) -> None:
    clock = Clock()
    srv = reshard_server(tmp_path, clock)
    try:
        c = CoordinatorClient(srv.address, TOKEN)
        incs = {m: c.register(p.RegisterRequest(m, 100 + i, "h", MODEL)).incarnation
                for i, m in enumerate(["w0", "w1", "w2", "w3"])}  # fmt: skip
        r1 = ready(c, incs, 0)
        assert r1.shard_size == 2 and r1.held == {}  # nobody held anything yet

        c.exit(p.ExitRequest("w1", 101, -9))  # and no replacement comes
        del incs["w1"]
        r2 = ready(c, incs, r1.gen)
        assert r2.reason == "failure" and r2.shard_size == 2
        assert r2.held == {"w0": [2, 0], "w2": [2, 0], "w3": [2, 1]}  # their slots of r1

        clock.t += RESHARD_AFTER - 1
        assert c.quorum(p.QuorumRequest("w0", incs["w0"], r2.gen, 1)).verdict == "proceed"
        clock.t += 2
        q = c.quorum(p.QuorumRequest("w0", incs["w0"], r2.gen, 2))
        assert q.verdict == "regroup"
        # Nobody's step in flight is broken: heartbeats do not say "changed", but
        # "superseded" (a member that can compute no step waits for exactly that).
        hb = c.heartbeat(p.HeartbeatRequest("w2", incs["w2"], r2.gen, 0.0))
        assert (hb.status, hb.gen) == (p.HeartbeatStatus.SUPERSEDED, q.gen)
        r3 = ready(c, incs, r2.gen)
        assert (r3.reason, r3.shard_size, r3.members) == ("reshard", 3, ["w0", "w2", "w3"])
        assert Layout.from_wire(r3.slots, r3.shard_size).describe() == "1x3: r0=[w0,w2,w3]"
        assert r3.held == {"w0": [2, 0], "w2": [2, 0], "w3": [2, 1]}

        incs["w4"] = c.register(p.RegisterRequest("w4", 104, "h", MODEL)).incarnation
        assert c.quorum(p.QuorumRequest("w0", incs["w0"], r3.gen, 3)).verdict == "regroup"
        r4 = ready(c, incs, r3.gen)
        assert (r4.reason, r4.shard_size) == ("join", 2)
        assert Layout.from_wire(r4.slots, r4.shard_size).complete_replicas() == [0, 1]
        assert r4.held == {"w0": [3, 0], "w2": [3, 1], "w3": [3, 2]}  # w4: nothing
        c.close()
    finally:
        srv.stop()

    events = read_events(tmp_path)
    formed = [(e["gen"], e["reason"], e["shard_size"]) for e in events
              if e["kind"] == "generation_formed"]  # fmt: skip
    assert formed == [
        (r1.gen, "start", 2),
        (r2.gen, "failure", 2),
        (r3.gen, "reshard", 3),
        (r4.gen, "join", 2),
    ]
    changes = [(e["gen"], e["old"], e["new"], e["reason"]) for e in events
               if e["kind"] == "layout_changed"]  # fmt: skip
    assert changes == [
        (r3.gen, "2x2: r0=[w0,-] r1=[w2,w3]", "1x3: r0=[w0,w2,w3]", "reshard"),
        (r4.gen, "1x3: r0=[w0,w2,w3]", Layout.from_wire(r4.slots, 2).describe(), "join"),
    ]
    assert {e["shard_size"] for e in events if e["kind"] == "generation_ready"} == {2, 3}


def test_the_coordinator_refuses_a_reshard_that_does_not_fit_once(tmp_path: Path) -> None:
    clock = Clock()
    srv = reshard_server(tmp_path, clock, memory_per_member=5000)
    try:
        c = CoordinatorClient(srv.address, TOKEN)
        incs = {m: c.register(p.RegisterRequest(m, 100 + i, "h", MODEL)).incarnation
                for i, m in enumerate(["w0", "w1", "w2", "w3"])}  # fmt: skip
        r1 = ready(c, incs, 0)
        c.exit(p.ExitRequest("w1", 101, -9))
        del incs["w1"]
        r2 = ready(c, incs, r1.gen)
        clock.t += 10 * RESHARD_AFTER
        for s in range(1, 4):
            q = c.quorum(p.QuorumRequest("w0", incs["w0"], r2.gen, s))
            assert (q.verdict, q.gen) == ("proceed", r2.gen)  # the job keeps its layout
        c.close()
    finally:
        srv.stop()
    [refused] = [e for e in read_events(tmp_path) if e["kind"] == "reshard_refused"]
    assert (refused["alive"], refused["preferred"], refused["shard_size"]) == (3, 2, 2)
    assert (refused["needed"], refused["budget"]) == (5334, 5000)
    assert "--memory-per-member" in refused["message"]
    assert not [e for e in read_events(tmp_path) if e["kind"] == "layout_changed"]


def test_a_fresh_process_under_an_old_name_holds_nothing() -> None:
    m = sharded_job()
    m.exited("w1", 101, 10.0)
    all_ready(m, 1, 10.0)
    m.remove("w3", "suspected", 11.0)  # expelled: it comes back as the same process
    all_ready(m, 2, 11.0)
    m.register("w3", 103, "h", 12.0, prev_incarnation=1)  # it keeps its rows
    # No group could compute in gen 3 (w0 and w2 both hold shard 0): w3 is admitted
    # at once, without waiting for a step boundary that cannot come.
    g = m.gen
    assert g is not None and g.gen == 4 and set(g.members) == {"w0", "w2", "w3"}
    m.register("w1", 201, "h", 12.0)  # a new process under a dead one's name: nothing
    all_ready(m, 3, 12.0)
    assert step(m, 1, 12.0) == "regroup"
    g = m.gen
    assert g is not None and set(g.members) == {"w0", "w1", "w2", "w3"}
    assert held(g) == {"w0": (2, 0), "w2": (2, 0), "w3": (2, 1)}


def test_an_unbelievable_reported_shard_size_is_not_adopted() -> None:
    m = Membership(CoordinatorConfig(target=4, shard_size=2))
    m.register("w0", 1, "h", 0.0, gen=3, gen_members=("w0", "w1"), gen_shard_size=10**15)
    assert m.gen is not None and m.gen.shard_size == 2


Op = tuple[str, int]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([2, 3]),
    st.integers(1, 3),
    st.lists(
        st.one_of(
            st.tuples(st.just("die"), st.integers(0, 50)),
            st.tuples(st.just("join"), st.just(0)),
            st.tuples(st.just("step"), st.integers(0, 40)),
        ),
        max_size=30,
    ),
)
def test_random_histories_with_resharding_keep_sound_layouts(
    size: int, groups: int, ops: list[Op]
) -> None:
    m = sharded_job(size * groups, shard_size=size)
    t, joined, s = 0.0, 0, 0
    for op, arg in ops:
        t += 1.0
        g = m.gen
        if op == "die" and g is not None and g.members:
            mid = g.members[arg % len(g.members)]
            if mid in m.members:
                m.exited(mid, m.members[mid].pid, t)
        elif op == "join":
            joined += 1
            m.register(f"j{joined}", 1000 + joined, "h", t)
        elif op == "step" and g is not None:
            t += arg
            for mid in m.members:
                m.touch(mid, m.members[mid].incarnation, t)
            was_due = (
                g.is_ready
                and not g.broken
                and m.vacant_since is not None
                and t >= m.vacant_since + RESHARD_AFTER
                and not set(m.members) - set(g.members)  # nobody waits to join
            )
            if g.is_ready and not g.broken:
                s += 1
                step(m, s, t)
                if was_due:  # a lasting vacancy is regrouped at this boundary
                    assert m.gen is not None and m.gen.reason == "reshard"
        g = m.gen
        if g is None or g.broken:
            continue
        for mid in g.members:  # everyone comes to the (new) generation
            if mid in m.members:
                m.rendezvous(mid, m.members[mid].incarnation, 0, 0, t)
        # Every generation's layout is sound at its own shard size ...
        layout = Layout(g.shard_size, g.slots)
        assert set(g.slots) == set(g.members)
        assert all(0 <= h.shard < h.shard_size for h in g.held.values())
        assert set(g.held) <= set(g.members)
        if g.reason == "reshard":  # ... a reshard makes whole groups ...
            assert len(g.members) % g.shard_size == 0
            assert len(layout.complete_replicas()) * g.shard_size == len(g.members)
        if g.shard_size != size:  # ... and the configured one is left only while it
            assert len(g.members) % size  # cannot make whole groups
