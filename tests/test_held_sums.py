"""Held sums (issue 41 item 4): which replica group holds which micro-batches of an
interrupted step, and the rest's assignment (pure, `elastrain.runtime.held_sums`).
The job-level test (a kill early in a step, the healthy group computing only the
lost group's micro-batches, bit for bit) is in tests/test_sharded.py."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace as NS
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.control import protocol as p
from elastrain.control.layout import Layout
from elastrain.data import assign_rounds
from elastrain.runtime import member as m
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.group import AbortReason, CollectiveAborted
from elastrain.runtime.held_sums import Claim, Held, assign_rest, claim_of, decide, row
from elastrain.runtime.shard_member import ShardedMember
from elastrain.runtime.step_run import StepRun, _Step, waits_whole_step
from elastrain.runtime.topology import Turns

G = [(0, ["a0", "a1"]), (1, ["b0", "b1"])]
GEN = 4
"""The lineage (`commit_gen`) of the claims below."""


def _claims(mask: set[int], members: list[str], step: int = 6, size: int = 2) -> dict:
    return {w: Claim(step, GEN, size, k, frozenset(mask)) for k, w in enumerate(members)}


def test_a_group_holds_what_all_its_shards_hold_for_this_step_and_slot() -> None:
    both = _claims({4, 5, 6, 7}, ["b0", "b1"])
    assert decide(both, G, 2, 6, GEN) == {1: frozenset({4, 5, 6, 7})}
    # One shard lacks it (a new member, a failed compute): the group holds nothing.
    assert decide({"b0": both["b0"], "b1": None}, G, 2, 6, GEN) == {}
    # Different sets (one member ran a round the other did not finish).
    assert decide({**both, "b1": Claim(6, GEN, 2, 1, frozenset({4, 5}))}, G, 2, 6, GEN) == {}
    # Another step, another shard size, or the shards swapped: dropped.
    assert decide(both, G, 2, 7, GEN) == {}
    assert decide(both, G, 3, 6, GEN) == {}
    assert decide({"b0": both["b1"], "b1": both["b0"]}, G, 2, 6, GEN) == {}
    # A group regrouped from two old ones: their sets differ, nothing held.
    mixed = {
        "a0": Claim(6, GEN, 2, 0, frozenset({0, 1})),
        "a1": Claim(6, GEN, 2, 1, frozenset({4})),
    }
    assert decide(mixed, G, 2, 6, GEN) == {}


def test_a_claim_of_another_lineage_is_not_held() -> None:
    """Same step count, another lineage (a zombie commit's state): other rows."""
    both = _claims({4, 5, 6, 7}, ["b0", "b1"])
    assert decide(both, G, 2, 6, GEN + 1) == {}
    # One member of the group on another lineage is enough.
    other = {**both, "b1": Claim(6, GEN - 1, 2, 1, frozenset({4, 5, 6, 7}))}
    assert decide(other, G, 2, 6, GEN) == {}


def test_two_groups_never_hold_one_micro_batch() -> None:
    claims = {**_claims({0, 1, 2}, ["a0", "a1"]), **_claims({2, 3}, ["b0", "b1"])}
    assert decide(claims, G, 2, 6, GEN) == {0: frozenset({0, 1, 2})}


def test_a_claim_survives_its_row() -> None:
    c = Claim(0, 9, 3, 2, frozenset({0, 7}))
    assert claim_of(row(c, 8)) == c
    assert claim_of(row(None, 8)) is None


@pytest.mark.parametrize("mbs,groups,size", [(8, 2, 2), (9, 3, 2), (5, 1, 3)])
def test_with_nothing_held_the_rest_is_a_whole_steps_assignment(
    mbs: int, groups: int, size: int
) -> None:
    complete = list(range(groups))
    for g in complete:
        for s in range(size):
            assert assign_rest(mbs, {}, complete, g, size, s) == assign_rounds(
                mbs, groups, g, size, s
            )


@settings(max_examples=60, deadline=None)
@given(
    mbs=st.integers(1, 16),
    size=st.integers(1, 3),
    replicas=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
    data=st.data(),
)
def test_held_and_assigned_cover_every_micro_batch_once(
    mbs: int, size: int, replicas: list[int], data: st.DataObject
) -> None:
    complete = sorted(replicas)
    # Disjoint held sets for some of the groups.
    owner = data.draw(st.lists(st.sampled_from([None, *complete]), min_size=mbs, max_size=mbs))
    held = {
        r: frozenset(i for i, o in enumerate(owner) if o == r)
        for r in complete
        if any(o == r for o in owner)
    }
    seen = [i for m in held.values() for i in m]
    for r in complete:
        turns = [assign_rest(mbs, held, complete, r, size, s) for s in range(size)]
        # Every member of a group runs the same rounds (FSDP2's collectives).
        assert len({len(t) for t in turns}) == 1
        seen += [i for t in turns for i in t if i is not None]
    assert sorted(seen) == list(range(mbs))


# ---- a member's kept sums (ShardedMember, StepRun: fakes, no processes) ------------

SLOTS = {"a0": [0, 0], "a1": [0, 1], "b0": [1, 0], "b1": [1, 1]}


class _Unread:
    """A loss sum that must not be read (a device tensor behind a hung collective)."""

    def __float__(self) -> float:
        raise AssertionError("the loss sum was read")


class _Backend:
    """What ShardedMember asks of its backend on these paths."""

    native = False
    placed = True
    shard_size = 2
    needs_fill = False

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.buf = torch.zeros(4, dtype=torch.float64)

    def reduce_buffers(self) -> list[torch.Tensor]:
        return [self.buf]

    def reset(self, shard: int, size: int) -> None:
        self.shard, self.shard_size = shard, size

    def place(self, shard: int, size: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def adopt(self, state: Any) -> None:
        pass

    model = None
    group_clean = True

    def form_group(self, group: Any, open_group: Any, keep: bool = False) -> bool:
        return False

    def set_collective_timeout(self, seconds: float) -> None:
        pass

    def plan_rounds(self, rounds: int) -> None:
        pass


class _Events:
    def emit(self, kind: Any, **fields: Any) -> None:
        pass


class _Stats:
    def event_fields(self) -> dict[str, Any]:
        return {}


def _member(name: str) -> tuple[ShardedMember, _Backend]:
    backend = _Backend(SLOTS[name][1])
    config = TrainerConfig(global_batch_size=8, micro_batch_size=1, total_steps=10, shard_size=2)
    w = ShardedMember(cast(Any, backend), name, config, "127.0.0.1", cast(Any, _Events()),
                      cast(Any, None))  # fmt: skip
    w.layout = Layout.from_wire(SLOTS, 2)
    w._members = list(SLOTS)
    return w, backend


def _held(name: str, step: int = 3, mask: frozenset[int] = frozenset({0, 1, 2, 3})) -> Held:
    claim = Claim(step, GEN, 2, SLOTS[name][1], mask)
    return Held(claim, torch.full((4,), 7.0, dtype=torch.float64), [10, 11], 1.5)


def _heal(w: ShardedMember, committed: dict[str, int]) -> bool:
    ready = p.RendezvousResponse(
        "ready", 5, list(SLOTS), committed, 3, commit_gens=dict.fromkeys(SLOTS, GEN),
        slots=SLOTS, shard_size=2,
    )  # fmt: skip
    out = w.heal(5, False, ready, _World({}), lambda c: {"step": c}, lambda meta: 3,
                 lambda *a, **k: ({"step": 3}, _Stats()), None)  # fmt: skip
    return out.received


def test_a_member_that_receives_its_state_drops_its_kept_sums() -> None:
    # b1 is behind (its twin a1 sends): its state is replaced, its sums are stale.
    w, _ = _member("b1")
    w._held = _held("b1")
    assert _heal(w, {"a0": 3, "a1": 3, "b0": 3, "b1": 2})
    assert w._held is None
    # A sender keeps them for the first step.
    w, _ = _member("a1")
    w._held = kept = _held("a1")
    assert not _heal(w, {"a0": 3, "a1": 3, "b0": 3, "b1": 2})
    assert w._held is kept
    # Its rows reset (shaped for another slot: it missed a reshard): dropped, by
    # the reset alone here (it is counted up to date, so it does not receive).
    w, backend = _member("a1")
    backend.shard = 0
    w._held = _held("a1")
    assert not _heal(w, {"a0": 3, "a1": 3, "b0": 3, "b1": 2})
    assert w._held is None


class _Work:
    """The exchange's all-reduce: on `wait`, the other members' rows arrive."""

    def __init__(self, table: torch.Tensor, rows: dict[int, list[float]]) -> None:
        self.table, self.rows = table, rows

    def wait(self) -> None:
        for r, values in self.rows.items():
            self.table[r] += torch.tensor(values, dtype=torch.float64)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


class _World:
    def __init__(self, rows: dict[int, list[float]]) -> None:
        self.rows = rows

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        return _Work(tensors[0], self.rows)


def test_the_exchange_is_waited_for_by_the_callers_wait() -> None:
    w, backend = _member("a0")
    w._held = kept = _held("a0")
    a1 = row(_held("a1").claim, 8)
    waited: list[list[Any]] = []

    def wait(works: list[Any]) -> None:
        waited.append(works)
        _wait(works)

    turns, mine = w.rounds(3, 8, 1.0, _World({1: a1}), GEN, wait)
    assert len(waited) == 1
    # Its group holds 0-3; the rest (4-7) goes over both groups: 4, 5 to this one.
    assert (turns, mine) == ([4], kept)
    assert torch.equal(backend.buf, kept.grad)


def test_a_given_up_exchange_keeps_the_sums_for_the_next_generation() -> None:
    w, backend = _member("a0")
    w._held = kept = _held("a0")

    def broken(works: list[Any]) -> None:
        raise CollectiveAborted(AbortReason.SUPERSEDED, "generation superseded while waiting")

    with pytest.raises(CollectiveAborted):
        w.rounds(3, 8, 1.0, _World({}), GEN, broken)
    assert w._held is kept
    assert not backend.buf.any()


def test_the_exchange_of_another_lineage_resumes_nothing() -> None:
    w, backend = _member("a0")
    w._held = _held("a0")
    world = _World({1: row(_held("a1").claim, 8)})
    turns, mine = w.rounds(3, 8, 1.0, world, GEN + 1, _wait)
    assert mine is None and turns == assign_rounds(8, 2, 0, 2, 0)
    assert not backend.buf.any()


def test_hold_reads_the_loss_sum_only_when_it_keeps() -> None:
    w, _ = _member("a0")
    assert not w.hold(3, [1], cast(Any, _Unread()))  # no claim: nothing read
    w._claim = _held("a0").claim
    assert w.hold(3, [1], torch.tensor(2.5, dtype=torch.float64))
    assert w._held is not None and w._held.loss_sum == 2.5


class _Topology:
    def __init__(self) -> None:
        self.held: list[tuple[int, list[int], Any]] = []

    def hold(self, step: int, samples: list[int], loss_sum: Any) -> bool:
        self.held.append((step, samples, loss_sum))
        return False


def test_forget_hands_the_loss_sum_over_unread() -> None:
    topo = _Topology()
    none = cast(Any, None)
    run = StepRun(none, cast(Any, topo), none, none, none, none)
    try:
        loss = _Unread()
        run._step = _Step(3, 0.0, 1, concurrent.futures.Future(), [5], cast(Any, loss),
                          complete=True)  # fmt: skip
        run.forget()
        assert topo.held == [(3, [5], loss)]
    finally:
        run.close()


def test_only_a_sharded_shadow_waits_for_the_whole_step() -> None:
    # A replica with no micro-batch (more members than micro-batches).
    assert not waits_whole_step(Turns([], True, False))
    assert waits_whole_step(Turns([], False, True, waits_whole_step=True))
    assert not waits_whole_step(Turns([None], False, True, waits_whole_step=True))


class _Aborting:
    """A topology whose first step's exchange is given up (`ShardedGroups.turns`)."""

    def __init__(self, reason: AbortReason) -> None:
        self.reason = reason

    def turns(self, step: int, num_microbatches: int) -> Turns:
        raise CollectiveAborted(self.reason, f"{self.reason} while waiting", ("w3",))


@pytest.mark.parametrize("reason", list(AbortReason))
def test_a_given_up_exchange_abandons_the_step_not_the_worker(reason: AbortReason) -> None:
    events: list[tuple[Any, dict[str, Any]]] = []
    ctx = NS(
        links=NS(broken=None),
        session=NS(incarnation=1, leaving=False),
        client=NS(quorum=lambda req: None),
        proto=NS(gen=5),
        member="w0",
        config=NS(global_batch_size=8, watchdog=NS(ceiling_s=60.0)),
        backend=NS(begin_step=lambda slots: None),
        events=NS(emit=lambda kind, **f: events.append((kind, f))),
    )
    feed = NS(microbatches=lambda s: [[0]] * 8)
    none = cast(Any, None)
    carried = NS(last_loss=None)
    tally = NS(take=lambda: {}, take_scalars=lambda: {})
    run = StepRun(cast(Any, ctx), cast(Any, _Aborting(reason)), cast(Any, feed),
                  cast(Any, carried), none, cast(Any, tally))  # fmt: skip
    try:
        got = run.compute(m.Action(m.Do.COMPUTE, step=3, gen=5))
        run.forget()
    finally:
        run.close()
    if reason is AbortReason.SUPERSEDED:
        assert isinstance(got, m.Superseded) and not events
    else:
        assert isinstance(got, m.ComputeFailed) and "watchdog" in got.error
        assert [f["confirmed"] for _, f in events] == [["w3"]]
