"""Seals: HMAC-SHA256 over a heal's manifest and over each stripe, keyed by the job token.

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
- a stripe seal: a label, the manifest seal (hence this heal and round), the
  sending rank, the stripe's offset and length, and its bytes in order.

HMAC-SHA256 runs at about 1.2 GB/s here (CRC-32 at 2.4 GB/s); hashlib drops
the GIL on large buffers, so a receiver checks one message while the next
arrives. There is no separate CRC: the seal is also the transport check.
Comparisons use `hmac.compare_digest`. Local; no communication.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterable, Sequence

import torch

from elastrain.transfer.errors import HealError
from elastrain.transfer.manifest import Stripe

SEAL_BYTES = 32
"""Length of every seal (SHA-256)."""
_MANIFEST_LABEL = b"elastrain/heal/manifest/2\0"
_STRIPE_LABEL = b"elastrain/heal/stripe/2\0"


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
        self._h = _hmac(key, _STRIPE_LABEL + heal_seal)
        self._h.update(struct.pack("<3q", stripe.sender_rank, stripe.offset, stripe.nbytes))

    def update(self, data: torch.Tensor) -> None:
        """Extend the seal over a contiguous CPU uint8 tensor."""
        self._h.update(data.numpy().data)

    def digest(self) -> bytes:
        return self._h.digest()


def seal_stripe(
    key: bytes | None, heal_seal: bytes, stripe: Stripe, parts: Iterable[torch.Tensor]
) -> bytes:
    """The seal of a stripe whose bytes are the concatenation of ``parts``."""
    s = StripeSeal(key, heal_seal, stripe)
    for p in parts:
        s.update(p)
    return s.digest()


def check_seal(got: bytes, expected: bytes, stripe: Stripe) -> None:
    """HealError naming the sender unless the stripe's seal matches the one it sent."""
    if not hmac.compare_digest(got, expected):
        end = stripe.offset + stripe.nbytes
        raise HealError(
            f"seal mismatch on the stripe from sender rank {stripe.sender_rank} "
            f"(payload bytes [{stripe.offset}, {end})): forged by a process without the job "
            "token, or damaged in transit"
        )
