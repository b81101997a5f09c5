"""The sharded topology: replica groups of `shard_size` members, one shard each.

A member holds one shard of the model (FSDP2 inside its replica group); the
layout's work of each generation is `ShardedMember`'s
(`elastrain.runtime.shard_member`): twins' groups, heal among twins or a
reshard, rounds, the twins' reduction and the commit vote. Checkpoints are
always DCP, each shard written by one writer; a resume reads a member's rows
when it takes its slot (its first `place`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from elastrain.checkpoint import CheckpointFormat, VerifiedCheckpoint
from elastrain.checkpoint.dcp import ShardedReader
from elastrain.checkpoint.manager import PartsFn, SaveRole, StateFn, written_format
from elastrain.checkpoint.replicated_parts import saved_objects
from elastrain.checkpoint.sharded_parts import (
    OBJECTS_META,
    read_plain_rows,
    restore_rows,
    shard_parts,
    writer_shard,
)
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.collectives import TransportChoice, choose_transport
from elastrain.runtime.context import Context, Links
from elastrain.runtime.evaluate import EvalShare
from elastrain.runtime.group import HangCheck
from elastrain.runtime.preflight import format_problem
from elastrain.runtime.registered import REGISTERED_META, meta_of_section
from elastrain.runtime.shard_member import (
    NoCompleteGroup,
    ShardedMember,
    ShardLost,
    twins_heal_receiver,
    twins_heal_root,
)
from elastrain.runtime.sharded import MetaModelUnfilled, ShardedBackend
from elastrain.runtime.topology import (
    CannotCompute,
    Healed,
    HealJob,
    Loaded,
    PreparedHeal,
    Reduction,
    Snapshots,
    StateLost,
    Turns,
    Unfillable,
)
from elastrain.runtime.watchdog import HANG_ASK_EVERY_S
from elastrain.transfer import HealAuth, LandingReserve, PreparedReceive, PreparedSend

log = logging.getLogger("elastrain.shards")


class ShardedGroups:
    """The `Topology` of a sharded job (`TrainerConfig.shard_size` > 1)."""

    standby_refresh = False
    """A sharded standby reads its rows when it takes a slot, not while it waits."""

    def __init__(self, ctx: Context, backend: ShardedBackend) -> None:
        self.ctx = ctx
        self.backend = backend
        self.shards = ShardedMember(
            backend, ctx.member, ctx.config, ctx.host, ctx.events, ctx.graveyard
        )
        self._prepared: PreparedHeal | None = None
        """The twins' heal root's share, begun at connect (`prepare_heal`)."""

    def transport(self, setting: str, device: torch.device) -> TransportChoice:
        """Gloo: FSDP2 inside the replica groups runs over gloo."""
        return choose_transport(setting, device.type, sharded=True, nccl_version=None)

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        return written_format(configured, sharded=True)

    def format_problems(self, configured: CheckpointFormat, written: CheckpointFormat) -> list[str]:
        why = format_problem(configured, self.backend.framework, True)
        return [] if why is None else [why]

    def landing_estimate(self) -> list[tuple[str, int]]:
        """The largest shard of the configured shard size (a joiner holds none yet)."""
        return self.backend.landing_estimate()

    def prepare_heal(self, a: m.Action, reserve: LandingReserve | None) -> None:
        """Beside the wait for peers (the layout is in the ready answer): the root of
        this member's twins' heal (`twins_heal_root`) flattens its shard's state and
        begins its digest (`PreparedSend`); a receiver of a twins' heal
        (`twins_heal_receiver`) takes its slot's rows now (`ShardedMember.place`, as
        the heal would) and lays out the layout it expects and its landing in them
        and in ``reserve`` (`PreparedReceive`). A member of a reshard prepares
        nothing: its rows move by the reshard's plan."""
        self._prepared = None
        ready, member = self.ctx.links.ready, self.ctx.member
        if ready is None:
            return
        committed = ready.committed.get(member, 0)
        if twins_heal_root(ready, member, self.backend):
            auth = HealAuth(self.ctx.config.heal_auth)
            self._prepared = PreparedHeal(committed, PreparedSend(self.backend.state(), auth))
        elif (shard := twins_heal_receiver(ready, member)) is not None:
            try:
                self.shards.place(shard, ready.shard_size, receiving=True)
            except Exception as e:  # noqa: BLE001 - the heal places again and reports it
                # (a meta model with nothing to fill it: `Unfillable`; a checkpoint's
                # rows that cannot be read: a failed heal), on the path that handles it.
                log.info("%s: placing its rows at the connect failed (%s)", member, e)
                return
            self._prepared = PreparedHeal(committed, PreparedReceive(self.backend.state(), reserve))

    def connect(self, links: Links) -> None:
        """Read the generation's layout and build this member's twins' group."""
        ready, session = links.ready, self.ctx.session
        assert ready is not None
        store = session.store(self.ctx.config.timeouts.rendezvous_s)
        self.shards.connect(ready, store, session.group_prefix(ready))

    def heal(self, job: HealJob) -> Healed:
        """Heal inside twins' groups, or reshard to a new shard size
        (`ShardedMember.heal`). Rows nobody holds: StateLost."""
        a, links = job.action, job.links
        assert links.ready is not None
        try:
            out = self.shards.heal(
                a.gen,
                a.roll_forward,
                links.ready,
                links.pg,
                job.meta,
                job.load_meta,
                job.heal_fn,
                self.ctx.key,
                job.reserve,
                self._take_prepared(),
            )
        except ShardLost as e:
            raise StateLost(str(e)) from None
        except MetaModelUnfilled as e:
            raise Unfillable(str(e)) from None
        return Healed(out.committed, out.received)

    def turns(self, step: int, num_microbatches: int) -> Turns:
        """This member's turns in its replica group's rounds (none for a shadow),
        less what its group kept of `step` from the generation before
        (`ShardedMember.rounds`: at a generation's first step, an exchange over it,
        waited for as a step's reductions are: raises CollectiveAborted when the
        generation breaks, a peer is found hung or the watchdog's ceiling passes)."""
        ctx = self.ctx
        try:
            rounds, held = self.shards.rounds(
                step,
                num_microbatches,
                ctx.hang.timeout_s,
                ctx.links.pg,
                ctx.proto.commit_gen,
                lambda works: self._await_exchange(works, step),
            )
        except NoCompleteGroup as e:
            raise CannotCompute(str(e)) from None
        if held is not None:
            return Turns(rounds, False, True, tuple(held.samples), held.loss_sum,
                         len(held.claim.mask), waits_whole_step=True)  # fmt: skip
        # No "superseded?" check between rounds: a group's members run every round
        # together (FSDP2's collectives), and two members that answered that question
        # differently would leave one waiting in a collective for the other until the
        # timeout. A superseded generation is seen at the verdict, one step later.
        return Turns(
            rounds, stop_when_superseded=False, collectives_inside=True, waits_whole_step=True
        )

    def _await_exchange(self, works: list[Any], step: int) -> None:
        """Wait for the held sums' exchange over the generation: members reach it
        as their heals end, so up to the watchdog's ceiling, as gloo's own bound
        was; a broken generation (a death, a leave) ends it at once, and past the
        soft deadline the coordinator is asked about silent peers (a stopped one).
        The works stay in `links.inflight` if it is given up (the group is parked
        with them)."""
        ctx = self.ctx
        links, gen = ctx.links, ctx.proto.gen
        ceiling = ctx.config.watchdog.ceiling_s
        soft, session = ctx.hang.soft_s, ctx.session
        check = None
        if soft is not None:
            check = HangCheck(soft, HANG_ASK_EVERY_S, lambda waited: session.confirm_hang(
                gen, step, waited, max(0.05, min(ceiling - waited, 2.0))))  # fmt: skip
        links.inflight = list(works)
        ctx.waiter.wait(links.inflight, ceiling, lambda: ctx.gen_broken(gen), check)
        links.inflight = []

    def hold(self, step: int, samples: list[int], loss_sum: float | torch.Tensor) -> bool:
        """Keep the interrupted step's shard buffer (`ShardedMember.hold`)."""
        return self.shards.hold(step, samples, loss_sum)

    def eval_share(self, num_batches: int, members: int, rank: int) -> EvalShare:
        """The batches of this member's replica group (a block per complete group,
        run by all its members together, reported by its shard 0); none for a
        shadow (`ShardedMember.eval_share`)."""
        try:
            return self.shards.eval_share(num_batches, self.ctx.hang.timeout_s)
        except NoCompleteGroup as e:
            raise CannotCompute(str(e)) from None

    def reductions(self, links: Links, extras: torch.Tensor) -> list[Reduction]:
        """The shard's twins first; the whole generation's all-reduce of the norm
        vector (the global gradient norm and found-inf, `shard_step`); the
        generation's all-reduce of the extras last, as the commit vote: one member
        through it proves that every member reduced its shard and the norm, so any
        member that then loses the vote's answer can apply the step it kept
        (`plan.roll_forwards`). A member that fails before the vote keeps nothing:
        no member can have committed that step."""
        world = links.pg
        # Float64: a handshake first, so that a twin gone since the verdict fails it
        # and the shard buffer, never handed over, is kept for the next generation.
        shake = [] if self.backend.native else [
            Reduction(self.shards.handshake, what="the twins' handshake")
        ]  # fmt: skip
        return [
            *shake,
            Reduction(
                self.shards.reduce,
                before_wait=hooks.StepPoint.ALLREDUCE,
                what="the twins' reduction",
                hands_over=True,
            ),
            Reduction(
                lambda: self.shards.norm(world),
                keep=self.shards.keep,
                what="the norm's reduction",
            ),
            Reduction(lambda: self.shards.vote(world, extras), after_wait=hooks.StepPoint.VOTE),
        ]

    def _take_prepared(self) -> PreparedHeal | None:
        prepared, self._prepared = self._prepared, None
        return prepared

    def drop(self, inflight: list[Any]) -> None:
        self._prepared = None
        self.shards.drop(inflight)

    def close(self) -> None:
        """The worker ends: leave the replica group `drop` kept (`ShardedMember.close`)."""
        self.shards.close()

    def event_fields(self) -> dict[str, int]:
        return self.shards.event_fields()

    def save_part(
        self, committed: int, snaps: Snapshots, written: CheckpointFormat
    ) -> tuple[StateFn | PartsFn, SaveRole]:
        """Its shard's rows if it is its shard's writer (`writer_shard`); rank 0 commits."""
        layout = self.shards.layout
        if layout is None:  # between generations: no layout, nothing to write
            return snaps.state_at(committed), SaveRole(None, 1, False)
        shard = writer_shard(layout, self.ctx.member)
        role = SaveRole(shard, layout.shard_size, self.ctx.proto.rank == 0)
        backend = self.backend
        return (
            lambda: shard_parts(backend, snaps.checkpoint_meta(committed), shard or 0),
            role,
        )

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        if ckpt.kind == "dcp":
            return None
        return (
            f"{ckpt.path} is a whole-model checkpoint (a replicated job's) and a sharded "
            "model resumes only from sharded ones: resume it without --shard-size, or start "
            "in a fresh run directory"
        )

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        """This member reads its slot's rows when it takes its slot (its first
        `place`, in the first generation's heal, whatever the layout;
        `restore_rows`) and says so then through `loaded`; returns None."""

        def on_read(nbytes: int, seconds: float) -> None:
            log.info("%s read its shard of %s: %d bytes in %.3f s", self.ctx.member, ckpt.path,
                     nbytes, seconds)  # fmt: skip
            loaded(nbytes, seconds)

        restore_rows(ckpt, meta, self.backend, on_read)
        if REGISTERED_META not in meta and meta.get(OBJECTS_META) is not None:
            # A replicated job's DCP checkpoint: its registered objects as that job
            # wrote them, into the meta this member installs next (`load_meta`).
            reader = ShardedReader(ckpt)
            try:
                got = saved_objects(reader, meta)
            finally:
                reader.close()
            if got is not None:
                meta[REGISTERED_META] = meta_of_section(*got)
        return None

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        """Check now; this member reads its slot's rows when it takes its slot
        (`read_plain_rows`)."""
        return read_plain_rows(directory, wanted_step, self.backend)


def sharded_groups(backend: ShardedBackend) -> Callable[[Context], ShardedGroups]:
    """The topology factory for a trainer that built `backend` (`TopologyFactory`)."""
    return lambda ctx: ShardedGroups(ctx, backend)
