"""Held sums: the shard sums a generation's healthy replica groups computed for a
step that did not commit, reused by the next generation.

With float64 reductions a member's shard buffer holds, after its group's
rounds, the exact sum of its group's micro-batch gradients for its shard's
rows. When the generation breaks before the member hands that buffer to the
twins' all-reduce (the verdict says "regroup", or its twins' handshake fails),
nothing has written into it but its own group's reduce-scatters. The member
keeps it (`Held`): the buffer, the step, its slot, which micro-batches its group
summed into it, and its own samples and loss sum of them.

At the next generation's first step every member reports what it holds (`Claim`,
one row each, all-reduced once over the generation, `post_exchange`, waited for
like a step's reductions: a broken generation ends the wait), and every
member decides alike from the same rows (`decide`, pure):

- a complete replica group of the new generation *holds* a set of micro-batches
  only when every one of its members claims the same set for the same step of
  the state it has now (same step count and lineage, `commit_gen`: a zombie
  commit's state has the same count but not the same rows) from the slot it has
  now (same shard size, same shard: its buffer's rows are its slot's rows). One member that lacks it (a new member, a member whose compute
  failed, a member moved by a reshard) and the group holds nothing;
- two groups never hold the same micro-batch (they come from one assignment;
  checked anyway: a later group that overlaps an earlier one holds nothing);
- a shadow holds nothing (its buffer must be zero: it takes part in its twins'
  all-reduce).

The micro-batches no group holds are assigned over the complete groups as a
fresh step's are (`assign_rest`: balanced contiguous blocks of the rest, one
micro-batch per member per round). So each micro-batch's gradient is summed once
per shard, by one group, and its samples and loss are counted once, by the member
that computed it. The float64 sums are exact for float32 gradients of similar
magnitude (the replicated trainer's bit-identity rests on the same), so the step's
sum does not depend on which group summed what, nor in which generation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastrain.data import assign_microbatches

__all__ = ["Claim", "Held", "assign_rest", "claim_of", "decide", "post_exchange", "row"]

_HEAD = 4
"""A claim row's fields before its mask: step + 1 (0: no claim), commit_gen, shard
size, shard."""


@dataclass(frozen=True)
class Claim:
    """What one member holds of a step: micro-batches `mask` summed in the buffer
    of its slot (`shard_size`, `shard`), computed from the state of `step` steps
    committed in generation `commit_gen` (its lineage, `MemberProtocol.commit_gen`)."""

    step: int
    commit_gen: int
    shard_size: int
    shard: int
    mask: frozenset[int]


@dataclass
class Held:
    """The kept part of an interrupted step, on the member that computed it."""

    claim: Claim
    grad: torch.Tensor
    """The shard buffer (float64): its group's sums of `claim.mask`."""
    samples: list[int]
    """This member's own samples of those micro-batches (for `step_contrib`)."""
    loss_sum: float
    """Their loss sum (for the step's extras)."""


def row(claim: Claim | None, num_microbatches: int) -> list[float]:
    """A member's row of the exchange: zeros for no claim."""
    out = [0.0] * (_HEAD + num_microbatches)
    if claim is None:
        return out
    out[:_HEAD] = [float(claim.step + 1), float(claim.commit_gen), float(claim.shard_size),
                   float(claim.shard)]  # fmt: skip
    for i in claim.mask:
        out[_HEAD + i] = 1.0
    return out


def claim_of(values: Sequence[float]) -> Claim | None:
    if values[0] <= 0:
        return None
    mask = frozenset(i for i, v in enumerate(values[_HEAD:]) if v > 0)
    return Claim(int(values[0]) - 1, int(values[1]), int(values[2]), int(values[3]), mask)


def decide(
    claims: Mapping[str, Claim | None],
    groups: Sequence[tuple[int, Sequence[str]]],
    shard_size: int,
    step: int,
    commit_gen: int,
) -> dict[int, frozenset[int]]:
    """The micro-batches each complete replica group holds for `step` of the state
    committed in generation `commit_gen` (`groups`: the complete groups in replica
    order, each with its members in shard order; see the module docstring). A group
    that holds nothing is left out."""
    held: dict[int, frozenset[int]] = {}
    taken: set[int] = set()
    for replica, members in groups:
        got = [claims.get(w) for w in members]
        first = got[0]
        if first is None or not first.mask:
            continue
        if not all(
            c is not None
            and c.step == step
            and c.commit_gen == commit_gen
            and c.shard_size == shard_size
            and c.shard == k
            and c.mask == first.mask
            for k, c in enumerate(got)
        ):
            continue
        if taken & first.mask:
            continue
        held[replica] = first.mask
        taken |= first.mask
    return held


def assign_rest(
    num_microbatches: int,
    held: Mapping[int, frozenset[int]],
    complete: Sequence[int],
    replica: int,
    shard_size: int,
    shard: int,
) -> list[int | None]:
    """The turns of shard `shard` of complete group `replica` (one micro-batch per
    round, None: a padding round): the micro-batches no group holds, in balanced
    contiguous blocks over the `complete` groups, as `data.assign_rounds` assigns
    a whole step."""
    taken = set().union(*held.values()) if held else set()
    rest = [i for i in range(num_microbatches) if i not in taken]
    block = [
        rest[j] for j in assign_microbatches(len(rest), len(complete), complete.index(replica))
    ]
    rounds = -(-len(block) // shard_size)
    return [
        block[k * shard_size + shard] if k * shard_size + shard < len(block) else None
        for k in range(rounds)
    ]


def post_exchange(
    pg: Any, rank: int, size: int, claim: Claim | None, num_microbatches: int
) -> tuple[list[Any], torch.Tensor]:
    """Start the exchange of every member's claim: one SUM all-reduce over the
    generation's group `pg` of a (size x row) float64 table in which each member
    writes its own row. Returns the works (not waited: the caller waits as for a
    step's reductions, so a broken generation or a hung peer ends the wait) and the
    table, whose rows `claim_of` reads once they completed. Collective over the
    generation."""
    table = torch.zeros(size, _HEAD + num_microbatches, dtype=torch.float64)
    table[rank] = torch.tensor(row(claim, num_microbatches), dtype=torch.float64)
    return [pg.allreduce([table])], table
