"""The start state: what a member holds before its first rendezvous.

Before the loop a member loads the checkpoint to resume from, if any (every
initial member of a resumed job loads the same one: the launcher chose it and
passed its step in $ELASTRAIN_RESUME; a replacement loads the newest verified
one and is healed by its peers if they are further), or else a plain torch
job's DCP directory (`elastrain run --resume-from`). A standby (hot spare)
takes each newer committed checkpoint while it waits. How a checkpoint becomes
this member's state is the topology's (`Topology.restore`, `read_plain`); the
checks common to all (framework, data order) and the bookkeeping are here.
A saved state that cannot fit this job ends the worker as misconfigured
(exit 78) before any step.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

from elastrain.checkpoint import VerifiedCheckpoint
from elastrain.checkpoint.files import committed_steps
from elastrain.checkpoint.plain import PlainCheckpointError
from elastrain.checkpoint.restore import ResumeError, from_ordered_json, load_resume
from elastrain.checkpoint.sharded_parts import ResumeMismatch
from elastrain.data import OrderKind
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
        directory: str | None,
        topology: Topology,
        feed: DataFeed,
        carried: Carried,
        mode: str | int,
        plain_from: str | None,
        plain_step: int | None,
    ) -> None:
        self.ctx = ctx
        self.directory = directory
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
        steps = committed_steps(self.directory)
        if steps and steps[-1] > self.ctx.proto.committed:
            self.resume(newer_than=self.ctx.proto.committed)

    def resume(self, newer_than: int | None = None) -> None:
        """Load the checkpoint to resume from, if any (before the first rendezvous).
        ``newer_than``: a standby's refresh: the newest verified one, only if it
        holds more than that many committed steps."""
        t0 = time.monotonic()
        mode = self.mode if newer_than is None else "latest"
        got = load_resume(self.directory, mode)
        if newer_than is not None and (got is None or got[0].step <= newer_than):
            return
        if got is None:
            if self.plain_from is not None:
                self._start_plain(self.plain_from, t0)
            return
        ckpt, tensors, meta = got
        problem = self.topology.restore_problem(ckpt)
        if problem is not None:
            self._misconfigured(problem)
        backend = self.ctx.backend
        saved = meta.get("framework", "torch")
        if saved != backend.framework:
            raise RuntimeError(
                f"checkpoint {ckpt.path} was written by a {saved} job, this is {backend.framework}"
            )
        meta["extra"] = from_ordered_json(meta.get("extra"))
        if meta.get("data") is None:
            # Written before the order was recorded: those jobs used randperm from 0.
            meta["data"] = {"order": OrderKind.RANDPERM.value, "position": None}
        problem = self.feed.order_problem(meta["data"].get("order"))
        if problem is not None:
            self._misconfigured(f"checkpoint {ckpt.path} cannot be resumed: {problem}")
        before = time.monotonic() - t0
        loaded = self.topology.restore(
            ckpt, tensors, meta, lambda nbytes, s: self._loaded(ckpt, nbytes, before + s)
        )
        committed = self.carried.load_meta(meta)
        if committed != ckpt.step:
            raise RuntimeError(
                f"checkpoint {ckpt.path} holds committed count {committed}, not {ckpt.step}"
            )
        self.ctx.proto.resumed(committed)
        seconds = time.monotonic() - t0
        member = self.ctx.member
        log.info("%s resumed from %s (step %d) in %.2f s", member, ckpt.path, ckpt.step, seconds)
        print(f"[{member}] resumed from checkpoint step {ckpt.step} ({ckpt.path})", flush=True)
        if loaded is not None:
            self._loaded(ckpt, loaded, seconds)

    def _start_plain(self, directory: str, t0: float) -> None:
        """Start from a plain torch job's DCP checkpoint: its model and optimizer
        state, at its step; the hyperparameters, the data order's kind and
        everything else from the script. A checkpoint that does not fit this model
        and optimizer ends the worker as misconfigured, naming the first differing
        tensor."""
        try:
            step, install = self.topology.read_plain(directory, self.plain_step)
        except (PlainCheckpointError, ResumeMismatch, ResumeError, ValueError) as e:
            self._misconfigured(f"--resume-from: {e}")
        before = time.monotonic() - t0

        def loaded(nbytes: int, seconds: float) -> None:
            self.ctx.events.emit(
                EventKind.CHECKPOINT_LOADED,
                step=step,
                path=str(directory),
                generation=None,
                bytes=nbytes,
                seconds=before + seconds,
                plain=True,
            )

        install(loaded)
        self.ctx.session.note_committed(step)
        self.ctx.proto.resumed(step)
        member = self.ctx.member
        log.info("%s starts from %s (step %d) after %.2f s", member, directory, step, before)
        print(f"[{member}] started from DCP checkpoint {directory} at step {step}", flush=True)

    def _loaded(self, ckpt: VerifiedCheckpoint, nbytes: int, seconds: float) -> None:
        self.ctx.events.emit(
            EventKind.CHECKPOINT_LOADED,
            step=ckpt.step,
            path=str(ckpt.path),
            generation=ckpt.generation,
            bytes=nbytes,
            seconds=seconds,
        )
