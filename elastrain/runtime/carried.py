"""What travels with the state besides its buffers: one owner for the job's ledger.

A heal sends it, a checkpoint saves it, a resume installs it: the committed
count, the last loss, the skipped steps, the checkpoint schedule's
measurements, the newest evaluation, the data order and position, and the
backend's own meta (RNG, the script's extras). Every member of a generation
holds the same values after its heal (they are functions of the committed
steps), so any member may send them.
"""

from __future__ import annotations

from typing import Any

from elastrain.checkpoint.manager import Checkpointing
from elastrain.runtime.backend import Backend
from elastrain.runtime.evaluate import EvalResult
from elastrain.runtime.feed import DataFeed
from elastrain.runtime.session import MemberSession


class Carried:
    """The job's values carried with the state (see the module docstring)."""

    def __init__(
        self, backend: Backend, feed: DataFeed, ckpt: Checkpointing, session: MemberSession
    ) -> None:
        self.backend = backend
        self.feed = feed
        self.ckpt = ckpt
        self.session = session
        self.last_loss: float | None = None
        """Mean loss of the last committed step (the job's)."""
        self.skipped_steps = 0
        """Committed steps that did not update the state."""
        self.eval_result: EvalResult | None = None
        """The newest evaluation's result."""

    def meta(self, committed: int) -> dict[str, Any]:
        """What travels with the state in a heal or a checkpoint, besides the buffers."""
        return {
            "committed": committed,
            "last_loss": self.last_loss,
            "skipped_steps": self.skipped_steps,
            "ckpt": self.ckpt.schedule.to_json(),
            "evaluation": self.eval_result.to_json() if self.eval_result is not None else None,
            "data": self.feed.meta(committed),
            **self.backend.meta(),
        }

    def load_meta(self, meta: dict[str, Any]) -> int:
        """Install a sender's or a checkpoint's meta; returns its committed count."""
        committed = int(meta["committed"])
        self.session.note_committed(committed)
        self.last_loss = meta.get("last_loss")
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.backend.load_meta(meta)
        self.ckpt.schedule.load_json(meta.get("ckpt"))
        self.eval_result = EvalResult.from_json(meta.get("evaluation"))
        if meta.get("data") is not None:
            self.feed.adopt(meta["data"])
        return committed
