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
from elastrain.control.layout import Slot, assign_slots
from elastrain.control.plan import (
    Form,
    Generation,
    LazySequence,
    Member,
    MembershipView,
    Plan,
    Wait,
    in_rank_order,
    plan_generation,
    plan_incremental,
)
from elastrain.control.protocol import GenerationReason, RendezvousStatus, Verdict

__all__ = [
    "Form",
    "Generation",
    "Member",
    "Membership",
    "MembershipView",
    "Plan",
    "Removal",
    "Wait",
    "plan_generation",
]


@dataclass(frozen=True)
class Removal:
    member: str
    reason: str


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
    ) -> int:
        """Add (or re-add, after expulsion or a coordinator restart) a member;
        returns its incarnation. `gen`/`gen_members`/`committed`/`gen_slots`
        are what the worker runs (see the module docstring on restarts)."""
        inc = max(self.incarnations.get(member, 0), prev_incarnation) + 1
        self.incarnations[member] = inc
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
                self._adopt(gen, tuple(gen_members), committed, now, gen_slots or {})
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
    ) -> None:
        g = Generation(
            gen,
            members,
            now,
            GenerationReason.ADOPTED,
            ready=dict.fromkeys(members, committed),
            # The reported slots where valid, the rest in rank order (module docstring).
            slots=assign_slots(slots, members, self.config.shard_size),
        )
        g.awaiting = {m for m in members if m not in self.members}
        self.gen = g
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
        level = 2 if step_boundary else 1
        if self._settled >= level:
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
        # Survivors keep their slots (their shards live there); joiners fill
        # the vacancies. Unsharded: {} at once, nothing to decide.
        slots = assign_slots(
            old.slots if old is not None else {}, plan.members, self.config.shard_size
        )
        self.gen = Generation(nxt, plan.members, now, plan.reason, slots=slots)
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
        g.set_ready(member, committed, commit_gen)
        return RendezvousStatus.READY if g.is_ready else RendezvousStatus.PENDING

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
