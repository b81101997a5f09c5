"""The global sample order and who computes which micro-batch.

Exactly-once rests on two pure functions: step `s` consumes positions
[s*B, (s+1)*B) of one seeded global order (epochs are fresh permutations,
concatenated), and the step's micro-batches are split over the members of the
current generation by `assign_microbatches(M, n, rank)` alone. Nothing depends
on who computed the previous step, so a failure, a join or a leave never
shifts the data.

Two kinds of order (`OrderKind`), both seeded by (seed, epoch):

- FEISTEL (the default for new jobs): each epoch's permutation is a seeded
  bijection on [0, N) (a balanced Feistel network on the smallest even number
  of bits that covers N, cycle-walking the values >= N back into range).
  Creating the order stores a few integers; `ids(a, b)` costs O(b - a),
  whatever N is, so a billion samples cost nothing up front.
- RANDPERM (jobs before it, and their checkpoints): `torch.randperm(N)` per
  epoch, held in memory as a Python list (about 40 bytes per sample: 40 GB
  at a billion, on every member). Kept bit for bit so a checkpoint written with it resumes on the
  same sample sequence (the engine records the kind with the state).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 6
"""Rounds of the Feistel network (4 already give a pseudorandom permutation of
the keyed round function; 6 for margin against a weak one)."""


ORDER_BLOCK = 1024
"""Positions of a FEISTEL epoch mapped together and kept (`GlobalOrder._block`): the
ids are elementwise functions of their positions, so a block gives each one the same
id as mapping it alone, and one id alone costs ~45 us of numpy call overhead where a
block of 1024 costs ~170 us. A step asks for a few micro-batches' ids every step."""
ORDER_BLOCKS_KEPT = 8
"""Blocks a `GlobalOrder` keeps (the oldest is dropped first): 64 KB or so of ids."""


class OrderKind(enum.StrEnum):
    """How each epoch's permutation is made (recorded in checkpoints and heals)."""

    FEISTEL = "feistel"
    """A seeded bijection computed per position: O(1) memory, O(1) per id."""
    RANDPERM = "randperm"
    """`torch.randperm` per epoch, held in memory (the order of older jobs)."""
    STREAM = "stream"
    """A streaming source's own order (`elastrain.data.stream.StreamOrder`)."""


DEFAULT_ORDER = OrderKind.FEISTEL
"""The kind a job without a checkpoint uses when the config does not say."""


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 on a Python int (key derivation, not per sample)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A seeded bijection on [0, size): `apply` maps positions to sample ids.

    Pure: the same (size, key) gives the same permutation on every machine
    (numpy uint64 arithmetic wraps the same everywhere). Memory: O(rounds).
    """

    def __init__(self, size: int, key: int) -> None:
        if size <= 0:
            raise ValueError("the dataset is empty")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        bits += bits & 1  # balanced halves; the domain 2^bits < 4 * size
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        keys, k = [], key & _MASK64
        for _ in range(FEISTEL_ROUNDS):
            k = _splitmix64(k)
            keys.append(k)
        self.keys = [np.uint64(k) for k in keys]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        """The Feistel network on the 2*half-bit domain (a bijection there)."""
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << h) | right

    def apply(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids of `positions` (uint64, each in [0, size)). Cycle-walking:
        a value outside [0, size) is mapped again until it falls inside, which
        keeps the map a bijection on [0, size); the domain is < 4x the size, so
        the expected number of walks per position is < 4."""
        out = self._round_trip(positions)
        n = np.uint64(self.size)
        outside = np.flatnonzero(out >= n)
        while outside.size:
            out[outside] = self._round_trip(out[outside])
            outside = outside[out[outside] >= n]
        return out


class GlobalOrder:
    """A seeded, infinite sample order over a dataset of `size` samples.

    Position k maps to sample `perm_e[k % size]` of epoch `e = k // size`, where
    `perm_e` is a permutation seeded by (seed, e) of the given `kind`. Every
    member computes the same order without communicating.
    """

    def __init__(
        self,
        size: int,
        seed: int,
        *,
        shuffle: bool = True,
        kind: OrderKind | str = DEFAULT_ORDER,
    ) -> None:
        if size <= 0:
            raise ValueError("the dataset is empty")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        if kind not in (OrderKind.FEISTEL, OrderKind.RANDPERM):
            raise ValueError(
                f"unknown sample order {kind!r} for a map-style dataset "
                f"(one of: {OrderKind.FEISTEL.value}, {OrderKind.RANDPERM.value})"
            )
        self.kind = OrderKind(kind)
        self._cache: dict[int, list[int]] = {}
        self._feistel: dict[int, FeistelPermutation] = {}
        self._blocks: dict[tuple[int, int], list[int]] = {}
        self._blocks_lock = threading.Lock()

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

    def _bijection(self, epoch: int) -> FeistelPermutation:
        f = self._feistel.get(epoch)
        if f is None:
            key = _splitmix64((self.seed & _MASK64) ^ _splitmix64(epoch & _MASK64))
            f = FeistelPermutation(self.size, key)
            if len(self._feistel) > 4:
                self._feistel.pop(min(self._feistel))
            self._feistel[epoch] = f
        return f

    def _slice(self, epoch: int, i: int, take: int) -> list[int]:
        """Sample ids at positions [i, i + take) of `epoch`'s permutation."""
        if not self.shuffle:
            return list(range(i, i + take))
        if self.kind is OrderKind.RANDPERM:
            return self._perm(epoch)[i : i + take]
        if take > ORDER_BLOCK:
            positions = np.arange(i, i + take, dtype=np.uint64)
            return self._bijection(epoch).apply(positions).tolist()
        out: list[int] = []
        j, stop = i, i + take
        while j < stop:
            b, off = divmod(j, ORDER_BLOCK)
            block = self._block(epoch, b)
            n = min(stop - j, len(block) - off)
            out.extend(block[off : off + n])
            j += n
        return out

    def _block(self, epoch: int, b: int) -> list[int]:
        """The ids of `epoch`'s positions [b, b + 1) x ORDER_BLOCK (clipped to the epoch)."""
        with self._blocks_lock:
            ids = self._blocks.get((epoch, b))
        if ids is None:
            lo = b * ORDER_BLOCK
            positions = np.arange(lo, min(lo + ORDER_BLOCK, self.size), dtype=np.uint64)
            ids = self._bijection(epoch).apply(positions).tolist()
            with self._blocks_lock:
                while len(self._blocks) >= ORDER_BLOCKS_KEPT:
                    del self._blocks[next(iter(self._blocks))]
                self._blocks[(epoch, b)] = ids
        return ids

    def ids(self, start: int, stop: int) -> list[int]:
        """Sample ids at global positions [start, stop)."""
        if start < 0 or stop < start:
            raise ValueError(f"bad position range [{start}, {stop})")
        out: list[int] = []
        k = start
        while k < stop:
            e, i = divmod(k, self.size)
            take = min(stop - k, self.size - i)
            out.extend(self._slice(e, i, take))
            k += take
        return out


@dataclass(frozen=True)
class DataPosition:
    """Where each step's window of the order starts: the position of the sample
    after the last one consumed, at a known step.

    Step s consumes positions [start(s), start(s) + B) with B the global batch.
    A job that never changed B has (0, 0), so step s starts at s * B. It travels
    with the state (heal meta, checkpoints) as of the committed count, so a job
    resumed with another global batch size goes on from the sample after the
    last one consumed, and a stream is reopened exactly there.
    """

    step: int = 0
    position: int = 0

    def start(self, step: int, global_batch: int) -> int:
        """The first position of `step`'s window."""
        return self.position + (step - self.step) * global_batch

    def at(self, step: int, global_batch: int) -> DataPosition:
        """The same positions, anchored at `step` (what is saved with its state)."""
        return DataPosition(step, self.start(step, global_batch))

    def microbatches(self, step: int, global_batch: int, micro_batch: int) -> list[range]:
        """Positions of each micro-batch of `step`."""
        base = self.start(step, global_batch)
        return [
            range(base + i, base + i + micro_batch) for i in range(0, global_batch, micro_batch)
        ]

    def to_json(self) -> list[int]:
        return [self.step, self.position]

    @staticmethod
    def from_json(raw: Any) -> DataPosition:
        """Parse `to_json`'s form; absent (state from before positions were kept): (0, 0)."""
        if raw is None:
            return DataPosition()
        if not (isinstance(raw, list | tuple) and len(raw) == 2
                and all(isinstance(x, int) and x >= 0 for x in raw)):  # fmt: skip
            raise ValueError(f"bad data position {raw!r} in the state's meta")
        return DataPosition(int(raw[0]), int(raw[1]))


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
