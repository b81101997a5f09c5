"""Striped heal: bring receivers' state up to date from senders, for any `NamedState`.

One protocol for every kind of state: the torch trainer heals a `TorchState`
(model + optimizer), the JAX trainer a `JaxState` (a pytree of leaves). And
one for every wire: the protocol talks to a `HealTransport`
(`elastrain.transfer.transport`), `heal` being `heal_over` a gloo group's.
Every rank of the group calls it with the same ``senders`` and
``receivers``; *trusted* starts as ``senders``:

1. **announce** -- one all-reduce (max) in which the first trusted sender (the
   *root*) announces its manifest's length, every rank states the most
   manifest bytes its state accepts (`NamedState.manifest_limit`) and adds a
   fresh random nonce. A length over the smallest limit is refused by every
   rank alike, before anything is allocated: the root counts as *malformed*.
2. **manifest** -- the root flattens its state, builds the JSON manifest
   (stripes over the trusted senders), seals it with HMAC-SHA256 under the job
   token, bound to this round's nonces (`elastrain.transfer.seal`), and
   broadcasts it. If it cannot build one (state not JSON-able), it broadcasts
   a sealed error manifest instead and every rank raises HealError.
3. **verdict** -- every other rank checks the seal, parses and validates the
   manifest; receivers judge it against their own state (`bound` before any
   allocation, then `check`); other senders check that their state has the
   same layout. One all-reduce of per-rank verdicts follows:
   - a manifest whose seal does not verify, that is not JSON, lies about sizes
     (entry bytes vs shape and dtype, offsets, total, stripes) or claims more
     than a receiver's state could hold is *malformed*: the root is refused,
     and the next trusted sender repeats steps 1-3 as root; none left: every
     rank raises HealError;
   - any other rejection (another kind of state, the receiver's state does
     not fit, the senders' states differ) makes every rank raise HealError at
     once, before any payload moves, leaving the group usable. A well-formed
     manifest that does not fit is a divergence, not damage, so it is not retried.
4. **payload** -- each trusted sender sends its stripe of the concatenated
   payload to every receiver, split into messages by `plan_chunks` (large
   tensor pieces straight from the live tensors, small ones packed), then the
   stripe's seal (Poly1305 under a key bound to the manifest seal, the sender's
   rank and the stripe's range). A sender packs and seals its stripe before
   the verdict round, while the receivers judge the manifest. Receivers post every receive at once (each entry into
   its own fresh tensor, `Landing`) and check each stripe's seal once all of
   it landed.
5. **outcome** -- one all-reduce of (receiver, stripe) seal failures. A sender
   whose stripe failed anywhere is refused for the rest of the heal; each
   failed stripe is sent again by a trusted sender (round-robin), to the
   receivers that need it, and steps 4-5 repeat. No trusted sender left for a
   failed stripe: every rank raises HealError. Only when every stripe matched
   do receivers install the state (`NamedState.install`): a failed heal leaves
   them untouched.

Everything is bounded by one deadline, ``timeout_s`` from the call. A transport
error or timeout raises HealError on the rank that saw it at once; its peers
then fail at their next collective (at the latest at the deadline).

Trust: every rank that holds the job token is trusted to be honest about its
own verdicts (any rank can make a heal fail); the seals keep out everything
else. A whole earlier heal replayed on the wire fails the manifest seal
(fresh nonces), so a joiner cannot be fed stale state.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from functools import partial
from typing import Any, Protocol

import torch

from elastrain.transfer.chunks import MAX_HEAL_ID, data_tag, plan_chunks, seal_tag
from elastrain.transfer.dtypes import cpu_bytes
from elastrain.transfer.errors import HealError, ManifestUnavailable
from elastrain.transfer.landing import Landing, LandingReserve, fresh_bytes
from elastrain.transfer.manifest import (
    Manifest,
    Stripe,
    build_manifest,
    decode_manifest,
    encode_error,
    encode_manifest,
    validate_manifest,
)
from elastrain.transfer.seal import (
    SEAL_BYTES,
    STRIPE_SEAL_BYTES,
    StripeSeal,
    check_seal,
    open_manifest,
    seal_manifest,
    seal_stripe,
)
from elastrain.transfer.state import FlatState, NamedState
from elastrain.transfer.tamper import Tamper
from elastrain.transfer.transport import GlooHeal, Group, HealTransport, Pending, Reduce


class Role(StrEnum):
    """What a rank does in a heal (a str, so that events and JSON carry the value)."""

    SEND = "send"
    RECV = "recv"
    IDLE = "idle"

    @staticmethod
    def of(rank: int, senders: Sequence[int], receivers: Sequence[int]) -> Role:
        """This rank's role: a sender, a receiver, or neither (idle)."""
        return Role.SEND if rank in senders else Role.RECV if rank in receivers else Role.IDLE


@dataclass(frozen=True)
class HealStats:
    """What one rank did in a heal.

    role: a `Role` ("send", "recv" or "idle"). bytes: payload bytes this rank sent (its
    stripe times the number of receivers, plus stripes it sent again for a
    refused sender) or received (the whole payload, plus what was fetched
    again); the manifest is not counted. seconds: wall time of the whole `heal`
    call here. refused: sender ranks whose manifest or stripe was refused
    (malformed, or a seal mismatch) and replaced by another sender's; the
    same on every rank. payload_s: the part of ``seconds`` spent moving the
    payload (steps 4-5: the stripes and their seals sent, received and checked,
    the outcome, any stripe sent again); the rest is the flatten, the manifest
    rounds (steps 1-3; the senders' staging of their stripes and the
    receivers' landing allocation overlap the verdict's) and the install.
    """

    role: str
    bytes: int
    seconds: float
    refused: tuple[int, ...] = ()
    payload_s: float = 0.0

    @property
    def rate_mb_s(self) -> float:
        """Payload throughput in MB/s (1 MB = 1e6 bytes) over the whole call; 0.0
        for an instant heal."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def event_fields(self) -> dict[str, Any]:
        """This heal's fields of a ``heal_end`` event (docs/guide/events.md)."""
        return {
            "role": self.role,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "payload_s": self.payload_s,
            "rate_mb_s": self.rate_mb_s,
        }


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class _Deadline:
    """Waits on a transport's posted operations, all against one deadline; errors
    become HealError."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.end - time.monotonic(), 0.001))

    def wait(self, work: Pending, what: str) -> None:
        try:
            work.wait(self.remaining())
        except RuntimeError as e:
            raise HealError(
                f"heal on rank {self.rank}: {what} failed (timeout_s={self.timeout_s:g}): "
                f"{_first_line(e)}"
            ) from e

    def call(self, fn: Callable[[], Pending], what: str) -> Pending:
        """Post an operation; a transport error at post time also becomes HealError."""
        try:
            return fn()
        except RuntimeError as e:
            raise HealError(f"heal on rank {self.rank}: {what} failed: {_first_line(e)}") from e


@dataclass(frozen=True)
class _Announcement:
    """Step 1 of the module docstring, as every rank sees it."""

    length: int
    limit: int
    nonces: tuple[int, ...]


def _announce(
    tx: HealTransport, root: int, length: int, limit: int, dl: _Deadline
) -> _Announcement:
    """All-reduce (max) of the root's manifest ``length`` (ignored elsewhere), minus
    every rank's limit (so the max is the smallest limit) and every rank's nonce in
    its own slot (collective)."""
    v = torch.zeros(2 + tx.size, dtype=torch.int64)
    v[0] = length if tx.rank == root else 0
    v[1] = -limit
    v[2 + tx.rank] = secrets.randbits(62)
    what = "manifest announcement all-reduce"
    work = dl.call(lambda: tx.allreduce(v, Reduce.MAX, dl.remaining()), what)
    dl.wait(work, "manifest announcement all-reduce")
    got = [int(x) for x in v.tolist()]
    return _Announcement(got[0], -got[1], tuple(got[2:]))


def _broadcast_bytes(
    tx: HealTransport, root: int, data: bytes | None, n: int, dl: _Deadline
) -> bytes:
    """Broadcast ``n`` bytes from ``root`` (other ranks pass None and allocate ``n``,
    which the announcement bounded); collective."""
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    work = dl.call(lambda: tx.broadcast(buf, root, dl.remaining()), "manifest broadcast")
    dl.wait(work, "manifest broadcast")
    return data if data is not None else buf.numpy().tobytes()


class Verdict(IntEnum):
    """A rank's verdict on a manifest (summed over ranks in one all-reduce)."""

    OK = 0
    MALFORMED = 1
    """Its seal does not verify, it is not JSON, it lies about sizes or claims more
    than this rank's state could hold: the root is to blame, the next one is asked."""
    REJECTED = 2
    """It is well-formed but does not fit this rank's state: a divergence."""


class _Flags:
    """An all-reduce (sum) of an int64 flag vector in which each rank set only its
    own slots, posted: `result` waits for it. Local work can run in between."""

    def __init__(self, tx: HealTransport, flags: torch.Tensor, what: str, dl: _Deadline) -> None:
        self.flags, self.what, self.dl = flags, what, dl
        self.work = dl.call(lambda: tx.allreduce(flags, Reduce.SUM, dl.remaining()), what)

    def result(self) -> list[int]:
        self.dl.wait(self.work, self.what)
        return [int(f) for f in self.flags.tolist()]


def _sum_flags(tx: HealTransport, flags: torch.Tensor, what: str, dl: _Deadline) -> list[int]:
    """All-reduce (sum) of an int64 flag vector in which each rank set only its own slots."""
    return _Flags(tx, flags, what, dl).result()


def _post_verdict(tx: HealTransport, code: Verdict, dl: _Deadline) -> _Flags:
    """Post the all-reduce of verdict codes; its result is every rank's code (collective)."""
    flags = torch.zeros(tx.size, dtype=torch.int64)
    flags[tx.rank] = code
    return _Flags(tx, flags, "verdict all-reduce", dl)


def _outcome(tx: HealTransport, n: int, failed: list[int], dl: _Deadline) -> dict[int, list[int]]:
    """All-reduce of seal failures over ``n`` stripes (collective).

    Returns {stripe index: receiver ranks that failed it}, only for failed stripes.
    """
    flags = torch.zeros(tx.size * n, dtype=torch.int64)
    for j in failed:
        flags[tx.rank * n + j] = 1
    got = _sum_flags(tx, flags, "seal outcome all-reduce", dl)
    out: dict[int, list[int]] = {}
    for r in range(tx.size):
        for j in range(n):
            if got[r * n + j]:
                out.setdefault(j, []).append(r)
    return out


def _check_args(
    tx: HealTransport, senders: Sequence[int], receivers: Sequence[int], timeout_s: float
) -> None:
    size = tx.size
    if not 0 <= tx.rank < size:
        raise ValueError(f"rank {tx.rank} is outside the group of size {size}")
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
    m: Manifest, role: Role, trusted: Sequence[int], flat: FlatState | None, state: NamedState
) -> tuple[Verdict, HealError | None]:
    """This rank's verdict on the manifest (not called on the root or idle ranks)."""
    try:
        validate_manifest(m, trusted)
        if not 1 <= m.heal_id <= MAX_HEAL_ID:
            raise HealError(f"manifest heal_id {m.heal_id} is outside [1, {MAX_HEAL_ID}]")
    except (HealError, TypeError, ValueError) as e:
        return Verdict.MALFORMED, e if isinstance(e, HealError) else HealError(str(e))
    if m.kind != state.kind:
        return Verdict.REJECTED, HealError(
            f"cannot heal: the senders' state is of kind {m.kind!r}, this rank's {state.kind!r}"
        )
    if role == Role.RECV:  # only receivers allocate for the payload
        try:
            why = state.bound(m)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            return Verdict.MALFORMED, HealError(f"manifest refused before allocation: {why}")
    try:
        if role == Role.RECV:
            why = state.check(m)
        else:
            assert flat is not None
            why = _sender_difference(m, flat, state.kind, trusted)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        why = f"{type(e).__name__}: {e}"
    return (Verdict.OK, None) if why is None else (Verdict.REJECTED, HealError(why))


def _sender_difference(
    m: Manifest, flat: FlatState, kind: str, trusted: Sequence[int]
) -> str | None:
    """None if this sender's own state has the root's layout and section, else how it differs."""
    mine = build_manifest(kind, flat.tensors, flat.section, trusted, {}, 0)
    for a, b in zip(mine.entries, m.entries, strict=False):
        if a != b:
            return f"sender states differ: this sender has {a}, the root has {b}"
    if len(mine.entries) != len(m.entries):
        return (
            f"sender states differ: {len(mine.entries)} tensors here, {len(m.entries)} on the root"
        )
    if json.loads(json.dumps(flat.section)) != m.section:
        return "sender states differ: optimizer hyperparameters or state differ"
    return None


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


@dataclass(frozen=True)
class _Round:
    """What every message of this heal is checked against: the manifest, its seal
    (which every stripe seal is bound to) and the key."""

    m: Manifest
    seal: bytes
    key: bytes | None


@dataclass(frozen=True)
class _Staged:
    """A sender's stripe, ready to go: its messages as they will be sent, and its seal."""

    wire: list[torch.Tensor]
    seal: torch.Tensor


def _stage(rd: _Round, flat: FlatState, stripe: Stripe, tamper: Tamper | None) -> _Staged:
    """Cut a stripe into its messages (large pieces as views of the live tensors,
    small ones packed) and seal it. Local: a sender does it while the receivers
    judge the manifest, so that neither the packing nor the seal's pass over the
    bytes competes with the transfer for the CPU."""
    m = rd.m
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
    wire = tamper.stripe(bufs) if tamper is not None else bufs
    key = tamper.sealing_key(rd.key) if tamper is not None else rd.key
    digest = seal_stripe(key, rd.seal, stripe, bufs)
    return _Staged(wire, torch.frombuffer(bytearray(digest), dtype=torch.uint8))


def _send_range(
    tx: HealTransport, dl: _Deadline, staged: _Staged, receivers: Sequence[int], tag_id: int
) -> list[tuple[int, Pending]]:
    """Post the messages of one staged stripe and its seal to every receiver;
    returns (receiver, work) pairs."""
    works = []
    for r in receivers:
        for i, buf in enumerate(staged.wire):
            tag = data_tag(tag_id, i)
            works.append((r, dl.call(partial(tx.send, buf, r, tag), f"send to {r}")))
    for r in receivers:
        tag = seal_tag(tag_id)
        works.append((r, dl.call(partial(tx.send, staged.seal, r, tag), f"send to {r}")))
    return works


@dataclass
class _Posted:
    """The receives of one assignment on a receiver."""

    j: int
    stripe: Stripe
    items: list[tuple[Any, torch.Tensor, Pending]]
    seal: torch.Tensor
    seal_work: Pending


def _post_range(
    tx: HealTransport, dl: _Deadline, m: Manifest, landing: Landing, j: int, s: Stripe, tag_id: int
) -> _Posted:
    what = f"receive from rank {s.sender_rank}"
    items = []
    for i, chunk in enumerate(plan_chunks(m.entries, s)):
        if chunk.packed:
            buf = fresh_bytes(chunk.nbytes)
        else:
            p = chunk.pieces[0]
            buf = landing.target(m.entries[p.entry], p.offset, p.nbytes)
        tag = data_tag(tag_id, i)
        work = dl.call(partial(tx.recv, buf, s.sender_rank, tag), what)
        items.append((chunk, buf, work))
    seal = torch.zeros(STRIPE_SEAL_BYTES, dtype=torch.uint8)
    tag = seal_tag(tag_id)
    seal_work = dl.call(partial(tx.recv, seal, s.sender_rank, tag), what)
    return _Posted(j, s, items, seal, seal_work)


def _land(dl: _Deadline, rd: _Round, landing: Landing, posted: _Posted) -> HealError | None:
    """Wait for every message of one assignment and check its seal; on a match, copy
    its packed messages into the landing. Returns the mismatch, or None."""
    s, m = posted.stripe, rd.m
    got = StripeSeal(rd.key, rd.seal, s)
    for _, buf, work in posted.items:
        dl.wait(work, f"receiving stripe from rank {s.sender_rank}")
        got.update(buf)
    dl.wait(posted.seal_work, f"receiving the seal from rank {s.sender_rank}")
    try:
        check_seal(got.digest(), posted.seal.numpy().tobytes(), s)
    except HealError as e:
        return e
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
    tx: HealTransport,
    dl: _Deadline,
    rd: _Round,
    flat: FlatState | None,
    landing: Landing | None,
    receivers: Sequence[int],
    trusted: list[int],
    refused: list[int],
    tamper: Tamper | None,
    staged: dict[Stripe, _Staged],
) -> int:
    """Steps 3-4 of the module docstring: send/receive stripes, retry the refused ones
    from other trusted senders. Collective; returns this rank's payload bytes.
    ``staged``: this sender's stripes staged ahead (`_stage`); the others (stripes
    sent again) are staged here. Mutates ``trusted`` and ``refused``; HealError when
    no trusted sender is left."""
    m, rank = rd.m, tx.rank
    work = [_Assignment(s, tuple(receivers)) for s in m.stripes if s.nbytes and receivers]
    nbytes = 0
    while work:
        sends: list[tuple[int, Pending]] = []
        posted: list[_Posted] = []
        for j, a in enumerate(work):
            tag_id = _tag_id(m.heal_id, j)
            if a.stripe.sender_rank == rank:
                assert flat is not None
                st = staged.pop(a.stripe, None) or _stage(rd, flat, a.stripe, tamper)
                sends += _send_range(tx, dl, st, a.receivers, tag_id)
                nbytes += a.stripe.nbytes * len(a.receivers)
            elif rank in a.receivers:
                assert landing is not None
                posted.append(_post_range(tx, dl, m, landing, j, a.stripe, tag_id))
                nbytes += a.stripe.nbytes
        for r, w in sends:
            dl.wait(w, f"sending stripe to rank {r}")
        mismatches: dict[int, HealError] = {}
        for p in posted:
            assert landing is not None
            if (e := _land(dl, rd, landing, p)) is not None:
                mismatches[p.j] = e
        failed = _outcome(tx, len(work), sorted(mismatches), dl)
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
                f"heal on rank {rank}: payload bytes {ranges} failed their seal and no "
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


class HealFn(Protocol):
    """What the trainers call to heal over a generation's group: `heal`, or a test's
    or another wire's stand-in with its signature (see `heal`; the test seam
    ``tamper`` is not part of it: trainers never pass it)."""

    def __call__(
        self,
        pg: Group,
        rank: int,
        senders: list[int],
        receivers: list[int],
        state: NamedState,
        meta: dict[str, Any] | None,
        timeout_s: float,
        *,
        key: bytes | None = None,
        reserve: LandingReserve | None = None,
    ) -> tuple[dict[str, Any], HealStats]: ...


def heal(
    pg: Group,
    rank: int,
    senders: list[int],
    receivers: list[int],
    state: NamedState,
    meta: dict[str, Any] | None,
    timeout_s: float,
    *,
    key: bytes | None = None,
    tamper: Tamper | None = None,
    reserve: LandingReserve | None = None,
) -> tuple[dict[str, Any], HealStats]:
    """`heal_over` the gloo group ``pg``, this rank being ``rank`` (`GlooHeal`): a `HealFn`.

    ValueError if ``rank`` is not this rank of ``pg``, before any communication."""
    return heal_over(
        GlooHeal(pg, rank),
        senders,
        receivers,
        state,
        meta,
        timeout_s,
        key=key,
        tamper=tamper,
        reserve=reserve,
    )


def heal_over(
    tx: HealTransport,
    senders: list[int],
    receivers: list[int],
    state: NamedState,
    meta: dict[str, Any] | None,
    timeout_s: float,
    *,
    key: bytes | None = None,
    tamper: Tamper | None = None,
    reserve: LandingReserve | None = None,
) -> tuple[dict[str, Any], HealStats]:
    """Copy senders' ``state`` onto receivers, striped over all senders, sealed by ``key``.

    Collective over ALL ranks of the transport's group (``tx``, this rank being
    ``tx.rank``): every rank calls it with the same
    ``senders`` (ranks with identical, up-to-date state; senders[0] is the
    first manifest root), ``receivers`` (ranks to overwrite) and ``key`` (the
    job token's bytes; the trainers always pass it). Every rank passes its own
    ``state`` (idle ranks too: it bounds the manifest they receive). A rank in
    neither list is idle: it only takes part in the manifest round and the
    all-reduces. Blocks until the heal is done on every rank or ``timeout_s``
    (one deadline for the whole call) has passed.

    Hostile or damaged input is refused and fetched again from another sender
    (see the module docstring): a manifest whose seal does not verify, that is
    not JSON, lies about sizes or claims more than a receiver's state could
    hold makes the next sender the root, before anything is allocated for it;
    a stripe whose seal does not match is sent again by another sender, to the
    receivers that refused it. The refused senders are listed in
    ``HealStats.refused`` on every rank.

    Returns ``(meta, stats)``: senders return the ``meta`` they passed (``{}``
    for None); receivers and idle ranks return the root's ``meta`` after a JSON
    round trip (tuples become lists, dict keys strings). ``meta`` must be
    JSON-able; it is how the caller ships step number, RNG state, data cursor.

    Raises ValueError for inconsistent arguments (on every rank, before any
    communication). Raises HealError on every rank when the manifest is rejected
    (another kind of state, it does not fit a receiver, the senders' states
    differ, or every sender's manifest was malformed), or when a stripe failed
    its seal and no unrefused sender is left to send it again; on the rank that
    sees it, for a transport error or timeout. A receiver's state is replaced
    (`NamedState.install`) only after every stripe arrived and matched its
    seal. After a HealError from a transport failure or timeout, drop the
    group.

    ``reserve``: a receiver's landing memory, mapped and touched ahead of the heal
    (`LandingReserve`; its sections are used up here). Without one, or for a
    section it does not fit, the payload lands in fresh memory.

    ``tamper`` is the test seam: this rank damages or forges what it sends (see `Tamper`).
    """
    t0 = time.perf_counter()
    _check_args(tx, senders, receivers, timeout_s)
    rank = tx.rank
    dl = _Deadline(rank, timeout_s)
    role = Role.of(rank, senders, receivers)

    flat: FlatState | None = None
    flat_error: Exception | None = None
    if role == Role.SEND:
        try:
            flat = state.flatten()
        except TypeError as e:
            flat_error = e
    sealing_key = tamper.sealing_key(key) if tamper is not None else key

    trusted = list(senders)
    refused: list[int] = []
    while True:
        root = trusted[0]
        code, problem = Verdict.OK, None
        built: Exception | None = None
        data, length = b"", 0
        if rank == root:
            try:
                if flat is None:
                    raise flat_error or HealError("no state")
                manifest = build_manifest(
                    state.kind,
                    flat.tensors,
                    flat.section,
                    trusted,
                    dict(meta or {}),
                    secrets.randbelow(MAX_HEAL_ID) + 1,
                )
                data = encode_manifest(manifest)
                if tamper is not None:
                    data = tamper.manifest_bytes(data)
            except (TypeError, ValueError) as e:
                built, data = e, encode_error(f"{type(e).__name__}: {e}")
            length = len(data) + SEAL_BYTES
            if tamper is not None:
                length = tamper.announced_length(length)

        # 1. announce: the length is judged by every rank alike, before allocating
        ann = _announce(tx, root, length, state.manifest_limit(), dl)
        if ann.length > ann.limit:
            code = Verdict.MALFORMED
            problem = HealError(
                f"malformed manifest: rank {root} announced {ann.length} manifest bytes; "
                f"the smallest limit in the group is {ann.limit}"
            )
        # 2. manifest, sealed by the root
        elif rank == root:
            seal = seal_manifest(sealing_key, ann.nonces, root, data)
            _broadcast_bytes(tx, root, data + seal, ann.length, dl)
            if built is not None:
                raise HealError(
                    f"heal on rank {rank} (manifest root): cannot build the manifest: {built}"
                ) from built
        else:
            sealed = _broadcast_bytes(tx, root, None, ann.length, dl)
            seal = sealed[-SEAL_BYTES:]
            try:
                manifest = decode_manifest(open_manifest(key, ann.nonces, root, sealed))
            except ManifestUnavailable:
                raise
            except HealError as e:
                code, problem = Verdict.MALFORMED, e
            else:
                if flat_error is not None:
                    code = Verdict.REJECTED
                    problem = HealError(f"cannot flatten this sender's state: {flat_error}")
                elif role != Role.IDLE:
                    code, problem = _local_problem(manifest, role, trusted, flat, state)

        # 3. verdict. While the round completes, a sender stages its stripe (packed
        # and sealed) and a receiver allocates its landing: both are local, and
        # wasted only when some rank refuses.
        verdict = _post_verdict(tx, code, dl)
        staged: dict[Stripe, _Staged] = {}
        landing: Landing | None = None
        try:
            if code == Verdict.OK and role == Role.SEND and flat is not None and receivers:
                rd = _Round(manifest, seal, key)
                staged = {s: _stage(rd, flat, s, tamper) for s in manifest.stripes
                          if s.sender_rank == rank and s.nbytes}  # fmt: skip
            elif code == Verdict.OK and role == Role.RECV:
                landing = Landing.allocate(manifest.entries, reserve)  # within `bound`
        except BaseException:
            with contextlib.suppress(HealError):
                verdict.result()  # the posted round completes; its peers go on to fail
            raise
        codes = verdict.result()
        malformed = [r for r, c in enumerate(codes) if c == Verdict.MALFORMED]
        if malformed:
            refused.append(root)
            trusted.remove(root)
            staged, landing = {}, None  # this root's; the next lands in fresh memory
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

    # 4-5. payload, sealed, with refused stripes sent again by trusted senders
    rd = _Round(manifest, seal, key)
    t_payload = time.perf_counter()
    nbytes = _payload(tx, dl, rd, flat, landing, receivers, trusted, refused, tamper, staged)
    payload_s = time.perf_counter() - t_payload
    if landing is not None:
        state.install(landing.tensors, manifest.section)

    stats = HealStats(role, nbytes, time.perf_counter() - t0, tuple(refused), payload_s)
    out_meta = dict(meta or {}) if role == Role.SEND else manifest.meta
    return out_meta, stats
