"""State transfer: named state buffers, JSON manifests, the striped heal.

No pickle anywhere: tensors travel as raw bytes described by a JSON manifest,
the manifest sealed with HMAC-SHA256 under the job token; the payload checked
by the root's state digest, sealed likewise (`HealAuth.DIGEST`, the default) or
sealed stripe by stripe with Poly1305 (`HealAuth.MAC`).
`heal` is the one collective, generic over a `NamedState` (`TorchState` here,
`elastrain.jax.state.JaxState` for JAX) and over a `HealTransport` (`heal_over`;
`heal` is it over a gloo group, `GlooHeal`); everything else is local.
"""

from __future__ import annotations

from elastrain.transfer.auth import HealAuth, check_auth
from elastrain.transfer.errors import HealError, TornHeal
from elastrain.transfer.flatten import state_digest, state_hash
from elastrain.transfer.landing import LandingReserve, section_bytes
from elastrain.transfer.prepared import PreparedReceive, PreparedSend
from elastrain.transfer.signature import model_signature, signature_mismatch
from elastrain.transfer.state import FlatState, NamedState
from elastrain.transfer.striped import (
    HealFn,
    HealStats,
    Role,
    heal,
    heal_over,
    heal_with,
)
from elastrain.transfer.torch_state import TorchState
from elastrain.transfer.transport import GlooHeal, HealTransport

__all__ = [
    "FlatState",
    "GlooHeal",
    "HealAuth",
    "HealError",
    "HealFn",
    "HealStats",
    "HealTransport",
    "LandingReserve",
    "NamedState",
    "PreparedReceive",
    "PreparedSend",
    "Role",
    "TorchState",
    "TornHeal",
    "check_auth",
    "heal",
    "heal_over",
    "heal_with",
    "model_signature",
    "section_bytes",
    "signature_mismatch",
    "state_digest",
    "state_hash",
]
