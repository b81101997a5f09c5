"""Seals: HMAC-SHA256 over a heal's manifest, Poly1305 over each stripe (mac mode)
or HMAC-SHA256 over a stripe's digest claim (digest mode), keyed by the job token.

Who holds the key: every member of the job (the launcher hands each worker
the job token, which also authenticates it to the coordinator;
`CoordinatorClient.token`). A process that does not hold it cannot
produce a manifest or a stripe that a receiver accepts, so it cannot feed
state to a joiner; damage in transit fails the same check. ``key=None`` seals
with an empty HMAC key: still an integrity check against damage, no
authenticity (tests and benchmarks without a token).

What each seal binds, so that nothing can be replayed elsewhere:

- the manifest seal: a label, the nonces every rank contributed to this
  manifest round (fresh per round: an old manifest does not verify), the
  root's rank and the manifest bytes (which carry the heal id);
- a stripe seal: a Poly1305 tag of the stripe's bytes in order, under a
  one-time key derived with HMAC-SHA256 from the job token, a label, the
  manifest seal (hence this heal and round), the sending rank and the
  stripe's offset and length.

Why two algorithms: the payload is the bulk of a heal, and HMAC-SHA256 runs
at 1.2-1.8 GB/s here, below the loopback link (gloo broadcast: 2.8-3.8 GB/s),
so it capped the heal rate; Poly1305 (OpenSSL, through `cryptography`) runs
at about 10 GB/s. Poly1305 is a one-time authenticator: its key must never
authenticate two different messages, which the derivation guarantees. Each
(heal round, sender, byte range) gets its own key, and an honest sender
sends the same bytes for it to every receiver (a retried stripe comes from
another sender, so under another key). This is the construction of
ChaCha20-Poly1305's tag, with HMAC as the key derivation. There is no
separate CRC: the seal is also the transport check. Comparisons use
`hmac.compare_digest`. Local; no communication.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterable, Sequence

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

from elastrain.transfer.errors import HealError
from elastrain.transfer.manifest import Stripe

SEAL_BYTES = 32
"""Length of a manifest seal (HMAC-SHA256)."""
STRIPE_SEAL_BYTES = 16
"""Length of a stripe seal (a Poly1305 tag)."""
_MANIFEST_LABEL = b"elastrain/heal/manifest/2\0"
_STRIPE_LABEL = b"elastrain/heal/stripe/3\0"
_CLAIM_LABEL = b"elastrain/heal/stripe-digest/1\0"
_REFERENCE_LABEL = b"elastrain/heal/state-digest/1\0"
CLAIM_BYTES = 48
"""A stripe digest claim on the wire: the XXH3-128 digest (16) and its `claim_tag` (32)."""


def _hmac(key: bytes | None, prefix: bytes) -> hmac.HMAC:
    # A digest name (not hashlib.sha256) selects OpenSSL's HMAC, which drops the GIL.
    return hmac.new(key or b"", prefix, "sha256")


def seal_manifest(key: bytes | None, nonces: Sequence[int], root: int, data: bytes) -> bytes:
    """The seal the manifest root appends to ``data`` (see the module docstring)."""
    h = _hmac(key, _MANIFEST_LABEL)
    h.update(struct.pack(f"<{len(nonces) + 1}q", root, *nonces))
    h.update(data)
    return h.digest()


def open_manifest(key: bytes | None, nonces: Sequence[int], root: int, sealed: bytes) -> bytes:
    """The manifest bytes of ``sealed`` (bytes + seal); HealError unless the seal verifies."""
    data, got = sealed[:-SEAL_BYTES], sealed[-SEAL_BYTES:]
    if len(sealed) < SEAL_BYTES or not hmac.compare_digest(
        got, seal_manifest(key, nonces, root, data)
    ):
        raise HealError(
            f"malformed manifest: the seal of the manifest from rank {root} does not verify "
            "(the sender does not hold the job token, or the bytes were damaged)"
        )
    return data


class StripeSeal:
    """The running seal of one stripe, fed its messages in order."""

    def __init__(self, key: bytes | None, heal_seal: bytes, stripe: Stripe) -> None:
        # The one-time Poly1305 key of this (heal round, sender, byte range).
        h = _hmac(key, _STRIPE_LABEL + heal_seal)
        h.update(struct.pack("<3q", stripe.sender_rank, stripe.offset, stripe.nbytes))
        self._p = Poly1305(h.digest())

    def update(self, data: torch.Tensor) -> None:
        """Extend the seal over a contiguous CPU uint8 tensor."""
        self._p.update(data.numpy().data)

    def digest(self) -> bytes:
        return self._p.finalize()


def seal_stripe(
    key: bytes | None, heal_seal: bytes, stripe: Stripe, parts: Iterable[torch.Tensor]
) -> bytes:
    """The seal of a stripe whose bytes are the concatenation of ``parts``."""
    s = StripeSeal(key, heal_seal, stripe)
    for p in parts:
        s.update(p)
    return s.digest()


def claim_tag(key: bytes | None, heal_seal: bytes, stripe: Stripe, digest: bytes) -> bytes:
    """HMAC-SHA256 by which a sender vouches, in digest mode, that ``digest`` is the
    XXH3-128 digest of the stripe it sent: bound to the manifest seal (this heal
    and round), its rank and the stripe's range. Only sent when a receiver's state
    digest mismatched (`elastrain.transfer.payload.DigestCheck`)."""
    h = _hmac(key, _CLAIM_LABEL + heal_seal)
    h.update(struct.pack("<3q", stripe.sender_rank, stripe.offset, stripe.nbytes))
    h.update(digest)
    return h.digest()


REFERENCE_BYTES = 48
"""The root's state digest on the wire (digest mode): the XXH3-128 digest (16) and
its `reference_tag` (32)."""


def reference_tag(key: bytes | None, heal_seal: bytes, root: int, digest: bytes) -> bytes:
    """HMAC-SHA256 by which the manifest's root vouches, in digest mode, that
    ``digest`` is the `state_digest` of the state its manifest describes: bound to
    the manifest seal (this heal and round) and the root's rank. Sent to every
    receiver after the root's stripes (`elastrain.transfer.payload.Reference`), so
    that computing it overlaps the payload instead of delaying the manifest."""
    h = _hmac(key, _REFERENCE_LABEL + heal_seal)
    h.update(struct.pack("<q", root))
    h.update(digest)
    return h.digest()


def check_seal(got: bytes, expected: bytes, stripe: Stripe) -> None:
    """HealError naming the sender unless the stripe's seal matches the one it sent."""
    if not hmac.compare_digest(got, expected):
        end = stripe.offset + stripe.nbytes
        raise HealError(
            f"seal mismatch on the stripe from sender rank {stripe.sender_rank} "
            f"(payload bytes [{stripe.offset}, {end})): forged by a process without the job "
            "token, or damaged in transit"
        )
