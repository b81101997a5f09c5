"""A sharded member's part of each generation: its slot, its groups, heal or reshard.

The step engine (`elastrain.runtime.engine`) runs the same protocol for every
member; when the model is sharded (`TrainerConfig.shard_size` > 1) it hands
the layout-specific work of a generation to a `ShardedMember`:

    connect   read the generation's layout (slots) and build the twins' group
              (every member with this member's shard index);
    heal      same shard size as the sources hold: the heal runs inside each
              twins' group (only the shard a member lacks moves); a new shard
              size: the reshard plan moves just the rows each new shard needs
              (`elastrain.runtime.reshard`); then the replica group's FSDP2
              wrapper is built (a shadow has none), or kept from the generation
              before when nothing of the group changed or broke
              (`elastrain.runtime.shard_regroup`);
    rounds    this member's micro-batch turns in its replica group's rounds (at a
              generation's first step, float64: less the micro-batches whose
              sums complete groups kept from the generation before,
              `elastrain.runtime.held_sums`);
    hold      the generation broke before the step's buffer was handed over:
              keep it for the next generation;
    reduce    a handshake over the twins (float64: a dead twin fails it, not the
              buffer's all-reduce), then the shard's gradient over the twins;
    norm      then the rows' sums of squares over everyone: the global gradient
              norm and found-inf (`elastrain.runtime.shard_step`);
    vote      then the extras over everyone: the commit vote (a member that
              loses its answer keeps the reduced gradient and norm, `keep`, and applies
              it at the next heal if the generation's ready answer says another
              member committed the step: `plan.roll_forwards`);
    drop      park the twins' group; the replica group's wrapper stays for
              the next generation's heal to keep or leave (`close`: leave it).

Groups are built in the same order on every member (generation, twins, replica
group), and a heal or reshard involves only groups built before the replica
group, so no member waits on one that waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastrain.control import protocol as p
from elastrain.control.layout import Layout
from elastrain.data import assign_microbatches
from elastrain.exitcodes import EXIT_MISCONFIGURED, ExitReason, WorkerExit
from elastrain.observe.events import EventKind, EventLog
from elastrain.runtime import member as m
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.evaluate import EvalShare
from elastrain.runtime.group import Graveyard, build_group, tensor_allreduce
from elastrain.runtime.held_sums import Claim, Held, assign_rest, claim_of, decide, post_exchange
from elastrain.runtime.reshard import (
    ShardLost,
    broadcast_json,
    exchange_rows,
    moved_bytes,
    plan_reshard,
)
from elastrain.runtime.shard_regroup import BuiltGroup, kept, report
from elastrain.runtime.shard_step import Reduced
from elastrain.runtime.sharded import ShardedBackend, open_replica_group
from elastrain.runtime.topology import PreparedHeal
from elastrain.transfer import HealFn, LandingReserve, Role

log = logging.getLogger("elastrain.shards")

__all__ = [
    "HealOutcome",
    "NoCompleteGroup",
    "ShardLost",
    "ShardedMember",
    "held_by_senders",
    "reshards",
    "twins_heal_root",
]


class NoCompleteGroup(RuntimeError):
    """Every replica group of the generation has a vacancy: no step can be computed."""


@dataclass(frozen=True)
class _Kept:
    step: int
    gen: int
    reduced: Reduced
    """`step`'s mean gradient (the twins' reduction) and norm vector (the generation's):
    no collective writes them any more."""


@dataclass(frozen=True)
class HealOutcome:
    committed: int
    """The committed count this member's state now stands for."""
    received: bool
    """Its state came from its peers (a heal's or a reshard's receiver)."""


def held_by_senders(ready: p.RendezvousResponse) -> dict[str, tuple[int, int]]:
    """The (shard size, shard) each of the heal's senders reported holding rows of."""
    members = tuple(ready.members)
    senders, _, _ = m.heal_roles(members, ready.committed, ready.commit_gens, ready.start_step)
    reported = ready.held
    up_to_date = [members[i] for i in senders]
    return {w: (int(reported[w][0]), int(reported[w][1])) for w in up_to_date if w in reported}


def reshards(layout: Layout, held: dict[str, tuple[int, int]]) -> bool:
    """A reshard whenever a source's rows are not its new slot's: a new shard size,
    or the same size with members moved to other shards (groups broken in several
    places regrouped into whole ones)."""
    return any(h != (layout.shard_size, layout.slots[w].shard) for w, h in held.items())


@dataclass(frozen=True)
class TwinsHeal:
    """The heal inside ``member``'s twins that the ready answer announces: its
    slot's shard and size, its twins, and their heal's roles (indices into
    ``twins``)."""

    shard: int
    size: int
    twins: tuple[str, ...]
    senders: tuple[int, ...]
    receivers: tuple[int, ...]


def twins_heal(ready: p.RendezvousResponse, member: str) -> TwinsHeal | None:
    """``member``'s twins' heal in the generation ``ready`` announces, known before
    it begins; None where nothing of it is known yet: a member that rolls forward
    (its state changes first), one with no slot, or a reshard first (it moves rows
    by plan, not by a twins' heal). Reads only."""
    if not ready.slots or member in ready.rolls_forward:
        return None
    layout = Layout.from_wire(ready.slots, ready.shard_size)
    slot = layout.slots.get(member)
    if slot is None or reshards(layout, held_by_senders(ready)):
        return None
    twins = tuple(layout.twins(slot.shard))
    senders, receivers, _ = m.heal_roles(
        twins, ready.committed, ready.commit_gens, ready.start_step
    )
    return TwinsHeal(slot.shard, layout.shard_size, twins, tuple(senders), tuple(receivers))


def twins_heal_root(ready: p.RendezvousResponse, member: str, backend: ShardedBackend) -> bool:
    """Whether ``member`` will be the root of its twins' heal (`twins_heal`: its first
    up-to-date twin, while a twin is behind) with nothing changing its rows before
    that heal: no reshard, no step of its own to roll forward, its rows already in
    its slot. Reads only."""
    heal = twins_heal(ready, member) if backend.placed else None
    if heal is None or (backend.shard_size, backend.shard) != (heal.size, heal.shard):
        return False
    return bool(heal.receivers and heal.senders and heal.twins[heal.senders[0]] == member)


def twins_heal_receiver(ready: p.RendezvousResponse, member: str) -> int | None:
    """The shard ``member`` will receive in its twins' heal (`twins_heal`), or None:
    it is behind and a twin of its slot is up to date. Its slot, hence its shard's
    shape, is then known before the heal. Reads only."""
    heal = twins_heal(ready, member)
    if heal is None or not heal.senders or heal.twins.index(member) not in heal.receivers:
        return None
    return heal.shard


class ShardedMember:
    """One member's sharded layout work, for the engine's training thread.

    Contract: every member of a generation calls `connect`, then `heal`, with
    that generation's ready answer, in that order; `drop` when the generation
    ends. Raises ShardLost from `heal` when rows of the model have no
    up-to-date holder (nothing in memory can restore them).
    """

    def __init__(
        self,
        backend: ShardedBackend,
        member: str,
        config: TrainerConfig,
        host: str,
        events: EventLog,
        graveyard: Graveyard,
    ) -> None:
        self.backend = backend
        self.member = member
        self.config = config
        self.host = host
        self.events = events
        self.graveyard = graveyard
        self.layout: Layout | None = None
        """The current generation's slots (None between generations)."""
        self.twins_pg: Any = None
        """The group of this member's shard index: its gradient's all-reduce and its heal."""
        self._store: Any = None
        self._prefix = ""
        self._kept: _Kept | None = None
        """The reduced step kept by `keep`, until the next heal applies or drops it."""
        self._members: list[str] = []
        """The generation's members in rank order (its group's ranks)."""
        self._held: Held | None = None
        """The buffer of a step interrupted before its reduction (`hold`), until the
        next generation's first step reuses or drops it, or this member's state is
        replaced before that (a heal's receiver, a reshard, a reset: `_drop_held`)."""
        self._exchanged = False
        """This generation's members told each other what they hold (first step)."""
        self._claim: Claim | None = None
        """What this member's buffer will hold once the current step's rounds are
        done (the step, its slot, its group's micro-batches): what `hold` keeps."""
        self._built: BuiltGroup | None = None
        """What the backend's wrapper was built for (None: it holds none)."""
        self.group_kept = False
        """This generation kept the replica group's wrapper of the one before."""
        self.group_s = 0.0
        """Seconds this generation spent on the replica group (agreeing, building)."""
        self.group_pg_s = 0.0
        """Of which in the replica process group's rendezvous (0 when kept)."""

    # ---- a generation -------------------------------------------------------------

    def connect(self, ready: p.RendezvousResponse, store: Any, prefix: str) -> None:
        """Read the layout and build the twins' group (blocks for the twins)."""
        if not ready.slots:
            raise WorkerExit(
                EXIT_MISCONFIGURED,
                ExitReason.MISCONFIGURED,
                f"elastrain: misconfigured: this worker shards the model "
                f"{self.config.shard_size} ways but the coordinator's job is not sharded (shard "
                f"size {ready.shard_size}): start the job with `elastrain run --shard-size "
                f"{self.config.shard_size}` (or set TrainerConfig.shard_size to match)",
            )
        self.layout = Layout.from_wire(ready.slots, ready.shard_size)
        self._store, self._prefix = store, prefix
        self._members, self._exchanged, self._claim = list(ready.members), False, None
        slot = self.layout.slots[self.member]
        twins = self.layout.twins(slot.shard)
        self.twins_pg = build_group(
            store,
            f"{prefix}/twins{slot.shard}",
            twins.index(self.member),
            len(twins),
            host=self.host,
            connect_timeout_s=self.config.timeouts.rendezvous_s,
            op_timeout_s=self.config.watchdog.ceiling_s,
        )

    def heal(
        self,
        gen: int,
        roll_forward: bool,
        ready: p.RendezvousResponse,
        world_pg: Any,
        meta: Callable[[int], dict[str, Any]],
        load_meta: Callable[[dict[str, Any]], int],
        heal_fn: HealFn,
        key: bytes | None,
        reserve: LandingReserve | None = None,
        prepared: PreparedHeal | None = None,
    ) -> HealOutcome:
        """Bring this member's shard up to date (apply the step it kept if
        `roll_forward`, heal from twins, or reshard), then build its replica
        group's wrapper. Collective over the generation."""
        layout = self.layout
        assert layout is not None
        members = tuple(ready.members)
        kept, self._kept = self._kept, None
        if roll_forward:
            self._roll_forward(kept, ready)
        senders, _, _ = m.heal_roles(members, ready.committed, ready.commit_gens, ready.start_step)
        up_to_date = [members[i] for i in senders]
        rolled = self._share_rolled_meta(ready, up_to_date, world_pg, meta, load_meta)
        held = held_by_senders(ready)
        reshard = reshards(layout, held)
        t0 = time.monotonic()
        keep = self._agree_kept(ready, world_pg, reshard)
        agree_s = time.monotonic() - t0
        if reshard:
            self._drop_held("a reshard moves its rows")
            outcome = self._reshard(gen, ready, world_pg, held, meta, load_meta)
        else:
            outcome = self._heal_twins(gen, ready, meta, load_meta, heal_fn, key, reserve, prepared)
        if outcome.received:
            self._drop_held("it received its state")
        t0 = time.monotonic()
        self._form_group(gen, keep)
        self.group_s = agree_s + time.monotonic() - t0
        if roll_forward and not outcome.received:
            # Its rows are the step's; its meta (data position, the script's state)
            # came from a sender (`_share_rolled_meta`): all of it is the lineage's.
            assert rolled
            return HealOutcome(outcome.committed, True)
        return outcome

    def _roll_forward(self, kept: _Kept | None, ready: p.RendezvousResponse) -> None:
        """Apply the kept step: a member of this generation committed it in the
        generation it was reduced in (the coordinator's `plan.roll_forwards`)."""
        want = ready.committed.get(self.member, 0) - 1
        if kept is None or kept.step != want or kept.gen != ready.commit_gens.get(self.member):
            # A bug, not a failure to recover from: the count already moved on.
            raise AssertionError(
                f"{self.member}: told to apply step {want} of generation "
                f"{ready.commit_gens.get(self.member)}, but kept "
                f"{'nothing' if kept is None else f'step {kept.step} of {kept.gen}'}"
            )
        self.backend.apply_kept(kept.reduced, kept.step)
        self.events.emit(EventKind.STEP_ROLLED_FORWARD, step=kept.step, gen=kept.gen)
        log.warning(
            "%s: applied step %d kept from generation %d (committed there by others)",
            self.member,
            kept.step,
            kept.gen,
        )

    def _share_rolled_meta(
        self,
        ready: p.RendezvousResponse,
        senders: list[str],
        world_pg: Any,
        meta: Callable[[int], dict[str, Any]],
        load_meta: Callable[[dict[str, Any]], int],
    ) -> bool:
        """When members that rolled forward are among the heal's senders, the first
        sender that did not roll broadcasts its meta (the data position, the
        script's registered state: what the step's own loop code would have
        advanced) and they install it. Collective over the generation when it
        happens; every member decides alike from `ready`. True if it happened."""
        rolled = [w for w in senders if w in ready.rolls_forward]
        if not rolled:
            return False
        members = list(ready.members)
        root = next(w for w in senders if w not in ready.rolls_forward)
        got = broadcast_json(
            world_pg,
            members.index(root),
            members.index(self.member),
            meta(ready.start_step) if self.member == root else None,
        )
        if self.member in rolled and load_meta(got) != ready.start_step:
            raise RuntimeError(f"{root}'s meta is not at step {ready.start_step}")
        return True

    def _heal_twins(
        self,
        gen: int,
        ready: p.RendezvousResponse,
        meta: Callable[[int], dict[str, Any]],
        load_meta: Callable[[dict[str, Any]], int],
        heal_fn: HealFn,
        key: bytes | None,
        reserve: LandingReserve | None,
        prepared: PreparedHeal | None,
    ) -> HealOutcome:
        """Same shard size as before: each shard index heals inside its twins;
        a receiver lands its shard in ``reserve`` when it has one."""
        layout = self.layout
        assert layout is not None
        slot = layout.slots[self.member]
        backend = self.backend
        mine: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        for shard in range(layout.shard_size):
            twins = tuple(layout.twins(shard))
            if not twins:
                continue
            senders, receivers, _ = m.heal_roles(
                twins, ready.committed, ready.commit_gens, ready.start_step
            )
            if receivers and not senders:
                raise ShardLost(
                    f"shard {shard} of {layout.shard_size} has no up-to-date holder (all of its "
                    "holders died): the job cannot heal it in memory; resume from a checkpoint"
                )
            if self.member in twins:
                mine = (senders, receivers)
        senders, receivers = mine
        rank = layout.twins(slot.shard).index(self.member)
        self.place(slot.shard, layout.shard_size, receiving=rank in receivers)
        committed = ready.committed.get(self.member, 0)
        if not receivers:
            return HealOutcome(committed, False)
        role = Role.of(rank, senders, receivers)
        self.events.emit(EventKind.HEAL_BEGIN, gen=gen, role=role, bytes=0)
        state = backend.state()
        got, stats = heal_fn(
            self.twins_pg,
            rank,
            list(senders),
            list(receivers),
            state,
            meta(committed) if role == Role.SEND else None,
            self.config.timeouts.heal_s,
            key=key,
            reserve=reserve if role == Role.RECV else None,
            prepared=None if prepared is None else prepared.for_heal(role, committed),
        )
        received = role == Role.RECV
        if received:
            backend.adopt(state)
            committed = load_meta(got)
        self.events.emit(EventKind.HEAL_END, gen=gen, **stats.event_fields())
        return HealOutcome(committed, received)

    def place(self, shard: int, size: int, receiving: bool) -> None:
        """Hold rows of ``shard`` of ``size`` for a twins' heal (no reshard): a member
        that missed a reshard takes zeroed rows of the new slot's shape (its rows
        are stale and shaped for the old layout; it is behind, its twins heal it),
        as does a receiver built on the meta device with nothing to resume from
        (its twins' heal is its state); any other is placed (`ShardedBackend.place`).
        Idempotent: a receiver places at the connect (`ShardedGroups.prepare_heal`,
        to lay out its landing in these rows) and the heal places again."""
        backend = self.backend
        stale = backend.placed and (backend.shard_size, backend.shard) != (size, shard)
        if stale or (backend.needs_fill and receiving):
            self._drop_held("its rows are reset")
            backend.reset(shard, size)
        backend.place(shard, size)

    def _reshard(
        self,
        gen: int,
        ready: p.RendezvousResponse,
        world_pg: Any,
        held: dict[str, tuple[int, int]],
        meta: Callable[[int], dict[str, Any]],
        load_meta: Callable[[dict[str, Any]], int],
    ) -> HealOutcome:
        """A new shard size: every member pulls its new shard's rows from the members
        that hold them (itself first), the leader sends the rest as JSON."""
        layout = self.layout
        assert layout is not None
        t0 = time.monotonic()
        members = list(ready.members)
        rank_of = {w: i for i, w in enumerate(members)}
        me = self.member
        backend = self.backend
        pieces = plan_reshard(backend.rows(), held, layout.slots, layout.shard_size, members)
        leader = next(w for w in members if w in held)
        holds = me in held
        old_size = next(iter(held.values()))[0]
        role = Role.SEND if holds else Role.RECV
        self.events.emit(EventKind.HEAL_BEGIN, gen=gen, role=role, bytes=0)
        what = broadcast_json(
            world_pg,
            rank_of[leader],
            rank_of[me],
            {"schema": backend.reshard_schema(), "meta": meta(ready.start_step)}
            if me == leader
            else None,
        )
        row_bytes = backend.row_bytes() if holds else [0] * len(backend.rows())
        counted: list[tuple[int, int]] = []
        moving = [0.0]  # seconds in the exchange: heal_end's payload_s

        def exchange(old: Any, new: Any) -> None:
            t = time.monotonic()
            counted.append(exchange_rows(world_pg, rank_of, me, pieces, old, new))
            moving[0] += time.monotonic() - t

        slot = layout.slots[me]
        backend.reshard(layout.shard_size, slot.shard, what["schema"], exchange, holds=holds)
        sent, received_bytes = counted[0]
        committed = ready.start_step
        if not holds:
            committed = load_meta(what["meta"])
        seconds = time.monotonic() - t0
        self.events.emit(
            EventKind.HEAL_END,
            gen=gen,
            role=role,
            bytes=received_bytes if not holds else sent,
            seconds=seconds,
            payload_s=moving[0],
            rate_mb_s=(received_bytes + sent) / 1e6 / max(seconds, 1e-9),
        )
        self.events.emit(
            EventKind.RESHARD_END,
            gen=gen,
            old_size=old_size,
            new_size=layout.shard_size,
            sent=sent,
            received=received_bytes,
            seconds=seconds,
            moved=moved_bytes(pieces, row_bytes) if holds else None,
        )
        log.info(
            "%s: resharded %d -> %d ways (%s) in %.3f s: sent %d B, received %d B",
            me,
            old_size,
            layout.shard_size,
            layout.describe(),
            seconds,
            sent,
            received_bytes,
        )
        return HealOutcome(committed, not holds)

    def _drop_held(self, why: str) -> None:
        """This member's state is replaced: sums it kept were computed from the old
        one (its rows, its lineage), so no group may resume them. `decide` would
        refuse most of them (step, lineage, slot); dropping them here does not rest on
        a new state always differing in one of those."""
        if self._held is not None:
            log.info("%s: drops its kept sums of step %d: %s", self.member,
                     self._held.claim.step, why)  # fmt: skip
            self._held = None

    def _agree_kept(self, ready: p.RendezvousResponse, world_pg: Any, reshard: bool) -> bool:
        """Whether this member's replica group keeps the wrapper it holds
        (`shard_regroup.kept`): every member's `report`, summed over the generation
        (one all-reduce, before the heal), and the heal's receivers and the reshard,
        read from `ready` alike on every member. No collective when the generation
        reshards (nothing is kept: every member knows it)."""
        layout = self.layout
        assert layout is not None
        if reshard:
            return False
        members = list(ready.members)
        clean = self.backend.group_clean and self.backend.model is not None
        reports = torch.zeros(len(members), dtype=torch.int64)
        reports[members.index(self.member)] = report(self._built, clean, layout, self.member)
        world_pg.allreduce([reports]).wait()
        receivers = []
        for shard in range(layout.shard_size):
            twins = tuple(layout.twins(shard))
            _, into, _ = m.heal_roles(twins, ready.committed, ready.commit_gens, ready.start_step)
            receivers += [twins[i] for i in into]
        agreed = kept(dict(zip(members, reports.tolist(), strict=True)), layout, receivers, False)
        return layout.slots[self.member].replica in agreed and not layout.is_shadow(self.member)

    def _form_group(self, gen: int, keep: bool) -> None:
        """Keep (`keep`) or build the replica group's FSDP2 wrapper (None for a shadow)."""
        layout = self.layout
        assert layout is not None
        slot = layout.slots[self.member]
        group = None if layout.is_shadow(self.member) else tuple(layout.group(slot.replica))
        timeouts = self.config.timeouts
        self.group_kept = keep
        if not keep:
            self._built = None  # until the new one is built
        t0 = time.monotonic()
        opened = [t0, t0]  # when the process group's rendezvous began and ended

        def open_group() -> None:
            opened[0] = time.monotonic()
            open_replica_group(
                self._store,
                f"{self._prefix}/replica{slot.replica}",
                slot.shard,
                layout.shard_size,
                # Group-mates may still be healing or resharding.
                connect_timeout_s=timeouts.rendezvous_s + timeouts.heal_s,
                op_timeout_s=self.config.watchdog.ceiling_s,
            )
            opened[1] = time.monotonic()

        built = self.backend.form_group(group, open_group, keep=keep)
        self.group_pg_s = opened[1] - opened[0]
        if built:
            assert group is not None
            self._built = BuiltGroup(group, layout.shard_size, gen)
            log.info("%s: built replica group %d in %.3f s: its process group %.3f s "
                     "(waiting for group-mates included), FSDP2 wrapper %.3f s", self.member,
                     slot.replica, time.monotonic() - t0, opened[1] - opened[0],
                     time.monotonic() - opened[1])  # fmt: skip
        elif keep:
            log.info("%s: kept replica group %d (built in generation %d)", self.member,
                     slot.replica, self._built.gen if self._built else 0)  # fmt: skip

    # ---- a step -------------------------------------------------------------------

    def rounds(
        self,
        step: int,
        num_microbatches: int,
        watchdog_s: float,
        world_pg: Any,
        commit_gen: int,
        wait: Callable[[list[Any]], None],
    ) -> tuple[list[int | None], Held | None]:
        """This member's micro-batch per round of its replica group (None: a padding
        turn; [] for a shadow), and what its group held of `step` from the
        generation before (then already back in its shard buffer; None: nothing).
        At the generation's first step (float64 reductions) the members first tell
        each other what they hold (`held_sums.post_exchange`: collective over the
        generation, its works waited for by `wait`, which raises to give up) and the
        held micro-batches are left out of the rounds. `commit_gen`: the lineage of
        the state `step` starts from (`MemberProtocol.commit_gen`). Bounds
        the group's collectives by `watchdog_s` and tells the backend how many rounds
        the step has (native reductions run in the last)."""
        layout = self.layout
        assert layout is not None
        slot = layout.slots[self.member]
        complete = layout.complete_replicas()
        if not complete:
            raise NoCompleteGroup(
                f"no complete replica group in {layout.describe()}: nobody can compute; "
                "waiting for a replacement (or a reshard, --reshard-after)"
            )
        held_by, mine = self._exchange(step, num_microbatches, world_pg, complete, commit_gen,
                                       wait)  # fmt: skip
        self._claim = None
        if slot.replica not in complete:
            return [], None
        self.backend.set_collective_timeout(watchdog_s)
        size = layout.shard_size

        def turns_of(shard: int) -> list[int | None]:
            return assign_rest(num_microbatches, held_by, complete, slot.replica, size, shard)

        turns = turns_of(slot.shard)
        if not self.backend.native:
            block = set(held_by.get(slot.replica, ()))
            for k in range(size):
                block.update(i for i in turns_of(k) if i is not None)
            self._claim = Claim(step, commit_gen, size, slot.shard, frozenset(block))
        self.backend.plan_rounds(len(turns))
        return turns, mine

    def _exchange(
        self,
        step: int,
        num_microbatches: int,
        world_pg: Any,
        complete: list[int],
        commit_gen: int,
        wait: Callable[[list[Any]], None],
    ) -> tuple[dict[int, frozenset[int]], Held | None]:
        """At the generation's first step (float64): every member's claim, the
        micro-batches each complete group holds (`held_sums.decide`), and this
        member's held part, put back into its shard buffer when its group holds it.
        Any other kept buffer is dropped. ({}, None) at later steps."""
        if self.backend.native or self._exchanged:
            return {}, None
        layout = self.layout
        assert layout is not None
        self._exchanged = True
        held, self._held = self._held, None
        works, table = post_exchange(
            world_pg,
            self._members.index(self.member),
            len(self._members),
            None if held is None else held.claim,
            num_microbatches,
        )
        try:
            wait(works)
        except BaseException:
            # Given up (the generation broke): nothing read the kept buffer; the next
            # generation's exchange may still resume it.
            self._held = held
            raise
        claims = [claim_of(r) for r in table.tolist()]
        groups = [(r, layout.group(r)) for r in complete]
        held_by = decide(dict(zip(self._members, claims, strict=True)), groups,
                         layout.shard_size, step, commit_gen)  # fmt: skip
        replica = layout.slots[self.member].replica
        if held is None or replica not in held_by:
            return held_by, None
        buffer = self.backend.reduce_buffers()[0]
        # `decide` checked the slot: the kept rows are this slot's rows.
        assert buffer.shape == held.grad.shape and buffer.dtype == held.grad.dtype
        buffer.copy_(held.grad)
        log.info("%s: step %d resumes %d micro-batches its group summed in an earlier "
                 "generation", self.member, step, len(held.claim.mask))  # fmt: skip
        return held_by, held

    def hold(self, step: int, samples: list[int], loss_sum: float | torch.Tensor) -> bool:
        """The generation broke after this member ran all its rounds of `step` and
        before it handed its shard buffer to a collective: keep the buffer (its
        group's sums of the step's micro-batches so far), `samples` and `loss_sum`
        (this member's own, for the step's contribution) for the next generation's
        first step. Float64 only (native sums are made in the last round). True if
        kept. Call before the backend's `discard`, which gives it a new buffer.
        `loss_sum` is read (a device sync if it is a device tensor) only when kept."""
        claim, self._claim = self._claim, None
        if claim is None or claim.step != step or not claim.mask:
            return False
        grad = self.backend.reduce_buffers()[0]
        self._held = Held(claim, grad, list(samples), float(loss_sum))
        log.info("%s: keeps its sums of %d micro-batches of step %d for the next generation",
                 self.member, len(claim.mask), step)  # fmt: skip
        return True

    def eval_share(self, num_batches: int, watchdog_s: float) -> EvalShare:
        """This member's part of an evaluation: its replica group's block of the
        batches (`assign_microbatches` over the complete groups), run by every member
        of the group together (FSDP2's collectives) and reported by its shard 0
        alone, so each batch's sums are counted once; nothing for a shadow. Bounds
        the group's collectives by `watchdog_s`, as a step's rounds do."""
        layout = self.layout
        assert layout is not None
        slot = layout.slots[self.member]
        complete = layout.complete_replicas()
        if not complete:
            raise NoCompleteGroup(
                f"no complete replica group in {layout.describe()}: nobody can evaluate; "
                "waiting for a replacement (or a reshard, --reshard-after)"
            )
        shadows = any(layout.is_shadow(w) for w in layout.slots)
        if slot.replica not in complete:
            return EvalShare([], False, shadows, True)
        self.backend.set_collective_timeout(watchdog_s)
        mine = assign_microbatches(num_batches, len(complete), complete.index(slot.replica))
        return EvalShare(mine, slot.shard == 0, shadows, True)

    def handshake(self) -> list[Any]:
        """Start a one-element all-reduce over the twins, before their gradient's:
        a twin that died or left fails this one, and the shard buffer, not yet handed
        to a collective, can be kept (`hold`). Returns the works (not waited)."""
        return tensor_allreduce(self.twins_pg, [torch.zeros(1, dtype=torch.float64)])

    def reduce(self) -> list[Any]:
        """Start the all-reduce of the step's gradient over the twins. Returns the
        works (not waited)."""
        return tensor_allreduce(self.twins_pg, self.backend.reduce_buffers())

    def norm(self, world_pg: Any) -> list[Any]:
        """Start the all-reduce of the norm vector over the whole generation, once
        `reduce`'s works completed here (the mean gradient is final). The first
        twin of each shard writes its rows' sums; everyone else zeros there.
        Returns the works (not waited)."""
        layout = self.layout
        assert layout is not None
        writes = layout.twins(layout.slots[self.member].shard)[0] == self.member
        return tensor_allreduce(world_pg, [self.backend.norm_vector(writes)])

    def vote(self, world_pg: Any, extras: torch.Tensor) -> list[Any]:
        """Start the commit vote, once `reduce`'s works completed here: the extras'
        all-reduce over the whole generation. Returns the works (not waited)."""
        return tensor_allreduce(world_pg, [extras])

    def keep(self, step: int, gen: int) -> None:
        """Keep the reduced gradient and norm vector of `step` (generation `gen`):
        the twins' and the norm's all-reduces completed here, the vote's answer did
        not."""
        self._kept = _Kept(step, gen, self.backend.take_reduced())

    def event_fields(self) -> dict[str, int]:
        """The slot, for the `generation_start` event (hashes compare among twins),
        whether the replica group's wrapper was kept (`group_kept`, 0/1), the
        milliseconds spent agreeing on it and building it (`group_ms`) and of those
        in its process group's rendezvous (`group_pg_ms`, waiting for mates included)."""
        if self.layout is None:
            return {}
        slot = self.layout.slots[self.member]
        return {"shard": slot.shard, "replica": slot.replica, "shard_size": self.layout.shard_size,
                "group_kept": int(self.group_kept), "group_ms": round(self.group_s * 1000),
                "group_pg_ms": round(self.group_pg_s * 1000)}  # fmt: skip

    def drop(self, inflight: list[Any]) -> None:
        """Park the twins' group (its all-reduce may be in flight). The replica
        group's wrapper and process group stay: none of its collectives is in flight
        (compute is synchronous; one that raised left the group unclean,
        `ShardedBackend.group_clean`), and the next generation's heal keeps them
        or leaves them (`shard_regroup`)."""
        if self.twins_pg is not None:
            self.graveyard.bury(self.twins_pg, inflight)
            self.twins_pg = None
        self.layout = None

    def close(self) -> None:
        """The worker ends: leave the replica group."""
        self._built = None
        self.backend.leave_group()
