"""State transfer: named state buffers, JSON manifests, the sealed striped heal.

No pickle anywhere: tensors travel as raw bytes described by a JSON manifest,
the manifest and every stripe sealed with HMAC-SHA256 under the job token.
`heal` is the one collective, generic over a `NamedState` (`TorchState` here,
`elastrain.jax.state.JaxState` for JAX); everything else is local.
"""

from __future__ import annotations

from elastrain.transfer.errors import HealError
from elastrain.transfer.flatten import state_digest, state_hash
from elastrain.transfer.landing import LandingReserve, section_bytes
from elastrain.transfer.signature import model_signature, signature_mismatch
from elastrain.transfer.state import FlatState, NamedState
from elastrain.transfer.striped import HealStats, Role, heal
from elastrain.transfer.torch_state import TorchState

__all__ = [
    "FlatState",
    "HealError",
    "HealStats",
    "LandingReserve",
    "NamedState",
    "Role",
    "TorchState",
    "heal",
    "model_signature",
    "section_bytes",
    "signature_mismatch",
    "state_digest",
    "state_hash",
]
