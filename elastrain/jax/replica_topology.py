"""The topology of a job whose JAX replicas span K processes (`--replica-procs K`).

Every member is one process; K of them (one JAX runtime, `elastrain.jax.replica`)
form a replica. The coordinator sees members as usual; this topology finds the
replicas in each generation (every member publishes its place over the
generation's group in `connect`) and answers the layout's questions:

- twins: process k of every replica holds the same rows; the step's gradient
  of those rows is all-reduced among them (a gloo group per k, per generation),
  then the extras (loss sum, sample count) over the whole generation as the
  commit vote, so the sample count is the global batch exactly once;
- turns: the complete replicas (all K processes present) take balanced blocks
  of the step's micro-batches, and inside a replica the processes take turns,
  one micro-batch each per round (`assign_rounds`); a process of an incomplete
  replica (its mates have not all joined yet) computes nothing, reduces zeros
  with its twins and applies their sum, so it stays current;
- heal: inside each twins' group (bytes = this process's part only);
- the failure domain is the replica: a process whose replica had all its
  processes in an earlier generation and misses one now leaves (its JAX runtime
  cannot outlive a dead peer) and the launcher rebuilds the replica as K fresh
  processes; the other replicas go on in the next generation.

Checkpoints are sharded (DCP) checkpoints, one replica's worth: process k's
part is written by its lowest-ranked holder; a resume reads each process's own
part, on any number of replicas (`elastrain.jax.replica_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from elastrain.checkpoint import CheckpointFormat, VerifiedCheckpoint
from elastrain.checkpoint.dcp import ShardedReader
from elastrain.checkpoint.manager import PartsFn, SaveRole, StateFn, written_format
from elastrain.checkpoint.plain import PlainCheckpointError
from elastrain.checkpoint.restore import NOT_THIS_MODEL, ResumeError
from elastrain.exitcodes import EXIT_LEFT, EXIT_MISCONFIGURED, ExitReason, WorkerExit
from elastrain.jax.replica import ReplicaLayout
from elastrain.jax.replica_backend import JaxReplicaBackend
from elastrain.jax.replica_checkpoint import (
    META,
    LeafPart,
    Rows,
    WholeTensors,
    flat_leaves,
    layout_problem,
    leaf_parts,
    read_part,
    replica_parts,
    saved_parts,
    writer_index,
)
from elastrain.jax.state import rebuild
from elastrain.observe.events import EventKind
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.collectives import TransportChoice, choose_transport
from elastrain.runtime.context import Context, Links
from elastrain.runtime.group import build_group, tensor_allreduce
from elastrain.runtime.topology import (
    CannotCompute,
    Healed,
    HealJob,
    Reduction,
    Snapshots,
    StateLost,
    Turns,
)
from elastrain.transfer import LandingReserve, Role

log = logging.getLogger("elastrain.jax.replicas")

Loaded = Callable[[int, float], None]
"""Told the bytes read and the seconds spent once a restore's reading is done
(the `Topology.restore` callback's type, spelled here: its home module moves)."""


def exchange_places(pg: Any, rank: int, size: int, mine: tuple[int, int, int, int]) -> Any:
    """Every member's (replica, incarnation, proc, procs), by rank: one sum
    all-reduce over the generation's group, each member filling its own row."""
    table = torch.zeros(size, 4, dtype=torch.int64)
    table[rank] = torch.tensor(mine, dtype=torch.int64)
    for w in tensor_allreduce(pg, [table]):
        w.wait()
    return table.tolist()


class ReplicaTwins:
    """The `Topology` of a job of K-process JAX replicas (module docstring)."""

    standby_refresh = False
    """A standby's state is one process's part: it takes no checkpoints while it waits."""

    def __init__(self, ctx: Context, backend: JaxReplicaBackend) -> None:
        self.ctx = ctx
        self.backend = backend
        self.place = backend.place
        self.layout: ReplicaLayout | None = None
        self.twins_pg: Any = None
        self._was_complete = False
        """This process's replica had all its processes in a generation before: a
        generation without one of them means a replica-mate is gone."""
        self._parts: list[LeafPart] | None = None

    def leaf_parts(self) -> list[LeafPart]:
        """This process's part of every leaf of the state (fixed for the job)."""
        if self._parts is None:
            b = self.backend
            self._parts = leaf_parts(b.whole_state(), b.state_tree(), self.place.procs)
        return self._parts

    def transport(self, setting: str, device: torch.device) -> TransportChoice:
        return choose_transport(setting, "cpu", sharded=False, nccl_version=None)

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        """Sharded (DCP) whatever ``--ckpt-format`` says: the one format of parts."""
        return written_format(configured, sharded=True)

    def format_problems(self, configured: CheckpointFormat, written: CheckpointFormat) -> list[str]:
        """A state whose parts are not row blocks of its leaves cannot be checkpointed."""
        ck = self.ctx.config.checkpoint
        if not ck.every and ck.mtbf_s is None:
            return []
        try:
            self.leaf_parts()
        except ValueError as e:
            return [f"checkpoints of a multi-process JAX replica: {e}"]
        return []

    def landing_estimate(self) -> list[tuple[str, int]]:
        return self.backend.state().landing_estimate()

    def prepare_heal(self, a: m.Action, reserve: LandingReserve | None) -> None:
        """Nothing ahead: a process learns its twins (who heals its shard) only
        from the places exchanged at `connect`."""

    def connect(self, links: Links) -> None:
        """Learn every member's place, leave if a replica-mate is gone, build this
        process's twins' group (blocks for the twins)."""
        ready, ctx = links.ready, self.ctx
        assert ready is not None
        members = tuple(ready.members)
        rank = members.index(ctx.member)
        p = self.place
        rows = exchange_places(
            links.pg, rank, len(members), (p.replica, p.incarnation, p.proc, p.procs)
        )
        places: dict[str, tuple[tuple[int, int], int]] = {}
        for w, (r, inc, k, procs) in zip(members, rows, strict=True):
            if procs != p.procs:
                raise WorkerExit(
                    EXIT_MISCONFIGURED,
                    ExitReason.MISCONFIGURED,
                    f"elastrain: misconfigured: {w} runs replicas of {procs} processes, this "
                    f"worker of {p.procs}",
                )
            places[w] = ((r, inc), k)
        layout = ReplicaLayout(members, places, p.procs)
        mates = sum(1 for w in members if places[w][0] == p.runtime)
        if mates == p.procs:
            self._was_complete = True
        elif self._was_complete:
            self._leave(ready.gen, mates)
        self.layout = layout
        twins = layout.twins(p.proc)
        store = ctx.session.store(ctx.config.timeouts.rendezvous_s)
        self.twins_pg = build_group(
            store,
            f"{ctx.session.group_prefix(ready)}/twins{p.proc}",
            twins.index(ctx.member),
            len(twins),
            host=ctx.host,
            connect_timeout_s=ctx.config.timeouts.rendezvous_s,
            op_timeout_s=ctx.config.watchdog.ceiling_s,
        )

    def _leave(self, gen: int, mates: int) -> None:
        """A replica-mate is gone: this process's JAX runtime cannot compute again.
        Leave at once (no JAX shutdown: its barrier would wait for the dead peer);
        the launcher rebuilds the replica."""
        ctx = self.ctx
        msg = (
            f"elastrain: {ctx.member}: replica {self.place.replica} has {mates} of its "
            f"{self.place.procs} processes in generation {gen}: a replica-mate is gone, this "
            "process leaves so that the replica is rebuilt"
        )
        log.warning(msg)
        ctx.events.emit(
            EventKind.WORKER_EXIT, reason=m.ExitReason.LEFT, committed=ctx.proto.committed
        )
        raise WorkerExit(EXIT_LEFT, ExitReason.LEFT, msg, immediate=True)

    def heal(self, job: HealJob) -> Healed:
        """Each twins' group heals on its own: a receiver gets its part from its twins."""
        a, ctx, layout = job.action, self.ctx, self.layout
        ready = job.links.ready
        assert layout is not None and ready is not None
        twins = tuple(layout.twins(self.place.proc))
        senders, receivers, _ = m.heal_roles(
            twins, ready.committed, ready.commit_gens, ready.start_step
        )
        committed = ready.committed.get(ctx.member, 0)
        if not receivers:
            return Healed(committed, False)
        if not senders:
            raise StateLost(
                f"shard {self.place.proc} of {self.place.procs} has no up-to-date holder "
                "(every replica holding it died)"
            )
        rank = twins.index(ctx.member)
        role = Role.of(rank, senders, receivers)
        ctx.events.emit(EventKind.HEAL_BEGIN, gen=a.gen, role=role, bytes=0)
        state = self.backend.state()
        got, stats = job.heal_fn(
            self.twins_pg,
            rank,
            list(senders),
            list(receivers),
            state,
            job.meta(committed) if role is Role.SEND else None,
            ctx.config.timeouts.heal_s,
            key=ctx.key,
            reserve=job.reserve if role is Role.RECV else None,
        )
        received = role is Role.RECV
        if received:
            self.backend.adopt(state)
            committed = job.load_meta(got)
        ctx.events.emit(EventKind.HEAL_END, gen=a.gen, **stats.event_fields())
        return Healed(committed, received)

    def hold(self, step: int, samples: list[int], loss_sum: float | torch.Tensor) -> bool:
        """Nothing is kept across generations (the step is computed again whole)."""
        return False

    def turns(self, step: int, num_microbatches: int) -> Turns:
        """This process's turns in its replica's rounds ([] in an incomplete replica)."""
        assert self.layout is not None
        try:
            mine = self.layout.turns(self.ctx.member, num_microbatches)
        except LookupError as e:
            raise CannotCompute(str(e)) from None
        # No "superseded?" check between rounds: a replica's processes run every
        # round together (JAX's collectives inside the round).
        return Turns(mine, stop_when_superseded=False, collectives_inside=True)

    def reductions(self, links: Links, extras: torch.Tensor) -> list[Reduction]:
        """The twins' gradient first, then the extras over the whole generation as
        the commit vote: one member through the vote proves every member reduced.
        The vote also sums the gradient's squared norm, part by part (`vote_slots`
        holds `extras` after the norm slot), for ``max_grad_norm`` and `grad_norm`."""
        world, backend, layout = links.pg, self.backend, self.layout
        assert layout is not None

        def vote() -> list[Any]:
            # Started once the twins' sum is in: this process's parts' squared norm
            # (one holder of each part counts it) rides the vote with the extras.
            backend.put_norm_share(writer_index(layout, self.ctx.member) is not None)
            return tensor_allreduce(world, [backend.vote_slots()])

        return [
            Reduction(
                lambda: tensor_allreduce(self.twins_pg, [backend.gradient()]),
                before_wait=hooks.StepPoint.ALLREDUCE,
                what="the twins' reduction",
            ),
            Reduction(vote, after_wait=hooks.StepPoint.VOTE),
        ]

    def eval_share(self, num_batches: int, members: int, rank: int) -> Any:
        """Evaluations are not built for multi-process replicas (JAX refuses
        `evaluate_every`): raises CannotCompute."""
        raise CannotCompute("evaluation is not built for multi-process JAX replicas")

    def drop(self, inflight: list[Any]) -> None:
        if self.twins_pg is not None:
            self.ctx.graveyard.bury(self.twins_pg, inflight)
            self.twins_pg = None
        self.layout = None

    def close(self) -> None:
        """`drop` keeps nothing (the replica's own runtime ends with its process)."""

    def event_fields(self) -> dict[str, int]:
        """The place, for the `generation_start` event (hashes compare among twins)."""
        p = self.place
        return {"shard": p.proc, "replica": p.replica, "shard_size": p.procs}

    def save_part(
        self, committed: int, snaps: Snapshots, written: CheckpointFormat
    ) -> tuple[StateFn | PartsFn, SaveRole]:
        """Its part of every leaf if it is its part's writer (`writer_index`: one
        replica's worth in all); rank 0 commits."""
        layout, p = self.layout, self.place
        if layout is None:  # between generations: no layout, nothing to write
            return snaps.state_at(committed), SaveRole(None, 1, False)
        k = writer_index(layout, self.ctx.member)
        role = SaveRole(k, p.procs, self.ctx.proto.rank == 0)
        backend = self.backend

        def parts() -> Any:
            meta = snaps.checkpoint_meta(committed)
            return replica_parts(self.leaf_parts(), backend.state_tree(), meta, p.procs, k or 0)

        return parts, role

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        if ckpt.kind == "flat" or META in ckpt.meta:
            return None  # a single-process JAX job's whole leaves, or replicas' parts
        return (
            f"{ckpt.path} is a sharded PyTorch job's checkpoint, not a JAX replica's: "
            "resume it with that job's script, or start in a fresh --run-dir"
        )

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        """Read this process's part of every leaf now (`read_part`: its rows only
        where the leaf is split as when saved) and install it; returns the bytes
        read. ResumeError, before anything is installed, if the saved leaves are
        not this script's."""
        mine, p = self.leaf_parts(), self.place
        source: Rows
        if ckpt.kind == "flat":
            saved = saved_parts(meta, flat_leaves(tensors), [m.name for m in mine])
            source, reader = WholeTensors(tensors), None
        else:
            saved = saved_parts(meta, {}, [])
            source = reader = ShardedReader(ckpt)
        try:
            problem = layout_problem(saved, mine)
            if problem is not None:
                raise ResumeError(
                    f"checkpoint {ckpt.path} does not fit this model and optimizer: "
                    f"{problem}. {NOT_THIS_MODEL}"
                )
            arrays = read_part(source, saved, mine, p.procs, p.proc)
        finally:
            if reader is not None:
                reader.close()
        state = self.backend.state()
        state.healed = rebuild(state.tree, arrays)
        self.backend.adopt(state)
        saved_k = meta.get(META, {}).get("procs", 1)
        log.info("%s read its part of %s (saved by replicas of %d processes, read by %d)",
                 self.ctx.member, ckpt.path, saved_k, p.procs)  # fmt: skip
        if reader is not None:
            return reader.bytes_read
        return sum(t.numel() * t.element_size() for t in tensors.values())  # read whole

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        """A plain torch DCP directory holds a torch model's state: refused."""
        raise PlainCheckpointError(
            f"{directory}: a plain PyTorch checkpoint cannot start a JAX replica's state"
        )


def replica_twins(backend: JaxReplicaBackend) -> Callable[[Context], ReplicaTwins]:
    """The topology factory for a trainer that built `backend` (`TopologyFactory`)."""
    return lambda ctx: ReplicaTwins(ctx, backend)
