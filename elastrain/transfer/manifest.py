"""The heal manifest: a JSON description of a flattened `NamedState` and its stripes.

The root sender (senders[0], or the next one after a refusal) builds it
(`build_manifest`), broadcasts `encode_manifest` bytes (sealed, see
`elastrain.transfer.seal`) to the whole group, and every other rank parses
them with `decode_manifest`, checks the layout with `validate_manifest` and
then judges it against its own state (`NamedState.bound` / `check`). All
functions here are local and raise `HealError` with a message that names the
offending entry or stripe.

Wire format (version 4)::

    {"version": 4, "kind": str, "heal_id": int, "auth": "digest" | "mac",
     "entries": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],
     "total_bytes": int,
     "stripes": [{"sender_rank", "offset", "nbytes"}, ...],
     "section": {...},
     "meta": {...}}

``kind`` names the state's kind ("torch", "jax"); entries are the state's
named tensors in `NamedState.flatten` order and tile ``[0, total_bytes)``;
``section`` is the state's JSON section. ``auth`` is the root's `HealAuth`:
in digest mode it commits the root to sending its `state_digest`, sealed under
the job token and bound to this manifest's seal, to every receiver after its
stripes (`elastrain.transfer.payload.Reference`; version 3 carried the digest
here, which held the manifest back until the root had hashed its whole
state). Stripes split the same byte range
evenly over the senders, in the order of the ``senders`` list. A manifest
``{"version": 4, "error": str}`` tells every rank that the root could not
build one (`ManifestUnavailable`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastrain.transfer.auth import HealAuth
from elastrain.transfer.dtypes import dtype_from_name, dtype_name
from elastrain.transfer.errors import HealError, ManifestUnavailable

VERSION = 4
TENSOR_REF = "$tensor"
"""Key of the placeholder ``{"$tensor": entry_name}`` in a state's JSON section."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the payload: its bytes are ``payload[offset : offset + nbytes]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Stripe:
    """The byte range ``[offset, offset + nbytes)`` of the payload that one sender sends."""

    sender_rank: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest; `validate_manifest` checks that it is self-consistent."""

    version: int
    kind: str
    heal_id: int
    entries: tuple[Entry, ...]
    total_bytes: int
    stripes: tuple[Stripe, ...]
    section: dict[str, Any]
    meta: dict[str, Any]
    auth: HealAuth = HealAuth.DIGEST
    """How the payload is checked (`elastrain.transfer.auth`)."""

    def stripe_of(self, rank: int) -> Stripe:
        """The stripe that ``rank`` sends (HealError if it has none)."""
        for s in self.stripes:
            if s.sender_rank == rank:
                return s
        raise HealError(f"manifest has no stripe for sender rank {rank}")


STRIPE_MIN_BYTES = 64 << 20
"""The least payload bytes worth a sender of their own (`stripe_senders`): the trainers'
heals (`elastrain.transfer.striped.heal_with`) stripe a state over more than one
sender only when every stripe gets at least this much."""


def stripe_senders(total_bytes: int, n_senders: int, min_stripe_bytes: int) -> int:
    """How many of ``n_senders`` send a stripe of a ``total_bytes`` payload.

    Each stripe costs fixed work whatever its size: a sender process cutting and
    posting its messages, a connection's messages for the receiver to post and
    wait for, and (on a host shared by the members, as on loopback) one more
    process competing for the same cores as the receiver. A stripe pays for
    that only when moving it takes long against it; for a small state one
    sender moves it faster than several (the 39.7 MB state on the 2-core
    machine: docs/design/heal-costs.md). So every
    stripe gets at least ``min_stripe_bytes`` (the first sender takes a
    smaller payload whole); ``min_stripe_bytes`` <= 0 stripes over every
    sender. Pure.
    """
    if n_senders < 1:
        raise ValueError(f"need at least one sender, got {n_senders}")
    if min_stripe_bytes <= 0:
        return n_senders
    return max(1, min(n_senders, total_bytes // min_stripe_bytes))


def plan_stripes(
    total_bytes: int, senders: Sequence[int], min_stripe_bytes: int = 0
) -> tuple[Stripe, ...]:
    """Split ``[0, total_bytes)`` into one contiguous stripe per sender: the first
    `stripe_senders` of them share it (sizes within 1 byte), the rest get empty
    stripes (they stay in the manifest as the senders a failed stripe is asked
    of again)."""
    k = stripe_senders(total_bytes, len(senders), min_stripe_bytes)
    base, extra = divmod(total_bytes, k)
    stripes = []
    offset = 0
    for i, rank in enumerate(senders):
        nbytes = base + (1 if i < extra else 0) if i < k else 0
        stripes.append(Stripe(int(rank), offset, nbytes))
        offset += nbytes
    return tuple(stripes)


def lay_out(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[Entry, ...]:
    """Entries for ``(name, dtype name, shape)`` laid out back to back from byte 0
    (KeyError for a dtype name `dtype_from_name` does not know)."""
    entries = []
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype_from_name(dtype).itemsize
        entries.append(Entry(name, dtype, shape, offset, nbytes))
        offset += nbytes
    return tuple(entries)


def laid_bytes(entries: Sequence[Entry]) -> int:
    """The payload bytes of entries laid out back to back (`lay_out`): where the last ends."""
    return entries[-1].offset + entries[-1].nbytes if entries else 0


def build_manifest(
    kind: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    section: dict[str, Any],
    senders: Sequence[int],
    meta: dict[str, Any],
    heal_id: int,
    *,
    auth: HealAuth = HealAuth.DIGEST,
    min_stripe_bytes: int = 0,
) -> Manifest:
    """Lay the named tensors out back to back (`lay_out`) and stripe the result over
    ``senders`` (`plan_stripes`); ``auth`` as in `Manifest`."""
    entries = lay_out(
        (name, dtype_name(t.dtype), tuple(int(d) for d in t.shape)) for name, t in tensors
    )
    total = laid_bytes(entries)
    return Manifest(
        version=VERSION,
        kind=kind,
        heal_id=heal_id,
        entries=entries,
        total_bytes=total,
        stripes=plan_stripes(total, senders, min_stripe_bytes),
        section=section,
        meta=meta,
        auth=auth,
    )


def for_heal(
    layout: Manifest,
    senders: Sequence[int],
    meta: dict[str, Any],
    heal_id: int,
    *,
    auth: HealAuth = HealAuth.DIGEST,
    min_stripe_bytes: int = 0,
) -> Manifest:
    """The manifest `build_manifest` gives for the tensors ``layout`` was built from,
    without laying them out again: ``layout``'s entries and section, striped over
    ``senders`` (a sender lays its state out before the heal, `PreparedSend`)."""
    return dataclasses.replace(
        layout,
        heal_id=heal_id,
        stripes=plan_stripes(layout.total_bytes, senders, min_stripe_bytes),
        meta=meta,
        auth=auth,
    )


def encode_entries(entries: Sequence[Entry]) -> bytes:
    """The JSON of a manifest's entries (what `encode_manifest` writes for them)."""
    return json.dumps(
        [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset,
             "nbytes": e.nbytes}
            for e in entries
        ],
        separators=(",", ":"),
    ).encode()  # fmt: skip


ENTRIES_HEAD = b'{"entries":'
"""How every manifest's bytes begin: its entries come first, so that a receiver
that expects a layout compares their bytes instead of parsing them (`Expected`)."""


@dataclass(frozen=True)
class Expected:
    """A layout a receiver expects (`NamedState.expected_layout`), with the bytes
    a manifest of it begins with (`ENTRIES_HEAD`, `encode_entries`, a comma)."""

    entries: tuple[Entry, ...]
    head: bytes
    total_bytes: int

    @classmethod
    def of(cls, entries: tuple[Entry, ...]) -> Expected:
        head = ENTRIES_HEAD + encode_entries(entries) + b","
        return cls(entries, head, laid_bytes(entries))


def encode_manifest(m: Manifest, entries: bytes | None = None) -> bytes:
    """UTF-8 JSON bytes of ``m``. Raises TypeError/ValueError if meta is not JSON-able.
    ``entries``: `encode_entries` of ``m.entries``, encoded before (most of the
    manifest's bytes, and the same for every heal of one layout)."""
    doc = {
        "version": m.version,
        "kind": m.kind,
        "heal_id": m.heal_id,
        "auth": m.auth.value,
        "total_bytes": m.total_bytes,
        "stripes": [
            {"sender_rank": s.sender_rank, "offset": s.offset, "nbytes": s.nbytes}
            for s in m.stripes
        ],
        "section": m.section,
        "meta": m.meta,
    }  # fmt: skip
    rest = json.dumps(doc, separators=(",", ":")).encode()
    listed = encode_entries(m.entries) if entries is None else entries
    return ENTRIES_HEAD + listed + b"," + rest[1:]


def encode_error(message: str) -> bytes:
    """The manifest senders[0] broadcasts when it cannot build a real one."""
    return json.dumps({"version": VERSION, "error": message}).encode()


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise HealError(f"malformed manifest: {what} is {value!r}, expected an integer")
    return value


def _nonneg(value: Any, what: str) -> int:
    v = _int(value, what)
    if v < 0:
        raise HealError(f"malformed manifest: {what} is negative ({v})")
    return v


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise HealError(f"malformed manifest: {what} is not a JSON object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise HealError(f"malformed manifest: {what} is not a JSON array")
    return value


def _entry(i: int, raw: Any) -> Entry:
    """Manifest entry ``i`` with strict types: one cheap test for a well-formed entry
    (a manifest has one per tensor, and its decoding is on the heal's critical
    path), the checks that name what is wrong only for one that is not."""
    if type(raw) is dict:
        name, dtype, shape = raw.get("name"), raw.get("dtype"), raw.get("shape")
        offset, nbytes = raw.get("offset"), raw.get("nbytes")
        if (
            type(name) is str
            and type(dtype) is str
            and type(shape) is list
            and all(type(d) is int and d >= 0 for d in shape)
            and type(offset) is int
            and offset >= 0
            and type(nbytes) is int
            and nbytes >= 0
        ):  # type() is, not isinstance: a bool is not an integer here
            return Entry(name, dtype, tuple(shape), offset, nbytes)
    return _strict_entry(i, raw)


def _strict_entry(i: int, raw: Any) -> Entry:
    """`_entry`'s checks one by one: HealError (or KeyError) naming what is wrong."""
    ent = _dict(raw, f"entries[{i}]")
    name = ent["name"]
    if not isinstance(name, str):
        raise HealError(f"malformed manifest: entries[{i}].name is not a string")
    dtype = ent["dtype"]
    if not isinstance(dtype, str):
        raise HealError(f"malformed manifest: entry {name!r} dtype is not a string")
    shape = tuple(_nonneg(d, f"entry {name!r} shape") for d in _list(ent["shape"], f"{name} shape"))
    return Entry(
        name,
        dtype,
        shape,
        _nonneg(ent["offset"], f"entry {name!r} offset"),
        _nonneg(ent["nbytes"], f"entry {name!r} nbytes"),
    )


def decode_manifest(data: bytes) -> Manifest:
    """Parse manifest bytes with strict types (HealError on anything malformed).

    An error manifest from senders[0] becomes a HealError carrying its message.
    Layout consistency is checked separately by `validate_manifest`.
    """
    return _from_doc(_json_object(data), None)


def decode_expected(data: bytes, expected: Expected) -> Manifest | None:
    """The manifest ``data`` if its entries are exactly ``expected``'s, else None (then
    `decode_manifest` it). The entries are compared as bytes, not parsed: the
    receiver's own prediction of them was laid out and judged before the heal.
    Only the rest is parsed (HealError if it is malformed, as `decode_manifest`);
    a manifest naming its entries twice is left to `decode_manifest`, so that
    both read the same document."""
    if not data.startswith(expected.head):
        return None
    doc = _json_object(b"{" + data[len(expected.head) :])
    if "entries" in doc:
        return None
    return _from_doc(doc, expected.entries)


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise HealError(f"malformed manifest: not JSON ({e})") from e
    return _dict(doc, "the manifest")


def _from_doc(doc: dict[str, Any], entries: tuple[Entry, ...] | None) -> Manifest:
    """The manifest of a parsed document, with ``entries`` (None: its own, parsed).
    HealError for anything malformed or missing; `ManifestUnavailable` for the
    root's error manifest."""
    try:
        return _fields(doc, entries)
    except KeyError as e:
        raise HealError(f"malformed manifest: missing field {e}") from e


def _fields(doc: dict[str, Any], entries: tuple[Entry, ...] | None) -> Manifest:
    version = _int(doc["version"], "version")
    if version != VERSION:
        raise HealError(f"manifest version {version} is not supported (expected {VERSION})")
    if "error" in doc:
        raise ManifestUnavailable(f"the manifest root could not build the manifest: {doc['error']}")
    if entries is None:
        entries = tuple(_entry(i, raw) for i, raw in enumerate(_list(doc["entries"], "entries")))
    stripes = []
    for i, raw in enumerate(_list(doc["stripes"], "stripes")):
        s = _dict(raw, f"stripes[{i}]")
        stripes.append(
            Stripe(
                _nonneg(s["sender_rank"], f"stripes[{i}].sender_rank"),
                _nonneg(s["offset"], f"stripes[{i}].offset"),
                _nonneg(s["nbytes"], f"stripes[{i}].nbytes"),
            )
        )
    kind = doc["kind"]
    if not isinstance(kind, str):
        raise HealError("malformed manifest: kind is not a string")
    auth = doc["auth"]
    if auth not in tuple(HealAuth):
        raise HealError(f"malformed manifest: auth is {auth!r}")
    return Manifest(
        version=VERSION,
        kind=kind,
        heal_id=_nonneg(doc["heal_id"], "heal_id"),
        entries=entries,
        total_bytes=_nonneg(doc["total_bytes"], "total_bytes"),
        stripes=tuple(stripes),
        section=_dict(doc["section"], "section"),
        meta=_dict(doc["meta"], "meta"),
        auth=HealAuth(auth),
    )


def tensor_refs(value: Any) -> list[str]:
    """Every entry name a JSON section refers to with ``{"$tensor": name}``, in order
    (HealError for a malformed reference)."""
    out: list[str] = []
    _collect_refs(value, out)
    return out


def _collect_refs(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        if TENSOR_REF in value:
            ref = value[TENSOR_REF]
            if len(value) != 1 or not isinstance(ref, str):
                raise HealError(f"malformed manifest: bad tensor reference {value!r}")
            out.append(ref)
            return
        for v in value.values():
            _collect_refs(v, out)
    elif isinstance(value, list):
        for v in value:
            _collect_refs(v, out)


def validate_manifest(m: Manifest, senders: Sequence[int]) -> None:
    """Check that the manifest is self-consistent and matches ``senders``.

    Entries: unique names, known dtypes, ``nbytes == numel * itemsize``,
    contiguous offsets from 0, ending at ``total_bytes``. Stripes: one per
    sender in ``senders`` order, tiling ``[0, total_bytes)`` with no gap and no
    overlap (`validate_stripes`). What the names and the section mean is the
    state's to judge (`NamedState.bound`).
    """
    seen: set[str] = set()
    offset = 0
    for e in m.entries:
        if e.name in seen:
            raise HealError(f"manifest lies: entry {e.name!r} appears twice")
        seen.add(e.name)
        try:
            itemsize = dtype_from_name(e.dtype).itemsize
        except KeyError:
            raise HealError(f"manifest entry {e.name!r} has unknown dtype {e.dtype!r}") from None
        expected = e.numel * itemsize
        if e.nbytes != expected:
            raise HealError(
                f"manifest lies: entry {e.name!r} claims {e.nbytes} bytes but shape "
                f"{list(e.shape)} of {e.dtype} is {expected} bytes"
            )
        if e.offset != offset:
            raise HealError(
                f"manifest lies: entry {e.name!r} starts at byte {e.offset}, expected {offset} "
                f"(entries must be contiguous)"
            )
        offset += e.nbytes
    if offset != m.total_bytes:
        raise HealError(
            f"manifest lies: entries cover {offset} bytes but total_bytes is {m.total_bytes}"
        )
    validate_stripes(m, senders)


def validate_stripes(m: Manifest, senders: Sequence[int]) -> None:
    """`validate_manifest`'s check of the stripes alone: one per sender in
    ``senders`` order, tiling ``[0, total_bytes)`` (for a manifest whose entries
    a receiver laid out itself, `Expected`)."""
    ranks = [s.sender_rank for s in m.stripes]
    if ranks != list(senders):
        raise HealError(
            f"manifest stripes come from ranks {ranks}, "
            f"but this rank was told senders={list(senders)}"
        )
    offset = 0
    for s in m.stripes:
        if s.offset > offset:
            raise HealError(
                f"manifest lies: gap of {s.offset - offset} bytes before the stripe of sender "
                f"{s.sender_rank} (it starts at {s.offset}, the previous one ended at {offset})"
            )
        if s.offset < offset:
            raise HealError(
                f"manifest lies: the stripe of sender {s.sender_rank} overlaps the previous one by "
                f"{offset - s.offset} bytes (it starts at {s.offset}, previous ended at {offset})"
            )
        offset += s.nbytes
    if offset != m.total_bytes:
        raise HealError(
            f"manifest lies: stripes cover [0, {offset}) but total_bytes is {m.total_bytes}"
        )
