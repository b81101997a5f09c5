"""Stripe checksums: zlib CRC-32 over raw bytes (about 3 GB/s here; releases the GIL).

A stripe's CRC is chained over its messages in order, so it equals the CRC of
the stripe's bytes however they were split.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from elastrain.transfer.errors import HealError


def crc_update(crc: int, data: torch.Tensor) -> int:
    """Extend ``crc`` over a contiguous CPU uint8 tensor."""
    return zlib.crc32(data.numpy().data, crc)


def stripe_crc(parts: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the concatenation of ``parts`` (unsigned; fits in int64)."""
    crc = 0
    for p in parts:
        crc = crc_update(crc, p)
    return crc


def check_crc(got: int, expected: int, sender_rank: int, nbytes: int) -> None:
    """HealError naming ``sender_rank`` unless the CRCs agree."""
    if got != expected:
        raise HealError(
            f"checksum mismatch on the stripe from sender rank {sender_rank}: "
            f"received {nbytes} bytes with crc32 {got:#010x}, sender says {expected:#010x}"
        )
