"""The global order, micro-batch assignment, streams and the prefetching loader
behind exactly-once data."""

from __future__ import annotations

import os
import random
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.data import (
    BatchLoader,
    DataPosition,
    FeistelPermutation,
    GlobalOrder,
    LoaderConfig,
    LoaderError,
    MapFetch,
    OrderKind,
    StreamEnded,
    StreamFetch,
    StreamReader,
    assign_microbatches,
    check_dataset,
    step_microbatches,
)
from elastrain.data.order import ORDER_BLOCK

KINDS = [OrderKind.FEISTEL, OrderKind.RANDPERM]


@pytest.mark.parametrize("kind", KINDS)
def test_order_is_seeded_and_covers_each_epoch_once(kind: OrderKind) -> None:
    a, b = GlobalOrder(100, seed=3, kind=kind), GlobalOrder(100, seed=3, kind=kind)
    assert a.ids(0, 250) == b.ids(0, 250)
    assert sorted(a.ids(0, 100)) == list(range(100))
    assert sorted(a.ids(100, 200)) == list(range(100))
    assert a.ids(0, 100) != a.ids(100, 200)
    assert GlobalOrder(100, seed=4, kind=kind).ids(0, 100) != a.ids(0, 100)


@pytest.mark.parametrize("kind", KINDS)
def test_ids_are_position_pure(kind: OrderKind) -> None:
    o = GlobalOrder(37, seed=1, kind=kind)
    whole = o.ids(0, 200)
    assert o.ids(50, 90) == whole[50:90]
    assert GlobalOrder(37, seed=1, kind=kind).ids(90, 91) == whole[90:91]


def test_the_randperm_order_is_the_one_older_jobs_and_checkpoints_used() -> None:
    """Bit for bit what GlobalOrder computed before the Feistel order existed."""
    o = GlobalOrder(50, seed=7, kind="randperm")
    for epoch in range(2):
        g = torch.Generator().manual_seed((7 * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF)
        assert o.ids(50 * epoch, 50 * (epoch + 1)) == torch.randperm(50, generator=g).tolist()
    assert GlobalOrder(50, seed=7).kind is OrderKind.FEISTEL  # the default for new jobs


def test_feistel_is_a_bijection_for_every_size_up_to_200() -> None:
    for n in range(1, 201):
        f = FeistelPermutation(n, key=n * 7919)
        got = f.apply(np.arange(n, dtype=np.uint64))
        assert sorted(got.tolist()) == list(range(n)), n


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50_000), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 50))
def test_feistel_epochs_are_permutations(n: int, seed: int, epoch: int) -> None:
    ids = GlobalOrder(n, seed).ids(epoch * n, (epoch + 1) * n)
    assert len(ids) == n
    assert np.array_equal(np.sort(np.asarray(ids)), np.arange(n))


def test_feistel_shuffles() -> None:
    ids = GlobalOrder(10_000, seed=0).ids(0, 10_000)
    # Not the identity, not a rotation: few fixed points, neighbours far apart.
    assert sum(i == x for i, x in enumerate(ids)) < 10
    assert np.median(np.abs(np.diff(np.asarray(ids)))) > 1000


def test_ids_kept_in_blocks_are_the_epoch_permutations_ids() -> None:
    """GlobalOrder maps a step's few positions from blocks of ORDER_BLOCK it keeps: each
    id must be its position's in the epoch's permutation (`FeistelPermutation.apply` on
    the asked positions, what `ids` computed before it kept blocks), across block and
    epoch edges, and with more blocks asked for than are kept."""
    for size in (5, ORDER_BLOCK, ORDER_BLOCK + 3, 3 * ORDER_BLOCK + 17):
        o = GlobalOrder(size, seed=11)
        rng = random.Random(size)
        for _ in range(60):
            a = rng.randrange(0, 3 * size)
            b = a + rng.randrange(0, min(ORDER_BLOCK + 5, 3 * size))
            want: list[int] = []
            for e in range(a // size, (b - 1) // size + 1):
                lo, hi = max(a, e * size) - e * size, min(b, (e + 1) * size) - e * size
                want += o._bijection(e).apply(np.arange(lo, hi, dtype=np.uint64)).tolist()
            assert o.ids(a, b) == want, (size, a, b)


def test_a_billion_sample_order_costs_nothing_up_front() -> None:
    """Acceptance: the order for 10^9 samples is created in < 10 ms and < 1 MB."""
    GlobalOrder(10, seed=1).ids(0, 10)  # imports and numpy warmed up

    def create() -> tuple[GlobalOrder, list[int]]:
        o = GlobalOrder(10**9, seed=123)
        return o, o.ids(0, 32)  # the first step's first ids included

    # Timed untraced (tracemalloc slows allocation); best of 3 on a shared machine.
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        create()
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.010, times
    tracemalloc.start()
    try:
        o, first = create()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    far = o.ids(10**9 - 16, 10**9 + 16)  # the end of epoch 0 and the start of epoch 1
    assert len(set(first)) == 32 and all(0 <= i < 10**9 for i in first + far)
    assert o.ids(10**9 - 16, 10**9) == far[:16]


def test_unknown_order_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown sample order 'sorted'"):
        GlobalOrder(10, 0, kind="sorted")
    with pytest.raises(ValueError, match="map-style"):
        GlobalOrder(10, 0, kind="stream")


@given(m=st.integers(1, 64), n=st.integers(1, 16))
def test_assignment_partitions_the_microbatches(m: int, n: int) -> None:
    got = [i for r in range(n) for i in assign_microbatches(m, n, r)]
    assert got == list(range(m))
    sizes = [len(assign_microbatches(m, n, r)) for r in range(n)]
    assert max(sizes) - min(sizes) <= 1


def test_step_microbatches_cover_the_step_window() -> None:
    mbs = step_microbatches(3, 32, 8)
    assert [(r.start, r.stop) for r in mbs] == [(96, 104), (104, 112), (112, 120), (120, 128)]


def test_data_position_goes_on_after_the_last_sample_consumed() -> None:
    p = DataPosition()
    assert p.microbatches(3, 32, 8) == step_microbatches(3, 32, 8)
    # Saved after 10 steps of 32, resumed with a global batch of 48.
    saved = p.at(10, 32)
    assert saved == DataPosition(10, 320)
    again = DataPosition.from_json(saved.to_json())
    assert again.start(10, 48) == 320 and again.start(12, 48) == 416
    assert DataPosition.from_json(None) == DataPosition()
    with pytest.raises(ValueError, match="bad data position"):
        DataPosition.from_json([1, -2])


# ---- streams ---------------------------------------------------------------------------


class Counting:
    """A replayable stream of `n` samples (sample k is k * 10); counts its opens."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.opened: list[int] = []

    def iter_from(self, position: int) -> Iterator[int]:
        self.opened.append(position)
        return iter(range(position * 10, self.n * 10, 10))


def test_a_stream_reader_continues_contiguous_reads_and_reopens_elsewhere() -> None:
    src = Counting(100)
    r = StreamReader(src)
    assert r.read(8, 12) == [80, 90, 100, 110]
    assert r.read(12, 14) == [120, 130]
    assert src.opened == [8]
    assert r.read(40, 42) == [400, 410]
    assert src.opened == [8, 40]
    with pytest.raises(StreamEnded, match="ended at position 100"):
        r.read(98, 103)


def test_an_iterable_without_a_position_is_refused_with_what_to_add() -> None:
    class Plain(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    class Sized(Plain):
        def __len__(self) -> int:
            return 3

    for plain in (Plain(), Sized()):
        with pytest.raises(TypeError, match=r"iter_from\(position\)"):
            check_dataset(plain)
    check_dataset(Counting(3))
    check_dataset([1, 2, 3])


# ---- the loader ------------------------------------------------------------------------


class Squares:
    """Sample j is tensor([j, j*j]); ids in `bad` raise."""

    def __init__(self, n: int = 1000, bad: frozenset[int] = frozenset()) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> torch.Tensor:
        if j in self.bad:
            raise KeyError(f"sample {j} is damaged")
        return torch.tensor([j, j * j])


def stacked(xs: list[Any]) -> torch.Tensor:
    return torch.stack(xs)


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("elastrain-data")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent reaps it).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def plan_of(
    order: GlobalOrder, step: int, mine: list[int]
) -> list[tuple[tuple[int, int], list[int]]]:
    mbs = step_microbatches(step, 16, 4)
    return [((step, i), order.ids(mbs[i].start, mbs[i].stop)) for i in mine]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_hands_out_planned_batches_and_drops_a_stale_plan(workers: int) -> None:
    order = GlobalOrder(1000, seed=5)
    loader = BatchLoader(MapFetch(Squares(), stacked), LoaderConfig(workers, prefetch_steps=1))
    try:
        loader.start()
        assert len(loader.worker_pids) == workers
        # Rank 0 of 2: micro-batches 0 and 1 of steps 0 and 1.
        loader.plan(plan_of(order, 0, [0, 1]) + plan_of(order, 1, [0, 1]))
        for key, ids in plan_of(order, 0, [0, 1]):
            assert loader.get(key, ids).tolist() == [[j, j * j] for j in ids]
        # The membership changed: now rank 1 of 2 (micro-batches 2 and 3).
        loader.plan(plan_of(order, 1, [2, 3]) + plan_of(order, 2, [2, 3]))
        assert loader.dropped == 2  # step 1's micro-batches 0 and 1
        for key, ids in plan_of(order, 1, [2, 3]) + plan_of(order, 2, [2, 3]):
            assert loader.get(key, ids)[:, 0].tolist() == ids
        # Asked for other ids than it loaded for a key: loads those, never the stale ones.
        loader.plan(plan_of(order, 3, [0]))
        other = order.ids(900, 904)
        assert loader.get((3, 0), other)[:, 0].tolist() == other
        # Unplanned: loaded inline.
        assert loader.get((9, 9), [1, 2])[:, 0].tolist() == [1, 2]
    finally:
        pids = loader.worker_pids
        loader.close()
    assert not data_threads()
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_dataset_surfaces_in_get_with_its_traceback(workers: int) -> None:
    loader = BatchLoader(
        MapFetch(Squares(bad=frozenset({7})), stacked), LoaderConfig(workers, prefetch_steps=1)
    )
    try:
        loader.plan([((0, 0), [1, 2]), ((0, 1), [6, 7])])
        assert loader.get((0, 0), [1, 2]).shape == (2, 2)
        with pytest.raises(LoaderError, match="sample 7 is damaged"):
            loader.get((0, 1), [6, 7])
    finally:
        loader.close()
    assert not data_threads()


def test_a_dead_data_worker_is_an_error_not_a_hang() -> None:
    class Slow(Squares):
        def __getitem__(self, j: int) -> torch.Tensor:
            if j == 3:
                os._exit(9)  # the worker dies (as if OOM-killed) mid-batch
            return super().__getitem__(j)

    loader = BatchLoader(MapFetch(Slow(), stacked), LoaderConfig(1, prefetch_steps=0))
    try:
        loader.plan([((0, 0), [3])])
        with pytest.raises(LoaderError, match="exited"):
            loader.get((0, 0), [3])
    finally:
        loader.close()


def test_streams_load_in_workers_from_their_positions() -> None:
    src = Counting(100)
    loader = BatchLoader(StreamFetch(src, list), LoaderConfig(2, prefetch_steps=1))
    try:
        loader.plan([((0, 0), [0, 1]), ((0, 1), [2, 3]), ((1, 0), [40, 41])])
        assert loader.get((0, 0), [0, 1]) == [0, 10]
        assert loader.get((0, 1), [2, 3]) == [20, 30]
        assert loader.get((1, 0), [40, 41]) == [400, 410]
    finally:
        loader.close()


def test_loader_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        LoaderConfig(-1, 0)
    assert not LoaderConfig().background
    assert LoaderConfig(0, 1).background and LoaderConfig(2, 0).background
