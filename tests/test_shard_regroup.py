"""Which replica groups keep their FSDP2 wrapper across a regroup
(`elastrain.runtime.shard_regroup`), without processes; and a member's heal
keeping or rebuilding it (`ShardedMember`, with fakes)."""

from __future__ import annotations

from typing import Any, cast

import torch

from elastrain.control import protocol as p
from elastrain.control.layout import Layout
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.shard_member import ShardedMember
from elastrain.runtime.shard_regroup import BuiltGroup, kept, report

TWO_BY_TWO = {"a0": [0, 0], "a1": [0, 1], "b0": [1, 0], "b1": [1, 1]}
BUILT_A = BuiltGroup(("a0", "a1"), 2, 3)
BUILT_B = BuiltGroup(("b0", "b1"), 2, 3)


def _layout(slots: dict[str, list[int]], size: int = 2) -> Layout:
    return Layout.from_wire(slots, size)


def test_a_member_reports_its_wrapper_only_for_the_same_group_in_the_same_slots() -> None:
    lay = _layout(TWO_BY_TWO)
    assert report(BUILT_A, True, lay, "a0") == 3
    assert report(BUILT_A, False, lay, "a0") == 0  # a collective of it failed or stopped
    assert report(None, True, lay, "a0") == 0
    # The same members, their shard slots swapped: the wrapper's ranks are not theirs.
    swapped = _layout({**TWO_BY_TWO, "a0": [0, 1], "a1": [0, 0]})
    assert report(BUILT_A, True, swapped, "a0") == 0
    # A new member in the group (a replacement for a1).
    replaced = _layout({"a0": [0, 0], "c1": [0, 1], "b0": [1, 0], "b1": [1, 1]})
    assert report(BUILT_A, True, replaced, "a0") == 0
    # A reshard to 1 x 3 (another shard size), and a shadow (its group lost a1).
    assert report(BUILT_A, True, _layout({"a0": [0, 0], "b0": [0, 1], "b1": [0, 2]}, 3), "a0") == 0
    assert report(BUILT_A, True, _layout({"a0": [0, 0], "b0": [1, 0], "b1": [1, 1]}), "a0") == 0


def test_a_group_keeps_its_wrapper_only_if_all_its_members_can_and_none_receives() -> None:
    lay = _layout(TWO_BY_TWO)
    every = {"a0": 3, "a1": 3, "b0": 3, "b1": 3}
    assert kept(every, lay, [], False) == {0, 1}
    assert kept(every, lay, [], True) == frozenset()  # a reshard moves every row
    assert kept(every, lay, ["b1"], False) == {0}  # a heal replaces b1's state
    assert kept({**every, "a1": 0}, lay, [], False) == {1}  # a1's group broke (or it has none)
    # Two wrappers of the same members from different generations: two process groups.
    assert kept({**every, "a1": 4}, lay, [], False) == {1}
    # A group with a vacancy computes nothing: nothing to keep.
    short = _layout({"a0": [0, 0], "b0": [1, 0], "b1": [1, 1]})
    assert kept({"a0": 3, "b0": 3, "b1": 3}, short, [], False) == {1}


class _Backend:
    """What `ShardedMember.heal` asks of its backend: a placed shard and a wrapper."""

    native = False
    placed = True
    needs_fill = False
    shard_size = 2

    def __init__(self, shard: int, group: tuple[str, ...]) -> None:
        self.shard = shard
        self.model: Any = object()
        self.group: tuple[str, ...] | None = group
        self.group_clean = True
        self.formed: list[tuple[Any, bool]] = []

    def place(self, shard: int, size: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def adopt(self, state: Any) -> None:
        pass

    def form_group(self, group: Any, open_group: Any, keep: bool = False) -> bool:
        self.formed.append((group, keep))
        if keep:
            return False
        self.group, self.model = group, None if group is None else object()
        return group is not None

    def leave_group(self) -> None:
        self.model, self.group = None, None


class _Events:
    def emit(self, kind: Any, **fields: Any) -> None:
        pass


class _Stats:
    def event_fields(self) -> dict[str, Any]:
        return {}


class _World:
    """The generation's group: the other members' reports arrive with the all-reduce."""

    def __init__(self, others: dict[int, int]) -> None:
        self.others = others

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        t = tensors[0]
        for rank, value in self.others.items():
            t[rank] += value
        return self

    def wait(self) -> None:
        pass


def _member(name: str, slots: dict[str, list[int]]) -> tuple[ShardedMember, _Backend]:
    group = tuple(
        w for w, s in sorted(slots.items(), key=lambda kv: kv[1]) if s[0] == slots[name][0]
    )
    backend = _Backend(slots[name][1], group)
    config = TrainerConfig(global_batch_size=8, micro_batch_size=1, total_steps=10, shard_size=2)
    w = ShardedMember(cast(Any, backend), name, config, "127.0.0.1", cast(Any, _Events()),
                      cast(Any, None))  # fmt: skip
    w._built = BuiltGroup(group, 2, 3)
    return w, backend


def _heal(w: ShardedMember, slots: dict[str, list[int]], committed: dict[str, int],
          others: dict[int, int]) -> None:  # fmt: skip
    members = list(slots)
    ready = p.RendezvousResponse(
        "ready", 5, members, committed, 3, commit_gens=dict.fromkeys(members, 4),
        slots=slots, shard_size=2,
    )  # fmt: skip
    w.layout = Layout.from_wire(slots, 2)
    w._members = members
    w.heal(5, False, ready, _World(others), lambda c: {"step": c}, lambda meta: 3,
           lambda *a, **k: ({"step": 3}, _Stats()), None)  # fmt: skip


def test_a_healthy_group_keeps_its_wrapper_through_a_heal_of_the_other_group() -> None:
    # b1 was replaced by c1, which its twin a1 heals: group 0 (a0, a1) is unchanged.
    slots = {"a0": [0, 0], "a1": [0, 1], "b0": [1, 0], "c1": [1, 1]}
    committed = {"a0": 3, "a1": 3, "b0": 3, "c1": 0}
    w, backend = _member("a0", {**TWO_BY_TWO})
    _heal(w, slots, committed, {1: 3, 2: 0, 3: 0})
    assert backend.formed == [(("a0", "a1"), True)] and w.group_kept
    assert w.event_fields()["group_kept"] == 1
    # b0's group changed (c1): built again, and remembered as built in generation 5.
    w, backend = _member("b0", {**TWO_BY_TWO})
    _heal(w, slots, committed, {0: 3, 1: 3, 3: 0})
    assert backend.formed == [(("b0", "c1"), False)] and not w.group_kept
    assert w._built == BuiltGroup(("b0", "c1"), 2, 5)
    # a0 again, but a1 saw a collective of their group fail (it reports 0): rebuilt.
    w, backend = _member("a0", {**TWO_BY_TWO})
    _heal(w, slots, committed, {1: 0, 2: 0, 3: 0})
    assert backend.formed == [(("a0", "a1"), False)]
    # a0's own compute left the group midway: it reports 0 and rebuilds with a1.
    w, backend = _member("a0", {**TWO_BY_TWO})
    backend.group_clean = False
    _heal(w, slots, committed, {1: 3, 2: 0, 3: 0})
    assert backend.formed == [(("a0", "a1"), False)]


def test_drop_keeps_the_wrapper_and_close_leaves_it() -> None:
    w, backend = _member("a0", {**TWO_BY_TWO})
    w.drop([])
    assert backend.model is not None and backend.group == ("a0", "a1")
    w.close()
    assert backend.model is None and w._built is None
