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
import time
from collections.abc import Sequence
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


ROUND_TAGS = 1 << 20
"""`Among`'s rounds use point-to-point tags in ``[1, ROUND_TAGS)``, one per round:
below every payload tag (`elastrain.transfer.chunks.data_tag` of a heal id >= 1)."""


def _wait_all(works: Sequence[Pending], end: float) -> None:
    """Wait for each posted operation, all by the monotonic time ``end``."""
    for w in works:
        w.wait(datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))


class _StarReduce:
    """An all-reduce among `Among`'s members as messages through its hub, posted at
    once. Each message is ``[status, *v]``: the hub answers every member with the
    combined vector, or with status 1 when it lost one of them, so that a member's
    death fails the round for every member at once (not at their deadlines)."""

    def __init__(self, among: Among, v: torch.Tensor, op: Reduce, tag: int) -> None:
        self.among, self.v, self.op, self.tag = among, v, op, tag
        tx, hub = among.tx, among.hub
        self.others = [r for r in among.members if r != hub]
        if tx.rank == hub:
            self.parts = {r: torch.empty(1 + v.numel(), dtype=v.dtype) for r in self.others}
            self.posted = {r: tx.recv(b, r, tag) for r, b in self.parts.items()}
        else:
            mine = torch.cat([torch.zeros(1, dtype=v.dtype), v])
            self.answer = torch.empty_like(mine)
            self.sent = tx.send(mine, hub, tag)
            self.got = tx.recv(self.answer, hub, tag)
        self.done = False

    def wait(self, timeout: datetime.timedelta) -> None:
        if self.done:
            return
        end = time.monotonic() + timeout.total_seconds()
        tx, hub = self.among.tx, self.among.hub
        if tx.rank != hub:
            _wait_all([self.sent, self.got], end)
            if int(self.answer[0]):
                raise RuntimeError(f"the heal's round failed at rank {hub}: it lost a member")
            self.v.copy_(self.answer[1:])
            self.done = True
            return
        lost: RuntimeError | None = None
        for r, work in self.posted.items():
            try:
                _wait_all([work], end)
            except RuntimeError as e:
                lost = lost or RuntimeError(f"rank {r} lost in the heal's round: {e}")
                continue
            part = self.parts[r][1:]
            if self.op == Reduce.MAX:
                torch.maximum(self.v, part, out=self.v)
            else:
                self.v.add_(part)
        answer = torch.cat([torch.tensor([int(lost is not None)], dtype=self.v.dtype), self.v])
        sends = []
        for r in self.others:
            try:
                sends.append(tx.send(answer, r, self.tag))
            except RuntimeError:
                pass  # a lost member: its peers still get the answer
        for w in sends:
            try:
                _wait_all([w], end)
            except RuntimeError as e:
                lost = lost or e
        if lost is not None:
            raise lost
        self.done = True


class _Direct:
    """A broadcast among `Among`'s members: the root sends to each, the others receive."""

    def __init__(self, works: list[Pending]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> None:
        _wait_all(self.works, time.monotonic() + timeout.total_seconds())


class Among:
    """The heal's rounds among some ranks of a generation only (`members`, the
    ``hub`` among them), over another `HealTransport` ``tx``: the ranks that move
    or take bytes, while the senders the heal keeps in reserve wait apart
    (`elastrain.transfer.striped`, "standbys").

    Ranks and sizes stay ``tx``'s, and so do `send` and `recv`. Its collectives are
    collective over ``members`` only, as point-to-point messages: an all-reduce goes
    through the hub (two hops, each member's vector in and the result out), a
    broadcast straight from its root to each member. Why not a group of their
    own: building one costs a rendezvous and connections at every heal, while
    every pair of the generation is connected already. Each round has its own tag
    (`ROUND_TAGS`), consumed whole unless the round fails, after which the caller
    drops the group (the transport contract)."""

    def __init__(
        self, tx: HealTransport, members: Sequence[int], hub: int, *, after: Among | None = None
    ) -> None:
        """``after``: an earlier `Among` of the same heal over the same ``tx``, whose
        rounds' tags this one's follow (no tag is used twice in one heal)."""
        if hub not in members:
            raise ValueError(f"hub {hub} is not one of the members {list(members)}")
        if tx.rank not in members:
            raise ValueError(f"rank {tx.rank} is not one of the members {list(members)}")
        self.tx, self.members, self.hub = tx, sorted(set(members)), hub
        self._rounds: int = after._rounds if after is not None else 0

    @property
    def rank(self) -> int:
        return self.tx.rank

    @property
    def size(self) -> int:
        return self.tx.size

    def _tag(self) -> int:
        self._rounds += 1
        if self._rounds >= ROUND_TAGS:
            raise RuntimeError(f"a heal of more than {ROUND_TAGS - 1} rounds")
        return self._rounds

    def allreduce(self, v: torch.Tensor, op: Reduce, timeout: datetime.timedelta) -> Pending:
        return _StarReduce(self, v, op, self._tag())

    def broadcast(self, buf: torch.Tensor, root: int, timeout: datetime.timedelta) -> Pending:
        tag = self._tag()
        if self.tx.rank == root:
            return _Direct([self.tx.send(buf, r, tag) for r in self.members if r != root])
        return _Direct([self.tx.recv(buf, root, tag)])

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Pending:
        return self.tx.send(buf, dst, tag)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Pending:
        return self.tx.recv(buf, src, tag)
