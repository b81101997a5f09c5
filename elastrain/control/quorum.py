"""Membership and quorum decisions: deterministic, clock-free, I/O-free.

`Membership` holds the coordinator's soft state. Every method takes `now` (the
caller's clock) and mutates only this object; none sleeps, blocks or does I/O,
so the server, the simulator and the unit tests drive the same code. The one
decision that matters, *which members form the next generation and when*, is
the pure function `plan_generation(view, now, config)`.

Vocabulary: a *member* is one registered worker incarnation. A *generation* is
an ordered member list; rank = position. A generation is *ready* once every
member has called rendezvous for it, reporting its committed step count; it
*starts* at the highest reported count (members below it are healed). It is
*broken* once one of its members is gone or a member reports a failure in it;
a broken generation never proceeds with another step.

Restarts: this state is soft. A restarted coordinator starts empty; workers
that still run a generation register again reporting it, and the first such
report *adopts* it (same number, same members, ready) so that training goes
on without a regroup. Members of the adopted generation that do not register
again within `lease_s` break it, as if their lease had expired. Generation
numbers continue after the highest one any worker reports.

Sharded jobs (`config.shard_size` > 1): every generation carries its members'
slots (`Generation.slots`, decided by `elastrain.control.layout.assign_slots`
from the previous generation's, so survivors keep theirs). An adopted
generation takes the slots the reporting worker sent (`gen_slots`); members it
names no valid slot for are placed as joiners, which for a report with no
slots at all is rank order (r0 = the first `shard_size` ranks, ...). Known
limitation: a worker that reports no slots (one that predates them) gets a
rank-order layout, which is the layout it ran only if no member of it was
replaced since the job started (a replacement takes the dead member's slot,
not the last rank's).

Resharding (`config.reshard_after_s`): each generation has its own shard size
(`Generation.shard_size`). When a sharded generation has had a vacancy (an
incomplete replica group) for `reshard_after_s`, through however many
generations, the next step boundary with nothing else to do regroups the same
members (`decide_reshard`, reason "reshard"); a later failure/join/leave that
makes the configured size divide the member count returns to it
(`formation_shard_size`). A shard size change places members with
`reshard_slots` instead of `assign_slots`. `holdings` remembers what each
member's state holds (its slot in the last ready generation it was in), which
every new generation reports as `Generation.held`. A reshard that cannot fit
`memory_per_member` is refused (`drain_refusals`), once per generation.

Scale: every per-request transition (`touch`, `register`, `quorum`,
`rendezvous`, `expire` with nothing due) is O(1) in the number of members, so
one coordinator serves 100k members: members are kept in registration order
(the alive list is not sorted per call), signs of life in the order they came
(`expire` stops at the first live member), and `evaluate` remembers that
nothing changed since it last found nothing to do (the per-step verdict is a
lookup). Only forming a generation is O(members).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice

from elastrain.control.config import CoordinatorConfig
from elastrain.control.layout import (
    Holding,
    Layout,
    Slot,
    assign_slots,
    reshard_slots,
    state_bytes,
)
from elastrain.control.plan import (
    Form,
    Generation,
    LazySequence,
    Member,
    MembershipView,
    Plan,
    ReshardRefused,
    Wait,
    decide_reshard,
    formation_shard_size,
    has_complete_group,
    has_vacancy,
    in_rank_order,
    plan_generation,
    plan_incremental,
)
from elastrain.control.protocol import GenerationReason, HangStatus, RendezvousStatus, Verdict

__all__ = [
    "Form",
    "Generation",
    "LayoutChange",
    "Member",
    "Membership",
    "MembershipView",
    "Plan",
    "Removal",
    "ReshardRefused",
    "Wait",
    "plan_generation",
]


@dataclass(frozen=True)
class Removal:
    member: str
    reason: str


@dataclass(frozen=True)
class LayoutChange:
    """Generation `gen` runs at another shard size than the one before it."""

    gen: int
    old: str
    """`Layout.describe()` of the previous generation."""
    new: str
    reason: GenerationReason


class Membership:
    """The coordinator's state and the transitions on it (see module docstring).

    Not thread-safe: the server holds one lock around every call.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.members: dict[str, Member] = {}
        """In registration order (a re-registration moves a member to the end)."""
        self.incarnations: dict[str, int] = {}
        self.gen: Generation | None = None
        self.signature: list[object] | None = None
        self.first_registration: float | None = None
        self.failure_reported = False
        self.decision: tuple[int, int, Verdict, int] | None = None
        """Latest per-step verdict: (gen, step, verdict, verdict_gen)."""
        self.finished = False
        self.clean_handoffs: set[int] = set()
        self.waiting: str | None = None
        self.removed: list[Removal] = []
        """Removals since the last `drain_removals()` (for events)."""
        self.formed: list[Generation] = []
        """Generations formed since the last `drain_formed()` (for events)."""
        self.progress_step = 0
        self.last_loss: float | None = None
        self.gen_floor = 0
        """The highest generation number workers reported (after a restart)."""
        self.restart_grace_until: float | None = None
        """See `restarted` and `MembershipView.restart_grace_until`."""
        self.adopted: list[Generation] = []
        """Generations adopted since the last `drain_adopted()` (for events)."""
        self.holdings: dict[str, Holding] = {}
        """member -> what its state holds: its slot (as shard size, shard) in the
        last generation it was part of that became ready. Kept for members
        that are gone, should they register again with their state; dropped
        when a fresh process registers under the name (no `prev_incarnation`)."""
        self.vacant_since: float | None = None
        """Since when the generations have had a vacancy, without a break (None:
        none now, or resharding is off)."""
        self.refusals: list[ReshardRefused] = []
        """Reshards refused since the last `drain_refusals()` (for events)."""
        self.layout_changes: list[LayoutChange] = []
        """Shard size changes since the last `drain_layout_changes()` (for events)."""
        self._reshard_at: float | None = None
        """When the current generation's vacancy is due a reshard decision (None:
        no vacancy, resharding off, or decided already for this generation)."""
        self._recorded: Generation | None = None
        """The generation last entered into `holdings` (at its ready)."""
        self._sized: tuple[object, int | None, str] | None = None
        """(signature, its bytes or None, why not): `_param_bytes`' cache."""
        # ---- indexes (derived from the above; see the module docstring on scale)
        self._seq = 0
        self._last_registered = float("-inf")
        self._registration_sorted = True
        """`members` (dict order) is ordered by `registered_at` too, as long as
        `now` never went backwards between registrations."""
        self._seen: OrderedDict[str, float] = OrderedDict()
        """member -> last_seen, in the order the signs of life came (an
        OrderedDict: the oldest is found in O(1), where a dict would skip the
        holes that moving members to its end leaves at its front)."""
        self._seen_last = float("-inf")
        self._seen_sorted = True
        """`_seen` is ordered by value (false once a caller's clock went back)."""
        self._leaving: set[str] = set()
        """Members with `leaving` set."""
        self._ix_gen: Generation | None = None
        """The generation `_lost` and `_outside` describe (None: rebuild them)."""
        self._lost: dict[str, None] = {}
        """Members of `_ix_gen` that are not alive (removed, or leaving)."""
        self._outside: dict[str, None] = {}
        """Alive members not in `_ix_gen`, in registration order."""
        self._settled = 0
        """2: the last `evaluate` at a step boundary found nothing to do and
        nothing changed since; 1: likewise off a boundary; 0: must evaluate.
        With no failure and no step boundary `plan_generation` returns None
        whatever the clock says, so this needs resetting only on changes."""

    def _changed(self) -> None:
        self._settled = 0

    # ---- registration and liveness ---------------------------------------

    def register(
        self,
        member: str,
        pid: int,
        host: str,
        now: float,
        *,
        gen: int = 0,
        gen_members: tuple[str, ...] = (),
        committed: int = 0,
        prev_incarnation: int = 0,
        gen_slots: Mapping[str, Slot] | None = None,
        gen_shard_size: int = 0,
    ) -> int:
        """Add (or re-add, after expulsion or a coordinator restart) a member;
        returns its incarnation. `gen`/`gen_members`/`committed`/`gen_slots`/
        `gen_shard_size` are what the worker runs (see the module docstring on
        restarts; `gen_shard_size` 0: the configured one)."""
        inc = max(self.incarnations.get(member, 0), prev_incarnation) + 1
        self.incarnations[member] = inc
        if not prev_incarnation:
            # A fresh process under a name seen before holds nothing of the old one's.
            self.holdings.pop(member, None)
        if member in self.members:
            self._remove(member, "reregistered", now)
        self._changed()
        self._seq += 1
        self.members[member] = Member(member, inc, pid, host, now, now, seq=self._seq)
        if now < self._last_registered:
            self._registration_sorted = False
        self._last_registered = max(self._last_registered, now)
        self._saw(member, now)
        self._index_alive(member)
        if self.first_registration is None:
            self.first_registration = now
        self.gen_floor = max(self.gen_floor, gen)
        g = self.gen
        if gen and member in gen_members:
            if g is None or (g.reason == GenerationReason.ADOPTED and g.gen < gen):
                # A size no generation can have (more than its members or the cap)
                # is not believed: it would only cost time (`Layout.describe`).
                believable = gen_shard_size <= max(self.config.max_members, len(gen_members))
                size = gen_shard_size if gen_shard_size and believable else self.config.shard_size
                self._adopt(gen, tuple(gen_members), committed, now, gen_slots or {}, size)
            elif g.gen == gen and member in g.awaiting:
                g.awaiting.discard(member)
                g.set_ready(member, committed)
        self.evaluate(now)
        return inc

    def _adopt(
        self,
        gen: int,
        members: tuple[str, ...],
        committed: int,
        now: float,
        slots: Mapping[str, Slot],
        shard_size: int,
    ) -> None:
        # The reported slots where valid, the rest in rank order (module docstring).
        placed = assign_slots(slots, members, shard_size)
        g = Generation(
            gen,
            members,
            now,
            GenerationReason.ADOPTED,
            ready=dict.fromkeys(members, committed),
            slots=placed,
            shard_size=shard_size,
            # Its members run it: they hold their slots in it (sharded jobs).
            held={m: Holding(shard_size, placed[m].shard if placed else 0) for m in members}
            if self.config.shard_size > 1
            else {},
        )
        g.awaiting = {m for m in members if m not in self.members}
        self.gen = g
        self._record_holdings(g)
        self.vacant_since = None
        self._track_vacancy(g, now)
        self.adopted.append(g)
        self.failure_reported = False
        self.decision = None
        self.progress_step = max(self.progress_step, committed)
        self._changed()

    def knows(self, member: str) -> bool:
        """Has this coordinator ever registered `member`? (No: it restarted since.)"""
        return member in self.incarnations

    def gen_interrupted(self, gen: int) -> bool:
        """Must members still running `gen` abandon their collective now?
        Yes if it broke, or was superseded for any reason but a step-boundary
        join/leave."""
        g = self.gen
        if g is None:
            return True
        if g.gen == gen:
            return g.broken
        return gen not in self.clean_handoffs

    def touch(self, member: str, incarnation: int, now: float) -> bool:
        """Record a sign of life; False if the caller is not a current member."""
        m = self.members.get(member)
        if m is None or m.incarnation != incarnation:
            return False
        m.last_seen = now
        self._saw(member, now)
        return True

    def _saw(self, member: str, now: float) -> None:
        seen = self._seen
        if member in seen:
            seen.move_to_end(member)
        seen[member] = now
        if now < self._seen_last:
            self._seen_sorted = False
        else:
            self._seen_last = now

    def _sort_seen(self) -> None:
        """Restore `_seen`'s time order after a caller's clock went back (rare)."""
        if not self._seen_sorted:
            self._seen = OrderedDict(sorted(self._seen.items(), key=lambda kv: kv[1]))
            self._seen_sorted = True
            self._seen_last = next(reversed(self._seen.values()), float("-inf"))

    def _set_leaving(self, m: Member) -> None:
        m.leaving = True
        self._leaving.add(m.id)
        self._index_gone(m.id)
        self._changed()

    # ---- the indexes behind `plan_incremental` -----------------------------

    def _index_alive(self, member: str) -> None:
        g = self._ix_gen
        if g is not None:
            if member in g.member_set:
                self._lost.pop(member, None)
            else:
                self._outside[member] = None

    def _index_gone(self, member: str) -> None:
        g = self._ix_gen
        if g is not None:
            if member in g.member_set:
                self._lost[member] = None
            else:
                self._outside.pop(member, None)

    def _index(self, g: Generation) -> bool:
        """Make `_lost`/`_outside` describe `g` (O(members) if they did not);
        False if `plan_incremental` does not apply (see `evaluate`)."""
        if g.awaiting or not self._registration_sorted:
            return False
        self._sort_seen()
        if self._ix_gen is not g:
            if len(g.member_set) != len(g.members):
                return False  # duplicate names (a malformed adoption report)
            alive = self.members
            leaving = self._leaving
            self._lost = {m: None for m in g.members if m not in alive or m in leaving}
            self._outside = {m: None for m in alive if m not in leaving and m not in g.member_set}
            self._ix_gen = g
        return True

    def remove(self, member: str, reason: str, now: float, incarnation: int | None = None) -> bool:
        m = self.members.get(member)
        if m is None or (incarnation is not None and m.incarnation != incarnation):
            return False
        self._remove(member, reason, now)
        self.evaluate(now)
        return True

    def exited(self, member: str, pid: int, now: float) -> bool:
        """The launcher saw the process exit: drop it at once (if that PID is the member)."""
        g = self.gen
        if member not in self.members and g is not None and member in g.awaiting:
            # Died while the coordinator was down: its adopted generation is broken.
            g.awaiting.discard(member)
            g.broken = True
            self._changed()
            self.removed.append(Removal(member, "exited"))
            self.evaluate(now)
            return True
        m = self.members.get(member)
        if m is None or m.pid != pid:
            return False
        return self.remove(member, "exited", now)

    def leave(self, member: str, incarnation: int, reason: str, now: float) -> bool:
        """A graceful leave ("left": dropped at the next step boundary) or "done"."""
        m = self.members.get(member)
        if m is None or m.incarnation != incarnation:
            return False
        if reason == "done":
            self.finished = True
            self._remove(member, "done", now)
            return True
        self._set_leaving(m)
        g = self.gen
        if g is None or member not in g.member_set or not g.is_ready:
            self._remove(member, "left", now)
            self.evaluate(now)
        return True

    def _remove(self, member: str, reason: str, now: float) -> None:
        del self.members[member]
        del self._seen[member]
        self._leaving.discard(member)
        self._index_gone(member)
        self._changed()
        if not self.members:
            self._registration_sorted = True
            self._last_registered = float("-inf")
        self.removed.append(Removal(member, reason))
        if self.gen is not None and member in self.gen.member_set and reason != "done":
            self.gen.broken = True

    # ---- generations -------------------------------------------------------

    def _alive_ids(self) -> tuple[str, ...]:
        """Registered, not leaving, in registration order."""
        leaving = self._leaving
        if self._registration_sorted:
            if not leaving:
                return tuple(self.members)
            return tuple(m for m in self.members if m not in leaving)
        alive = sorted(
            (m for m in self.members.values() if not m.leaving), key=lambda m: m.registered_at
        )
        return tuple(m.id for m in alive)

    def _view(self, step_boundary: bool) -> MembershipView:
        g = self.gen
        # Members of an adopted generation count as alive until their grace ends.
        awaiting = tuple(sorted(g.awaiting)) if g is not None and not g.broken else ()
        last_seen: Mapping[str, float] = self._seen  # read during the call only
        if awaiting:
            assert g is not None
            last_seen = {**self._seen, **dict.fromkeys(awaiting, g.formed_at)}
        current: tuple[str, ...] | None = g.members if g is not None else None
        if current is None and self.gen_floor:
            # Restarted while nobody ran a generation: re-form as after a failure
            # rather than wait for a fresh start.
            current = ()
        n_alive = len(self.members) - len(self._leaving) + len(awaiting)
        return MembershipView(
            alive=LazySequence(
                n_alive, (lambda: self._alive_ids() + awaiting) if awaiting else self._alive_ids
            ),
            current=current,
            current_broken=g.broken if g is not None else bool(self.gen_floor),
            failure_reported=self.failure_reported,
            last_seen=last_seen,
            first_registration=self.first_registration,
            step_boundary=step_boundary,
            restart_grace_until=self.restart_grace_until if g is None else None,
        )

    verify = False
    """Tests: check every incremental plan against `plan_generation`."""

    def evaluate(self, now: float, step_boundary: bool = False) -> Generation | None:
        """Apply `plan_generation`; returns the newly formed generation, if any.

        With a current generation the plan comes from `plan_incremental` over
        the indexes (the same answer, without a pass over every member)."""
        if self.finished:
            return None
        g = self.gen
        if not step_boundary and g is not None and g.is_ready and not has_complete_group(g):
            # No replica group can compute in it: no step is in flight to protect, so
            # every moment is a step boundary (joiners are admitted, a due reshard
            # forms) while its members wait for the next generation.
            step_boundary = True
        level = 2 if step_boundary else 1
        # A vacancy's reshard is due by the clock: the one decision that is.
        due = step_boundary and self._reshard_at is not None and now >= self._reshard_at
        if self._settled >= level and not due:
            return None
        old = self.gen
        fast = old is not None and self._index(old)
        out: list[str] = []
        admitted = 0
        if fast:
            assert old is not None
            plan, out, admitted = plan_incremental(
                old,
                self._lost,
                self._outside,
                self._seen,
                self.failure_reported,
                step_boundary,
                now,
                self.config,
            )
            if self.verify:
                want = plan_generation(self._view(step_boundary), now, self.config)
                assert plan == want, (plan, want)
                assert isinstance(plan, Form) == isinstance(want, Form)
                if isinstance(plan, Form):
                    assert out == self._left_out(old, plan), (out, self._left_out(old, plan))
        else:
            plan = plan_generation(self._view(step_boundary), now, self.config)
        if plan is None and due and old is not None and old.is_ready and not old.awaiting:
            # (Not while an adopted generation still waits for members to report:
            # the regrouped one would wait for them too.)
            plan = self._decide_reshard(old)
        if isinstance(plan, Wait):
            self.waiting = plan.message
            if old is not None:
                old.broken = True
            self._changed()
            return None
        if plan is None:
            self._settled = max(self._settled, level)
            return None
        self.waiting = None
        self._changed()
        clean = old is not None and step_boundary and not old.broken
        # Members left out of a re-formed generation are expelled: they must
        # register again (and be healed) rather than drift back in.
        if not fast and old is not None:
            out = self._left_out(old, plan)
        for mid in out:
            self._remove(mid, "suspected", now)
        planned = set(plan.members) if not fast and self._leaving else frozenset()
        for mid in sorted(self._leaving, key=lambda x: self.members[x].seq):
            in_gen = old is None or mid in old.member_set
            if in_gen and mid not in planned:  # (a leaving member is never planned)
                self._remove(mid, "left", now)
        if old is not None and clean:
            # Superseded at a step boundary (join/leave): its members learn it
            # from their next quorum call; nobody's collective is aborted.
            self.clean_handoffs.add(old.gen)
        nxt = max(old.gen if old is not None else 0, self.gen_floor) + 1
        self.gen = self._new_generation(nxt, old, plan, now)
        if fast:
            self._outside = dict.fromkeys(islice(self._outside, admitted, None))
        elif old is None and self._registration_sorted:
            n_alive = len(self.members) - len(self._leaving)
            beyond = self._alive_ids()[len(plan.members) :] if n_alive > len(plan.members) else ()
            self._outside = dict.fromkeys(beyond)  # the start admitted the first ones
        self._lost = {}
        self._ix_gen = self.gen if fast or old is None and self._registration_sorted else None
        self.formed.append(self.gen)
        self.failure_reported = False
        self.decision = None
        return self.gen

    def _new_generation(
        self, gen: int, old: Generation | None, plan: Form, now: float
    ) -> Generation:
        """Generation `gen` of `plan.members`: its shard size and slots, what its
        members hold; a size change is recorded for events. O(members)."""
        old_size = old.shard_size if old is not None else None
        if plan.shard_size is not None:
            size = plan.shard_size
        else:
            size = formation_shard_size(old_size, len(plan.members), self.config, self._fits)
        previous = old.slots if old is not None else {}
        if old_size is None or size == old_size and plan.reason != GenerationReason.RESHARD:
            # Survivors keep their slots (their shards live there); joiners fill
            # the vacancies. Unsharded: {} at once, nothing to decide.
            slots = assign_slots(previous, plan.members, size)
        else:
            # A new shape: each member takes the new shard that keeps most of its rows.
            slots = reshard_slots(previous, old_size, plan.members, size)
        holdings = self.holdings
        held = {m: holdings[m] for m in plan.members if m in holdings} if holdings else {}
        g = Generation(gen, plan.members, now, plan.reason, slots=slots, shard_size=size, held=held)
        if old is not None and size != old.shard_size:
            self.layout_changes.append(
                LayoutChange(
                    gen,
                    Layout(old.shard_size, old.slots).describe(),
                    Layout(size, slots).describe(),
                    plan.reason,
                )
            )
        self._track_vacancy(g, now)
        return g

    def _track_vacancy(self, g: Generation, now: float) -> None:
        """Arm the reshard clock for a new current generation `g`: a vacancy that
        began in an earlier generation keeps its start."""
        after = self.config.reshard_after_s
        if after is None or not has_vacancy(g):
            self.vacant_since = None
            self._reshard_at = None
            return
        if self.vacant_since is None:
            self.vacant_since = now
        self._reshard_at = self.vacant_since + after

    def _decide_reshard(self, g: Generation) -> Form | None:
        """The reshard of `g` whose vacancy is due; decided once per generation
        (a refusal is reported once, and decided again only when membership
        changes and a new generation forms)."""
        self._reshard_at = None
        size, why = self._param_bytes()
        plan = decide_reshard(g, self.config, size, why)
        if isinstance(plan, ReshardRefused):
            self.refusals.append(plan)
            return None
        return plan

    def _param_bytes(self) -> tuple[int | None, str]:
        """The job's model size in bytes from its signature (None and why, when
        it cannot be sized); recomputed only when the signature changes."""
        sig = self.signature
        if self._sized is None or self._sized[0] is not sig:
            try:
                self._sized = (sig, state_bytes(sig or []), "")  # type: ignore[arg-type]
            except (ValueError, TypeError) as e:
                self._sized = (sig, None, str(e))
        return self._sized[1], self._sized[2]

    def _fits(self, shard_size: int) -> bool:
        """Does the model split `shard_size` ways fit `memory_per_member`?"""
        if self.config.memory_per_member is None:
            return True
        size, _ = self._param_bytes()
        return size is not None and self.config.fits(size, shard_size)

    def _record_holdings(self, g: Generation) -> None:
        """`g` became ready: its members now hold their slots in it. Sharded
        jobs only (an unsharded member holds the whole model: nothing to say)."""
        if self._recorded is g or self.config.shard_size == 1:
            return
        self._recorded = g
        size, slots, holdings = g.shard_size, g.slots, self.holdings
        for m in g.members:
            s = slots.get(m)
            holdings[m] = Holding(size, s.shard if s is not None else 0)

    def _left_out(self, old: Generation, plan: Form) -> list[str]:
        """Members of `old` that are alive but not in `plan`, in rank order."""
        planned = set(plan.members)
        gone = {
            mid
            for mid in old.member_set.difference(planned)
            if mid in self.members and not self.members[mid].leaving
        }
        return in_rank_order(old.members, gone)

    def rendezvous(
        self,
        member: str,
        incarnation: int,
        known_gen: int,
        committed: int,
        now: float,
        commit_gen: int = 0,
        pending_gen: int = 0,
    ) -> RendezvousStatus:
        """A member asks for a generation newer than `known_gen`.

        Returns "ready" (self.gen is ready and contains it), "pending",
        "expelled" or "finished". Asking while in the current generation means
        that generation failed for the caller: it is re-formed.
        """
        if self.finished:
            return RendezvousStatus.FINISHED
        if not self.knows(member):
            return RendezvousStatus.UNKNOWN
        if not self.touch(member, incarnation, now):
            return RendezvousStatus.EXPELLED
        g = self.gen
        if g is not None and g.gen <= known_gen and member in g.member_set:
            # The caller's generation failed under it.
            if not g.broken:
                self.failure_reported = True
                self._changed()
            self.evaluate(now)
            g = self.gen
        if g is None or member not in g.member_set or g.gen <= known_gen or g.broken:
            return (
                RendezvousStatus.EXPELLED
                if member not in self.members
                else RendezvousStatus.PENDING
            )
        g.set_ready(member, committed, commit_gen, pending_gen)
        if not g.is_ready:
            return RendezvousStatus.PENDING
        self._record_holdings(g)
        return RendezvousStatus.READY

    def quorum(
        self, member: str, incarnation: int, gen: int, step: int, leaving: bool, now: float
    ) -> tuple[Verdict, int]:
        """Per-step verdict for (gen, step): the first request for a step
        decides for everyone asking about that step in that generation."""
        if not self.touch(member, incarnation, now):
            verdict = Verdict.EXPELLED if self.knows(member) else Verdict.UNKNOWN
            return verdict, self.gen.gen if self.gen else 0
        m = self.members[member]
        if leaving and not m.leaving:
            self._set_leaving(m)
        g = self.gen
        if g is None or g.gen != gen or g.broken or not g.is_ready:
            return Verdict.REGROUP, g.gen if g else 0
        if self.decision is not None and self.decision[:2] == (gen, step):
            return self.decision[2], self.decision[3]
        formed = self.evaluate(now, step_boundary=True)
        if formed is not None:
            self.decision = (gen, step, Verdict.REGROUP, formed.gen)
            return Verdict.REGROUP, formed.gen
        if self.gen is not None and self.gen.broken:
            return Verdict.REGROUP, self.gen.gen
        self.decision = (gen, step, Verdict.PROCEED, gen)
        self.progress_step = max(self.progress_step, step)
        return Verdict.PROCEED, gen

    def confirm_hang(
        self, member: str, incarnation: int, gen: int, now: float
    ) -> tuple[HangStatus, tuple[str, ...]]:
        """A member's collective in generation `gen` is overdue (its soft
        watchdog deadline passed): is a peer of that generation hung?

        Hung means silent (no heartbeat or other call) for longer than
        `hang_silence_s`: a stopped or frozen process stops heartbeating, a
        slow one does not. The silent members are expelled ("suspected"), the
        generation breaks and is re-formed without them at once; every member
        still waiting in it learns that from its heartbeat, as from any other
        failure. Nobody silent: ALIVE, nothing changes (the step is slow, not
        hung; the caller keeps waiting up to its hard deadline). `gen` no longer
        the current, unbroken generation: STALE (the caller will learn why)."""
        if not self.touch(member, incarnation, now):
            return HangStatus.STALE, ()
        g = self.gen
        if g is None or g.gen != gen or g.broken or not g.is_ready:
            return HangStatus.STALE, ()
        limit = self.config.hang_silence_s
        silent = tuple(
            mid
            for mid in g.members
            if mid != member and mid in self.members and now - self.members[mid].last_seen > limit
        )
        if not silent:
            return HangStatus.ALIVE, ()
        for mid in silent:
            self._remove(mid, "suspected", now)
        self.evaluate(now)
        return HangStatus.CONFIRMED, silent

    def expire(self, now: float) -> None:
        """Periodic check: leases and generations whose members never came.
        O(expired members): signs of life are kept in the order they came."""
        lease = self.config.lease_s
        self._sort_seen()
        due: list[str] = []
        for mid, seen in self._seen.items():
            if now - seen <= lease:
                break  # everyone after it was seen later
            due.append(mid)
        due.sort(key=lambda mid: self.members[mid].seq)
        for mid in due:
            self._remove(mid, "lease_expired", now)
        g = self.gen
        if g is not None and g.awaiting and now - g.formed_at > lease:
            for mid in sorted(g.awaiting):
                self.removed.append(Removal(mid, "lease_expired"))
            g.awaiting.clear()
            g.broken = True
            self._changed()
        late = g is not None and not g.broken and not g.is_ready
        if g is not None and late and now - g.formed_at > self.config.ready_timeout_s:
            for mid in g.members:
                if mid not in g.ready and mid in self.members:
                    self._remove(mid, "not_ready", now)
        elif g is not None and late:
            # A member the new generation waits for that has gone silent (its
            # whole node died with no agent left to report it) is not waited
            # for until its lease ends: suspicion is enough, as when forming.
            for mid in g.members:
                silent = self.members.get(mid)
                if (
                    mid not in g.ready
                    and silent is not None
                    and now - silent.last_seen > self.config.suspect_s
                ):
                    self._remove(mid, "suspected", now)
        self.evaluate(now)

    def drain_removals(self) -> list[Removal]:
        out, self.removed = self.removed, []
        return out

    def drain_formed(self) -> list[Generation]:
        out, self.formed = self.formed, []
        return out

    def restarted(self, gen_floor: int, now: float) -> None:
        """This coordinator replaces one that ran generations up to `gen_floor`
        (the launcher knows it): new ones are numbered after it, and for one
        lease no generation is formed of fewer than `target` members unless a
        worker reports the one it runs (see `MembershipView.restart_grace_until`)."""
        self.gen_floor = max(self.gen_floor, gen_floor)
        if gen_floor > 0:
            self.restart_grace_until = now + self.config.lease_s

    def drain_adopted(self) -> list[Generation]:
        out, self.adopted = self.adopted, []
        return out

    def drain_refusals(self) -> list[ReshardRefused]:
        out, self.refusals = self.refusals, []
        return out

    def drain_layout_changes(self) -> list[LayoutChange]:
        out, self.layout_changes = self.layout_changes, []
        return out
