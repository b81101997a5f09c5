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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastrain.control.config import CoordinatorConfig


@dataclass
class Member:
    id: str
    incarnation: int
    pid: int
    host: str
    registered_at: float
    last_seen: float
    leaving: bool = False


@dataclass
class Generation:
    gen: int
    members: tuple[str, ...]
    formed_at: float
    reason: str
    ready: dict[str, int] = field(default_factory=dict)
    """member -> committed step count reported at rendezvous."""
    commit_gens: dict[str, int] = field(default_factory=dict)
    """member -> the generation its state's last commit came from (rendezvous)."""
    broken: bool = False
    awaiting: set[str] = field(default_factory=set)
    """Adopted generations only: members that have not registered again yet."""

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.members)

    @property
    def start_step(self) -> int:
        return max(self.ready.values()) if self.ready else 0


@dataclass(frozen=True)
class MembershipView:
    """What `plan_generation` looks at: a read-only snapshot."""

    alive: tuple[str, ...]
    """Registered, not leaving, ordered by registration time."""
    current: tuple[str, ...] | None
    """Members of the current generation, or None before the first."""
    current_broken: bool
    failure_reported: bool
    """A member reported a failure in the current generation."""
    last_seen: dict[str, float]
    first_registration: float | None
    step_boundary: bool
    """True when asked from a quorum request, i.e. at a step boundary."""


@dataclass(frozen=True)
class Form:
    members: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Wait:
    message: str


Plan = Form | Wait | None


def plan_generation(view: MembershipView, now: float, config: CoordinatorConfig) -> Plan:
    """Decide whether to form a new generation now, and with whom.

    - No generation yet: start once `target` members registered, or once
      `min_members` have and `start_grace_s` has passed since the first one.
    - Current generation broken (a member died/left/was expelled) or a failure
      was reported in it: re-form at once from its surviving members (leaving
      out those silent for `suspect_s`; a hung member must not stall the next
      generation) plus waiting joiners, up to `max_members`.
    - Otherwise, only at a step boundary: admit waiting joiners (up to
      `max_members`) or drop members that announced a leave.
    Fewer than `min_members` candidates: Wait with a message saying why.
    """
    cap = config.max_members
    if view.current is None:
        n = len(view.alive)
        started = view.first_registration
        if n >= config.target or (
            n >= config.min_members
            and started is not None
            and now - started >= config.start_grace_s
        ):
            return Form(view.alive[:cap], "start")
        return Wait(
            f"waiting for workers to register: {n}/{config.target} "
            f"(will start with >= {config.min_members} after {config.start_grace_s:g}s)"
        )

    alive = set(view.alive)
    survivors = [m for m in view.current if m in alive]
    joiners = [m for m in view.alive if m not in set(view.current)]
    if view.current_broken or view.failure_reported:
        fresh = [m for m in survivors if now - view.last_seen.get(m, now) <= config.suspect_s]
        # If everybody looks silent (e.g. the coordinator itself was paused), keep them.
        if not fresh and survivors:
            fresh = survivors
        candidates = (fresh + joiners)[:cap]
        if len(candidates) < config.min_members:
            return Wait(
                f"below --min: {len(candidates)} member(s) alive, need {config.min_members}; "
                "waiting for a replacement to register"
            )
        return Form(tuple(candidates), "failure")
    if not view.step_boundary:
        return None
    leaving = len(survivors) < len(view.current)
    room = max(0, cap - len(survivors))
    admitted = joiners[:room]
    if not leaving and not admitted:
        return None
    candidates = survivors + admitted
    if len(candidates) < config.min_members:
        return Wait(
            f"below --min: {len(candidates)} member(s) after leave, need {config.min_members}; "
            "waiting for a replacement to register"
        )
    return Form(tuple(candidates), "leave" if leaving else "join")


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
        self.incarnations: dict[str, int] = {}
        self.gen: Generation | None = None
        self.signature: list[object] | None = None
        self.first_registration: float | None = None
        self.failure_reported = False
        self.decision: tuple[int, int, str, int] | None = None
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
        self.adopted: list[Generation] = []
        """Generations adopted since the last `drain_adopted()` (for events)."""

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
    ) -> int:
        """Add (or re-add, after expulsion or a coordinator restart) a member;
        returns its incarnation. `gen`/`gen_members`/`committed` are what the
        worker runs (see the module docstring on restarts)."""
        inc = max(self.incarnations.get(member, 0), prev_incarnation) + 1
        self.incarnations[member] = inc
        if member in self.members:
            self._remove(member, "reregistered", now)
        self.members[member] = Member(member, inc, pid, host, now, now)
        if self.first_registration is None:
            self.first_registration = now
        self.gen_floor = max(self.gen_floor, gen)
        g = self.gen
        if gen and member in gen_members:
            if g is None or (g.reason == "adopted" and g.gen < gen):
                self._adopt(gen, tuple(gen_members), committed, now)
            elif g.gen == gen and member in g.awaiting:
                g.awaiting.discard(member)
                g.ready[member] = committed
        self.evaluate(now)
        return inc

    def _adopt(self, gen: int, members: tuple[str, ...], committed: int, now: float) -> None:
        g = Generation(gen, members, now, "adopted", ready=dict.fromkeys(members, committed))
        g.awaiting = {m for m in members if m not in self.members}
        self.gen = g
        self.adopted.append(g)
        self.failure_reported = False
        self.decision = None
        self.progress_step = max(self.progress_step, committed)

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
        m.leaving = True
        if self.gen is None or member not in self.gen.members or not self.gen.is_ready:
            self._remove(member, "left", now)
            self.evaluate(now)
        return True

    def _remove(self, member: str, reason: str, now: float) -> None:
        del self.members[member]
        self.removed.append(Removal(member, reason))
        if self.gen is not None and member in self.gen.members and reason != "done":
            self.gen.broken = True

    # ---- generations -------------------------------------------------------

    def _view(self, step_boundary: bool) -> MembershipView:
        alive = sorted(
            (m for m in self.members.values() if not m.leaving), key=lambda m: m.registered_at
        )
        g = self.gen
        # Members of an adopted generation count as alive until their grace ends.
        awaiting = sorted(g.awaiting) if g is not None and not g.broken else []
        last_seen = {m.id: m.last_seen for m in self.members.values()}
        last_seen.update(dict.fromkeys(awaiting, g.formed_at if g is not None else 0.0))
        current: tuple[str, ...] | None = g.members if g is not None else None
        if current is None and self.gen_floor:
            # Restarted while nobody ran a generation: re-form as after a failure
            # rather than wait for a fresh start.
            current = ()
        return MembershipView(
            alive=tuple(m.id for m in alive) + tuple(awaiting),
            current=current,
            current_broken=g.broken if g is not None else bool(self.gen_floor),
            failure_reported=self.failure_reported,
            last_seen=last_seen,
            first_registration=self.first_registration,
            step_boundary=step_boundary,
        )

    def evaluate(self, now: float, step_boundary: bool = False) -> Generation | None:
        """Apply `plan_generation`; returns the newly formed generation, if any."""
        if self.finished:
            return None
        plan = plan_generation(self._view(step_boundary), now, self.config)
        if isinstance(plan, Wait):
            self.waiting = plan.message
            if self.gen is not None:
                self.gen.broken = True
            return None
        if plan is None:
            return None
        self.waiting = None
        clean = self.gen is not None and step_boundary and not self.gen.broken
        # Members left out of a re-formed generation are expelled: they must
        # register again (and be healed) rather than drift back in.
        if self.gen is not None:
            for mid in self.gen.members:
                if (
                    mid in self.members
                    and mid not in plan.members
                    and not self.members[mid].leaving
                ):
                    self._remove(mid, "suspected", now)
        for mid in list(self.members):
            m = self.members[mid]
            in_gen = self.gen is None or mid in self.gen.members
            if m.leaving and in_gen and mid not in plan.members:
                self._remove(mid, "left", now)
        if self.gen is not None and clean:
            # Superseded at a step boundary (join/leave): its members learn it
            # from their next quorum call; nobody's collective is aborted.
            self.clean_handoffs.add(self.gen.gen)
        nxt = max(self.gen.gen if self.gen is not None else 0, self.gen_floor) + 1
        self.gen = Generation(nxt, plan.members, now, plan.reason)
        self.formed.append(self.gen)
        self.failure_reported = False
        self.decision = None
        return self.gen

    def rendezvous(
        self,
        member: str,
        incarnation: int,
        known_gen: int,
        committed: int,
        now: float,
        commit_gen: int = 0,
    ) -> str:
        """A member asks for a generation newer than `known_gen`.

        Returns "ready" (self.gen is ready and contains it), "pending",
        "expelled" or "finished". Asking while in the current generation means
        that generation failed for the caller: it is re-formed.
        """
        if self.finished:
            return "finished"
        if not self.knows(member):
            return "unknown"
        if not self.touch(member, incarnation, now):
            return "expelled"
        g = self.gen
        if g is not None and g.gen <= known_gen and member in g.members:
            # The caller's generation failed under it.
            if not g.broken:
                self.failure_reported = True
            self.evaluate(now)
            g = self.gen
        if g is None or member not in g.members or g.gen <= known_gen or g.broken:
            return "expelled" if member not in self.members else "pending"
        g.ready[member] = committed
        g.commit_gens[member] = commit_gen
        return "ready" if g.is_ready else "pending"

    def quorum(
        self, member: str, incarnation: int, gen: int, step: int, leaving: bool, now: float
    ) -> tuple[str, int]:
        """Per-step verdict for (gen, step): the first request for a step
        decides for everyone asking about that step in that generation."""
        if not self.touch(member, incarnation, now):
            verdict = "expelled" if self.knows(member) else "unknown"
            return verdict, self.gen.gen if self.gen else 0
        if leaving and not self.members[member].leaving:
            self.members[member].leaving = True
        g = self.gen
        if g is None or g.gen != gen or g.broken or not g.is_ready:
            return "regroup", g.gen if g else 0
        if self.decision is not None and self.decision[:2] == (gen, step):
            return self.decision[2], self.decision[3]
        formed = self.evaluate(now, step_boundary=True)
        if formed is not None:
            self.decision = (gen, step, "regroup", formed.gen)
            return "regroup", formed.gen
        if self.gen is not None and self.gen.broken:
            return "regroup", self.gen.gen
        self.decision = (gen, step, "proceed", gen)
        self.progress_step = max(self.progress_step, step)
        return "proceed", gen

    def expire(self, now: float) -> None:
        """Periodic check: leases and generations whose members never came."""
        for m in list(self.members.values()):
            if now - m.last_seen > self.config.lease_s:
                self._remove(m.id, "lease_expired", now)
        g = self.gen
        if g is not None and g.awaiting and now - g.formed_at > self.config.lease_s:
            for mid in sorted(g.awaiting):
                self.removed.append(Removal(mid, "lease_expired"))
            g.awaiting.clear()
            g.broken = True
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

    def drain_adopted(self) -> list[Generation]:
        out, self.adopted = self.adopted, []
        return out
