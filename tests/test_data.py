"""The global order and micro-batch assignment behind exactly-once data."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches


def test_order_is_seeded_and_covers_each_epoch_once() -> None:
    a, b = GlobalOrder(100, seed=3), GlobalOrder(100, seed=3)
    assert a.ids(0, 250) == b.ids(0, 250)
    assert sorted(a.ids(0, 100)) == list(range(100))
    assert sorted(a.ids(100, 200)) == list(range(100))
    assert a.ids(0, 100) != a.ids(100, 200)
    assert GlobalOrder(100, seed=4).ids(0, 100) != a.ids(0, 100)


def test_ids_are_position_pure() -> None:
    o = GlobalOrder(37, seed=1)
    whole = o.ids(0, 200)
    assert o.ids(50, 90) == whole[50:90]
    assert GlobalOrder(37, seed=1).ids(90, 91) == whole[90:91]


@given(m=st.integers(1, 64), n=st.integers(1, 16))
def test_assignment_partitions_the_microbatches(m: int, n: int) -> None:
    got = [i for r in range(n) for i in assign_microbatches(m, n, r)]
    assert got == list(range(m))
    sizes = [len(assign_microbatches(m, n, r)) for r in range(n)]
    assert max(sizes) - min(sizes) <= 1


def test_step_microbatches_cover_the_step_window() -> None:
    mbs = step_microbatches(3, 32, 8)
    assert [(r.start, r.stop) for r in mbs] == [(96, 104), (104, 112), (112, 120), (120, 128)]
