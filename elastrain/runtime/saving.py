"""Checkpoint saves from the engine: what a snapshot reads, when, and the emergency one.

`Checkpointing` (`elastrain.checkpoint.manager`) answers whether a save is due
(`save_due`) and writes it (`save`); this part asks first, then tells it what
this member's part of a due checkpoint is (the topology's `save_part`: a
stripe, rows, a shard), and holds the preemption's emergency checkpoint. Contract: every member of the generation
calls `after_commit` for the same committed count (a due save is collective
through its commit marker, rank 0 commits) and `emergency` on the same notice.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from elastrain.checkpoint.files import committed_steps
from elastrain.checkpoint.manager import Checkpointing, PartsFn, SaveRole, StateFn
from elastrain.checkpoint.restore import ordered_json
from elastrain.observe.events import EventKind
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.carried import Carried
from elastrain.runtime.context import Context
from elastrain.runtime.topology import Topology

log = logging.getLogger("elastrain.engine")


class Saving:
    """This member's checkpoint saves (see the module docstring); also the
    engine's `Snapshots` for the topology."""

    def __init__(
        self, ctx: Context, ckpt: Checkpointing, carried: Carried, topology: Topology
    ) -> None:
        self.ctx = ctx
        self.ckpt = ckpt
        self.carried = carried
        self.topology = topology

    def state_at(self, committed: int) -> StateFn:
        """What a checkpoint snapshot of the state after `committed` steps reads: the
        flattened state (aliases of the live tensors), its JSON meta and the names
        of what only the optimizer step writes (copied until the readers settle)."""
        return lambda: self._checkpoint_state(committed)

    def _checkpoint_state(
        self, committed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
        flat = self.ctx.backend.state().flatten()
        meta = self.checkpoint_meta(committed)
        meta["optimizer"] = ordered_json(flat.section)
        return dict(flat.tensors), meta, flat.stable

    def checkpoint_meta(self, committed: int) -> dict[str, Any]:
        meta = self.carried.meta(committed)
        meta["extra"] = ordered_json(meta.get("extra"))
        meta["framework"] = self.ctx.backend.framework
        return meta

    def save_args(self, committed: int) -> tuple[StateFn | PartsFn, SaveRole]:
        """What this member snapshots for checkpoint `committed` and its role in it."""
        return self.topology.save_part(committed, self, self.ckpt.format)

    def after_commit(self, step: int, gen: int, members: list[str], rank: int) -> None:
        """Step `step` committed (by `members`, this one `rank`) and its caller's
        work is done: ask the manager whether a checkpoint of it is due, and only
        then build this member's part of it and save; then the commit hook."""
        n = step + 1
        final = n >= self.ctx.config.total_steps
        if self.ckpt.save_due(n, rank, final=final):
            state, role = self.save_args(n)
            self.ckpt.save(n, gen, members, rank, state, role, final=final)
        self.ctx.hook(step, hooks.StepPoint.COMMIT)

    def emergency(self, a: m.Action) -> m.Observation:
        """The job is being preempted: write an emergency checkpoint of the step just
        committed (every member of the generation got the same notice with the same
        step's verdict) and wait until it is durable within the grace period."""
        member = self.ctx.member
        deadline = time.monotonic() + a.grace_s
        n = a.step
        log.warning("%s: preemption notice; emergency checkpoint at step %d", member, n)
        print(f"[{member}] preempted: emergency checkpoint at step {n}", flush=True)
        members, rank = list(self.ctx.proto.members), self.ctx.proto.rank
        state, role = self.save_args(n)
        ok = self.ckpt.emergency(n, a.gen, members, rank, state, deadline, role)
        self.ctx.events.emit(
            EventKind.CHECKPOINT_EMERGENCY,
            step=n,
            ok=ok,
            rank=rank,
            seconds=a.grace_s - max(0.0, deadline - time.monotonic()),
        )
        return m.CheckpointWritten(ok)

    def resume_hint(self) -> str:
        """Where the job can resume from (a worker ending because rows are lost)."""
        d = self.ckpt.directory
        steps = committed_steps(d)
        if not steps:
            return "no checkpoint was committed (--ckpt-every, --ckpt-mtbf) to resume from"
        return (
            f"the newest committed checkpoint is step {steps[-1]} in {d}: run the same command "
            "again (same --run-dir) to resume the whole job from it, with any --shard-size"
        )
