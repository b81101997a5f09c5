"""The global sample order and who computes which micro-batch.

Exactly-once rests on two pure functions: step `s` consumes positions
[s*B, (s+1)*B) of one seeded global order (epochs are fresh permutations,
concatenated), and the step's micro-batches are split over the members of the
current generation by `assign_microbatches(M, n, rank)` alone. Nothing depends
on who computed the previous step, so a failure, a join or a leave never
shifts the data.
"""

from __future__ import annotations

import torch


class GlobalOrder:
    """A seeded, infinite sample order over a dataset of `size` samples.

    Position k maps to sample `perm_e[k % size]` of epoch `e = k // size`, where
    `perm_e` is a permutation seeded by (seed, e). Every member computes the
    same order without communicating.
    """

    def __init__(self, size: int, seed: int, *, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("the dataset is empty")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self._cache: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        p = self._cache.get(epoch)
        if p is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF
                )
                p = torch.randperm(self.size, generator=g).tolist()
            else:
                p = list(range(self.size))
            if len(self._cache) > 4:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = p
        return p

    def ids(self, start: int, stop: int) -> list[int]:
        """Sample ids at global positions [start, stop)."""
        out: list[int] = []
        k = start
        while k < stop:
            e, i = divmod(k, self.size)
            take = min(stop - k, self.size - i)
            out.extend(self._perm(e)[i : i + take])
            k += take
        return out


def step_microbatches(step: int, global_batch: int, micro_batch: int) -> list[range]:
    """Global-order positions of each micro-batch of `step`."""
    base = step * global_batch
    return [range(base + i, base + i + micro_batch) for i in range(0, global_batch, micro_batch)]


def assign_microbatches(num_microbatches: int, members: int, rank: int) -> list[int]:
    """Micro-batch indices that `rank` of `members` computes: balanced contiguous
    blocks (sizes differ by at most one); every index goes to exactly one rank."""
    if not 0 <= rank < members:
        raise ValueError(f"rank {rank} out of range for {members} members")
    lo = rank * num_microbatches // members
    hi = (rank + 1) * num_microbatches // members
    return list(range(lo, hi))


def assign_rounds(
    num_microbatches: int, groups: int, group: int, shard_size: int, shard: int
) -> list[int | None]:
    """Micro-batch indices that shard `shard` of replica group `group` (of `groups`
    complete ones) computes, one per round: the group takes a balanced
    contiguous block (`assign_microbatches`) and its members take turns, round k
    giving micro-batch `block[k * shard_size + shard]`. A member whose turn falls
    past the block's end gets None: it still runs the round (its group's
    collectives need every member) with a zero-weight batch."""
    block = assign_microbatches(num_microbatches, groups, group)
    rounds = -(-len(block) // shard_size)
    return [
        block[k * shard_size + shard] if k * shard_size + shard < len(block) else None
        for k in range(rounds)
    ]
