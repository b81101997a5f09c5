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

Resharding (issue 16): when the members cannot fill whole replica groups of the
job's shard size for long, the coordinator regroups them to another shard size
in memory (`choose_shard_size` decides which, `reshard_slots` who takes which
shard of it), and back when replacements return. Shard k of S holds the rows
[k/S, (k+1)/S) of every parameter (the `torch.chunk` split along dim 0, which is
FSDP2's `Shard(0)`); a member's `Holding` says which rows it holds now.
`state_bytes` sizes a model from its signature, for the memory check.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import count
from typing import Any, NamedTuple

__all__ = [
    "Holding",
    "Layout",
    "Slot",
    "assign_slots",
    "choose_shard_size",
    "reshard_slots",
    "slots_from_wire",
    "state_bytes",
]


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


# ---- resharding -----------------------------------------------------------------


class Holding(NamedTuple):
    """What a member's state holds: shard `shard` of the model split
    `shard_size` ways, i.e. the rows [shard/shard_size, (shard+1)/shard_size)
    of every parameter (shard_size 1: the whole model)."""

    shard_size: int
    shard: int

    def rows(self) -> tuple[Fraction, Fraction]:
        """The fraction [lo, hi) of every parameter's rows it holds."""
        return Fraction(self.shard, self.shard_size), Fraction(self.shard + 1, self.shard_size)

    def overlap(self, other: Holding) -> Fraction:
        """The fraction of every parameter's rows that both hold (0: none)."""
        (a, b), (c, d) = self.rows(), other.rows()
        return max(Fraction(0), min(b, d) - max(a, c))


def choose_shard_size(alive: int, preferred: int, fits: Callable[[int], bool]) -> int | None:
    """The shard size S for `alive` members: a divisor of `alive`, so that the
    members form whole replica groups (alive / S of them) and every group
    computes; None when no divisor `fits`.

    alive      members to place (>= 1)
    preferred  the job's configured shard size (`--shard-size`)
    fits(S)    does a shard of the model split S ways fit one member's memory
               budget? (A larger S means a smaller shard, so it is monotone in
               practice; the rule does not rely on it.)

    The rule, in order:

    1. `preferred` when it divides `alive` and fits: the job's own shape.
    2. Else the smallest divisor >= `preferred` that fits (3 alive, preferred
       2: 3, i.e. 1 x 3). At least `preferred` because then no member holds
       more than it did in the job's own shape, which ran in its memory even
       when no budget was declared; the smallest such because fewer shards per
       group mean more replica groups: more twins to heal a shard from, and a
       data-parallel degree closer to the job's.
    3. Else the largest divisor below `preferred` that fits (3 alive, preferred
       4: 3): the least memory per member that whole groups allow.

    With a configured `--min` (a multiple of `preferred`) the coordinator never
    has fewer than `preferred` members, so step 2 always has `alive` itself as a
    candidate and step 3 is for completeness. O(sqrt(alive)) divisor search
    plus one `fits` call per divisor at most.
    """
    if alive < 1 or preferred < 1:
        raise ValueError(f"alive and preferred must be >= 1 (got {alive}, {preferred})")
    if alive % preferred == 0 and fits(preferred):
        return preferred
    divisors = _divisors(alive)
    for s in divisors:
        if s >= preferred and fits(s):
            return s
    for s in reversed(divisors):
        if s < preferred and fits(s):
            return s
    return None


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def reshard_slots(
    previous: Mapping[str, Slot], old_size: int, members: Sequence[str], new_size: int
) -> dict[str, Slot]:
    """The slots of a generation that regroups `members` to a new shard size.

    previous  the slots the members hold now, in a layout of `old_size`
              (members without a valid one hold nothing: joiners)
    members   the new generation, in rank order
    new_size  the new shard size; 1 (unsharded) returns {}

    The result is a fresh layout: n = len(members) members fill n // new_size
    complete replica groups (replica ids 0, 1, ...) and, with a remainder, one
    incomplete group after them. Which member takes which shard minimises the
    bytes that move: a member that held old shard k keeps the rows its new
    shard shares with k (rows as fractions [k/S, (k+1)/S) of every
    parameter), so the placement maximises the total overlap over all members
    (a transportation problem between old and new shard indices, solved
    exactly as a min-cost flow; which shards the incomplete group holds is
    part of it). Joiners hold nothing and take what the holders leave.

    Deterministic: among placements that move as few bytes, the one found by
    the fixed order of the solver; members taking the same new shard go to
    replica ids in the order of their old replica id (joiners last, in
    `members` order), which keeps old group-mates together where it costs
    nothing. A member named twice is placed once; a previous slot that does
    not fit `old_size`, or that an earlier member already holds, counts as
    none (as in `assign_slots`). With `old_size` 1 every previous member held
    the whole model, so any placement keeps everything: rank order.

    Cost: O(members log members) plus the flow over O(old_size + new_size)
    nodes, independent of the member count.
    """
    _check_shard_size(old_size)
    _check_shard_size(new_size)
    distinct = list(dict.fromkeys(members))
    if new_size == 1:
        return {}
    if old_size == 1:
        return assign_slots({}, distinct, new_size)
    held: dict[str, Slot] = {}
    taken: set[Slot] = set()
    for m in distinct:
        s = previous.get(m)
        if s is not None and _valid(s, old_size) and s not in taken:
            held[m] = s
            taken.add(s)
    n = len(distinct)
    full, rest = divmod(n, new_size)
    by_class: list[list[str]] = [[] for _ in range(old_size + 1)]  # old shards, then joiners
    order = {m: i for i, m in enumerate(distinct)}
    for m in distinct:
        s = held.get(m)
        by_class[s.shard if s is not None else old_size].append(m)
    for ms in by_class[:old_size]:
        ms.sort(key=lambda m: (held[m].replica, order[m]))
    counts = _transport([len(ms) for ms in by_class], old_size, new_size, full, rest)
    # Members per new shard, class by class (within a class every member holds
    # the same rows, so which of them goes where moves the same bytes).
    on_shard: list[list[str]] = [[] for _ in range(new_size)]
    for k, ms in enumerate(by_class):
        it = iter(ms)
        for j in range(new_size):
            on_shard[j].extend(next(it) for _ in range(counts[k][j]))
    out: dict[str, Slot] = {}
    for j, ms in enumerate(on_shard):
        ms.sort(key=lambda m: (held[m].replica if m in held else n + order[m], order[m]))
        for r, m in enumerate(ms):
            out[m] = Slot(r, j)
    return {m: out[m] for m in distinct}


def _transport(
    supply: list[int], old_size: int, new_size: int, full: int, rest: int
) -> list[list[int]]:
    """How many members of each class (old shard 0..old_size-1, then joiners)
    take each new shard, maximising the total rows kept: counts[k][j].

    Every new shard is taken by `full` members (the complete groups) and
    `rest` distinct shards by one more (the incomplete group). A min-cost flow:
    source -> class (its member count) -> new shard (cost: minus the overlap,
    for overlapping pairs; through a zero-cost hub for any pair, so that every
    placement is possible) -> sink (`full` at a cost of minus BIG, which
    outweighs any overlap and so fills the complete groups first; then 1 more
    per shard at no cost, for the incomplete group). Overlaps are integers in
    units of 1 / (old_size * new_size) of the rows, so the optimum is exact.
    """
    n = sum(supply)
    classes = old_size + 1
    src, hub, sink = 0, 1 + classes + new_size, 2 + classes + new_size
    flow = _MinCostFlow(sink + 1)
    big = n * min(old_size, new_size) + 1

    def cls(k: int) -> int:
        return 1 + k

    def shard(j: int) -> int:
        return 1 + classes + j

    for k, c in enumerate(supply):
        if c:
            flow.add(src, cls(k), c, 0)
    direct: dict[tuple[int, int], int] = {}
    for k in range(old_size):
        if not supply[k]:
            continue
        # The new shards whose rows meet [k/old, (k+1)/old): j*old < (k+1)*new
        # and (j+1)*old > k*new.
        for j in range(k * new_size // old_size, min(new_size, -(-(k + 1) * new_size // old_size))):
            w = min((k + 1) * new_size, (j + 1) * old_size) - max(k * new_size, j * old_size)
            if w > 0:
                direct[k, j] = flow.add(cls(k), shard(j), n, -w)
    via_hub = {k: flow.add(cls(k), hub, n, 0) for k, c in enumerate(supply) if c}
    from_hub = [flow.add(hub, shard(j), n, 0) for j in range(new_size)]
    for j in range(new_size):
        if full:
            flow.add(shard(j), sink, full, -big)
        if rest:
            flow.add(shard(j), sink, 1, 0)
    flow.run(src, sink, n)
    counts = [[0] * new_size for _ in range(classes)]
    for (k, j), e in direct.items():
        counts[k][j] += flow.used(e)
    # Split the hub's flow among the classes that sent into it (all at zero
    # overlap, so any split keeps as many rows): in class then shard order.
    left = [flow.used(e) for e in from_hub]
    j = 0
    for k, e in via_hub.items():
        need = flow.used(e)
        while need:
            while not left[j]:
                j += 1
            take = min(need, left[j])
            counts[k][j] += take
            left[j] -= take
            need -= take
    return counts


class _MinCostFlow:
    """Successive shortest paths (Bellman-Ford with a queue, so negative costs
    are fine: the residual graph of a min-cost flow has no negative cycle).
    For the few nodes of `_transport`."""

    def __init__(self, nodes: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(nodes)]
        self.to: list[int] = []
        self.cap: list[int] = []
        self.cost: list[int] = []
        self.initial: list[int] = []

    def add(self, u: int, v: int, cap: int, cost: int) -> int:
        """An edge u -> v (and its residual twin); returns its handle."""
        e = len(self.to)
        for a, b, c, w in ((u, v, cap, cost), (v, u, 0, -cost)):
            self.adj[a].append(len(self.to))
            self.to.append(b)
            self.cap.append(c)
            self.cost.append(w)
            self.initial.append(c)
        return e

    def used(self, e: int) -> int:
        """The flow on edge `e`."""
        return self.initial[e] - self.cap[e]

    def run(self, s: int, t: int, amount: int) -> None:
        """Send `amount` units from s to t at the least total cost."""
        nodes = len(self.adj)
        while amount:
            dist: list[float] = [math.inf] * nodes
            back = [-1] * nodes
            dist[s] = 0
            queue, queued = [s], [False] * nodes
            queued[s] = True
            head = 0
            while head < len(queue):
                u = queue[head]
                head += 1
                queued[u] = False
                for e in self.adj[u]:
                    v = self.to[e]
                    if self.cap[e] and dist[u] + self.cost[e] < dist[v]:
                        dist[v] = dist[u] + self.cost[e]
                        back[v] = e
                        if not queued[v]:
                            queued[v] = True
                            queue.append(v)
            if back[t] < 0:
                raise AssertionError("no room for every member: the sink cannot take them")
            push, v = amount, t
            while v != s:
                e = back[v]
                push = min(push, self.cap[e])
                v = self.to[e ^ 1]
            v = t
            while v != s:
                e = back[v]
                self.cap[e] -= push
                self.cap[e ^ 1] += push
                v = self.to[e ^ 1]
            amount -= push


_ITEMSIZE: dict[str, int] = {
    **dict.fromkeys(["complex128"], 16),
    **dict.fromkeys(["float64", "double", "int64", "long", "uint64", "complex64", "cfloat"], 8),
    **dict.fromkeys(["float32", "float", "int32", "int", "uint32", "qint32", "complex32"], 4),
    **dict.fromkeys(["float16", "half", "bfloat16", "int16", "short", "uint16", "bits16"], 2),
    **dict.fromkeys(["bool", "int8", "uint8", "qint8", "quint8", "bits8"], 1),
}
"""Bytes per element of the dtypes a signature names, without importing torch
or numpy (the coordinator needs neither): torch's `str(dtype)` less its
"torch." prefix, and numpy/JAX names."""
_ONE_BYTE = re.compile(r"(u?int[1-7]|float[468]_\w+|quint\dx\d|bits\dx\d)")
"""Sub-byte and 8-bit float dtypes: one byte per element (torch stores each
element, or each packed pair like `float4_e2m1fn_x2`, in a byte; so do
ml_dtypes' int4 and float8 types)."""


def state_bytes(signature: Sequence[Sequence[Any]]) -> int:
    """Bytes of a model's tensors from its signature `[[name, shape, dtype], ...]`
    (as workers register it: `elastrain.transfer.model_signature`, or the JAX
    backend's): the sum of numel x element size. dtypes are torch's
    ("torch.float32") or numpy's ("float32", "bfloat16"). The signature lists
    the state_dict, so buffers count too (they are small next to parameters).
    ValueError on a malformed entry or an unknown dtype."""
    total = 0
    for entry in signature:
        if len(entry) != 3:
            raise ValueError(f"signature entry {entry!r} is not [name, shape, dtype]")
        _, shape, dtype = entry
        name = str(dtype).removeprefix("torch.")
        size = _ITEMSIZE.get(name)
        if size is None:
            if not _ONE_BYTE.fullmatch(name):
                raise ValueError(f"cannot size dtype {dtype!r} of {entry[0]!r}")
            size = 1
        total += math.prod(int(d) for d in shape) * size
    return total
