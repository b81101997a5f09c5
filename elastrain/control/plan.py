"""Deciding generations: the pure `plan_generation` and its incremental twin.

`plan_generation(view, now, config)` is the specification: which members form
the next generation, and when, from a snapshot of the membership. It is
O(members) per call. `plan_incremental` returns the same plan from the
indexes `Membership` keeps up to date (members of the current generation that
are gone, alive members outside it, signs of life in time order), touching
only the members that changed, so deciding a generation of 100k members after
a failure costs a copy of the member list, not a pass over every member's
state. tests/test_quorum_scale.py checks that both agree on random histories.

Sharded jobs decide each generation's shard size too (`formation_shard_size`,
and `decide_reshard` at a step boundary where a vacancy lasted; see
`CoordinatorConfig.reshard_after_s`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from typing import overload

from elastrain.control.config import CoordinatorConfig
from elastrain.control.layout import Holding, Slot, choose_shard_size
from elastrain.control.protocol import GenerationReason


@dataclass(slots=True)
class Member:
    id: str
    incarnation: int
    pid: int
    host: str
    registered_at: float
    last_seen: float
    leaving: bool = False
    seq: int = field(default=0, repr=False, compare=False)
    """Registration order (removals are reported in this order)."""


@dataclass
class Generation:
    gen: int
    members: tuple[str, ...]
    formed_at: float
    reason: GenerationReason
    ready: dict[str, int] = field(default_factory=dict)
    """member -> committed step count reported at rendezvous."""
    commit_gens: dict[str, int] = field(default_factory=dict)
    """member -> the generation its state's last commit came from (rendezvous)."""
    broken: bool = False
    awaiting: set[str] = field(default_factory=set)
    """Adopted generations only: members that have not registered again yet."""
    slots: dict[str, Slot] = field(default_factory=dict)
    """member -> its (replica group, shard) slot when the job is sharded (see
    `elastrain.control.layout`; {} when unsharded). Decided when the generation
    is formed, from the previous generation's: survivors keep theirs (or, when
    the shard size changes, take the new shard that keeps most of their rows)."""
    shard_size: int = 1
    """Members per replica group in this generation: the job's configured one,
    or another after a reshard (`decide_reshard`). 1: unsharded."""
    held: dict[str, Holding] = field(default_factory=dict)
    """member -> what its state held when this generation formed: its slot in
    the last generation it was part of that became ready (absent: nothing, a
    fresh joiner). The ready answer's `held`."""
    ready_version: int = field(default=0, init=False, repr=False, compare=False)
    """Bumped whenever `ready` changes (the server caches the ready answer)."""
    announced: bool = field(default=False, init=False, repr=False, compare=False)
    """The server emitted its `generation_ready` event (once per generation)."""
    _first_missing: int = field(default=0, init=False, repr=False, compare=False)

    pending_gens: dict[str, int] = field(default_factory=dict)
    """member -> the generation of the reduced step it kept without learning the
    vote (`RendezvousRequest.pending_gen`); only members that reported one."""

    def set_ready(
        self, member: str, committed: int, commit_gen: int = 0, pending_gen: int = 0
    ) -> None:
        if (
            self.ready.get(member) != committed
            or self.commit_gens.get(member) != commit_gen
            or self.pending_gens.get(member, 0) != pending_gen
        ):
            self.ready[member] = committed
            self.commit_gens[member] = commit_gen
            if pending_gen:
                self.pending_gens[member] = pending_gen
            else:
                self.pending_gens.pop(member, None)
            self.ready_version += 1

    @property
    def rolls_forward(self) -> tuple[str, ...]:
        """The members that apply their kept step (`roll_forwards`), in member order."""
        return roll_forwards(self.members, self.ready, self.commit_gens, self.pending_gens)

    def answer_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """The ready answer's (committed, commit_gens): as reported, except that a
        member rolling forward counts one step further, committed in the
        generation it kept that step from."""
        committed, gens = dict(self.ready), dict(self.commit_gens)
        for m in self.rolls_forward:
            committed[m] += 1
            gens[m] = self.pending_gens[m]
        return committed, gens

    @cached_property
    def has_complete_group(self) -> bool:
        """Some replica group has all its slots filled (always, unsharded): some
        group can compute a step in this generation. Slots are fixed at formation."""
        if self.shard_size == 1:
            return True
        filled = Counter(s.replica for s in self.slots.values())
        return any(n == self.shard_size for n in filled.values())

    @cached_property
    def member_set(self) -> frozenset[str]:
        """`members` as a set, for O(1) membership tests."""
        return frozenset(self.members)

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.members)

    def missing(self, limit: int = 5) -> tuple[list[str], int]:
        """Up to `limit` members (in rank order) that have not called rendezvous
        yet, and how many have not. Amortised O(1): `ready` only grows, so the
        scan resumes where every earlier member had arrived."""
        count = len(self.members) - len(self.ready)
        names: list[str] = []
        if count <= 0:
            return names, 0
        members, ready = self.members, self.ready
        i = self._first_missing
        while i < len(members) and members[i] in ready:
            i += 1
        self._first_missing = i
        for j in range(i, min(len(members), i + 1000)):
            if members[j] not in ready:
                names.append(members[j])
                if len(names) == limit:
                    break
        return names, count

    @property
    def start_step(self) -> int:
        return max(self.ready.values()) if self.ready else 0


def roll_forwards(
    members: Sequence[str],
    committed: Mapping[str, int],
    commit_gens: Mapping[str, int],
    pending_gens: Mapping[str, int],
) -> tuple[str, ...]:
    """Which members apply the step they kept (sharded jobs), in `members` order.

    A sharded step's commit vote is a world all-reduce that every member posts
    only after its shard's twins reduced the gradient. A member that committed
    step n in generation g therefore proves that every member of g holds its
    shard's reduced gradient of step n. A member at n whose own wait for that
    vote failed (`pending_gens` -> g) applies it when a member at n + 1 with
    `commit_gens` g is in the new generation, instead of waiting for a holder
    of its shard at n + 1 that may not exist (the twins of one shard may all
    have lost the vote's answer while another shard's twins committed). With no
    such member, nobody alive holds step n: it is run again from n."""
    done = {(committed[m], commit_gens.get(m, 0)) for m in members if m in committed}
    return tuple(
        m
        for m in members
        if pending_gens.get(m, 0) and m in committed
        and (committed[m] + 1, pending_gens[m]) in done
    )  # fmt: skip


@dataclass(frozen=True)
class MembershipView:
    """What `plan_generation` looks at: a read-only snapshot."""

    alive: Sequence[str]
    """Registered, not leaving, ordered by registration time."""
    current: tuple[str, ...] | None
    """Members of the current generation, or None before the first."""
    current_broken: bool
    failure_reported: bool
    """A member reported a failure in the current generation."""
    last_seen: Mapping[str, float]
    first_registration: float | None
    step_boundary: bool
    """True when asked from a quorum request, i.e. at a step boundary."""
    restart_grace_until: float | None = None
    """A restarted coordinator with no generation yet: until this time, only
    `target` registered members form one. Workers still running the previous
    generation report it when they register again (and it is adopted); fresh
    replacements that register first must not form a generation of their own,
    which would start a second lineage from an older checkpoint."""


@dataclass(frozen=True)
class Form:
    members: tuple[str, ...]
    reason: GenerationReason
    shard_size: int | None = None
    """A reshard's new shard size; None: decided by `formation_shard_size`."""


@dataclass(frozen=True)
class Wait:
    message: str


Plan = Form | Wait | None


class LazySequence(Sequence[str]):
    """A sequence of known length built on first use: most decisions need only
    how many members are alive, not who (registering 100k members one by one
    must not copy the list 100k times)."""

    __slots__ = ("_n", "_build", "_items")

    def __init__(self, n: int, build: Callable[[], tuple[str, ...]]) -> None:
        self._n = n
        self._build = build
        self._items: tuple[str, ...] | None = None

    def _get(self) -> tuple[str, ...]:
        if self._items is None:
            self._items = self._build()
            assert len(self._items) == self._n, (len(self._items), self._n)
        return self._items

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self._get()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __contains__(self, x: object) -> bool:
        return x in self._get()


def plan_generation(view: MembershipView, now: float, config: CoordinatorConfig) -> Plan:
    """Decide whether to form a new generation now, and with whom.

    - No generation yet: start once `target` members registered, or once
      `min_members` have and `start_grace_s` has passed since the first one.
    - Current generation broken (a member died/left/was expelled) or a failure
      was reported in it: re-form at once from its surviving members (leaving
      out those silent for `suspect_s`; a hung member must not stall the next
      generation) plus waiting joiners, up to `max_members`.
    - A restarted coordinator with no generation yet (none adopted): wait
      until `restart_grace_until` unless `target` members registered.
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
            return Form(tuple(view.alive[:cap]), GenerationReason.START)
        return Wait(
            f"waiting for workers to register: {n}/{config.target} "
            f"(will start with >= {config.min_members} after {config.start_grace_s:g}s)"
        )

    if (
        not view.current
        and view.restart_grace_until is not None
        and now < view.restart_grace_until
        and len(view.alive) < config.target
    ):
        return Wait(
            f"coordinator restarted: waiting {view.restart_grace_until - now:.1f}s more for "
            f"workers still training to report their generation ({len(view.alive)}/"
            f"{config.target} registered)"
        )
    failed = view.current_broken or view.failure_reported
    if not failed and not view.step_boundary:
        return None
    alive = set(view.alive)
    current = set(view.current)
    survivors = [m for m in view.current if m in alive]
    joiners = [m for m in view.alive if m not in current]
    if failed:
        seen, suspect = view.last_seen, config.suspect_s
        fresh = [m for m in survivors if now - seen.get(m, now) <= suspect]
        # If everybody looks silent (e.g. the coordinator itself was paused), keep them.
        if not fresh and survivors:
            fresh = survivors
        candidates = (fresh + joiners)[:cap]
        if len(candidates) < config.min_members:
            return Wait(below_min_message(len(candidates), "alive", config))
        return Form(tuple(candidates), GenerationReason.FAILURE)
    leaving = len(survivors) < len(view.current)
    room = max(0, cap - len(survivors))
    admitted = joiners[:room]
    if not leaving and not admitted:
        return None
    candidates = survivors + admitted
    if len(candidates) < config.min_members:
        return Wait(below_min_message(len(candidates), "after leave", config))
    return Form(tuple(candidates), GenerationReason.LEAVE if leaving else GenerationReason.JOIN)


def below_min_message(n: int, what: str, config: CoordinatorConfig) -> str:
    return (
        f"below --min: {n} member(s) {what}, need {config.min_members}; "
        "waiting for a replacement to register"
    )


def _without(members: tuple[str, ...], drop: Mapping[str, object] | set[str]) -> list[str]:
    """`members` in order, less `drop` (a subset of them). A few drops cost a
    copy and a C-level search each; many cost one pass."""
    if not drop:
        return list(members)
    if len(drop) <= 8:
        out = list(members)
        for i in sorted((members.index(m) for m in drop), reverse=True):
            del out[i]
        return out
    return [m for m in members if m not in drop]


def in_rank_order(members: tuple[str, ...], subset: set[str]) -> list[str]:
    """The members of `subset` (all in `members`) in `members` order."""
    if len(subset) <= 8:
        return sorted(subset, key=members.index)
    return [m for m in members if m in subset]


def plan_incremental(
    g: Generation,
    lost: Mapping[str, object],
    outside: Mapping[str, object],
    seen: Mapping[str, float],
    failure_reported: bool,
    step_boundary: bool,
    now: float,
    config: CoordinatorConfig,
) -> tuple[Plan, list[str], int]:
    """`plan_generation` for a current generation `g` without adopted members
    still awaited, from indexes instead of a snapshot; also returns the members
    of `g` that are alive but left out of the plan, in rank order (the caller
    expels them), and how many of `outside` (its first ones) the plan admits.
    Same answer as `plan_generation` on the equivalent view.

    lost     members of `g` that are not alive (removed, or leaving)
    outside  alive members not in `g`, in registration order (the joiners)
    seen     every alive member's last sign of life, oldest first
    """
    failed = g.broken or failure_reported
    if not failed and not step_boundary:
        return None, [], 0
    cap = config.max_members
    n_surv = len(g.members) - len(lost)
    if failed:
        silent: list[str] = []
        if n_surv:
            in_gen = g.member_set
            for mid, t in seen.items():
                if now - t <= config.suspect_s:
                    break  # everyone after it was seen later
                if mid in in_gen and mid not in lost:
                    silent.append(mid)
        # If everybody looks silent (e.g. the coordinator itself was paused), keep them.
        if len(silent) == n_surv:
            silent = []
        n_fresh = n_surv - len(silent)
        n_cand = min(cap, n_fresh + len(outside))
        if n_cand < config.min_members:
            return Wait(below_min_message(n_cand, "alive", config)), [], 0
        drop = {**lost, **dict.fromkeys(silent)} if silent else lost
        cand = _without(g.members, drop)  # the fresh survivors
        out = in_rank_order(g.members, set(silent)) if silent else []
        if len(cand) > cap:  # only an adopted generation can be larger than the cap
            out = in_rank_order(g.members, set(out) | set(cand[cap:]))
            del cand[cap:]
        admitted = cap - len(cand)
        cand.extend(islice(outside, admitted))
        return Form(tuple(cand), GenerationReason.FAILURE), out, min(admitted, len(outside))
    room = max(0, cap - n_surv)
    n_admitted = min(room, len(outside))
    if not lost and not n_admitted:
        return None, [], 0
    if n_surv + n_admitted < config.min_members:
        return Wait(below_min_message(n_surv + n_admitted, "after leave", config)), [], 0
    cand = _without(g.members, lost)
    cand.extend(islice(outside, n_admitted))
    return (
        Form(tuple(cand), GenerationReason.LEAVE if lost else GenerationReason.JOIN),
        [],
        n_admitted,
    )


# ---- shard sizes ----------------------------------------------------------------


def formation_shard_size(
    old_size: int | None, members: int, config: CoordinatorConfig, fits: Callable[[int], bool]
) -> int:
    """The shard size of a generation formed for a failure, a join or a leave
    (a reshard's is `decide_reshard`'s): the previous generation's, so that
    survivors keep their slots; but back at the configured one (`shard_size`)
    when the job had resharded away from it and it now divides the member
    count and `fits` (members returned, or one more left). With no previous
    generation: the configured one."""
    preferred = config.shard_size
    if old_size is None:
        return preferred
    if (
        config.reshard_after_s is not None
        and old_size != preferred
        and members % preferred == 0
        and fits(preferred)
    ):
        return preferred
    return old_size


@dataclass(frozen=True)
class ReshardRefused:
    """No shard size that makes whole replica groups of `alive` members fits a
    member's memory: the job keeps its layout (`reshard_refused` event)."""

    alive: int
    preferred: int
    shard_size: int
    """The current generation's shard size (kept)."""
    needed: int | None
    """Bytes of training state per member in the thinnest layout (1 x alive);
    None when the model could not be sized."""
    budget: int | None
    message: str


def has_vacancy(g: Generation) -> bool:
    """Does sharded generation `g` have an incomplete replica group? O(members)."""
    size = g.shard_size
    if size == 1:
        return False
    if len(g.members) % size:
        return True
    filled = Counter(s.replica for s in g.slots.values())
    return any(n < size for n in filled.values())


def has_complete_group(g: Generation) -> bool:
    """Can some replica group of sharded generation `g` compute (all S slots filled)?
    Always True unsharded. O(members) once per generation (its slots are fixed)."""
    return g.has_complete_group


def decide_reshard(
    g: Generation, config: CoordinatorConfig, param_bytes: int | None, why_unsized: str = ""
) -> Form | ReshardRefused | None:
    """At a step boundary of generation `g`, once a vacancy lasted
    `reshard_after_s`: regroup its members into whole replica groups of
    `choose_shard_size` (a Form of the same members, reason "reshard"), or
    ReshardRefused when no size fits; None when `g` has no vacancy.

    The size may be `g`'s own: members left in several groups (2x2 that lost
    one member of each group) regroup into fewer, complete ones, which moves
    few bytes or none (each survivor may already hold a different shard).

    param_bytes   the model's bytes (`layout.state_bytes` of the signature);
                  None when it could not be sized (`why_unsized` says why), in
                  which case only a job without `memory_per_member` reshards
    """
    if not has_vacancy(g):
        return None
    alive = len(g.members)
    budget = config.memory_per_member

    def fits(size: int) -> bool:
        if budget is None:
            return True
        return param_bytes is not None and config.fits(param_bytes, size)

    size = choose_shard_size(alive, config.shard_size, fits)
    if size is not None:
        return Form(g.members, GenerationReason.RESHARD, size)
    needed = config.member_bytes(param_bytes, alive) if param_bytes is not None else None
    if needed is None:
        why = f"the model's size is unknown ({why_unsized})"
    else:
        why = (
            f"even split {alive} ways (1x{alive}) a member would hold {needed:,} bytes of "
            f"training state (state factor {config.state_factor:g}), over the "
            f"{budget:,} bytes of --memory-per-member"
        )
    return ReshardRefused(
        alive,
        config.shard_size,
        g.shard_size,
        needed,
        budget,
        f"cannot regroup the {alive} members into whole replica groups: {why}; keeping "
        f"shard size {g.shard_size} and waiting for a replacement",
    )
