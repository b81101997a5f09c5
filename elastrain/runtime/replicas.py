"""The replicated topology: every member holds the whole model (data parallel).

Each member computes its share of a step's micro-batches
(`assign_microbatches`), one all-reduce (NCCL or gloo) sums the gradient with
the extras, the up-to-date members heal the behind ones by a striped copy of
the whole state (`elastrain.transfer.heal`), and each member writes its stripe
(flat) or its rows (DCP) of a checkpoint; rank 0 commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastrain.checkpoint import CheckpointFormat, VerifiedCheckpoint
from elastrain.checkpoint.manager import PartsFn, SaveRole, StateFn
from elastrain.checkpoint.replicated_parts import (
    read_plain_whole,
    replicated_parts,
    replicated_schema,
    restore_whole,
)
from elastrain.data import assign_microbatches
from elastrain.observe.events import EventKind
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.collectives import TransportChoice, choose_transport, runtime_nccl_version
from elastrain.runtime.context import Context, Links
from elastrain.runtime.evaluate import EvalShare, my_batches
from elastrain.runtime.group import tensor_allreduce
from elastrain.runtime.preflight import format_problem
from elastrain.runtime.topology import (
    Healed,
    HealJob,
    Loaded,
    PreparedHeal,
    Reduction,
    Snapshots,
    Turns,
)
from elastrain.transfer import (
    HealAuth,
    LandingReserve,
    PreparedReceive,
    PreparedSend,
    Role,
    TorchState,
)


class Replicated:
    """The `Topology` of a data-parallel job (every member a whole replica)."""

    standby_refresh = True

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._prepared: PreparedHeal | None = None
        """This sender's share of the heal to come (the root's with its digest)."""

    def transport(self, setting: str, device: torch.device) -> TransportChoice:
        cuda = device.type == "cuda"
        return choose_transport(
            setting,
            device.type,
            sharded=False,
            nccl_version=runtime_nccl_version() if cuda else None,
        )

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        return configured

    def format_problems(self, configured: CheckpointFormat, written: CheckpointFormat) -> list[str]:
        why = format_problem(configured, self.ctx.backend.framework, False)
        if why is not None:
            return [why]
        if written == CheckpointFormat.DCP:
            state = self.ctx.backend.state()
            assert isinstance(state, TorchState)  # format_problem: a torch job
            try:
                replicated_schema(state)
            except ValueError as e:
                return [f"--ckpt-format {configured}: {e}"]
        return []

    def landing_estimate(self) -> list[tuple[str, int]]:
        return self.ctx.backend.state().landing_estimate()

    def prepare_heal(self, a: m.Action, reserve: LandingReserve | None) -> None:
        """A sender of the heal to come flattens its state and lays it out while the
        group is built, and the root (its first sender) begins its digest: on this
        path they were the largest part of a heal that moves no bytes, and every
        round waits for the slowest sender (`PreparedSend`). Only the root digests:
        the others' digests are never asked for unless a stripe fails. A receiver
        lays out the layout it expects and its landing for it, in ``reserve``
        (`PreparedReceive`): they were its path's part before its first receive."""
        self._prepared = None
        share: PreparedSend | PreparedReceive | None = None
        if a.receivers and a.rank in a.senders:
            auth = HealAuth(self.ctx.config.heal_auth)
            root = a.senders[0] == a.rank
            share = PreparedSend(self.ctx.backend.state(), auth, root=root)
        elif a.rank in a.receivers:
            share = PreparedReceive(self.ctx.backend.state(), reserve)
        if share is not None:
            self._prepared = PreparedHeal(a.step, share)

    def connect(self, links: Links) -> None:
        """Nothing besides the generation's own group."""

    def heal(self, job: HealJob) -> Healed:
        """Senders copy the whole state onto receivers (striped over the senders)."""
        a, ctx = job.action, self.ctx
        if not a.receivers:
            return Healed(a.step, False)
        committed, received = a.step, False
        role = Role.of(a.rank, a.senders, a.receivers)
        ctx.events.emit(EventKind.HEAL_BEGIN, gen=a.gen, role=role, bytes=0)
        state = ctx.backend.state()
        prepared, self._prepared = self._prepared, None
        got, stats = job.heal_fn(
            job.links.pg,
            a.rank,
            list(a.senders),
            list(a.receivers),
            state,
            job.meta(committed) if role is Role.SEND else None,
            ctx.config.timeouts.heal_s,
            key=ctx.key,
            reserve=job.reserve if role is Role.RECV else None,
            prepared=None if prepared is None else prepared.for_heal(role, a.step),
        )
        if role is Role.RECV:
            ctx.backend.adopt(state)
            committed, received = job.load_meta(got), True
        ctx.events.emit(EventKind.HEAL_END, gen=a.gen, **stats.event_fields())
        return Healed(committed, received)

    def turns(self, step: int, num_microbatches: int) -> Turns:
        proto = self.ctx.proto
        mine = assign_microbatches(num_microbatches, len(proto.members), proto.rank)
        return Turns(list(mine), stop_when_superseded=True, collectives_inside=False)

    def hold(self, step: int, samples: list[int], loss_sum: float | torch.Tensor) -> bool:
        """Nothing is kept: a replica's step is one member's (its buffer is
        dropped with the generation; computed again whole)."""
        return False

    def eval_share(self, num_batches: int, members: int, rank: int) -> EvalShare:
        """A block of batches, run and reported by this member alone."""
        return EvalShare(my_batches(num_batches, members, rank), True, False, False)

    def reductions(self, links: Links, extras: torch.Tensor) -> list[Reduction]:
        """One all-reduce of the gradient with the extras (NCCL where chosen)."""
        grads = links.nccl or links.pg
        buffers = self.ctx.backend.reduce_buffers()
        return [
            Reduction(
                lambda: tensor_allreduce(grads, buffers), before_wait=hooks.StepPoint.ALLREDUCE
            )
        ]

    def drop(self, inflight: list[Any]) -> None:
        """Nothing besides the generation's own group (a heal prepared for it is
        dropped with it)."""
        self._prepared = None

    def close(self) -> None:
        """`drop` keeps nothing."""

    def event_fields(self) -> dict[str, int]:
        return {}

    def save_part(
        self, committed: int, snaps: Snapshots, written: CheckpointFormat
    ) -> tuple[StateFn | PartsFn, SaveRole]:
        """Its stripe of the flattened state, or its rows of the DCP one; rank 0 commits."""
        rank, members = self.ctx.proto.rank, len(self.ctx.proto.members)
        role = SaveRole.replicated(rank, list(self.ctx.proto.members))
        if written == CheckpointFormat.DCP:

            def parts() -> Any:
                state = self.ctx.backend.state()
                assert isinstance(state, TorchState)  # `format_problem` refused DCP for others
                return replicated_parts(state, snaps.checkpoint_meta(committed), rank, members)

            return parts, role
        return snaps.state_at(committed), role

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        return None

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        """The whole state, installed now (`restore_whole`: flat or DCP)."""
        state = self.ctx.backend.state()
        nbytes = restore_whole(ckpt, tensors, meta, state)
        self.ctx.backend.adopt(state)
        return nbytes

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        """Read the whole plain checkpoint now (`read_plain_whole`); installing it
        is adopting it."""
        backend = self.ctx.backend
        state = backend.state()
        step, nbytes = read_plain_whole(directory, wanted_step, state)

        def install(loaded: Loaded) -> None:
            backend.adopt(state)
            loaded(nbytes, 0.0)

        return step, install
