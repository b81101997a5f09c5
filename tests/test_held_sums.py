"""Held sums (issue 41 item 4): which replica group holds which micro-batches of an
interrupted step, and the rest's assignment (pure, `elastrain.runtime.held_sums`).
The job-level test (a kill early in a step, the healthy group computing only the
lost group's micro-batches, bit for bit) is in tests/test_sharded.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.data import assign_rounds
from elastrain.runtime.held_sums import Claim, assign_rest, claim_of, decide, row

G = [(0, ["a0", "a1"]), (1, ["b0", "b1"])]


def _claims(mask: set[int], members: list[str], step: int = 6, size: int = 2) -> dict:
    return {w: Claim(step, size, k, frozenset(mask)) for k, w in enumerate(members)}


def test_a_group_holds_what_all_its_shards_hold_for_this_step_and_slot() -> None:
    both = _claims({4, 5, 6, 7}, ["b0", "b1"])
    assert decide(both, G, 2, 6) == {1: frozenset({4, 5, 6, 7})}
    # One shard lacks it (a new member, a failed compute): the group holds nothing.
    assert decide({"b0": both["b0"], "b1": None}, G, 2, 6) == {}
    # Different sets (one member ran a round the other did not finish).
    assert decide({**both, "b1": Claim(6, 2, 1, frozenset({4, 5}))}, G, 2, 6) == {}
    # Another step, another shard size, or the shards swapped: dropped.
    assert decide(both, G, 2, 7) == {}
    assert decide(both, G, 3, 6) == {}
    assert decide({"b0": both["b1"], "b1": both["b0"]}, G, 2, 6) == {}
    # A group regrouped from two old ones: their sets differ, nothing held.
    mixed = {"a0": Claim(6, 2, 0, frozenset({0, 1})), "a1": Claim(6, 2, 1, frozenset({4}))}
    assert decide(mixed, G, 2, 6) == {}


def test_two_groups_never_hold_one_micro_batch() -> None:
    claims = {**_claims({0, 1, 2}, ["a0", "a1"]), **_claims({2, 3}, ["b0", "b1"])}
    assert decide(claims, G, 2, 6) == {0: frozenset({0, 1, 2})}


def test_a_claim_survives_its_row() -> None:
    c = Claim(0, 3, 2, frozenset({0, 7}))
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
