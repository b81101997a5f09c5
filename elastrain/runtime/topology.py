"""Topology: how a job's members hold the model, chosen once when the trainer is built.

The step protocol (`elastrain.runtime.member`) and the engine's loop are the
same for every layout; what differs is the job's topology, one object per
worker that owns every question the layout answers:

    transport / checkpoint_format   what carries the gradient, what a save writes
    connect / drop                  the groups a generation needs besides its own
    heal                            who heals whom, and how (a copy, a reshard)
    turns                           which micro-batches this member computes
    eval_share                      which evaluation batches it runs and reports
    reductions                      which collectives sum a step, in order
    save_part                       what this member's part of a checkpoint is
    restore_problem / restore /     how a checkpoint or a plain torch DCP
    read_plain                      directory becomes this member's state

Two exist: `Replicated` (`elastrain.runtime.replicas`: every member holds the
whole model) and `ShardedGroups` (`elastrain.runtime.shard_groups`: replica
groups of `shard_size` members, each holding one shard, FSDP2 inside a group).
A third (a replica made of several processes, JAX) is a new class here, chosen
by its trainer; the engine does not change.

Contract: every member of a job uses the same kind of topology (the trainer
chooses from the config); every method runs on the engine's training thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastrain.checkpoint import CheckpointFormat, VerifiedCheckpoint
from elastrain.checkpoint.manager import PartsFn, SaveRole, StateFn
from elastrain.checkpoint.restore import Loaded
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.collectives import TransportChoice
from elastrain.runtime.context import Context, Links
from elastrain.runtime.evaluate import EvalShare
from elastrain.transfer import HealFn, LandingReserve, PreparedReceive, PreparedSend, Role


class StateLost(Exception):
    """Rows of the model have no up-to-date holder: nothing in memory restores
    them, the job resumes from its newest checkpoint."""


class Unfillable(Exception):
    """The model has no values at all (built on the meta device, no checkpoint, no
    peer): no retry or replacement can fill it."""


class CannotCompute(RuntimeError):
    """No step can commit in this generation (a sharded job with no complete
    replica group): wait for the coordinator's next one."""


class Misfit(Exception):
    """This job cannot start from that saved state (a misconfiguration, exit 78)."""


@dataclass(frozen=True)
class HealJob:
    """What a heal needs: the protocol's action and the engine's carriers."""

    action: m.Action
    links: Links
    meta: Callable[[int], dict[str, Any]]
    """The meta a sender sends with its state (`Carried.meta`)."""
    load_meta: Callable[[dict[str, Any]], int]
    """Installs a received meta; returns its committed count (`Carried.load_meta`)."""
    heal_fn: HealFn
    reserve: LandingReserve | None
    """The landing a joiner prepared (used up by this heal, whatever its role)."""


@dataclass(frozen=True)
class PreparedHeal:
    """A member's share of the heal to come, begun at connect (`Topology.prepare_heal`)."""

    committed: int
    """The committed count the heal was planned at (a sender's: of the state it describes)."""
    share: PreparedSend | PreparedReceive

    def for_heal(self, role: Role, committed: int) -> PreparedSend | PreparedReceive | None:
        """What the heal hands on: the preparation if this member has the role it was
        made for and the heal is the one planned, else None (the heal does its share
        afresh)."""
        made_for = Role.SEND if isinstance(self.share, PreparedSend) else Role.RECV
        return self.share if role == made_for and committed == self.committed else None


@dataclass(frozen=True)
class Healed:
    """After a heal: the committed count this member now holds, and whether it
    received state (it was behind)."""

    committed: int
    received: bool


@dataclass(frozen=True)
class Turns:
    """This member's micro-batches of one step, in order."""

    mine: list[int | None]
    """Indexes of the step's micro-batches (None: a padding turn, weight 0)."""
    stop_when_superseded: bool
    """Check "superseded?" between micro-batches (only where no collective runs
    inside compute: members that answered differently would wait on each other)."""
    collectives_inside: bool
    """Compute runs collectives (FSDP2): a failed one abandons the generation."""
    held_samples: tuple[int, ...] = ()
    """This member's samples of the step that its group computed in an earlier
    generation and kept (`Topology.hold`): already in its gradient, counted in its
    contribution."""
    held_loss: float = 0.0
    """Their loss sum."""
    held: int = 0
    """How many of the step's micro-batches its group kept (not in `mine`)."""
    waits_whole_step: bool = False
    """With no turn (`mine` empty), this member's reduction waits through the
    others' whole compute, which may be twice a steady step's (a sharded shadow
    while a replica group is alone after a kill): it waits up to the watchdog's
    ceiling, not the step timeout. False: an idle member waits as any other (a
    replica with no micro-batch waits for one micro-batch of its peers)."""


@dataclass(frozen=True)
class Reduction:
    """One collective of a step's reduction, started and waited for in order."""

    start: Callable[[], list[Any]]
    """Starts it; returns the works (not waited)."""
    before_wait: hooks.StepPoint | None = None
    """The step hook run once it is started."""
    after_wait: hooks.StepPoint | None = None
    """The step hook run once it completed (an injected failure there loses this
    member's answer: it waits as for one that never comes)."""
    keep: Callable[[int, int], None] | None = None
    """Once it completed: keep the reduced step (step, gen) if a later one fails,
    in case another member committed it."""
    what: str = "the reduction"
    """Its name in an abort's message."""
    hands_over: bool = False
    """Starting it hands the step's gradient buffers to a collective: from then on
    they cannot be kept (`Topology.hold`); not started once the generation broke."""


class Snapshots(Protocol):
    """What a checkpoint save reads of the engine's state (`elastrain.runtime.saving`)."""

    def state_at(self, committed: int) -> StateFn:
        """The flattened state after `committed` steps, its meta and its stable names."""

    def checkpoint_meta(self, committed: int) -> dict[str, Any]:
        """The JSON meta of a checkpoint of `committed` steps."""


class Topology(Protocol):
    """How this job's members hold the model (see the module docstring)."""

    standby_refresh: bool
    """A standby (hot spare) takes each newer committed checkpoint while it waits."""

    def transport(self, setting: str, device: torch.device) -> TransportChoice:
        """What carries the gradient all-reduce (`choose_transport`)."""

    def checkpoint_format(self, configured: CheckpointFormat) -> CheckpointFormat:
        """The format this member writes, given ``--ckpt-format``."""

    def format_problems(self, configured: CheckpointFormat, written: CheckpointFormat) -> list[str]:
        """Why this job cannot write its checkpoint format (checked at start)."""

    def landing_estimate(self) -> list[tuple[str, int]]:
        """The sections a joiner's heal will land (for its landing reserve)."""

    def prepare_heal(self, a: m.Action, reserve: LandingReserve | None) -> None:
        """At a generation's connect, before its groups are built (`a`: the CONNECT
        action, with the heal's roles): a member that will send or receive in the
        heal right after may prepare its share now (`PreparedSend`,
        `PreparedReceive`: a receiver lays its landing out in ``reserve``, the
        joiner's, when it has one), while it waits on peers. Nothing writes the
        state between this and that heal."""

    def connect(self, links: Links) -> None:
        """Build the generation's groups besides `links.pg` (blocks for peers)."""

    def heal(self, job: HealJob) -> Healed:
        """Bring this member's state up to date; collective over the generation.
        Raises StateLost, Unfillable, or HealError/RuntimeError/ValueError (retry)."""

    def turns(self, step: int, num_microbatches: int) -> Turns:
        """This member's micro-batches of `step` (raises CannotCompute; a failed
        collective, RuntimeError, abandons the generation)."""

    def hold(self, step: int, samples: list[int], loss_sum: float | torch.Tensor) -> bool:
        """The generation was abandoned after this member computed all its
        micro-batches of `step` and before a collective took its gradient buffers
        (`Reduction.hands_over`): keep what it summed (with its `samples` and
        `loss_sum`) for the next generation's `turns`, if this topology can. True if
        kept. Called before `Backend.discard`."""

    def reductions(self, links: Links, extras: torch.Tensor) -> list[Reduction]:
        """The step's collectives in order; the last one's extras decide the step."""

    def eval_share(self, num_batches: int, members: int, rank: int) -> EvalShare:
        """This member's part of an evaluation of `num_batches` fixed batches by the
        generation's `members` (this one `rank`); raises CannotCompute."""

    def drop(self, inflight: list[Any]) -> None:
        """The generation ended: park or leave the groups `connect` built."""

    def close(self) -> None:
        """The worker ends: leave what `drop` kept for the next generation."""

    def event_fields(self) -> dict[str, int]:
        """This member's place in the layout, for the `generation_start` event."""

    def save_part(
        self, committed: int, snaps: Snapshots, written: CheckpointFormat
    ) -> tuple[StateFn | PartsFn, SaveRole]:
        """What this member snapshots for checkpoint `committed`, and its role."""

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        """Why this job cannot resume from `ckpt` at all (None: it may try)."""

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        """Install `ckpt` (its meta already decoded); returns the bytes read now, or
        None where the reading happens later and calls `loaded` then."""

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        """Check a plain torch DCP directory against this script; returns its step
        and the function that installs it (raises PlainCheckpointError...)."""


TopologyFactory = Callable[[Context], Topology]
"""Builds a worker's topology from the engine's `Context` (the trainer picks one)."""
