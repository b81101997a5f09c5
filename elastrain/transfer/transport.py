"""The heal's transport seam: how the heal protocol reaches the other members of a generation.

The striped heal (`elastrain.transfer.striped`: manifest, plan, stripes,
landing, install) moves its bytes through a `HealTransport` and nothing else:
three small collectives for its rounds (announce, manifest, verdict, outcome)
and point-to-point sends and receives of byte ranges (the stripes and their
seals). `GlooHeal` is the transport over a generation's gloo process group
(what the trainers use today); tests run the same protocol over an in-memory
one. A transport for another wire (NCCL on GPUs) implements this protocol and
is handed to `heal_over`; nothing in the heal changes.

This is not `elastrain.runtime.collectives.Transport`, which chooses how a
step's gradients are reduced.

The contract every implementation keeps:

- The transport belongs to one generation's group: ranks `0 .. size-1` are its
  members, `rank` is this one. Messages of one heal never cross generations.
- Collectives (`allreduce`, `broadcast`) are called by every rank of the group
  in the same order, with tensors of the same shape and dtype (int64 vectors
  for `allreduce`, a uint8 buffer for `broadcast`).
- `send` and `recv` carry one contiguous CPU uint8 tensor each, matched by
  (peer, tag); a `recv` buffer has exactly the size of the message sent to it.
  Several messages may be in flight between two ranks under distinct tags.
- Every operation is posted and returns a `Pending` at once; `wait(timeout)`
  blocks until it completed here. A send's buffer may be read until its wait
  returns; a recv's buffer holds the message when its wait returns.
- A failure of the wire or a timeout raises `RuntimeError`, at post or at wait,
  on the rank that sees it (the heal turns it into `HealError` and the caller
  drops the group); its peers fail at their next operation or deadline.
"""

from __future__ import annotations

import datetime
from enum import StrEnum
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Reduce(StrEnum):
    """How an `allreduce` combines the ranks' vectors, element by element."""

    MAX = "max"
    SUM = "sum"


class Pending(Protocol):
    """A posted operation."""

    def wait(self, timeout: datetime.timedelta) -> Any:
        """Block until the operation completed here; RuntimeError on failure or timeout."""
        ...


class HealTransport(Protocol):
    """The members of one generation, as a heal reaches them (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allreduce(self, v: torch.Tensor, op: Reduce, timeout: datetime.timedelta) -> Pending:
        """Combine every rank's int64 vector `v` in place (collective)."""
        ...

    def broadcast(self, buf: torch.Tensor, root: int, timeout: datetime.timedelta) -> Pending:
        """Copy `root`'s uint8 `buf` into every other rank's `buf` (collective)."""
        ...

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Pending:
        """Send the bytes of `buf` to rank `dst` under `tag`."""
        ...

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Pending:
        """Receive rank `src`'s message under `tag` into `buf`."""
        ...


Group = Any
"""A gloo process group: ``ProcessGroupGloo(store, rank, size, timeout)`` or a ``ProcessGroup``.

Typed as Any because torch's stubs do not declare the collectives on the backend
classes; `GlooHeal` uses ``size()``, ``rank()``, ``broadcast``, ``allreduce``,
``send`` and ``recv`` with their option-object signatures."""

_OPS = {Reduce.MAX: dist.ReduceOp.MAX, Reduce.SUM: dist.ReduceOp.SUM}


class GlooHeal:
    """`HealTransport` over a generation's gloo process group (its work objects are
    the `Pending`s). `rank` is this member's rank in `pg`; a group that knows its
    own rank must agree (ValueError otherwise, before anything is sent)."""

    def __init__(self, pg: Group, rank: int) -> None:
        self.pg = pg
        self._rank = rank
        self._size = int(pg.size())
        if not 0 <= rank < self._size:
            raise ValueError(f"rank {rank} is outside the group of size {self._size}")
        pg_rank = getattr(pg, "rank", None)
        if callable(pg_rank) and pg_rank() != rank:
            raise ValueError(f"rank={rank} but the process group says this is rank {pg_rank()}")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allreduce(self, v: torch.Tensor, op: Reduce, timeout: datetime.timedelta) -> Pending:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(_OPS[op])
        opts.timeout = timeout
        work: Pending = self.pg.allreduce([v], opts)
        return work

    def broadcast(self, buf: torch.Tensor, root: int, timeout: datetime.timedelta) -> Pending:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = timeout
        work: Pending = self.pg.broadcast([buf], opts)
        return work

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Pending:
        work: Pending = self.pg.send([buf], dst, tag)
        return work

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Pending:
        work: Pending = self.pg.recv([buf], src, tag)
        return work
