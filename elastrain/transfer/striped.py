"""Striped heal: bring receivers' state up to date from senders, for any `NamedState`.

One protocol for every kind of state: the torch trainer heals a `TorchState`
(model + optimizer), the JAX trainer a `JaxState` (a pytree of leaves). And
one for every wire: the protocol talks to a `HealTransport`
(`elastrain.transfer.transport`), `heal` being `heal_over` a gloo group's.
Every rank of the group calls it with the same ``senders`` and
``receivers``; *trusted* starts as ``senders``:

1. **announce** -- one all-reduce (max) in which the first trusted sender (the
   *root*) announces its manifest's length and how many trusted senders, from
   the first, its manifest gives bytes to send (`stripe_senders`), every rank
   states the most manifest bytes its state accepts
   (`NamedState.manifest_limit`) and adds a fresh random nonce. A length over
   the smallest limit is refused by every rank alike, before anything is
   allocated: the root counts as *malformed*.

   **Standbys.** The trusted senders the manifest gives no bytes (a small
   state comes from the root alone) sit the first pass out: each waits for
   the root's word (`Word`), and steps 2-5 run among the other ranks only
   (`Among`: their rounds as messages through the root), so that no round
   waits for a standby's process to be scheduled (on members sharing cores
   that wait was most of a round). The root's word is DONE once every
   receiver installed; RETRY when its manifest was refused or a stripe failed
   from every sender of the pass, and then every rank, standbys included,
   runs the heal again from step 1 without the refused senders (what a
   receiver landed in place is landed again); FAILED when the heal failed
   among the others, and a standby raises HealError too. A manifest that
   gives a standby bytes is malformed.
2. **manifest** -- the root flattens its state, builds the JSON manifest
   (stripes over the trusted senders), seals it with HMAC-SHA256 under the job
   token, bound to this round's nonces (`elastrain.transfer.seal`), and
   broadcasts it. If it cannot build one (state not JSON-able), it broadcasts
   a sealed error manifest instead and every rank raises HealError.
3. **verdict** -- every other rank checks the seal, parses and validates the
   manifest; receivers judge it against their own state (`bound` before any
   allocation, then `check`); other senders check that their state has the
   same layout. A receiver that laid out the entries it expects before the
   heal (`PreparedReceive`) compares the manifest's entries with them as bytes
   (`decode_expected`): the same, it judges only the rest (total, stripes,
   `bound_section`, `check_section`) and lands where it laid out; else it
   judges the whole, as above. One all-reduce of per-rank verdicts follows:
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
   tensor pieces straight from the live tensors, small ones packed).
   Receivers post every receive at once (each entry into its own fresh
   tensor, `Landing`). How the bytes are vouched for is the heal's `HealAuth`
   (`elastrain.transfer.payload`): in digest mode (the default) the root sends
   each receiver its `state_digest`, sealed under the job token and bound to
   the manifest seal, after its stripes (computed on a thread from its manifest's
   broadcast on, overlapping the verdict round and its sends, or begun before the
   heal by a `PreparedSend`), and each receiver hashes the payload as it lands and
   compares; in mac mode each stripe is followed by its Poly1305
   seal (a key bound to the manifest seal, the sender's rank and the stripe's
   range), which a sender computes before the verdict round completes.
5. **outcome** -- one all-reduce of per-receiver verdicts (digest mode: a
   mismatch then runs a blame round, in which each sender vouches for its
   stripes' digests under the job token) or of (receiver, stripe) seal
   failures (mac mode). A sender whose stripe failed anywhere is refused for
   the rest of the heal; each failed stripe is sent again by a trusted sender
   (round-robin), to the receivers that need it, and steps 4-5 repeat. No
   trusted sender left for a failed stripe: every rank raises HealError. Only
   when every check passed do receivers install the state
   (`NamedState.install`): a failed heal leaves them untouched, except that a
   heal run ``in_place`` (the trainers') lands the entries the state names
   (`NamedState.live_targets`: torch's model tensors) straight in the live
   tensors, and a receiver whose heal then fails raises `TornHeal`.

Everything is bounded by one deadline, ``timeout_s`` from the call. A transport
error or timeout raises HealError on the rank that saw it at once; its peers
then fail at their next collective (at the latest at the deadline). In a pass
with standbys, the root answers a round it could not complete with a failure,
so the others fail at once, and tells its standbys FAILED.

Trust: every rank that holds the job token is trusted to be honest about its
own verdicts (any rank can make a heal fail); the manifest seal keeps out
every process without the token. In mac mode the stripe seals keep out any
byte it did not seal; in digest mode the payload is as exposed as a step's
gradients on the same connections, and the digest detects damage, not a
chosen collision (docs/design/trust.md). A whole earlier heal replayed on the
wire fails the manifest seal (fresh nonces), so a joiner cannot be fed stale
state. The root's word to its standbys travels unsealed, as the verdicts and
outcomes do: it writes no state (a standby's is never written), so a forged
word can only make a heal fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from functools import partial
from typing import Any, Protocol

import torch

from elastrain.transfer.auth import HealAuth
from elastrain.transfer.chunks import MAX_HEAL_ID
from elastrain.transfer.errors import HealError, ManifestUnavailable, NoSenderLeft, TornHeal
from elastrain.transfer.landing import Landing, LandingReserve
from elastrain.transfer.manifest import (
    STRIPE_MIN_BYTES,
    Expected,
    Manifest,
    Stripe,
    build_manifest,
    decode_expected,
    decode_manifest,
    encode_error,
    encode_manifest,
    for_heal,
    stripe_senders,
    validate_manifest,
    validate_stripes,
)
from elastrain.transfer.payload import (
    CHECKS,
    PayloadCheck,
    Round,
    Staged,
    run_payload,
    stage,
)
from elastrain.transfer.prepared import Digesting, PreparedReceive, PreparedSend
from elastrain.transfer.rounds import Deadline, Flags
from elastrain.transfer.seal import SEAL_BYTES, open_manifest, seal_manifest
from elastrain.transfer.standby import Word, hear, tell
from elastrain.transfer.state import FlatState, NamedState
from elastrain.transfer.tamper import Tamper
from elastrain.transfer.transport import Among, GlooHeal, Group, HealTransport, Reduce


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
    (malformed, or a stripe that failed its check) and replaced by another sender's; the
    same on every rank. payload_s: the part of ``seconds`` spent moving the
    payload (steps 4-5: the stripes (and mac seals) sent, received and checked,
    the outcome, any stripe sent again); the rest is the flatten, the manifest
    rounds (steps 1-3; the senders' staging of their stripes and the
    receivers' landing allocation overlap the verdict's) and the install.
    prepared: this rank's share was done before the heal (a sender's `PreparedSend`:
    its flatten and digest; a receiver's `PreparedReceive`: its expected layout and
    landing). rounds_s: the part of ``seconds`` before the payload: the
    flatten and the manifest rounds (steps 1-3, with the staging and the landing's
    allocation); what is left besides ``payload_s`` is the install. standby: this
    sender was kept in reserve (its manifest stripe empty) and sat the heal out,
    waiting for the root's word (`Word`): its ``seconds`` are that wait.
    predicted: this receiver's manifest had exactly the layout it expected
    (`PreparedReceive`): it judged only the rest and landed where it had laid out.
    """

    role: str
    bytes: int
    seconds: float
    refused: tuple[int, ...] = ()
    payload_s: float = 0.0
    prepared: bool = False
    rounds_s: float = 0.0
    standby: bool = False
    predicted: bool = False

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
            "prepared": self.prepared,
            "rounds_s": self.rounds_s,
            "standby": self.standby,
            "predicted": self.predicted,
        }


@dataclass(frozen=True)
class _Announcement:
    """Step 1 of the module docstring, as every rank sees it."""

    length: int
    limit: int
    active: int
    """How many of the trusted senders, from the first, the root's manifest gives
    bytes to send; the rest are its standbys."""
    nonces: tuple[int, ...]


STAR_FROM = 3
"""Groups of at least this many ranks announce through the root (`Among`), not in
the transport's own all-reduce: gloo's is a ring of ``2 (size - 1)`` hops, each
waking a thread in another process, where the root's star is two. On members
sharing cores each hop waits to be scheduled: with one standby beside the root
and the receiver (3 ranks), the announcement took 4.5 ms on the receiver
against 1.6 ms with 2 ranks (phase timers by hand, 2026-12-07)."""


def _announce(
    tx: HealTransport, root: int, length: int, active: int, limit: int, dl: Deadline
) -> _Announcement:
    """All-reduce (max) of the root's manifest ``length`` and ``active`` count (both
    ignored elsewhere), minus every rank's limit (so the max is the smallest limit)
    and every rank's nonce in its own slot (collective). ``tx``: the transport, or an
    `Among` of every rank through the root (`STAR_FROM`)."""
    v = torch.zeros(3 + tx.size, dtype=torch.int64)
    if tx.rank == root:
        v[0], v[2] = length, active
    v[1] = -limit
    v[3 + tx.rank] = secrets.randbits(62)
    what = "manifest announcement all-reduce"
    work = dl.call(lambda: tx.allreduce(v, Reduce.MAX, dl.remaining()), what)
    dl.wait(work, "manifest announcement all-reduce")
    got = [int(x) for x in v.tolist()]
    return _Announcement(got[0], -got[1], got[2], tuple(got[3:]))


def _broadcast_bytes(
    tx: HealTransport, root: int, data: bytes | None, n: int, dl: Deadline
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


def _post_verdict(tx: HealTransport, code: Verdict, dl: Deadline) -> Flags:
    """Post the all-reduce of verdict codes; its result is every rank's code (collective)."""
    flags = torch.zeros(tx.size, dtype=torch.int64)
    flags[tx.rank] = code
    return Flags(tx, flags, "verdict all-reduce", dl)


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
    m: Manifest,
    role: Role,
    trusted: Sequence[int],
    flat: FlatState | None,
    state: NamedState,
    auth: HealAuth,
    layout: Manifest | None = None,
    expected: Expected | None = None,
) -> tuple[Verdict, HealError | None]:
    """This rank's verdict on the manifest (not called on the root). ``expected``: a
    receiver's layout laid out ahead, which ``m``'s entries are (`decode_expected`):
    they were judged then, and only the rest of ``m`` is judged here."""
    try:
        if expected is None:
            validate_manifest(m, trusted)
        elif m.total_bytes != expected.total_bytes:
            raise HealError(
                f"manifest lies: entries cover {expected.total_bytes} bytes but total_bytes "
                f"is {m.total_bytes}"
            )
        else:
            validate_stripes(m, trusted)
        if not 1 <= m.heal_id <= MAX_HEAL_ID:
            raise HealError(f"manifest heal_id {m.heal_id} is outside [1, {MAX_HEAL_ID}]")
    except (HealError, TypeError, ValueError) as e:
        return Verdict.MALFORMED, e if isinstance(e, HealError) else HealError(str(e))
    if m.auth != auth:
        # A configuration that differs between members, not damage: never a downgrade.
        return Verdict.REJECTED, HealError(
            f"cannot heal: the root heals with heal_auth={m.auth.value!r}, this rank is "
            f"configured with heal_auth={auth.value!r}"
        )
    if role == Role.IDLE:
        return Verdict.OK, None
    if m.kind != state.kind:
        return Verdict.REJECTED, HealError(
            f"cannot heal: the senders' state is of kind {m.kind!r}, this rank's {state.kind!r}"
        )
    if role == Role.RECV:  # only receivers allocate for the payload
        try:
            why = state.bound(m) if expected is None else state.bound_section(m)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            return Verdict.MALFORMED, HealError(f"manifest refused before allocation: {why}")
    try:
        if role == Role.RECV:
            why = state.check(m) if expected is None else state.check_section(m)
        else:
            assert flat is not None
            why = _sender_difference(m, flat, state.kind, trusted, layout)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        why = f"{type(e).__name__}: {e}"
    return (Verdict.OK, None) if why is None else (Verdict.REJECTED, HealError(why))


def _sender_difference(
    m: Manifest, flat: FlatState, kind: str, trusted: Sequence[int], layout: Manifest | None
) -> str | None:
    """None if this sender's own state has the root's layout and section, else how it
    differs. ``layout``: this sender's own, laid out ahead (`PreparedSend`)."""
    mine = layout or build_manifest(kind, flat.tensors, flat.section, trusted, {}, 0)
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


Prepared = PreparedSend | PreparedReceive
"""A member's share of a heal done ahead, by its role (`elastrain.transfer.prepared`)."""


class HealFn(Protocol):
    """What the trainers call to heal over a generation's group: `heal_with(mode)`
    (the engine's), `heal`, or a test's or another wire's stand-in with its signature (see `heal`; the test seam
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
        prepared: Prepared | None = None,
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
    auth: HealAuth = HealAuth.DIGEST,
    in_place: bool = False,
    min_stripe_bytes: int = 0,
    prepared: Prepared | None = None,
) -> tuple[dict[str, Any], HealStats]:
    """`heal_over` the gloo group ``pg``, this rank being ``rank`` (`GlooHeal`): a `HealFn`
    (in digest mode; `heal_with` gives one for either mode).

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
        auth=auth,
        in_place=in_place,
        min_stripe_bytes=min_stripe_bytes,
        prepared=prepared,
    )


def heal_with(
    auth: HealAuth, *, in_place: bool = True, min_stripe_bytes: int = STRIPE_MIN_BYTES
) -> HealFn:
    """The `HealFn` the trainers call, in mode ``auth`` (`TrainerConfig.heal_auth`):
    chosen once, when the engine is built, for every topology that heals with it
    (replicated members, sharded twins, JAX members). ``in_place`` (the trainers'
    choice: the engine ends a member whose heal raised `TornHeal`, see
    `heal_over`); ``min_stripe_bytes`` (`stripe_senders`: a small state comes from
    one sender, the others kept for a stripe that fails)."""

    def heal_in_mode(
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
        prepared: Prepared | None = None,
    ) -> tuple[dict[str, Any], HealStats]:
        return heal(
            pg, rank, senders, receivers, state, meta, timeout_s,
            key=key, reserve=reserve, auth=auth, in_place=in_place,
            min_stripe_bytes=min_stripe_bytes, prepared=prepared,
        )  # fmt: skip

    return heal_in_mode


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
    auth: HealAuth = HealAuth.DIGEST,
    in_place: bool = False,
    min_stripe_bytes: int = 0,
    prepared: Prepared | None = None,
) -> tuple[dict[str, Any], HealStats]:
    """Copy senders' ``state`` onto receivers, striped over the senders, checked in
    mode ``auth`` (`HealAuth`) under ``key``.

    Collective over ALL ranks of the transport's group (``tx``, this rank being
    ``tx.rank``): every rank calls it with the same
    ``senders`` (ranks with identical, up-to-date state; senders[0] is the
    first manifest root), ``receivers`` (ranks to overwrite) and ``key`` (the
    job token's bytes; the trainers always pass it) and ``auth`` (a rank whose
    mode differs from the root's rejects the manifest). Every rank passes its own
    ``state`` (idle ranks too: it bounds the manifest they receive). A rank in
    neither list is idle: it only takes part in the manifest round and the
    all-reduces. Blocks until the heal is done on every rank or ``timeout_s``
    (one deadline for the whole call) has passed.

    Hostile or damaged input is refused and fetched again from another sender
    (see the module docstring): a manifest whose seal does not verify, that is
    not JSON, lies about sizes or claims more than a receiver's state could
    hold makes the next sender the root, before anything is allocated for it;
    a stripe whose seal does not match (mac mode), or that made the receiver's
    state digest differ from the root's (digest mode), is sent again by
    another sender, to the receivers that refused it. The refused senders are listed in
    ``HealStats.refused`` on every rank.

    Returns ``(meta, stats)``: senders return the ``meta`` they passed (``{}``
    for None); receivers and idle ranks return the root's ``meta`` after a JSON
    round trip (tuples become lists, dict keys strings). ``meta`` must be
    JSON-able; it is how the caller ships step number, RNG state, data cursor.

    Raises ValueError for inconsistent arguments (on every rank, before any
    communication). Raises HealError on every rank when the manifest is rejected
    (another kind of state or another mode, it does not fit a receiver, the
    senders' states differ in layout, or every sender's manifest was malformed),
    or when a stripe failed its check and no unrefused sender is left to send
    it again; on the rank that sees it, for a transport error or timeout. A
    receiver's state is replaced (`NamedState.install`) only after every stripe
    arrived and matched its seal (mac mode), or what landed has the root's sealed
    state digest (digest mode). After a HealError from a transport failure or timeout, drop the
    group.

    ``reserve``: a receiver's landing memory, mapped and touched ahead of the heal
    (`LandingReserve`; its sections are used up here). Without one, or for a
    section it does not fit, the payload lands in fresh memory.

    ``in_place``: a receiver lands the entries its state names (`NamedState.live_targets`:
    torch's model tensors) straight in its live tensors instead of fresh memory
    and an install copy. Its state is then written before it is verified: a
    heal that fails on a receiver once that receiver's payload receives were posted
    raises `TornHeal` there (a HealError), and that member's state must be thrown
    away (the engine ends the process for a fresh one, healed again). Every other
    failure, and any without ``in_place``, leaves the receiver untouched.

    ``min_stripe_bytes``: the root stripes the payload only over as many senders as
    give each stripe at least this many bytes (`stripe_senders`; 0: over every
    trusted sender); the others are its standbys: they sit the heal out until the
    root's word, and send only if the root's manifest or a stripe is refused and
    the heal runs again with them (the module docstring). Only the root's value
    counts (the announcement and the manifest carry its choice).

    ``prepared``: this rank's share done ahead, of this same ``state``: a sender's
    flatten and digest (`PreparedSend`), a receiver's expected layout and landing
    (`PreparedReceive`, used when it was laid out for this heal's ``in_place``);
    ignored on a rank of another role or when its kind differs.

    ``tamper`` is the test seam: this rank damages or forges what it sends (see `Tamper`).
    """
    t0 = time.perf_counter()
    _check_args(tx, senders, receivers, timeout_s)
    check = CHECKS[HealAuth(auth)]
    rank = tx.rank
    role = Role.of(rank, senders, receivers)

    # The heal is the only thing touching the state meanwhile (`NamedState.steady`).
    with state.steady():
        flat: FlatState | None = None
        flat_error: Exception | None = None
        digesting: dict[int, Digesting] = {}
        send: PreparedSend | None = None
        receive: PreparedReceive | None = None
        if prepared is not None and prepared.kind == state.kind:
            if role == Role.SEND and isinstance(prepared, PreparedSend):
                send = prepared
            elif (
                role == Role.RECV
                and isinstance(prepared, PreparedReceive)
                and prepared.in_place == in_place
            ):
                receive = prepared
        if send is not None:
            flat, flat_error = send.flat, send.error
            begun = send.digesting()
            if begun is not None and check.auth == HealAuth.DIGEST:
                digesting[rank] = begun
        elif role == Role.SEND:
            try:
                flat = state.flatten()
            except TypeError as e:
                flat_error = e
        try:
            out_meta, stats = _heal(tx, senders, receivers, state, meta, timeout_s, key,
                                    tamper, reserve, check, t0, flat, flat_error, digesting,
                                    in_place, min_stripe_bytes, send, receive)  # fmt: skip
            done_ahead = send is not None or receive is not None
            return out_meta, dataclasses.replace(stats, prepared=done_ahead)
        finally:
            for d in digesting.values():
                d.join()


def _heal(
    tx: HealTransport,
    senders: list[int],
    receivers: list[int],
    state: NamedState,
    meta: dict[str, Any] | None,
    timeout_s: float,
    key: bytes | None,
    tamper: Tamper | None,
    reserve: LandingReserve | None,
    check: PayloadCheck,
    t0: float,
    flat: FlatState | None,
    flat_error: Exception | None,
    digesting: dict[int, Digesting],
    in_place: bool,
    min_stripe_bytes: int,
    prepared: PreparedSend | None,
    receive: PreparedReceive | None,
) -> tuple[dict[str, Any], HealStats]:
    """`heal_over`'s protocol, once its arguments are checked and its state flattened.
    ``digesting``: this rank's state digest once it is a root (digest mode), by rank.
    ``prepared``: this sender's flatten and layout (and, on a root, its manifest's
    entries and messages) done ahead (`PreparedSend`). ``receive``: this receiver's
    expected layout and landing done ahead (`PreparedReceive`), for the first pass."""
    layout = prepared.layout if prepared is not None else None
    rank = tx.rank
    dl = Deadline(rank, timeout_s)
    role = Role.of(rank, senders, receivers)
    sealing_key = tamper.sealing_key(key) if tamper is not None else key

    # The most manifest bytes this rank accepts: the same in every pass.
    ahead = prepared or receive
    limit = ahead.limit if ahead is not None else state.manifest_limit()
    predicted = False  # this receiver landed where its preparation laid out
    trusted = list(senders)
    refused: list[int] = []
    keep_standbys = True  # only the first pass: a pass run again takes every rank
    moved = 0  # payload bytes this rank moved in earlier passes
    torn = False  # an earlier pass landed in this receiver's live tensors
    while True:
        root = trusted[0]
        code, problem = Verdict.OK, None
        expected: Expected | None = None  # a receiver's manifest has its laid-out entries
        built: Exception | None = None
        data, length, active = b"", 0, len(trusted)
        if rank == root:
            digest_now = check.auth == HealAuth.DIGEST and flat is not None and receivers
            try:
                if flat is None:
                    raise flat_error or HealError("no state")
                heal_id = secrets.randbelow(MAX_HEAL_ID) + 1
                if layout is not None:
                    manifest = for_heal(
                        layout, trusted, dict(meta or {}), heal_id,
                        auth=check.auth, min_stripe_bytes=min_stripe_bytes,
                    )  # fmt: skip
                else:
                    manifest = build_manifest(
                        state.kind, flat.tensors, flat.section, trusted, dict(meta or {}),
                        heal_id, auth=check.auth, min_stripe_bytes=min_stripe_bytes,
                    )  # fmt: skip
                active = stripe_senders(manifest.total_bytes, len(trusted), min_stripe_bytes)
                data = encode_manifest(manifest, prepared.entries if prepared else None)
                if tamper is not None:
                    data = tamper.manifest_bytes(data)
            except (TypeError, ValueError) as e:
                built, data = e, encode_error(f"{type(e).__name__}: {e}")
            length = len(data) + SEAL_BYTES
            if tamper is not None:
                length = tamper.announced_length(length)

        # 1. announce: the length is judged by every rank alike, before allocating
        star = Among(tx, range(tx.size), root) if tx.size >= STAR_FROM else None
        ann = _announce(star or tx, root, length, active, limit, dl)
        standbys: list[int] = []
        if keep_standbys and ann.length <= ann.limit and 1 <= ann.active < len(trusted):
            standbys = trusted[ann.active :]
        if rank in standbys:
            word, out = hear(tx, root, dl)
            if word == Word.DONE:
                return dict(meta or {}), HealStats(  # a first pass: it moved nothing
                    role, 0, time.perf_counter() - t0, tuple(refused), standby=True
                )  # fmt: skip
            if word == Word.FAILED:
                raise HealError(
                    f"heal on rank {rank}: it failed among the ranks that took part (the "
                    f"root, rank {root}, says so) while this sender was kept in reserve"
                )
            refused += [r for r in out if r not in refused]
            trusted = [t for t in trusted if t not in refused]
            keep_standbys = False
            continue
        # The rest of this pass runs among the others only: the standbys wait for
        # the root's word, and no round waits for their processes to be scheduled.
        gx: HealTransport = tx
        if standbys:
            gx = Among(tx, [r for r in range(tx.size) if r not in standbys], root, after=star)
        try:
            # 2. manifest, sealed by the root
            if ann.length > ann.limit:
                code = Verdict.MALFORMED
                problem = HealError(
                    f"malformed manifest: rank {root} announced {ann.length} manifest bytes; "
                    f"the smallest limit in the group is {ann.limit}"
                )
            elif rank == root:
                seal = seal_manifest(sealing_key, ann.nonces, root, data)
                _broadcast_bytes(gx, root, data + seal, ann.length, dl)
                # Its digest starts only now: begun at the flatten, the hash competed with
                # the manifest's build, seal and broadcast, which every rank waits for.
                if digest_now and rank not in digesting and built is None:
                    assert flat is not None
                    digesting[rank] = Digesting(flat)
                if built is not None:
                    raise HealError(
                        f"heal on rank {rank} (manifest root): cannot build the manifest: {built}"
                    ) from built
            else:
                sealed = _broadcast_bytes(gx, root, None, ann.length, dl)
                seal = sealed[-SEAL_BYTES:]
                expected = receive.expected if receive is not None else None
                try:
                    opened = open_manifest(key, ann.nonces, root, sealed)
                    got = decode_expected(opened, expected) if expected is not None else None
                    manifest = got if got is not None else decode_manifest(opened)
                    if got is None:
                        expected = None  # judged whole: its entries are not the ones laid out
                except ManifestUnavailable:
                    raise
                except HealError as e:
                    code, problem = Verdict.MALFORMED, e
                else:
                    if any(s.nbytes for s in manifest.stripes if s.sender_rank in standbys):
                        code = Verdict.MALFORMED
                        problem = HealError(
                            f"malformed manifest: rank {root} announced {ann.active} sending "
                            "sender(s), and its manifest gives bytes to a sender beyond them"
                        )
                    elif flat_error is not None:
                        code = Verdict.REJECTED
                        problem = HealError(f"cannot flatten this sender's state: {flat_error}")
                    else:
                        code, problem = _local_problem(
                            manifest, role, trusted, flat, state, check.auth, layout, expected
                        )

            # 3. verdict. While the round completes, a sender stages its stripe (packed
            # and sealed) and a receiver allocates its landing: both are local, and
            # wasted only when some rank refuses.
            verdict = _post_verdict(gx, code, dl)
            staged: dict[Stripe, Staged] = {}
            landing: Landing | None = None
            try:
                if code == Verdict.OK and role == Role.SEND and flat is not None and receivers:
                    rd = Round(manifest, seal, key, root)
                    whole = prepared.whole if prepared is not None else None
                    staged = {s: stage(rd, flat, s, tamper, check,
                                       whole if s.nbytes == manifest.total_bytes else None)
                              for s in manifest.stripes if s.sender_rank == rank and s.nbytes}  # fmt: skip
                elif code == Verdict.OK and role == Role.RECV:
                    if receive is not None and receive.landing is not None and expected is not None:
                        landing, predicted = receive.landing, True
                    else:
                        live = state.live_targets(manifest) if in_place else None
                        landing = Landing.allocate(manifest.entries, reserve, live)  # in `bound`
                    receive = None  # one pass lands in it: a pass run again allocates afresh
            except BaseException:
                with contextlib.suppress(HealError):
                    verdict.result()  # the posted round completes; its peers go on to fail
                raise
            codes = verdict.result()
            malformed = [r for r, c in enumerate(codes) if c == Verdict.MALFORMED]
            if malformed:
                refused.append(root)
                trusted.remove(root)
                if standbys:  # the next root is a standby: every rank runs the next pass
                    if rank == root:
                        tell(tx, standbys, Word.RETRY, refused, dl)
                    keep_standbys = False
                    continue
                if trusted:
                    continue
                why = f"; here: {problem}" if problem is not None else ""
                raise HealError(
                    f"heal on rank {rank}: rank(s) {malformed} refused the manifest of sender "
                    f"rank {root} as malformed and no sender is left to ask (refused: {refused})"
                    f"{why}"
                ) from problem
            if problem is not None:
                raise problem
            rejected = [r for r, c in enumerate(codes) if c]
            if rejected:
                raise HealError(
                    f"heal on rank {rank}: rank(s) {rejected} rejected the manifest "
                    "(their own HealError says why)"
                )

            # 4-5. payload, checked, with refused stripes sent again by trusted senders
            # (of this pass: not the standbys, who are asked in the next pass)
            rd = Round(manifest, seal, key, root)
            t_payload = time.perf_counter()
            own = digesting.get(rank)
            asked = [t for t in trusted if t not in standbys]
            try:
                payload = partial(
                    run_payload, gx, dl, rd, check, flat, landing, receivers, asked, refused,
                    tamper, staged, own.result if own is not None else None,
                )  # fmt: skip
                nbytes = _payload_and_install(
                    payload, rank, landing, state, manifest, bool(standbys)
                )  # fmt: skip
            except NoSenderLeft as e:
                if not standbys:
                    raise
                moved += e.nbytes
                torn = torn or (landing is not None and landing.in_place)
                trusted = [t for t in trusted if t not in refused]
                if rank == root:
                    tell(tx, standbys, Word.RETRY, refused, dl)
                keep_standbys = False
                continue
            payload_s = time.perf_counter() - t_payload
            if standbys and rank == root:
                tell(tx, standbys, Word.DONE, refused, dl)
        except BaseException as e:
            # Nothing raises after a word is sent whole (the RETRYs go straight on to
            # the next pass): an exception here means the standbys heard nothing,
            # or not all of them did.
            if standbys and rank == root:
                with contextlib.suppress(HealError):
                    tell(tx, standbys, Word.FAILED, refused, dl)
            if torn and isinstance(e, Exception) and not isinstance(e, TornHeal):
                raise TornHeal(
                    f"heal on rank {rank} failed after an earlier pass began landing the "
                    f"payload in this member's live state, which is no longer valid: {e}",
                    own=not isinstance(e, HealError),
                ) from e
            raise
        break

    stats = HealStats(
        role, nbytes + moved, time.perf_counter() - t0, tuple(refused), payload_s,
        rounds_s=t_payload - t0, predicted=predicted,
    )  # fmt: skip
    out_meta = dict(meta or {}) if role == Role.SEND else manifest.meta
    return out_meta, stats


def _payload_and_install(
    payload: Callable[[], int],
    rank: int,
    landing: Landing | None,
    state: NamedState,
    manifest: Manifest,
    spare: bool,
) -> int:
    """Steps 4-5 (``payload``: `run_payload` with its arguments bound) and the install:
    a receiver installs once every check passed. A failure once a receiver's
    payload lands in its live tensors raises `TornHeal`, except a `NoSenderLeft`
    with senders kept in reserve (``spare``: the caller asks them next, and the
    next pass lands the whole payload again)."""
    installing = False  # past the payload: a failure now is this member's own
    try:
        nbytes = payload()
        installing = landing is not None
        if landing is not None:
            state.install(landing.tensors, manifest.section)
        return nbytes
    except BaseException as e:
        if spare and isinstance(e, NoSenderLeft):
            raise
        # Whatever raised (a bug's KeyError as much as a lost sender), the live
        # tensors may hold part of the payload: never let it leave unmarked.
        if landing is None or not landing.in_place:
            raise
        torn = (
            f"heal on rank {rank} failed after it began landing the payload in this "
            "member's live state, which is no longer valid"
        )
        if not isinstance(e, Exception):  # an interrupt stays one, marked
            e.add_note(f"elastrain: {torn}")
            raise
        # A HealError of the payload is a peer's failure (a lost sender, every
        # sender's bytes refused); the install's refusal, or a bug, is this member's.
        raise TornHeal(f"{torn}: {e}", own=installing or not isinstance(e, HealError)) from e
