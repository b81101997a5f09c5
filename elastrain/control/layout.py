"""Sharded replica groups: which member holds which slot (pure: no I/O, no clock).

With `shard_size` S > 1 a job's members form replica groups of S: inside a
group the model is sharded (member k of the group holds shard k), and across
groups the members holding the same shard index, the *twins*, reduce that
shard's gradients. A member's *slot* is (replica group, shard index).

`assign_slots` decides the slots of a new generation from the previous one.
Its contract:

- A member that had a slot keeps it. Its shard's bytes (parameters, optimizer
  state) live in its memory: moving it to another slot would mean healing a
  shard it could have kept, and its group-mates would have to re-shard.
- When a member dies, the other members of its replica group stay, holding
  their shards, as *shadows*: their group is incomplete, so it cannot compute
  a gradient, but they keep applying the updates their twins reduce (with a
  zero contribution of their own), so that their shards stay current.
- A joiner takes a vacant slot, so that it completes a group and is healed
  only its shard, from its twins. Vacancies are filled in the incomplete group
  with the most filled slots first (lowest replica id on ties): the group
  closest to completion completes first, and its shadows compute again.
- With no vacancy left, joiners open new replica groups, numbered with the
  smallest unused replica id.

`shard_size` 1 means unsharded: every member is a whole replica and there are
no slots (`assign_slots` returns {} and the wire carries none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import NamedTuple

__all__ = ["Layout", "Slot", "assign_slots", "slots_from_wire"]


class Slot(NamedTuple):
    """Where a member sits: replica group `replica`, shard index `shard`."""

    replica: int
    shard: int


def _check_shard_size(shard_size: int) -> None:
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1 (got {shard_size}); 1 means unsharded")


def _valid(slot: Slot, shard_size: int) -> bool:
    return slot.replica >= 0 and 0 <= slot.shard < shard_size


def assign_slots(
    previous: Mapping[str, Slot], members: Sequence[str], shard_size: int
) -> dict[str, Slot]:
    """The slots of a new generation's `members` (see the module docstring).

    previous    the previous generation's slots; entries of members that are
                not in `members` are ignored (their slots become vacant)
    members     the new generation in the coordinator's rank order (survivors
                first, in their old order, then joiners): joiners are placed
                in this order
    shard_size  S; 1 (unsharded) returns {}

    The result maps every member to a distinct slot, in `members` order. A
    member named twice is placed once. A previous slot that does not fit
    `shard_size`, or that an earlier member already holds, is not kept: that
    member is placed as a joiner (the coordinator's own state never has such
    slots; a worker's report after a coordinator restart might). O(members).
    """
    _check_shard_size(shard_size)
    if shard_size == 1:
        return {}
    kept: dict[str, Slot] = {}
    taken: set[Slot] = set()
    joiners: list[str] = []
    distinct = dict.fromkeys(members)
    for m in distinct:
        s = previous.get(m)
        if s is not None and _valid(s, shard_size) and s not in taken:
            kept[m] = s
            taken.add(s)
        else:
            joiners.append(m)
    if not joiners:
        return kept
    filled = Counter(s.replica for s in taken)
    placed = dict(zip(joiners, _vacancies(filled, taken, shard_size), strict=False))
    return {m: kept[m] if m in kept else placed[m] for m in distinct}


def _vacancies(filled: Counter[int], taken: Collection[Slot], shard_size: int) -> Iterator[Slot]:
    """Slots for joiners, in the order they are given: the vacant slots of the
    incomplete groups, closest to completion first (lowest replica id on ties),
    lowest shard first; then whole new groups, smallest unused replica id first.
    Filling a group never lets it fall behind another, so the order of the
    incomplete groups holds while they are being filled."""
    incomplete = sorted(
        (r for r, n in filled.items() if n < shard_size), key=lambda r: (-filled[r], r)
    )
    for r in incomplete:
        for k in range(shard_size):
            if Slot(r, k) not in taken:
                yield Slot(r, k)
    for r in count():
        if r not in filled:
            yield from (Slot(r, k) for k in range(shard_size))


def slots_from_wire(wire: Mapping[str, Sequence[int]]) -> dict[str, Slot]:
    """member -> [replica, shard] (the wire's form) as Slots; ValueError if malformed."""
    out: dict[str, Slot] = {}
    for m, v in wire.items():
        if (
            not isinstance(v, list | tuple)
            or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ):
            raise ValueError(f"slot of {m!r} must be [replica, shard], got {v!r}")
        out[m] = Slot(v[0], v[1])
    return out


@dataclass(frozen=True)
class Layout:
    """A generation's slots, with the questions a worker asks about them.

    `slots` maps each member to its distinct slot, every one inside
    `shard_size` (ValueError otherwise). An unsharded layout (`shard_size` 1)
    has no slots: its helpers know no member. Replica ids need not be
    contiguous (a group all of whose members died leaves its id unused until a
    new group takes it).
    """

    shard_size: int
    slots: Mapping[str, Slot] = field(default_factory=dict)
    _at: dict[Slot, str] = field(init=False, repr=False, compare=False)
    _filled: Counter[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_shard_size(self.shard_size)
        at: dict[Slot, str] = {}
        for m, s in self.slots.items():
            if not _valid(s, self.shard_size):
                raise ValueError(
                    f"{m} holds slot (replica {s.replica}, shard {s.shard}), outside "
                    f"replica >= 0 and shard < {self.shard_size}"
                )
            if s in at:
                raise ValueError(
                    f"{at[s]} and {m} both hold slot (replica {s.replica}, shard {s.shard})"
                )
            at[s] = m
        object.__setattr__(self, "_at", at)
        object.__setattr__(self, "_filled", Counter(s.replica for s in self.slots.values()))

    @property
    def sharded(self) -> bool:
        return self.shard_size > 1

    def replicas(self) -> list[int]:
        """Every replica id with at least one member, sorted."""
        return sorted(self._filled)

    def complete_replicas(self) -> list[int]:
        """Replica ids whose `shard_size` slots are all filled, sorted: the groups
        that compute gradients."""
        return sorted(r for r, n in self._filled.items() if n == self.shard_size)

    def group(self, replica: int) -> list[str]:
        """The members of replica group `replica`, in shard order (filled slots only)."""
        at = self._at
        return [at[Slot(replica, k)] for k in range(self.shard_size) if Slot(replica, k) in at]

    def twins(self, shard: int) -> list[str]:
        """The members holding shard index `shard`, in replica order: they reduce
        that shard's gradients, and heal a replacement in that shard's slot."""
        at = self._at
        return [at[Slot(r, shard)] for r in sorted(self._filled) if Slot(r, shard) in at]

    def is_shadow(self, member: str) -> bool:
        """Is `member`'s replica group incomplete? A shadow holds its shard and
        applies the updates its twins reduce, contributing no gradient of its
        own. KeyError if `member` has no slot."""
        return self._filled[self.slots[member].replica] < self.shard_size

    def describe(self) -> str:
        """One line for logs: `2x2: r0=[a,b] r1=[c,-]` (groups x shard size;
        `-` a vacant slot); "unsharded" when `shard_size` is 1."""
        if not self.sharded:
            return "unsharded"
        at = self._at
        groups = " ".join(
            f"r{r}=[" + ",".join(at.get(Slot(r, k), "-") for k in range(self.shard_size)) + "]"
            for r in self.replicas()
        )
        head = f"{len(self._filled)}x{self.shard_size}"
        return f"{head}: {groups}" if groups else head

    def to_wire(self) -> dict[str, list[int]]:
        """member -> [replica, shard], as `RendezvousResponse.slots` carries it."""
        return {m: [s.replica, s.shard] for m, s in self.slots.items()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Sequence[int]], shard_size: int) -> Layout:
        """The layout a coordinator sent (`RendezvousResponse.slots`, `.shard_size`);
        ValueError if it is malformed or inconsistent."""
        return cls(shard_size, slots_from_wire(wire))
