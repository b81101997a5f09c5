"""Checkpoints of K-process JAX replicas: who writes which part, and resume on any R x K.

The format is the sharded one (`elastrain.checkpoint.dcp`, the sharded torch
path's model: `elastrain.checkpoint.sharded_parts`); the layout is this module's:

- **What is stored.** Every leaf of the replica's state tree (``{"params",
  "opt_state", "key"}``, named by key path as everywhere in `elastrain.jax`) is
  one tensor of the *whole* leaf's shape, except that a leaf split over the
  replica's processes along dimension ``d`` is stored with ``d`` moved first
  (`stored_shape`), so that each process's part is a block of rows: a chunk.
- **Who writes** (`writer_index`): for each process index k, the holder of part
  k with the lowest rank in the generation (twins hold the same bytes, so one
  replica's worth is written: K writers, whatever R). Writer k writes its rows of
  every split leaf; writer 0 also writes the leaves every process holds whole
  (the PRNG key, Adam's count, a replicated parameter). Nobody gathers anything.
  Rank 0 of the generation commits, as in every checkpoint.
- **The manifest** (the meta's `META` entry, verified on load): K, and every
  leaf's name, whole shape, dtype and split dimension (`LeafPart`).
- **Resume** (`read_part`): a process of the new job (any number of replicas R;
  any K, since the stored tensors are whole leaves) checks the saved leaves
  against its own (`layout_problem`: names, whole shapes, dtypes) and reads only
  the rows of its part where the split dimension is the same as when saved; a
  leaf split differently (another K that does not divide it, or a script's
  other `specs=`) is read whole and sliced. A flat checkpoint of a single-process
  JAX job holds the same leaves whole, so it resumes the same way.

Local; the writer's parts are aliases of the live (immutable) JAX arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
import torch

from elastrain.checkpoint.dcp import Chunk, ShardParts, row_count
from elastrain.jax.replica import ReplicaLayout
from elastrain.jax.state import Tree, _as_tensor
from elastrain.transfer.dtypes import byte_view, dtype_from_name

META = "jax_replica"
"""The meta key of the layout: ``{"procs": K, "leaves": [[name, shape, dtype, dim], ...]}``."""


@dataclass(frozen=True)
class LeafPart:
    """One leaf of the replica's state: its whole shape, its dtype (numpy's name)
    and the dimension split over the replica's processes (None: every process
    holds it whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None

    def stored_shape(self) -> tuple[int, ...]:
        """The stored tensor's shape: the whole leaf, its split dimension first."""
        if self.dim is None:
            return self.shape
        d = self.dim
        return (self.shape[d], *self.shape[:d], *self.shape[d + 1 :])

    def rows(self, procs: int, proc: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of the stored tensor that process `proc` of `procs` holds."""
        if self.dim is None:
            return 0, row_count(self.shape)
        n = self.shape[self.dim] // procs
        return proc * n, (proc + 1) * n

    def encode(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype, self.dim]

    @staticmethod
    def decode(row: Sequence[Any]) -> LeafPart:
        name, shape, dtype, dim = row
        return LeafPart(str(name), tuple(int(x) for x in shape), str(dtype), dim)


def leaf_parts(whole: Tree, local: Tree, procs: int) -> list[LeafPart]:
    """Every leaf's part, from the whole state's shapes and this process's leaves
    (the same tree structure). Pure. ValueError for a leaf whose part is not a
    K-th of one dimension of the whole (an optimizer state that is not shaped
    like its parameter, say a factored one: it cannot be split by rows)."""
    wholes = jax.tree_util.tree_flatten_with_path(whole)[0]
    mine = jax.tree_util.tree_leaves(local)
    if len(wholes) != len(mine):
        raise ValueError(f"the whole state has {len(wholes)} leaves, this process's {len(mine)}")
    out = []
    for (path, w), x in zip(wholes, mine, strict=True):
        name, shape, part = jax.tree_util.keystr(path), tuple(w.shape), tuple(np.shape(x))
        differ = [d for d, (a, b) in enumerate(zip(shape, part, strict=False)) if a != b]
        if len(shape) != len(part) or len(differ) > 1:
            raise ValueError(f"leaf {name}: this process holds {list(part)} of {list(shape)}")
        dim = differ[0] if differ else None
        if dim is not None and shape[dim] != part[dim] * procs:
            raise ValueError(
                f"leaf {name}: this process holds {part[dim]} of {shape[dim]} along "
                f"dimension {dim}, not a {procs}th"
            )
        out.append(LeafPart(name, shape, str(np.dtype(w.dtype)), dim))
    return out


def writer_index(layout: ReplicaLayout, member: str) -> int | None:
    """The part `member` writes in a checkpoint of this generation, or None: each
    part's holder of the lowest rank writes it."""
    k = layout.places[member][1]
    twins = layout.twins(k)
    return k if twins and twins[0] == member else None


def _torch_dtype(numpy_name: str) -> torch.dtype:
    return dtype_from_name(f"torch.{numpy_name}")


def replica_parts(
    parts: Sequence[LeafPart], local: Tree, meta: dict[str, Any], procs: int, proc: int
) -> ShardParts:
    """What writer `proc` writes: its rows of every split leaf (and every whole one
    if it is writer 0), every leaf declared, the layout in the meta. The chunks
    alias JAX's immutable arrays: nothing writes them, so their copy may be deferred."""
    declared = {p.name: (str(_torch_dtype(p.dtype)), p.stored_shape()) for p in parts}
    chunks = []
    for p, x in zip(parts, jax.tree_util.tree_leaves(local), strict=True):
        if p.dim is None and proc != 0:
            continue
        t = _as_tensor(x)
        if p.dim:
            t = t.movedim(p.dim, 0).contiguous()
        lo, hi = p.rows(procs, proc)
        chunks.append(Chunk(p.name, lo, hi, t, defer=True))
    layout = {"procs": procs, "leaves": [p.encode() for p in parts]}
    return ShardParts(declared, chunks, {**meta, META: layout})


def saved_parts(
    meta: dict[str, Any], whole: dict[str, tuple[str, tuple[int, ...]]], names: Sequence[str]
) -> list[LeafPart]:
    """The saved leaves: the layout in a replica checkpoint's meta, else (a flat
    checkpoint of a single-process JAX job) every tensor of ``whole`` (name ->
    (numpy dtype name, shape)) whole, in the order of ``names`` (this state's)
    where it has them."""
    got = meta.get(META)
    if got is not None:
        return [LeafPart.decode(r) for r in got["leaves"]]
    order = [n for n in names if n in whole] + [n for n in whole if n not in set(names)]
    return [LeafPart(n, whole[n][1], whole[n][0], None) for n in order]


def layout_problem(saved: Sequence[LeafPart], mine: Sequence[LeafPart]) -> str | None:
    """Why a state saved as `saved` is not this script's (names, whole shapes and
    dtypes, in order), or None. The split dimensions may differ. Pure."""
    if len(saved) != len(mine):
        return f"it has {len(saved)} state leaves, this script's state {len(mine)}"
    for s, m in zip(saved, mine, strict=True):
        if (s.name, s.shape, s.dtype) != (m.name, m.shape, m.dtype):
            return (
                f"its leaf {s.name} {s.dtype}{list(s.shape)} is {m.name} "
                f"{m.dtype}{list(m.shape)} here"
            )
    return None


class Rows(Protocol):
    """What `read_part` reads from (`elastrain.checkpoint.dcp.ShardedReader`, or
    `WholeTensors`): rows ``[lo, hi)`` of a stored tensor by name (a 0-dim
    tensor is one row)."""

    def read_rows(self, fqn: str, lo: int, hi: int) -> torch.Tensor: ...


class WholeTensors:
    """`Rows` of the tensors of a flat checkpoint, already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read_rows(self, fqn: str, lo: int, hi: int) -> torch.Tensor:
        t = self.tensors[fqn]
        return (t.reshape(1) if t.dim() == 0 else t)[lo:hi]


def flat_leaves(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A flat checkpoint's tensors as `saved_parts` takes them: name -> (numpy
    dtype name, shape)."""
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


def _as_numpy(t: torch.Tensor, dtype: str, shape: Sequence[int]) -> np.ndarray[Any, Any]:
    return byte_view(t.contiguous()).numpy().view(np.dtype(dtype)).reshape(tuple(shape))


def _slice(a: np.ndarray[Any, Any], dim: int, lo: int, hi: int) -> np.ndarray[Any, Any]:
    index: list[slice] = [slice(None)] * a.ndim
    index[dim] = slice(lo, hi)
    return a[tuple(index)]


def read_part(
    source: Rows, saved: Sequence[LeafPart], mine: Sequence[LeafPart], procs: int, proc: int
) -> list[np.ndarray[Any, Any]]:
    """Process `proc` of `procs`'s part of every leaf, in order (checked first with
    `layout_problem`): only the rows of its part where the leaf is split as when
    saved, else the whole leaf, sliced."""
    out = []
    for s, m in zip(saved, mine, strict=True):
        lo, hi = m.rows(procs, proc)
        if s.dim == m.dim:
            shape = (hi - lo, *m.stored_shape()[1:]) if m.shape else ()
            rows = _as_numpy(source.read_rows(s.name, lo, hi), m.dtype, shape)
            out.append(rows if m.dim is None else np.moveaxis(rows, 0, m.dim))
            continue
        stored = s.stored_shape()
        raw = _as_numpy(source.read_rows(s.name, 0, row_count(stored)), s.dtype, stored)
        whole = raw if s.dim is None else np.moveaxis(raw, 0, s.dim)
        out.append(whole if m.dim is None else _slice(whole, m.dim, lo, hi))
    return out
