"""Steps 4-5 of the striped heal: the payload's stripes, and how they are checked.

Once every rank accepted the manifest (`elastrain.transfer.striped`), each
trusted sender sends its stripe of the concatenated payload to every receiver,
cut into messages by `plan_chunks` (large tensor pieces straight from the live
tensors into the receiver's landing, small ones packed). What vouches for the
bytes is the heal's `HealAuth`, one `PayloadCheck` chosen once per heal:

- `DigestCheck` (digest mode, the default): besides the bytes, one small
  message travels: the root's `state_digest`, sealed with HMAC-SHA256 under the
  job token and bound to the manifest seal (`Reference`), which the root sends
  each receiver after its stripes. The root computes it on a thread from the
  moment its manifest is broadcast, overlapping the verdict round and the
  payload, so that it never delays the manifest. A receiver feeds the state digest
  (`elastrain.transfer.flatten.digest_hasher`) the payload in order as its
  messages land, then compares it with the root's. One all-reduce of per-receiver verdicts follows. Only when a receiver
  mismatched does a *blame* round run: every sender of a stripe that receiver
  got states the stripe's XXH3-128 digest of its own live bytes, sealed with
  HMAC-SHA256 under the job token and bound to the manifest seal
  (`elastrain.transfer.seal.claim_tag`), and the receiver compares each with the
  digest of what landed. A stripe whose claim does not verify or does not
  match failed; if every claim matched yet the whole did not, the senders'
  states differ and the stripes of every sender but the root failed (the
  root's own if it sent all of them).
- `MacCheck` (mac mode): each stripe is followed by its Poly1305 seal
  (`elastrain.transfer.seal.StripeSeal`); a receiver checks each stripe once
  all of it landed.

Either way one all-reduce of (receiver, stripe) failures decides what is
refused: a sender with a failed stripe is refused for the rest of the heal and
its stripes go again, round-robin over the remaining trusted senders, only to
the receivers that failed them; the check repeats (in digest mode over the
whole landing). A receiver installs nothing until every check passed. All
functions here are collective over the transport's group unless they say they
are local.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import xxhash

from elastrain.transfer.auth import HealAuth
from elastrain.transfer.chunks import (
    MAX_HEAL_ID,
    Chunk,
    data_tag,
    plan_chunks,
    seal_tag,
    stripe_pieces,
)
from elastrain.transfer.dtypes import cpu_bytes, dtype_from_name
from elastrain.transfer.errors import HealError, NoSenderLeft
from elastrain.transfer.flatten import digest_hasher
from elastrain.transfer.landing import Landing, fresh_bytes
from elastrain.transfer.manifest import Entry, Manifest, Stripe
from elastrain.transfer.rounds import Deadline, outcome, sum_flags
from elastrain.transfer.seal import (
    CLAIM_BYTES,
    REFERENCE_BYTES,
    STRIPE_SEAL_BYTES,
    StripeSeal,
    check_seal,
    claim_tag,
    reference_tag,
    seal_stripe,
)
from elastrain.transfer.state import FlatState
from elastrain.transfer.tamper import Tamper
from elastrain.transfer.transport import HealTransport, Pending


@dataclass(frozen=True)
class Round:
    """What every message of this heal is checked against: the manifest, its seal
    (which every stripe seal and claim is bound to), the key, and the manifest's root."""

    m: Manifest
    seal: bytes
    key: bytes | None
    root: int


@dataclass(frozen=True)
class Assignment:
    """Byte range ``stripe`` of the payload, sent by ``stripe.sender_rank`` to ``receivers``."""

    stripe: Stripe
    receivers: tuple[int, ...]


def tag_id(heal_id: int, j: int) -> int:
    """The tag namespace of assignment ``j`` in a round: distinct per assignment, so
    one sender can send several ranges to one receiver. Rounds reuse ids: every
    message of a round is consumed before the next round starts."""
    return 1 + (heal_id - 1 + j) % MAX_HEAL_ID


@dataclass(frozen=True)
class Staged:
    """A sender's stripe, ready to go: its messages as they will be sent, and its
    seal (mac mode; None in digest mode, where nothing follows the bytes)."""

    wire: list[torch.Tensor]
    seal: torch.Tensor | None


Cut = list[list[torch.Tensor]]
"""A stripe's messages before packing: each a list of views of the live tensors (one
for a large piece, sent as it is; several small ones, packed into a copy)."""


def cut_stripe(m: Manifest, flat: FlatState, stripe: Stripe) -> Cut:
    """A sender's stripe cut into its messages' pieces, as views of its live tensors
    (no byte copied: what they hold is read when they are packed or sent). Local."""
    sources: dict[int, torch.Tensor] = {}
    out: Cut = []
    for chunk in plan_chunks(m.entries, stripe):
        parts = []
        for p in chunk.pieces:
            if p.entry not in sources:
                sources[p.entry] = cpu_bytes(flat.tensors[p.entry][1])
            rel = p.offset - m.entries[p.entry].offset
            parts.append(sources[p.entry][rel : rel + p.nbytes])
        out.append(parts)
    return out


def pack(cut: Cut) -> list[torch.Tensor]:
    """The messages of a `cut_stripe`: large pieces as they are, small ones packed
    into a copy of their bytes now. Local."""
    return [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in cut]


def stripe_parts(m: Manifest, flat: FlatState, stripe: Stripe) -> list[torch.Tensor]:
    """A sender's stripe as its messages (large pieces as views of the live tensors,
    small ones packed into a copy). Local."""
    return pack(cut_stripe(m, flat, stripe))


def send_range(
    tx: HealTransport, dl: Deadline, staged: Staged, receivers: Sequence[int], tid: int
) -> list[tuple[int, Pending]]:
    """Post the messages of one staged stripe (and its seal, if any) to every
    receiver; returns (receiver, work) pairs."""
    works = []
    for r in receivers:
        for i, buf in enumerate(staged.wire):
            works.append((r, dl.call(partial(tx.send, buf, r, data_tag(tid, i)), f"send to {r}")))
    if staged.seal is not None:
        for r in receivers:
            post = partial(tx.send, staged.seal, r, seal_tag(tid))
            works.append((r, dl.call(post, f"send to {r}")))
    return works


@dataclass
class Posted:
    """The receives of one assignment on a receiver (``seal``: mac mode's)."""

    j: int
    stripe: Stripe
    items: list[tuple[Any, torch.Tensor, Pending]]
    seal: tuple[torch.Tensor, Pending] | None


def plan_receives(
    entries: Sequence[Entry], landing: Landing, s: Stripe
) -> list[tuple[Chunk, torch.Tensor]]:
    """The messages of stripe ``s`` (`plan_chunks`), each with the buffer it lands in:
    a packed one in fresh memory (unpacked once checked), any other straight in the
    landing. Local."""
    out = []
    for chunk in plan_chunks(entries, s):
        if chunk.packed:
            buf = fresh_bytes(chunk.nbytes)
        else:
            p = chunk.pieces[0]
            buf = landing.target(entries[p.entry], p.offset, p.nbytes)
        out.append((chunk, buf))
    return out


def post_range(
    tx: HealTransport,
    dl: Deadline,
    m: Manifest,
    landing: Landing,
    j: int,
    s: Stripe,
    tid: int,
    sealed: bool,
) -> Posted:
    """Post the receives of stripe ``s`` into ``landing`` (those it laid out ahead for
    that range, `Landing.planned`, else laid out now)."""
    what = f"receive from rank {s.sender_rank}"
    items = []
    ahead = landing.planned.pop((s.offset, s.nbytes), None)
    for i, (chunk, buf) in enumerate(ahead or plan_receives(m.entries, landing, s)):
        work = dl.call(partial(tx.recv, buf, s.sender_rank, data_tag(tid, i)), what)
        items.append((chunk, buf, work))
    seal = None
    if sealed:
        sbuf = torch.zeros(STRIPE_SEAL_BYTES, dtype=torch.uint8)
        seal = (sbuf, dl.call(partial(tx.recv, sbuf, s.sender_rank, seal_tag(tid)), what))
    return Posted(j, s, items, seal)


def _unpack(m: Manifest, landing: Landing, chunk: Any, buf: torch.Tensor) -> None:
    """Copy a packed message's pieces to their places in the landing. Local."""
    at = 0
    for p in chunk.pieces:
        landing.target(m.entries[p.entry], p.offset, p.nbytes).copy_(buf[at : at + p.nbytes])
        at += p.nbytes


@dataclass
class Landed:
    """What one round's receives showed on this receiver: the assignments whose
    seal failed (mac mode), or the state digest's mismatch (digest mode)."""

    failed: dict[int, HealError] = field(default_factory=dict)
    mismatch: HealError | None = None

    def first(self) -> HealError | None:
        return self.mismatch or next(iter(self.failed.values()), None)


class Reference:
    """A receiver's receive of the root's sealed state digest (digest mode), posted
    before the payload's receives; the root sends it after its stripes (`vouch`).
    Its seal is checked once, on the first `digest`, and the digest kept for the
    rounds that fetch stripes again."""

    def __init__(self, tx: HealTransport, dl: Deadline, rd: Round) -> None:
        self._rd, self._dl = rd, dl
        self._buf = torch.zeros(REFERENCE_BYTES, dtype=torch.uint8)
        post = partial(tx.recv, self._buf, rd.root, seal_tag(rd.m.heal_id))
        self._work = dl.call(post, f"receive the state digest from rank {rd.root}")
        self._got: str | HealError | None = None

    def digest(self) -> str:
        """The root's state digest; HealError if its seal does not verify (forged or
        damaged: nothing this receiver holds can then be vouched for)."""
        if self._got is None:
            self._dl.wait(self._work, f"receiving the state digest from rank {self._rd.root}")
            raw = self._buf.numpy().tobytes()
            digest, tag = raw[:16], raw[16:]
            rd = self._rd
            if hmac.compare_digest(tag, reference_tag(rd.key, rd.seal, rd.root, digest)):
                self._got = digest.hex()
            else:
                self._got = HealError(
                    f"the state digest message of rank {rd.root} does not verify: forged by a "
                    "process without the job token, or damaged in transit"
                )
        if isinstance(self._got, HealError):
            raise self._got
        return self._got


def vouch(
    tx: HealTransport, dl: Deadline, rd: Round, receivers: Sequence[int], digest: str
) -> list[tuple[int, Pending]]:
    """The root's side of `Reference`: post its sealed ``digest`` to every receiver."""
    raw = bytes.fromhex(digest)
    raw += reference_tag(rd.key, rd.seal, rd.root, raw)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    tag = seal_tag(rd.m.heal_id)
    return [(r, dl.call(partial(tx.send, buf, r, tag), f"send to {r}")) for r in receivers]


class PayloadCheck(Protocol):
    """How a heal vouches for its payload (see the module docstring)."""

    auth: HealAuth
    word: str
    """What fails, in messages ("seal", "digest")."""
    sealed: bool
    """A seal message follows each stripe."""

    def seal(
        self, rd: Round, stripe: Stripe, bufs: list[torch.Tensor], tamper: Tamper | None
    ) -> torch.Tensor | None:
        """The seal message of a sender's stripe (None: no seal message). Local."""
        ...

    def expect(self, tx: HealTransport, dl: Deadline, rd: Round) -> Reference | None:
        """A receiver's receive of what its checks compare against beyond the
        stripes (digest mode: the root's `Reference`), posted before the payload."""
        ...

    def vouch(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        receivers: Sequence[int],
        digest: Callable[[], str] | None,
    ) -> list[tuple[int, Pending]]:
        """The root's message after its first round's stripes (digest mode: its
        sealed ``digest()``); posted sends."""
        ...

    def land(
        self,
        dl: Deadline,
        rd: Round,
        landing: Landing,
        posted: list[Posted],
        whole: bool,
        ref: Reference | None,
    ) -> Landed:
        """Wait for a receiver's messages of one round, put them in place, check them.
        ``whole``: ``posted`` is every stripe of the payload in order; ``ref``: what
        `expect` posted."""
        ...

    def outcome(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        work: list[Assignment],
        landed: Landed,
        flat: FlatState | None,
        landing: Landing | None,
        tamper: Tamper | None,
    ) -> dict[int, list[int]]:
        """{assignment: receivers that failed it} of this round, the same on every rank."""
        ...


class MacCheck:
    """Mac mode: a Poly1305 seal per stripe under a one-time key from the job token."""

    auth = HealAuth.MAC
    word = "seal"
    sealed = True

    def seal(
        self, rd: Round, stripe: Stripe, bufs: list[torch.Tensor], tamper: Tamper | None
    ) -> torch.Tensor | None:
        key = tamper.sealing_key(rd.key) if tamper is not None else rd.key
        digest = seal_stripe(key, rd.seal, stripe, bufs)
        return torch.frombuffer(bytearray(digest), dtype=torch.uint8)

    def expect(self, tx: HealTransport, dl: Deadline, rd: Round) -> Reference | None:
        return None

    def vouch(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        receivers: Sequence[int],
        digest: Callable[[], str] | None,
    ) -> list[tuple[int, Pending]]:
        return []

    def land(
        self,
        dl: Deadline,
        rd: Round,
        landing: Landing,
        posted: list[Posted],
        whole: bool,
        ref: Reference | None,
    ) -> Landed:
        out = Landed()
        for p in posted:
            s = p.stripe
            got = StripeSeal(rd.key, rd.seal, s)
            for _, buf, work in p.items:
                dl.wait(work, f"receiving stripe from rank {s.sender_rank}")
                got.update(buf)
            assert p.seal is not None
            dl.wait(p.seal[1], f"receiving the seal from rank {s.sender_rank}")
            try:
                check_seal(got.digest(), p.seal[0].numpy().tobytes(), s)
            except HealError as e:
                out.failed[p.j] = e
                continue
            for chunk, buf, _ in p.items:
                if chunk.packed:
                    _unpack(rd.m, landing, chunk, buf)
        return out

    def outcome(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        work: list[Assignment],
        landed: Landed,
        flat: FlatState | None,
        landing: Landing | None,
        tamper: Tamper | None,
    ) -> dict[int, list[int]]:
        if not work:  # no stripe, no seal: nothing can have failed (every rank knows)
            return {}
        return outcome(tx, len(work), sorted(landed.failed), dl)


def landing_hasher(m: Manifest) -> xxhash.xxh3_128:
    """The running state digest of the state ``m`` describes, before its bytes. Local."""
    layout = ((e.name, dtype_from_name(e.dtype), e.shape) for e in m.entries)
    return digest_hasher(layout, m.section)


def landing_digest(m: Manifest, landing: Landing) -> str:
    """The state digest of what landed (every entry in order). Local."""
    h = landing_hasher(m)
    for e in m.entries:
        if e.nbytes:
            h.update(landing.raw[e.name].numpy().data)
    return h.hexdigest()


def _range_digest(parts: Sequence[torch.Tensor]) -> bytes:
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p.numpy().data)
    return h.digest()


_CLAIM_SLOTS = CLAIM_BYTES // 8


class DigestCheck:
    """Digest mode: the state digest of what landed against the root's (`Reference`)."""

    auth = HealAuth.DIGEST
    word = "digest"
    sealed = False

    def seal(
        self, rd: Round, stripe: Stripe, bufs: list[torch.Tensor], tamper: Tamper | None
    ) -> torch.Tensor | None:
        return None

    def expect(self, tx: HealTransport, dl: Deadline, rd: Round) -> Reference | None:
        return Reference(tx, dl, rd)

    def vouch(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        receivers: Sequence[int],
        digest: Callable[[], str] | None,
    ) -> list[tuple[int, Pending]]:
        assert digest is not None  # the root computes one in digest mode
        return vouch(tx, dl, rd, receivers, digest())

    def land(
        self,
        dl: Deadline,
        rd: Round,
        landing: Landing,
        posted: list[Posted],
        whole: bool,
        ref: Reference | None,
    ) -> Landed:
        m = rd.m
        assert ref is not None
        if not posted and not whole:
            return Landed()  # nothing landed here this round: what did already matched
        # Round one brings the whole payload in order: hash it as it lands, so the
        # pass over the bytes overlaps the transfer. Later rounds rehash the landing.
        h = landing_hasher(m) if whole else None
        for p in posted:
            for chunk, buf, work in p.items:
                dl.wait(work, f"receiving stripe from rank {p.stripe.sender_rank}")
                if h is not None:
                    h.update(buf.numpy().data)
                if chunk.packed:
                    _unpack(m, landing, chunk, buf)
        got = h.hexdigest() if h is not None else landing_digest(m, landing)
        try:
            want = ref.digest()
        except HealError as e:
            return Landed(mismatch=e)
        if got == want:
            return Landed()
        return Landed(
            mismatch=HealError(
                f"state digest mismatch: what landed hashes to {got}, the root (rank "
                f"{rd.root}) says {want} (damaged in transit, or the senders' states differ)"
            )
        )

    def outcome(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        work: list[Assignment],
        landed: Landed,
        flat: FlatState | None,
        landing: Landing | None,
        tamper: Tamper | None,
    ) -> dict[int, list[int]]:
        flags = torch.zeros(tx.size, dtype=torch.int64)
        flags[tx.rank] = int(landed.mismatch is not None)
        bad = {r for r, f in enumerate(sum_flags(tx, flags, "digest verdict all-reduce", dl)) if f}
        if not bad:
            return {}
        if not work:  # no bytes moved, yet the layout or the root's message did not match
            raise HealError(
                f"heal on rank {tx.rank}: the state digest mismatched on rank(s) {sorted(bad)} "
                "and there are no payload bytes to fetch again"
            )
        return outcome(tx, len(work), self._blame(tx, dl, rd, work, bad, flat, landing, tamper), dl)

    def _blame(
        self,
        tx: HealTransport,
        dl: Deadline,
        rd: Round,
        work: list[Assignment],
        bad: set[int],
        flat: FlatState | None,
        landing: Landing | None,
        tamper: Tamper | None,
    ) -> list[int]:
        """The blame round: senders state their stripes' digests (sealed), receivers
        that mismatched find which stripes caused it. This rank's failed assignments."""
        rank, m = tx.rank, rd.m
        claims = torch.zeros(len(work) * _CLAIM_SLOTS, dtype=torch.int64)
        key = tamper.sealing_key(rd.key) if tamper is not None else rd.key
        for j, a in enumerate(work):
            if a.stripe.sender_rank == rank and bad & set(a.receivers):
                assert flat is not None
                digest = _range_digest(stripe_parts(m, flat, a.stripe))
                raw = digest + claim_tag(key, rd.seal, a.stripe, digest)
                claims[j * _CLAIM_SLOTS : (j + 1) * _CLAIM_SLOTS] = torch.frombuffer(
                    bytearray(raw), dtype=torch.int64
                )
        got = torch.tensor(sum_flags(tx, claims, "stripe digest claims all-reduce", dl))
        if rank not in bad:
            return []
        assert landing is not None
        mine = [j for j, a in enumerate(work) if rank in a.receivers]
        failed = []
        for j in mine:
            s = work[j].stripe
            raw = got[j * _CLAIM_SLOTS : (j + 1) * _CLAIM_SLOTS].numpy().tobytes()
            claimed, tag = raw[:16], raw[16:]
            parts = [
                landing.target(m.entries[p.entry], p.offset, p.nbytes)
                for p in stripe_pieces(m.entries, s)
            ]
            if _range_digest(parts) != claimed or not claim_ok(rd, s, claimed, tag):
                failed.append(j)
        if failed:
            return failed
        # Every sender vouched for what it sent, yet the whole differs from the
        # root's digest: their states differ. The root's digest is the reference.
        others = [j for j in mine if work[j].stripe.sender_rank != rd.root]
        return others or mine


def claim_ok(rd: Round, s: Stripe, claimed: bytes, tag: bytes) -> bool:
    """Whether ``tag`` seals the digest ``claimed`` for stripe ``s`` under this rank's key."""
    return hmac.compare_digest(tag, claim_tag(rd.key, rd.seal, s, claimed))


CHECKS: dict[HealAuth, PayloadCheck] = {HealAuth.DIGEST: DigestCheck(), HealAuth.MAC: MacCheck()}
"""The check of each mode (stateless: one instance each)."""


def stage(
    rd: Round,
    flat: FlatState,
    stripe: Stripe,
    tamper: Tamper | None,
    check: PayloadCheck,
    cut: Cut | None = None,
) -> Staged:
    """Cut a stripe into its messages and seal it where the mode does. Local: a
    sender does it while the receivers judge the manifest, so that neither the
    packing nor a seal's pass over the bytes competes with the transfer.
    ``cut``: the stripe's `cut_stripe`, made before the heal (its small pieces are
    packed here: the copy is of the bytes the state holds now)."""
    bufs = pack(cut_stripe(rd.m, flat, stripe) if cut is None else cut)
    wire = tamper.stripe(bufs) if tamper is not None else bufs
    return Staged(wire, check.seal(rd, stripe, bufs, tamper))


_WHOLE = (0, -1)
"""`_track`'s mark for a receiver whose whole landing failed its state digest."""


def _track(
    unrepaired: set[tuple[int, int]],
    work: Sequence[Assignment],
    rank: int,
    landed: Landed,
    hashed_whole: bool,
) -> None:
    """Keep ``unrepaired`` (a receiver's payload ranges, as (offset, nbytes), whose
    bytes last failed their check here) up to date after one round's `land`: a
    stripe that failed its seal is added, one that passed removed; a state digest
    that mismatched marks the whole landing, one that matched over the whole
    landing (``hashed_whole``) clears every mark."""
    for j, a in enumerate(work):
        if rank in a.receivers:
            rng = (a.stripe.offset, a.stripe.nbytes)
            if j in landed.failed:
                unrepaired.add(rng)
            else:
                unrepaired.discard(rng)
    if landed.mismatch is not None:
        unrepaired.add(_WHOLE)
    elif hashed_whole:
        unrepaired.clear()


def run_payload(
    tx: HealTransport,
    dl: Deadline,
    rd: Round,
    check: PayloadCheck,
    flat: FlatState | None,
    landing: Landing | None,
    receivers: Sequence[int],
    trusted: list[int],
    refused: list[int],
    tamper: Tamper | None,
    staged: dict[Stripe, Staged],
    digest: Callable[[], str] | None,
) -> int:
    """Send/receive the stripes, retry the refused ones from other trusted senders.
    Collective; returns this rank's payload bytes. ``staged``: this sender's
    stripes staged ahead (`stage`); the others (stripes sent again) are staged
    here. ``digest``: on the root, its state digest (waited for only once its
    first round's stripes are posted). Mutates ``trusted`` and ``refused``;
    HealError when no trusted sender is left. On return every receiver's landing
    passed the check."""
    m, rank = rd.m, tx.rank
    if not receivers:
        return 0
    ref = check.expect(tx, dl, rd) if landing is not None else None
    work = [Assignment(s, tuple(receivers)) for s in m.stripes if s.nbytes]
    nbytes = 0
    whole = True
    unrepaired: set[tuple[int, int]] = set()  # a receiver's ranges that failed, not refetched
    while True:  # the first round runs even with no bytes: the digest still travels
        sends: list[tuple[int, Pending]] = []
        posted: list[Posted] = []
        for j, a in enumerate(work):
            tid = tag_id(m.heal_id, j)
            if a.stripe.sender_rank == rank:
                assert flat is not None
                st = staged.pop(a.stripe, None) or stage(rd, flat, a.stripe, tamper, check)
                sends += send_range(tx, dl, st, a.receivers, tid)
                nbytes += a.stripe.nbytes * len(a.receivers)
            elif rank in a.receivers:
                assert landing is not None
                posted.append(post_range(tx, dl, m, landing, j, a.stripe, tid, check.sealed))
                nbytes += a.stripe.nbytes
        if whole and rank == rd.root:
            sends += check.vouch(tx, dl, rd, receivers, digest)
        for r, w in sends:
            dl.wait(w, f"sending stripe to rank {r}")
        landed = Landed()
        if landing is not None:
            landed = check.land(dl, rd, landing, posted, whole, ref)
            hashed_whole = check.auth == HealAuth.DIGEST and (whole or bool(posted))
            _track(unrepaired, work, rank, landed, hashed_whole)
        whole = False
        failed = check.outcome(tx, dl, rd, work, landed, flat, landing, tamper)
        if not failed:
            if unrepaired:
                # Installing rests on this receiver's own checks, never on the
                # round's word: its messages are not sealed.
                raise HealError(
                    f"heal on rank {rank}: the outcome round reports no failure, yet bytes "
                    "that failed their check here were not sent again (the round's "
                    "messages were damaged or forged); nothing is installed"
                ) from landed.first()
            return nbytes
        bad = sorted({work[j].stripe.sender_rank for j in failed})
        refused += [b for b in bad if b not in refused]
        trusted[:] = [t for t in trusted if t not in bad]
        if not trusted:
            ranges = ", ".join(
                f"[{work[j].stripe.offset}, {work[j].stripe.offset + work[j].stripe.nbytes})"
                f" from rank {work[j].stripe.sender_rank} on rank(s) {failed[j]}"
                for j in sorted(failed)
            )
            mine = landed.first()
            raise NoSenderLeft(
                f"heal on rank {rank}: payload bytes {ranges} failed their {check.word} and no "
                f"sender is left to retry from (refused senders: {refused})"
                + (f"; here: {mine}" if mine is not None else ""),
                nbytes,
            ) from mine
        work = [
            Assignment(
                Stripe(trusted[k % len(trusted)], work[j].stripe.offset, work[j].stripe.nbytes),
                tuple(failed[j]),
            )
            for k, j in enumerate(sorted(failed))
        ]
