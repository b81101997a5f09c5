"""Striped heal: bring receivers' model + optimizer state up to date from senders.

Protocol (every rank of the process group calls `heal` with the same
``senders`` and ``receivers``):

1. **manifest** -- senders[0] flattens its state, builds the JSON manifest and
   broadcasts it (int64 length, then uint8 bytes) to the whole group. If it
   cannot (state not JSON-able), it broadcasts an error manifest instead and
   every rank raises HealError.
2. **verdict** -- receivers validate the manifest and check it against their own
   model and optimizer; other senders check that their state has the same
   layout. One all-reduce of per-rank reject flags follows, so a rejection on
   any rank makes every rank raise HealError promptly, before any payload moves,
   and leaves the group usable.
3. **payload** -- each sender sends its stripe of the concatenated payload to
   every receiver, split into messages by `plan_chunks` (large tensor pieces
   straight from the live tensors, small ones packed), then the stripe's CRC-32.
   Receivers post every receive at once (model bytes into one staging buffer,
   optimizer bytes into the new state tensors), check each stripe's CRC as it
   lands and only then install the state (optimizer via ``load_state_dict``,
   model tensors overwritten in place). A failed heal leaves the receiver's
   model and optimizer untouched.

Everything is bounded by one deadline, ``timeout_s`` from the call.
"""

from __future__ import annotations

import datetime
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrain.transfer.checksum import check_crc, crc_update, stripe_crc
from elastrain.transfer.chunks import MAX_HEAL_ID, crc_tag, data_tag, plan_chunks
from elastrain.transfer.dtypes import cpu_bytes
from elastrain.transfer.errors import HealError
from elastrain.transfer.flatten import FlatState, Landing, flatten_state, install
from elastrain.transfer.manifest import (
    Manifest,
    build_manifest,
    check_model,
    check_optimizer,
    decode_manifest,
    encode_error,
    encode_manifest,
    validate_manifest,
)
from elastrain.transfer.signature import model_signature

Group = Any
"""A gloo process group: ``ProcessGroupGloo(store, rank, size, timeout)`` or a ``ProcessGroup``.

Typed as Any because torch's stubs do not declare the collectives on the backend
classes; `heal` uses ``size()``, ``rank()``, ``broadcast``, ``allreduce``, ``send``
and ``recv`` with their option-object signatures."""


@dataclass(frozen=True)
class HealStats:
    """What one rank did in a heal.

    role: "send", "recv" or "idle". bytes: payload bytes this rank sent (its
    stripe times the number of receivers) or received (the whole payload); the
    manifest is not counted. seconds: wall time of the whole `heal` call here.
    """

    role: str
    bytes: int
    seconds: float

    @property
    def rate_mb_s(self) -> float:
        """Payload throughput in MB/s (1 MB = 1e6 bytes); 0.0 for an instant heal."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class _Deadline:
    """Waits on gloo work objects, all against one deadline; errors become HealError."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.end - time.monotonic(), 0.001))

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.remaining())
        except RuntimeError as e:
            raise HealError(
                f"heal on rank {self.rank}: {what} failed (timeout_s={self.timeout_s:g}): "
                f"{_first_line(e)}"
            ) from e

    def call(self, fn: Any, what: str) -> Any:
        """Post an operation; a transport error at post time also becomes HealError."""
        try:
            return fn()
        except RuntimeError as e:
            raise HealError(f"heal on rank {self.rank}: {what} failed: {_first_line(e)}") from e


def _broadcast_bytes(pg: Group, root: int, data: bytes | None, dl: _Deadline) -> bytes:
    """Broadcast ``data`` from ``root`` (other ranks pass None); collective over pg."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = dl.remaining()
    work = dl.call(lambda: pg.broadcast([length], opts), "manifest length broadcast")
    dl.wait(work, "manifest length broadcast")
    n = int(length.item())
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    opts.timeout = dl.remaining()
    work = dl.call(lambda: pg.broadcast([buf], opts), "manifest broadcast")
    dl.wait(work, "manifest broadcast")
    return data if data is not None else buf.numpy().tobytes()


def _verdict(pg: Group, rank: int, rejected: bool, dl: _Deadline) -> list[int]:
    """All-reduce of reject flags; returns the ranks that rejected (collective)."""
    flags = torch.zeros(pg.size(), dtype=torch.int64)
    flags[rank] = int(rejected)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    opts.timeout = dl.remaining()
    work = dl.call(lambda: pg.allreduce([flags], opts), "verdict all-reduce")
    dl.wait(work, "verdict all-reduce")
    return [r for r, f in enumerate(flags.tolist()) if f]


def _check_args(
    pg: Group, rank: int, senders: Sequence[int], receivers: Sequence[int], timeout_s: float
) -> None:
    size = pg.size()
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the group of size {size}")
    pg_rank = getattr(pg, "rank", None)
    if callable(pg_rank) and pg_rank() != rank:
        raise ValueError(f"rank={rank} but the process group says this is rank {pg_rank()}")
    if not senders:
        raise ValueError("heal needs at least one sender (a rank with up-to-date state)")
    for what, ranks in (("senders", senders), ("receivers", receivers)):
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{what} {list(ranks)} has duplicates")
        if any(not 0 <= r < size for r in ranks):
            raise ValueError(f"{what} {list(ranks)} has a rank outside the group of size {size}")
    both = set(senders) & set(receivers)
    if both:
        raise ValueError(f"ranks {sorted(both)} are both senders and receivers")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")


def _local_problem(
    m: Manifest,
    role: str,
    senders: Sequence[int],
    flat: FlatState | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> HealError | None:
    """Why this rank cannot take part with this manifest, or None."""
    try:
        if role == "idle":
            return None
        validate_manifest(m, senders)
        if not 1 <= m.heal_id <= MAX_HEAL_ID:
            return HealError(f"manifest heal_id {m.heal_id} is outside [1, {MAX_HEAL_ID}]")
        if role == "recv":
            check_model(m, model_signature(model))
            check_optimizer(m, optimizer)
        else:
            assert flat is not None
            mine = build_manifest(flat.tensors, flat.optimizer, senders, {}, 0)
            for a, b in zip(mine.entries, m.entries, strict=False):
                if a != b:
                    return HealError(
                        f"sender states differ: this sender has {a}, senders[0] has {b}"
                    )
            if len(mine.entries) != len(m.entries):
                return HealError(
                    f"sender states differ: {len(mine.entries)} tensors here, "
                    f"{len(m.entries)} on senders[0]"
                )
            if json.loads(json.dumps(flat.optimizer)) != m.optimizer:
                return HealError("sender states differ: optimizer hyperparameters or state differ")
    except (HealError, TypeError, ValueError) as e:
        return e if isinstance(e, HealError) else HealError(str(e))
    return None


def _send_stripe(
    pg: Group, dl: _Deadline, m: Manifest, flat: FlatState, rank: int, receivers: Sequence[int]
) -> int:
    """Send this sender's stripe and its CRC to every receiver; returns bytes sent."""
    stripe = m.stripe_of(rank)
    if not stripe.nbytes:
        return 0
    sources: dict[int, torch.Tensor] = {}
    bufs: list[torch.Tensor] = []
    for chunk in plan_chunks(m.entries, stripe):
        parts = []
        for p in chunk.pieces:
            if p.entry not in sources:
                sources[p.entry] = cpu_bytes(flat.tensors[p.entry][1])
            rel = p.offset - m.entries[p.entry].offset
            parts.append(sources[p.entry][rel : rel + p.nbytes])
        bufs.append(torch.cat(parts) if chunk.packed else parts[0])
    works = []
    for r in receivers:
        for i, buf in enumerate(bufs):
            tag = data_tag(m.heal_id, i)
            works.append((r, dl.call(lambda b=buf, r=r, t=tag: pg.send([b], r, t), f"send to {r}")))
    crc = torch.tensor([stripe_crc(bufs)], dtype=torch.int64)  # overlaps the transfer
    for r in receivers:
        tag = crc_tag(m.heal_id)
        works.append((r, dl.call(lambda r=r, t=tag: pg.send([crc], r, t), f"send to {r}")))
    for r, w in works:
        dl.wait(w, f"sending stripe to rank {r}")
    return stripe.nbytes * len(receivers)


def _receive(
    pg: Group,
    dl: _Deadline,
    m: Manifest,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Receive every stripe, verify every CRC, then install the state."""
    landing = Landing.allocate(m.entries)
    posted = []
    for s in m.stripes:
        if not s.nbytes:
            continue
        what = f"receive from rank {s.sender_rank}"
        items = []
        for i, chunk in enumerate(plan_chunks(m.entries, s)):
            if chunk.packed:
                buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
            else:
                p = chunk.pieces[0]
                buf = landing.target(m.entries[p.entry], p.offset, p.nbytes)
            tag = data_tag(m.heal_id, i)
            work = dl.call(lambda b=buf, s=s, t=tag: pg.recv([b], s.sender_rank, t), what)
            items.append((chunk, buf, work))
        crc = torch.zeros(1, dtype=torch.int64)
        tag = crc_tag(m.heal_id)
        crc_work = dl.call(lambda c=crc, s=s, t=tag: pg.recv([c], s.sender_rank, t), what)
        posted.append((s, items, crc, crc_work))
    for s, items, crc, crc_work in posted:
        got = 0
        for _, buf, work in items:
            dl.wait(work, f"receiving stripe from rank {s.sender_rank}")
            got = crc_update(got, buf)
        dl.wait(crc_work, f"receiving checksum from rank {s.sender_rank}")
        check_crc(got, int(crc.item()), s.sender_rank, s.nbytes)
    for _, items, _, _ in posted:
        for chunk, buf, _ in items:
            if chunk.packed:
                at = 0
                for p in chunk.pieces:
                    landing.target(m.entries[p.entry], p.offset, p.nbytes).copy_(
                        buf[at : at + p.nbytes]
                    )
                    at += p.nbytes
    install(m.entries, landing, m.optimizer, model, optimizer)


def heal(
    pg: Group,
    rank: int,
    senders: list[int],
    receivers: list[int],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any] | None,
    timeout_s: float,
) -> tuple[dict[str, Any], HealStats]:
    """Copy senders' model + optimizer state onto receivers, striped over all senders.

    Collective over ALL ranks of ``pg``: every rank calls it with the same
    ``senders`` (ranks with identical, up-to-date state; senders[0] is the
    manifest root) and ``receivers`` (ranks to overwrite). A rank in neither is
    idle: it only takes part in the manifest broadcast and the verdict. Blocks
    until this rank's part is done or ``timeout_s`` (one deadline for the whole
    call) has passed.

    Returns ``(meta, stats)``: senders return the ``meta`` they passed (``{}``
    for None); receivers and idle ranks return senders[0]'s ``meta`` after a JSON
    round trip (tuples become lists, dict keys strings). ``meta`` must be
    JSON-able; it is how the caller ships step number, RNG state, data cursor.

    Raises ValueError for inconsistent arguments (on every rank, before any
    communication), HealError when the manifest is rejected by any rank (every
    rank raises), on a checksum mismatch (the receiver raises, naming the
    sender), on a transport error or timeout. A receiver's state is replaced
    only after every stripe arrived and matched its checksum. After a HealError
    from a transport failure or timeout, drop the process group.
    """
    t0 = time.perf_counter()
    _check_args(pg, rank, senders, receivers, timeout_s)
    dl = _Deadline(rank, timeout_s)
    role = "send" if rank in senders else "recv" if rank in receivers else "idle"
    root = senders[0]

    flat: FlatState | None = None
    flat_error: Exception | None = None
    if role == "send":
        try:
            flat = flatten_state(model, optimizer)
        except TypeError as e:
            flat_error = e

    # 1. manifest
    if rank == root:
        try:
            if flat is None:
                raise flat_error or HealError("no state")
            manifest = build_manifest(
                flat.tensors,
                flat.optimizer,
                senders,
                dict(meta or {}),
                secrets.randbelow(MAX_HEAL_ID) + 1,
            )
            data = encode_manifest(manifest)
        except (TypeError, ValueError) as e:
            _broadcast_bytes(pg, root, encode_error(f"{type(e).__name__}: {e}"), dl)
            raise HealError(
                f"heal on rank {rank} (senders[0]): cannot build the manifest: {e}"
            ) from e
        _broadcast_bytes(pg, root, data, dl)
    else:
        manifest = decode_manifest(_broadcast_bytes(pg, root, None, dl))

    # 2. verdict
    problem: HealError | None = None
    if flat_error is not None:
        problem = HealError(f"cannot flatten this sender's state: {flat_error}")
    elif rank != root:
        problem = _local_problem(manifest, role, senders, flat, model, optimizer)
    rejected = _verdict(pg, rank, problem is not None, dl)
    if problem is not None:
        raise problem
    if rejected:
        raise HealError(
            f"heal aborted on rank {rank}: rank(s) {rejected} rejected the manifest "
            "(their own HealError says why)"
        )

    # 3. payload
    nbytes = 0
    if role == "send" and receivers:
        assert flat is not None
        nbytes = _send_stripe(pg, dl, manifest, flat, rank, receivers)
    elif role == "recv":
        _receive(pg, dl, manifest, model, optimizer)
        nbytes = manifest.total_bytes

    stats = HealStats(role, nbytes, time.perf_counter() - t0)
    out_meta = dict(meta or {}) if role == "send" else manifest.meta
    return out_meta, stats
