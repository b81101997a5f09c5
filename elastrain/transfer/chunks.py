"""How a stripe travels: a deterministic split of the stripe into messages.

Both ends derive the same plan from the manifest, so no extra negotiation is
needed. A stripe is cut at tensor boundaries into *pieces*; a piece of at least
`DIRECT_MIN` bytes travels in messages of up to `DIRECT_MAX` bytes straight from
the sender's tensor into the receiver's destination (no staging copy on either
side); runs of smaller pieces are packed into one message of up to `PACK_MAX`
bytes. Pure
functions, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastrain.transfer.errors import HealError
from elastrain.transfer.manifest import Entry, Stripe

DIRECT_MIN = 256 * 1024
"""Pieces at least this large are sent as their own message."""
DIRECT_MAX = 8 * 1024 * 1024
"""Larger pieces are cut into messages of at most this size, so that the receiver
checks one message while the next is still arriving."""
PACK_MAX = 4 * 1024 * 1024
"""A packed message is closed once it holds this many bytes."""
_CHUNK_BITS = 20
MAX_CHUNKS = (1 << _CHUNK_BITS) - 1
"""Most messages one stripe may need (the last tag of a stripe carries its seal)."""
MAX_HEAL_ID = (1 << (31 - _CHUNK_BITS)) - 1
"""heal_id is at most this, so that every tag fits in a signed 32-bit int."""


@dataclass(frozen=True)
class Piece:
    """Payload bytes ``[offset, offset + nbytes)``, all inside ``entries[entry]``."""

    entry: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """One message: a single piece sent in place, or several small ones packed."""

    pieces: tuple[Piece, ...]
    packed: bool

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def stripe_pieces(entries: Sequence[Entry], stripe: Stripe) -> list[Piece]:
    """The non-empty intersections of ``stripe`` with each entry, in payload order."""
    start, end = stripe.offset, stripe.offset + stripe.nbytes
    out = []
    for i, e in enumerate(entries):
        if e.offset >= end:
            break
        lo, hi = max(start, e.offset), min(end, e.offset + e.nbytes)
        if lo < hi:
            out.append(Piece(i, lo, hi - lo))
    return out


def plan_chunks(entries: Sequence[Entry], stripe: Stripe) -> list[Chunk]:
    """Split a stripe into messages (same result on sender and receiver)."""
    chunks: list[Chunk] = []
    run: list[Piece] = []
    run_bytes = 0

    def flush() -> None:
        nonlocal run, run_bytes
        if run:
            chunks.append(Chunk(tuple(run), packed=len(run) > 1))
        run, run_bytes = [], 0

    for p in stripe_pieces(entries, stripe):
        if p.nbytes >= DIRECT_MIN:
            flush()
            for at in range(p.offset, p.offset + p.nbytes, DIRECT_MAX):
                n = min(DIRECT_MAX, p.offset + p.nbytes - at)
                chunks.append(Chunk((Piece(p.entry, at, n),), packed=False))
            continue
        run.append(p)
        run_bytes += p.nbytes
        if run_bytes >= PACK_MAX:
            flush()
    flush()
    if len(chunks) > MAX_CHUNKS:
        raise HealError(f"stripe of sender {stripe.sender_rank} needs {len(chunks)} messages")
    return chunks


def data_tag(heal_id: int, chunk: int) -> int:
    """Tag of message ``chunk`` of a stripe in heal ``heal_id``."""
    return (heal_id << _CHUNK_BITS) | chunk


def seal_tag(heal_id: int) -> int:
    """Tag of the message that carries a stripe's seal (`elastrain.transfer.seal`)."""
    return (heal_id << _CHUNK_BITS) | MAX_CHUNKS
