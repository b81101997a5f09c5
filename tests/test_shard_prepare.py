"""Which sharded member prepares its twins' heal at the connect (`twins_heal_root`).

The root of a twins' heal flattens its shard and begins its digest while the
generation's groups are built (`PreparedSend`); it must do so only where nothing
changes its rows before that heal, or its digest would not be the state it sends
(the heal would then fail on every rank: tests/test_transfer.py).
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any, cast

from elastrain.control import protocol as p
from elastrain.runtime.shard_member import twins_heal_root

SLOTS = {"a0": [0, 0], "a1": [0, 1], "b0": [1, 0], "b1": [1, 1]}
"""Member -> [replica group, shard]: a0 and b0 are the twins of shard 0."""


def _ready(committed: dict[str, int], **kw: Any) -> p.RendezvousResponse:
    return p.RendezvousResponse(
        "ready", 5, list(SLOTS), committed, max(committed.values()),
        commit_gens=dict.fromkeys(SLOTS, 1), slots=SLOTS, shard_size=2, **kw,
    )  # fmt: skip


def _backend(shard: int | None, shard_size: int = 2) -> Any:
    return cast(Any, NS(placed=shard is not None, shard=shard, shard_size=shard_size))


BEHIND_B0 = {"a0": 3, "a1": 3, "b0": 2, "b1": 3}
"""b0 (shard 0) is behind: its twin a0 heals it."""


def test_the_first_up_to_date_twin_of_a_member_behind_prepares() -> None:
    ready = _ready(BEHIND_B0)
    assert twins_heal_root(ready, "a0", _backend(0))
    # Not the receiver, nor the members of a shard nobody needs healed.
    assert not twins_heal_root(ready, "b0", _backend(0))
    assert not twins_heal_root(ready, "a1", _backend(1))
    assert not twins_heal_root(ready, "b1", _backend(1))
    # Nobody behind: no heal.
    assert not twins_heal_root(_ready(dict.fromkeys(SLOTS, 3)), "a0", _backend(0))


def test_no_preparation_where_the_rows_change_before_the_heal() -> None:
    # Its own step to roll forward first.
    assert not twins_heal_root(_ready(BEHIND_B0, rolls_forward=["a0"]), "a0", _backend(0))
    # Rows not placed yet, or placed for another slot or shard size (reset at the heal).
    assert not twins_heal_root(_ready(BEHIND_B0), "a0", _backend(None))
    assert not twins_heal_root(_ready(BEHIND_B0), "a0", _backend(1))
    assert not twins_heal_root(_ready(BEHIND_B0), "a0", _backend(0, shard_size=4))
    # A reshard: a sender reported rows of another layout.
    held = {"a0": [4, 0], "a1": [2, 1], "b1": [2, 1]}
    assert not twins_heal_root(_ready(BEHIND_B0, held=held), "a0", _backend(0))
    same = {"a0": [2, 0], "a1": [2, 1], "b1": [2, 1]}
    assert twins_heal_root(_ready(BEHIND_B0, held=same), "a0", _backend(0))
    # A job that is not sharded (no slots): nothing to read.
    plain = p.RendezvousResponse("ready", 5, list(SLOTS), BEHIND_B0, 3)
    assert not twins_heal_root(plain, "a0", _backend(0))
