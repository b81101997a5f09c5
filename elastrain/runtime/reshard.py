"""Resharding in memory: move just the rows each member's new shard needs.

When a sharded job changes its shard size (3 survivors of a 2 x 2 job regroup as
1 x 3, and back to 2 x 2 when a replacement arrives), every member's new shard is
the rows ``shard_rows(rows, new_size, new_shard)`` of every parameter (and of the
optimizer state shaped like it). Those rows are spread over the old shards. For
each old shard that overlaps, a member takes the overlap from itself when it
holds that old shard, and otherwise from one of the old shard's holders (twins),
taken in turn so that the bytes are striped over all of them. A joiner is the
member that holds nothing. `plan_reshard` is that decision, pure;
`exchange_rows` performs it over the generation's group with point-to-point
sends.

Only the rows move. The rest of the state is small and the same on every
up-to-date member: optimizer state that is not shaped like its parameter
(Adam's ``step``), the param groups' hyperparameters, and the engine's meta
(committed count, RNG, the trainer's extra state). The plan's leader (the
first source) broadcasts it as JSON, and members that were not up to date
install it, as a heal's receivers do.

Trust: the pieces travel inside the generation's gloo group, whose store keys
only members told the generation's secret can name (docs/design/trust.md). Unlike a heal's stripes they carry no per-piece seal yet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastrain.control.layout import Slot
from elastrain.runtime.sharded import RowStateLike, shard_rows


class ShardLost(RuntimeError):
    """Some rows of the model have no up-to-date holder: nothing in memory restores them."""


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of parameter `param` (global row numbers) that `src` sends `dst`
    (`src == dst`: a copy inside one member)."""

    param: int
    lo: int
    hi: int
    src: str
    dst: str


def plan_reshard(
    rows: Sequence[int],
    held: Mapping[str, tuple[int, int]],
    new: Mapping[str, Slot],
    new_size: int,
    order: Sequence[str],
) -> list[Piece]:
    """The pieces that give every member of `new` its new shard's rows.

    rows      dim-0 size of each parameter, in the model's parameter order
    held      up-to-date member -> (shard size, shard) it holds now (the sources;
              they all hold shards of one size)
    new       member -> its slot in the new layout (size `new_size`)
    order     the generation's members in rank order (fixes the plan's order)

    Every member computes the same plan from the same inputs. Raises ShardLost
    when rows some member needs are held by no source.
    """
    sizes = {size for size, _ in held.values()}
    if len(sizes) > 1:
        raise ValueError(f"the sources hold shards of different sizes: {sorted(sizes)}")
    if not held:
        raise ShardLost("no member holds an up-to-date shard")
    old_size = sizes.pop()
    holders: dict[int, list[str]] = {}
    for m in order:
        if m in held:
            holders.setdefault(held[m][1], []).append(m)
    turn: dict[int, int] = {}
    pieces: list[Piece] = []
    for dst in order:
        if dst not in new:
            continue
        shard = new[dst].shard
        for i, n in enumerate(rows):
            lo, hi = shard_rows(n, new_size, shard)
            for k in range(old_size):
                olo, ohi = shard_rows(n, old_size, k)
                a, b = max(lo, olo), min(hi, ohi)
                if a >= b:
                    continue
                who = holders.get(k, [])
                if not who:
                    raise ShardLost(
                        f"rows {a}-{b} of parameter {i} (old shard {k} of {old_size}) have no "
                        "up-to-date holder: the job cannot reshard in memory"
                    )
                if dst in who:
                    src = dst
                else:
                    # In turn over the old shard's holders: the bytes are striped.
                    src = who[turn.get(k, 0) % len(who)]
                    turn[k] = turn.get(k, 0) + 1
                pieces.append(Piece(i, a, b, src, dst))
    return pieces


def moved_bytes(pieces: Sequence[Piece], row_bytes: Sequence[int]) -> int:
    """Bytes that cross between members (copies inside a member excluded);
    `row_bytes[i]`: the bytes of one row of parameter i and its row-shaped state."""
    return sum((p.hi - p.lo) * row_bytes[p.param] for p in pieces if p.src != p.dst)


def exchange_rows(
    pg: Any,
    rank_of: Mapping[str, int],
    me: str,
    pieces: Sequence[Piece],
    old: RowStateLike | None,
    new: RowStateLike,
) -> tuple[int, int]:
    """Perform `me`'s part of the plan over `pg` (point-to-point): send the rows it
    is the source of, receive (or copy) the rows of its new shard into `new`.
    Returns (bytes sent, bytes received). Blocks until every transfer of this
    member is done; a dead peer raises (the generation is abandoned)."""
    works: list[Any] = []
    sent = received = 0
    new_t, new_start = new
    old_t, old_start = old if old is not None else ([], [])
    for n, p in enumerate(pieces):
        if p.dst == me and p.src == me:
            for src, dst in zip(old_t[p.param], new_t[p.param], strict=True):
                dst[p.lo - new_start[p.param] : p.hi - new_start[p.param]].copy_(
                    src[p.lo - old_start[p.param] : p.hi - old_start[p.param]]
                )
            continue
        for j, t in enumerate(new_t[p.param] if p.dst == me else ()):
            view = t[p.lo - new_start[p.param] : p.hi - new_start[p.param]]
            works.append(pg.recv([view], rank_of[p.src], _tag(n, j)))
            received += view.numel() * view.element_size()
        if p.src == me:
            for j, t in enumerate(old_t[p.param]):
                view = t[p.lo - old_start[p.param] : p.hi - old_start[p.param]].contiguous()
                works.append(pg.send([view], rank_of[p.dst], _tag(n, j)))
                sent += view.numel() * view.element_size()
    for w in works:
        w.wait()
    return sent, received


def _tag(piece: int, tensor: int) -> int:
    # Unique per (piece, tensor) and below gloo's tag range (int32).
    return (piece * 16 + tensor) % (2**31 - 1)


def broadcast_json(pg: Any, root: int, rank: int, value: Any) -> Any:
    """`value` of rank `root`, on every member of `pg` (length, then UTF-8 bytes)."""
    data = json.dumps(value, separators=(",", ":")).encode() if rank == root else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    pg.broadcast(n, root).wait()
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if rank == root
        else torch.empty(int(n.item()), dtype=torch.uint8)
    )
    if buf.numel():
        pg.broadcast(buf, root).wait()
    return value if rank == root else json.loads(bytes(buf.numpy()).decode())
