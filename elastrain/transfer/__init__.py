"""State transfer: flatten model + optimizer state, JSON manifests, striped heal, checksums.

No pickle anywhere: tensors travel as raw bytes described by a JSON manifest,
each stripe guarded by a CRC-32. `heal` is the one collective; everything else
is local.
"""

from __future__ import annotations

from elastrain.transfer.errors import HealError
from elastrain.transfer.flatten import state_hash
from elastrain.transfer.signature import model_signature, signature_mismatch
from elastrain.transfer.striped import HealStats, heal

__all__ = [
    "HealError",
    "HealStats",
    "heal",
    "model_signature",
    "signature_mismatch",
    "state_hash",
]
