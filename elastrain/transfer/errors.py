"""The exception types a failed heal raises: `HealError`, and its `TornHeal` where the
receiver's live state was already written."""

from __future__ import annotations


class HealError(RuntimeError):
    """A heal could not complete; the receiver's state was not (fully) replaced.

    Raised for: a manifest that lies (sizes, offsets or stripes inconsistent,
    claims beyond the receiver's bounds, a seal that does not verify) when no
    other sender is left to ask, a state of another kind or layout (model
    signature, optimizer structure, JAX leaves) or of another `heal_auth`, a
    stripe seal mismatch (mac mode) or a state digest mismatch (digest mode) that
    no other sender could repair, a transport failure (peer closed the
    connection) or a timeout. Transport errors are chained as ``__cause__``.
    After a HealError the process group may hold pending operations; the
    caller should drop it and regroup.
    """


class ManifestUnavailable(HealError):
    """The manifest root said it cannot build a manifest (its state cannot travel
    without pickle); every rank raises, nothing is retried."""


class TornHeal(HealError):
    """A heal that landed bytes straight in this receiver's live tensors (``in_place``)
    failed after its first receive was posted: some of the live state may be
    overwritten, so this member no longer holds any valid state. It must never
    train on, checkpoint or send that state: the engine ends the process for a
    fresh one (`elastrain.exitcodes.EXIT_STATE_TORN`), which is healed again from
    members that hold the state."""
