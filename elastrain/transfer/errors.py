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


class NoSenderLeft(HealError):
    """Some stripe failed its check from every sender the payload could ask
    (`elastrain.transfer.payload.run_payload`): the same on every rank of the
    round. ``nbytes``: the payload bytes this rank had moved in it. A heal that
    kept senders in reserve asks them next; otherwise the heal fails."""

    def __init__(self, message: str, nbytes: int) -> None:
        super().__init__(message)
        self.nbytes = nbytes


class TornHeal(HealError):
    """A heal that landed bytes straight in this receiver's live tensors (``in_place``)
    failed after its first receive was posted: some of the live state may be
    overwritten, so this member no longer holds any valid state. It must never
    train on, checkpoint or send that state: the engine ends the process for a
    fresh one (`elastrain.exitcodes.EXIT_STATE_TORN`), which is healed again from
    members that hold the state.

    `own`: the failure is this member's, not a peer's: its install refused the
    verified state (a registered object's ``load_state_dict``) or something other
    than a HealError raised (a bug). A fresh process would be torn again the same
    way, so the engine records the cause (``__cause__``) as the worker's exit
    record and the launcher's same-error rule stops a repeat. A HealError of the
    payload (a sender lost, every sender's bytes refused) is a peer's failure."""

    def __init__(self, message: str, *, own: bool = False) -> None:
        super().__init__(message)
        self.own = own
