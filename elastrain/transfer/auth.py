"""How a heal vouches for the bytes it installs: the one choice `heal_auth` makes.

Both modes authenticate the manifest (layout, sizes, the senders' meta) with
HMAC-SHA256 under the job token, bound to fresh per-round nonces
(`elastrain.transfer.seal`). They differ in how the payload's bytes are checked:

- `HealAuth.DIGEST` (the default): the bytes travel bare over the generation's
  group, exactly as a step's gradients do; the receiver computes the state
  digest (`elastrain.transfer.flatten.state_digest`, XXH3-128) of what landed,
  as it lands, and compares it, before installing, with the root's: a 48-byte
  message the root sends after its stripes, HMAC-SHA256-sealed under the job
  token and bound to the manifest seal (`elastrain.transfer.payload.Reference`). A
  mismatch is traced to the stripe that caused it (each sender states its
  stripes' digests, sealed under the job token) and that stripe is fetched
  again from another sender. It detects damage, lost or misplaced bytes and
  senders whose state differs from the root's; it does not stop a party that
  can write into the group's connections and chooses bytes to collide (which
  could equally write into every step's gradients).
- `HealAuth.MAC`: every stripe is sealed with Poly1305 under a one-time key
  derived from the job token, as before the digest existed: for networks where
  the data plane itself is not trusted. It costs a MAC pass over the payload on
  each end.

docs/design/trust.md ("Trust boundary") states the threat model; docs/design/heal.md
the protocol and its measurements.
"""

from __future__ import annotations

from enum import StrEnum


class HealAuth(StrEnum):
    """The heal's integrity mode (`TrainerConfig.heal_auth`, ``--heal-auth``); its
    value travels in the manifest, and a rank configured otherwise refuses it."""

    DIGEST = "digest"
    MAC = "mac"


def check_auth(value: str, what: str = "heal_auth") -> HealAuth:
    """``value`` as a `HealAuth`; ValueError naming ``what`` and the choices otherwise."""
    try:
        return HealAuth(value)
    except ValueError:
        choices = ", ".join(repr(a.value) for a in HealAuth)
        raise ValueError(f"{what} must be one of {choices}, got {value!r}") from None
