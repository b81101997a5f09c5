"""The start state: what a member holds before its first rendezvous.

Before the loop a member loads the checkpoint to resume from, if any (every
initial member of a resumed job loads the same one: the launcher chose it and
passed its step in $ELASTRAIN_RESUME; a replacement loads the newest verified
one and is healed by its peers if they are further), or else a plain torch
job's DCP directory (`elastrain run --resume-from`). A standby (hot spare)
takes each newer committed checkpoint while it waits. What to read and whether
the job may go on from it is the checkpoint manager's (`Checkpointing.restore`);
how a checkpoint becomes this member's state is the topology's
(`Topology.restore`, `read_plain`); the carried meta and the protocol's
bookkeeping are here.
A saved state that cannot fit this job ends the worker as misconfigured
(exit 78) before any step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from elastrain.checkpoint import VerifiedCheckpoint
from elastrain.checkpoint.files import committed_steps
from elastrain.checkpoint.manager import Checkpointing
from elastrain.checkpoint.restore import Loaded, RestoreRefused, RestoreSource
from elastrain.observe.events import EventKind
from elastrain.runtime import member as m
from elastrain.runtime.carried import Carried
from elastrain.runtime.context import Context
from elastrain.runtime.feed import DataFeed
from elastrain.runtime.preflight import exit_misconfigured
from elastrain.runtime.topology import Topology

log = logging.getLogger("elastrain.engine")


class StartState:
    """Loads this member's start state (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        ckpt: Checkpointing,
        topology: Topology,
        feed: DataFeed,
        carried: Carried,
        mode: str | int,
        plain_from: str | None,
        plain_step: int | None,
    ) -> None:
        self.ctx = ctx
        self.ckpt = ckpt
        self.topology = topology
        self.feed = feed
        self.carried = carried
        self.mode = mode
        """Which checkpoint the first load takes ($ELASTRAIN_RESUME: latest, none, a step)."""
        self.plain_from, self.plain_step = plain_from, plain_step
        """A plain torch job's DCP checkpoint to start from when no elastrain one loads."""

    def _misconfigured(self, message: str) -> NoReturn:
        self.ctx.events.emit(
            EventKind.WORKER_EXIT,
            reason=m.ExitReason.MISCONFIGURED,
            committed=self.ctx.proto.committed,
        )
        exit_misconfigured(message)

    def refresh_standby(self) -> None:
        """A standby takes each newer committed checkpoint while it waits: a spare
        promoted beside survivors is healed by them anyway, but spares left alone
        (every member dead) go on from their own state, which is then one
        checkpoint interval at most behind the newest. Only where the topology
        says so (a sharded standby reads its rows when it takes a slot)."""
        if not self.topology.standby_refresh:
            return
        steps = committed_steps(self.ckpt.directory)
        if steps and steps[-1] > self.ctx.proto.committed:
            self.resume(newer_than=self.ctx.proto.committed)

    def resume(self, newer_than: int | None = None) -> None:
        """Restore the state to start from, if any (before the first rendezvous),
        through the checkpoint manager (`Checkpointing.restore`). ``newer_than``: a
        standby's refresh: the newest verified checkpoint, only if it holds more
        than that many committed steps."""
        plain = None
        if self.plain_from is not None and newer_than is None:
            plain = (self.plain_from, self.plain_step)
        try:
            got = self.ckpt.restore(self.mode, _Target(self), newer_than=newer_than, plain=plain)
        except RestoreRefused as e:
            self._misconfigured(str(e))
        if got is None:
            return
        member = self.ctx.member
        if got.source is RestoreSource.PLAIN:
            self.ctx.session.note_committed(got.step)
            self.ctx.proto.resumed(got.step)
            log.info(
                "%s starts from %s (step %d) after %.2f s", member, got.path, got.step, got.seconds
            )
            print(
                f"[{member}] started from DCP checkpoint {got.path} at step {got.step}", flush=True
            )
            return
        assert got.meta is not None  # a checkpoint's restore always carries its meta
        try:
            committed = self.carried.load_meta(got.meta)
        except ValueError as e:
            # Its carried state (registered objects, data order) is not this script's.
            self._misconfigured(f"checkpoint {got.path} cannot be resumed: {e}")
        if committed != got.step:
            raise RuntimeError(
                f"checkpoint {got.path} holds committed count {committed}, not {got.step}"
            )
        self.ctx.proto.resumed(committed)
        log.info("%s resumed from %s (step %d) in %.2f s", member, got.path, got.step, got.seconds)
        print(f"[{member}] resumed from checkpoint step {got.step} ({got.path})", flush=True)


class _Target:
    """This worker as a `RestoreTarget`: the topology places the bytes, the
    backend names the framework, the data feed judges the order."""

    def __init__(self, start: StartState) -> None:
        self._topology = start.topology
        self._feed = start.feed
        self.framework = start.ctx.backend.framework

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        return self._topology.restore_problem(ckpt)

    def order_problem(self, order: Any) -> str | None:
        return self._feed.order_problem(order)

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        return self._topology.restore(ckpt, tensors, meta, loaded)

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        return self._topology.read_plain(directory, wanted_step)
