"""Striped heal: bring receivers' model + optimizer state up to date from senders.

Protocol (every rank of the process group calls `heal` with the same
``senders`` and ``receivers``; *trusted* starts as ``senders``):

1. **manifest** -- the first trusted sender (the *root*) flattens its state,
   builds the JSON manifest (stripes over the trusted senders) and broadcasts
   it (int64 length, then uint8 bytes) to the whole group. If it cannot (state
   not JSON-able), it broadcasts an error manifest instead and every rank
   raises HealError.
2. **verdict** -- every other rank parses and validates the manifest; receivers
   check it against their own model and optimizer; other senders check that
   their state has the same layout. One all-reduce of per-rank codes follows:
   - a manifest that is not JSON or lies about sizes (entry bytes vs shape and
     dtype, offsets, total, stripes) is *malformed*: the root is refused, and
     the next trusted sender repeats steps 1-2 as root; none left: every rank
     raises HealError;
   - any other rejection (the receiver's model or optimizer does not fit, the
     senders' states differ) makes every rank raise HealError at once, before
     any payload moves, leaving the group usable. A well-formed manifest that
     does not fit is a divergence, not damage in transit, so it is not retried.
3. **payload** -- each trusted sender sends its stripe of the concatenated
   payload to every receiver, split into messages by `plan_chunks` (large
   tensor pieces straight from the live tensors, small ones packed), then the
   stripe's CRC-32. Receivers post every receive at once (model bytes into one
   staging buffer, optimizer bytes into new state tensors) and check each
   stripe's CRC once all of it landed.
4. **outcome** -- one all-reduce of (receiver, stripe) checksum failures. A
   sender whose stripe failed anywhere is refused for the rest of the heal; each
   failed stripe is sent again by a trusted sender (round-robin), to the
   receivers that need it, and steps 3-4 repeat. No trusted sender left for a
   failed stripe: every rank raises HealError. Only when every stripe matched
   do receivers install the state (optimizer via ``load_state_dict``, model
   tensors overwritten in place): a failed heal leaves them untouched.

Everything is bounded by one deadline, ``timeout_s`` from the call. A transport
error or timeout raises HealError on the rank that saw it at once; its peers
then fail at their next collective (at the latest at the deadline).
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
from elastrain.transfer.errors import HealError, ManifestUnavailable
from elastrain.transfer.flatten import FlatState, Landing, flatten_state, install
from elastrain.transfer.manifest import (
    Manifest,
    Stripe,
    build_manifest,
    check_model,
    check_optimizer,
    decode_manifest,
    encode_error,
    encode_manifest,
    validate_manifest,
)
from elastrain.transfer.signature import model_signature
from elastrain.transfer.tamper import Tamper

Group = Any
"""A gloo process group: ``ProcessGroupGloo(store, rank, size, timeout)`` or a ``ProcessGroup``.

Typed as Any because torch's stubs do not declare the collectives on the backend
classes; `heal` uses ``size()``, ``rank()``, ``broadcast``, ``allreduce``, ``send``
and ``recv`` with their option-object signatures."""


@dataclass(frozen=True)
class HealStats:
    """What one rank did in a heal.

    role: "send", "recv" or "idle". bytes: payload bytes this rank sent (its
    stripe times the number of receivers, plus stripes it sent again for a
    refused sender) or received (the whole payload, plus what was fetched
    again); the manifest is not counted. seconds: wall time of the whole `heal`
    call here. refused: sender ranks whose manifest or stripe was refused
    (malformed, or a checksum mismatch) and replaced by another sender's; the
    same on every rank.
    """

    role: str
    bytes: int
    seconds: float
    refused: tuple[int, ...] = ()

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


OK, MALFORMED, REJECTED = 0, 1, 2
"""A rank's verdict on a manifest: fine; malformed (not JSON, or it lies about
sizes: the root is to blame); rejected (it does not fit this rank's state)."""


def _sum_flags(pg: Group, flags: torch.Tensor, what: str, dl: _Deadline) -> list[int]:
    """All-reduce (sum) of an int64 flag vector in which each rank set only its own slots."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    opts.timeout = dl.remaining()
    work = dl.call(lambda: pg.allreduce([flags], opts), what)
    dl.wait(work, what)
    return [int(f) for f in flags.tolist()]


def _verdict(pg: Group, rank: int, code: int, dl: _Deadline) -> list[int]:
    """All-reduce of verdict codes; returns every rank's code (collective)."""
    flags = torch.zeros(pg.size(), dtype=torch.int64)
    flags[rank] = code
    return _sum_flags(pg, flags, "verdict all-reduce", dl)


def _outcome(
    pg: Group, rank: int, n: int, failed: list[int], dl: _Deadline
) -> dict[int, list[int]]:
    """All-reduce of checksum failures over ``n`` stripes (collective).

    Returns {stripe index: receiver ranks that failed it}, only for failed stripes.
    """
    flags = torch.zeros(pg.size() * n, dtype=torch.int64)
    for j in failed:
        flags[rank * n + j] = 1
    got = _sum_flags(pg, flags, "checksum outcome all-reduce", dl)
    out: dict[int, list[int]] = {}
    for r in range(pg.size()):
        for j in range(n):
            if got[r * n + j]:
                out.setdefault(j, []).append(r)
    return out


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
    trusted: Sequence[int],
    flat: FlatState | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[int, HealError | None]:
    """This rank's verdict on the manifest: (code, why) with code OK, MALFORMED or REJECTED."""
    try:
        validate_manifest(m, trusted)
        if not 1 <= m.heal_id <= MAX_HEAL_ID:
            raise HealError(f"manifest heal_id {m.heal_id} is outside [1, {MAX_HEAL_ID}]")
    except (HealError, TypeError, ValueError) as e:
        return MALFORMED, e if isinstance(e, HealError) else HealError(str(e))
    try:
        if role == "recv":
            check_model(m, model_signature(model))
            check_optimizer(m, optimizer)
        elif role == "send":
            assert flat is not None
            mine = build_manifest(flat.tensors, flat.optimizer, trusted, {}, 0)
            for a, b in zip(mine.entries, m.entries, strict=False):
                if a != b:
                    return REJECTED, HealError(
                        f"sender states differ: this sender has {a}, the root has {b}"
                    )
            if len(mine.entries) != len(m.entries):
                return REJECTED, HealError(
                    f"sender states differ: {len(mine.entries)} tensors here, "
                    f"{len(m.entries)} on the root"
                )
            if json.loads(json.dumps(flat.optimizer)) != m.optimizer:
                return REJECTED, HealError(
                    "sender states differ: optimizer hyperparameters or state differ"
                )
    except (HealError, TypeError, ValueError) as e:
        return REJECTED, e if isinstance(e, HealError) else HealError(str(e))
    return OK, None


@dataclass(frozen=True)
class _Assignment:
    """Byte range ``stripe`` of the payload, sent by ``stripe.sender_rank`` to ``receivers``."""

    stripe: Stripe
    receivers: tuple[int, ...]


def _tag_id(heal_id: int, j: int) -> int:
    """The tag namespace of assignment ``j`` in a round: distinct per assignment, so
    one sender can send several ranges to one receiver. Rounds reuse ids: every
    message of a round is consumed before the next round starts."""
    return 1 + (heal_id - 1 + j) % MAX_HEAL_ID


def _send_range(
    pg: Group,
    dl: _Deadline,
    m: Manifest,
    flat: FlatState,
    a: _Assignment,
    tag_id: int,
    tamper: Tamper | None,
) -> list[tuple[int, Any]]:
    """Post the messages of one assignment and its CRC; returns (receiver, work) pairs."""
    sources: dict[int, torch.Tensor] = {}
    bufs: list[torch.Tensor] = []
    for chunk in plan_chunks(m.entries, a.stripe):
        parts = []
        for p in chunk.pieces:
            if p.entry not in sources:
                sources[p.entry] = cpu_bytes(flat.tensors[p.entry][1])
            rel = p.offset - m.entries[p.entry].offset
            parts.append(sources[p.entry][rel : rel + p.nbytes])
        bufs.append(torch.cat(parts) if chunk.packed else parts[0])
    wire = tamper.stripe(bufs) if tamper is not None else bufs
    works = []
    for r in a.receivers:
        for i, buf in enumerate(wire):
            tag = data_tag(tag_id, i)
            works.append((r, dl.call(lambda b=buf, r=r, t=tag: pg.send([b], r, t), f"send to {r}")))
    crc = torch.tensor([stripe_crc(bufs)], dtype=torch.int64)  # overlaps the transfer
    for r in a.receivers:
        tag = crc_tag(tag_id)
        works.append((r, dl.call(lambda r=r, t=tag: pg.send([crc], r, t), f"send to {r}")))
    return works


@dataclass
class _Posted:
    """The receives of one assignment on a receiver."""

    j: int
    stripe: Stripe
    items: list[tuple[Any, torch.Tensor, Any]]
    crc: torch.Tensor
    crc_work: Any


def _post_range(
    pg: Group, dl: _Deadline, m: Manifest, landing: Landing, j: int, s: Stripe, tag_id: int
) -> _Posted:
    what = f"receive from rank {s.sender_rank}"
    items = []
    for i, chunk in enumerate(plan_chunks(m.entries, s)):
        if chunk.packed:
            buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
        else:
            p = chunk.pieces[0]
            buf = landing.target(m.entries[p.entry], p.offset, p.nbytes)
        tag = data_tag(tag_id, i)
        work = dl.call(lambda b=buf, s=s, t=tag: pg.recv([b], s.sender_rank, t), what)
        items.append((chunk, buf, work))
    crc = torch.zeros(1, dtype=torch.int64)
    tag = crc_tag(tag_id)
    crc_work = dl.call(lambda c=crc, s=s, t=tag: pg.recv([c], s.sender_rank, t), what)
    return _Posted(j, s, items, crc, crc_work)


def _land(dl: _Deadline, m: Manifest, landing: Landing, posted: _Posted) -> HealError | None:
    """Wait for every message of one assignment and check its CRC; on a match, copy
    its packed messages into the landing. Returns the mismatch, or None."""
    s = posted.stripe
    got = 0
    for _, buf, work in posted.items:
        dl.wait(work, f"receiving stripe from rank {s.sender_rank}")
        got = crc_update(got, buf)
    dl.wait(posted.crc_work, f"receiving checksum from rank {s.sender_rank}")
    try:
        check_crc(got, int(posted.crc.item()), s.sender_rank, s.nbytes)
    except HealError as e:
        return HealError(f"{e} (payload bytes [{s.offset}, {s.offset + s.nbytes}))")
    for chunk, buf, _ in posted.items:
        if chunk.packed:
            at = 0
            for p in chunk.pieces:
                landing.target(m.entries[p.entry], p.offset, p.nbytes).copy_(
                    buf[at : at + p.nbytes]
                )
                at += p.nbytes
    return None


def _payload(
    pg: Group,
    dl: _Deadline,
    rank: int,
    m: Manifest,
    flat: FlatState | None,
    landing: Landing | None,
    receivers: Sequence[int],
    trusted: list[int],
    refused: list[int],
    tamper: Tamper | None,
) -> int:
    """Steps 3-4 of the module docstring: send/receive stripes, retry the refused ones
    from other trusted senders. Collective over pg; returns this rank's payload bytes.
    Mutates ``trusted`` and ``refused``; HealError when no trusted sender is left."""
    work = [_Assignment(s, tuple(receivers)) for s in m.stripes if s.nbytes and receivers]
    nbytes = 0
    while work:
        sends: list[tuple[int, Any]] = []
        posted: list[_Posted] = []
        for j, a in enumerate(work):
            tag_id = _tag_id(m.heal_id, j)
            if a.stripe.sender_rank == rank:
                assert flat is not None
                sends += _send_range(pg, dl, m, flat, a, tag_id, tamper)
                nbytes += a.stripe.nbytes * len(a.receivers)
            elif rank in a.receivers:
                assert landing is not None
                posted.append(_post_range(pg, dl, m, landing, j, a.stripe, tag_id))
                nbytes += a.stripe.nbytes
        for r, w in sends:
            dl.wait(w, f"sending stripe to rank {r}")
        mismatches: dict[int, HealError] = {}
        for p in posted:
            assert landing is not None
            if (e := _land(dl, m, landing, p)) is not None:
                mismatches[p.j] = e
        failed = _outcome(pg, rank, len(work), sorted(mismatches), dl)
        if not failed:
            break
        bad = sorted({work[j].stripe.sender_rank for j in failed})
        refused += [b for b in bad if b not in refused]
        trusted[:] = [t for t in trusted if t not in bad]
        if not trusted:
            ranges = ", ".join(
                f"[{work[j].stripe.offset}, {work[j].stripe.offset + work[j].stripe.nbytes})"
                f" from rank {work[j].stripe.sender_rank} on rank(s) {failed[j]}"
                for j in sorted(failed)
            )
            mine = next(iter(mismatches.values()), None)
            raise HealError(
                f"heal on rank {rank}: payload bytes {ranges} failed their checksum and no "
                f"sender is left to retry from (refused senders: {refused})"
                + (f"; here: {mine}" if mine is not None else "")
            ) from mine
        work = [
            _Assignment(
                Stripe(trusted[k % len(trusted)], work[j].stripe.offset, work[j].stripe.nbytes),
                tuple(failed[j]),
            )
            for k, j in enumerate(sorted(failed))
        ]
    return nbytes


def heal(
    pg: Group,
    rank: int,
    senders: list[int],
    receivers: list[int],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any] | None,
    timeout_s: float,
    *,
    tamper: Tamper | None = None,
) -> tuple[dict[str, Any], HealStats]:
    """Copy senders' model + optimizer state onto receivers, striped over all senders.

    Collective over ALL ranks of ``pg``: every rank calls it with the same
    ``senders`` (ranks with identical, up-to-date state; senders[0] is the
    first manifest root) and ``receivers`` (ranks to overwrite). A rank in
    neither is idle: it only takes part in the manifest broadcast and the
    all-reduces. Blocks until the heal is done on every rank or ``timeout_s``
    (one deadline for the whole call) has passed.

    Hostile or damaged input is refused and fetched again from another sender
    (see the module docstring): a manifest that is not JSON or lies about sizes
    makes the next sender the root; a stripe whose CRC-32 does not match is sent
    again by another sender, to the receivers that refused it. The refused
    senders are listed in ``HealStats.refused`` on every rank.

    Returns ``(meta, stats)``: senders return the ``meta`` they passed (``{}``
    for None); receivers and idle ranks return the root's ``meta`` after a JSON
    round trip (tuples become lists, dict keys strings). ``meta`` must be
    JSON-able; it is how the caller ships step number, RNG state, data cursor.

    Raises ValueError for inconsistent arguments (on every rank, before any
    communication). Raises HealError on every rank when the manifest is rejected
    (it does not fit a receiver, the senders' states differ, or every sender's
    manifest was malformed), or when a stripe failed its checksum and no
    unrefused sender is left to send it again; on the rank that sees it, for a
    transport error or timeout. A receiver's state is replaced only after every
    stripe arrived and matched its checksum. After a HealError from a transport
    failure or timeout, drop the process group.

    ``tamper`` is the test seam: this rank damages what it sends (see `Tamper`).
    """
    t0 = time.perf_counter()
    _check_args(pg, rank, senders, receivers, timeout_s)
    dl = _Deadline(rank, timeout_s)
    role = "send" if rank in senders else "recv" if rank in receivers else "idle"

    flat: FlatState | None = None
    flat_error: Exception | None = None
    if role == "send":
        try:
            flat = flatten_state(model, optimizer)
        except TypeError as e:
            flat_error = e

    trusted = list(senders)
    refused: list[int] = []
    while True:
        # 1. manifest, from the first trusted sender
        root = trusted[0]
        code, problem = OK, None
        if rank == root:
            try:
                if flat is None:
                    raise flat_error or HealError("no state")
                manifest = build_manifest(
                    flat.tensors,
                    flat.optimizer,
                    trusted,
                    dict(meta or {}),
                    secrets.randbelow(MAX_HEAL_ID) + 1,
                )
                data = encode_manifest(manifest)
            except (TypeError, ValueError) as e:
                _broadcast_bytes(pg, root, encode_error(f"{type(e).__name__}: {e}"), dl)
                raise HealError(
                    f"heal on rank {rank} (manifest root): cannot build the manifest: {e}"
                ) from e
            _broadcast_bytes(pg, root, tamper.manifest_bytes(data) if tamper else data, dl)
        else:
            data = _broadcast_bytes(pg, root, None, dl)
            try:
                manifest = decode_manifest(data)
            except ManifestUnavailable:
                raise
            except HealError as e:
                code, problem = MALFORMED, e
            else:
                if flat_error is not None:
                    code = REJECTED
                    problem = HealError(f"cannot flatten this sender's state: {flat_error}")
                elif role != "idle":
                    code, problem = _local_problem(manifest, role, trusted, flat, model, optimizer)

        # 2. verdict
        codes = _verdict(pg, rank, code, dl)
        malformed = [r for r, c in enumerate(codes) if c == MALFORMED]
        if malformed:
            refused.append(root)
            trusted.remove(root)
            if trusted:
                continue
            why = f"; here: {problem}" if problem is not None else ""
            raise HealError(
                f"heal on rank {rank}: rank(s) {malformed} refused the manifest of sender rank "
                f"{root} as malformed and no sender is left to ask (refused: {refused}){why}"
            ) from problem
        if problem is not None:
            raise problem
        rejected = [r for r, c in enumerate(codes) if c]
        if rejected:
            raise HealError(
                f"heal on rank {rank}: rank(s) {rejected} rejected the manifest "
                "(their own HealError says why)"
            )
        break

    # 3-4. payload, checked, with refused stripes sent again by trusted senders
    landing = Landing.allocate(manifest.entries) if role == "recv" else None
    nbytes = _payload(pg, dl, rank, manifest, flat, landing, receivers, trusted, refused, tamper)
    if landing is not None:
        install(manifest.entries, landing, manifest.optimizer, model, optimizer)

    stats = HealStats(role, nbytes, time.perf_counter() - t0, tuple(refused))
    out_meta = dict(meta or {}) if role == "send" else manifest.meta
    return out_meta, stats
