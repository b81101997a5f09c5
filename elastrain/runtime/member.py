"""The member protocol as a pure state machine: observations in, actions out.

`MemberProtocol` decides what a worker does next; it performs no I/O, reads
no clock and starts no thread. The engine (`elastrain.runtime.engine`) is the
thin loop around it: it performs the `Action`, turns what happened into an
observation and feeds it back with `advance`. Everything a member decides on
its own about the step protocol lives here, so it can be tested in-process
against scripted observations (tests/test_protocol.py).

    REGISTER ─▶ JOIN ─▶ CONNECT ─▶ HEAL ─▶ COMPUTE ─▶ VERDICT ─▶ REDUCE ─▶ APPLY ─┐
                 ▲        │          │        │          │          │        │    │
                 │        ▼          ▼        ▼          ▼          ▼        │    │
                 └──── (rendezvous again) ◀── ABANDON ◀──┴──────────┘        │    │
                                                                  COMPUTE ◀─┘    │
                          EXIT (left / preempted / refused / no coordinator) ◀───┘
                          FINISH (total steps committed, or the job finished)

    After APPLY or HEAL, when an evaluation is due at the committed count:
    EVALUATE ─▶ COMPUTE (or FINISH); a failed one ─▶ ABANDON, and the next
    generation's HEAL leads to EVALUATE again.

The rules (docs/design/step-protocol.md argues each):
- A leave requested (SIGTERM) takes effect at a step boundary: before
  rendezvous, or when the verdict is not "proceed" or cannot be had.
- An expelled member registers again before it asks for a generation.
- A verdict that cannot be fetched counts as "proceed": the all-reduce is the
  real agreement and the sample count guards exactly-once.
- A restarted coordinator ("unknown") is registered with again and asked
  again under the new incarnation; an answer about a stale incarnation is
  asked again too.
- A step is applied only when the all-reduced sample count is the global
  batch; anything else abandons the generation and retries the same step.
- A preemption notice rides on a "proceed" verdict: after committing that
  step, one emergency checkpoint, then exit.
- Sharded: a member that reduced its shard but lost the commit vote's answer
  (`ReduceAborted.kept`) reports that generation at rendezvous; it applies the
  step when the next ready answer names it in `rolls_forward` (someone
  committed the step there) and counts it at once, else runs it again.
- An evaluation due at a committed count (`eval_every`, `evaluate.eval_due`)
  runs after the commit that reaches it (and after the loop's code for that
  step: the engine yields the step's result first) and again after any heal
  that starts a generation at it (a member that already has the result hands
  it over, so it is not computed twice); a failed evaluation abandons the
  generation like a failed step, and is redone even after the last step. A
  preempted member does not evaluate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from elastrain.control.protocol import RendezvousStatus, Verdict
from elastrain.exitcodes import (
    EXIT_LEFT,
    EXIT_NO_COORDINATOR,
    EXIT_PREEMPTED,
    EXIT_REFUSED,
    ExitReason,
)
from elastrain.runtime.evaluate import eval_due


class Phase(StrEnum):
    """Where a member is in the protocol (what it is waiting to observe)."""

    REGISTER = "register"
    REJOIN = "rejoin"
    JOIN = "join"
    CONNECT = "connect"
    HEAL = "heal"
    COMPUTE = "compute"
    VERDICT = "verdict"
    REREGISTER = "reregister"
    REASK = "reask"
    REDUCE = "reduce"
    APPLY = "apply"
    EVALUATE = "evaluate"
    EMERGENCY = "emergency"
    ABANDON = "abandon"
    DONE = "done"


class Do(StrEnum):
    """What the engine performs next."""

    REGISTER = "register"
    """Register with the coordinator (first time; retries until its timeout)."""
    REGISTER_AGAIN = "register_again"
    """Register again unless someone did since `Action.incarnation` (None: the current one)."""
    RENDEZVOUS = "rendezvous"
    """Ask the coordinator for a generation (a long poll)."""
    BACK_OFF = "back_off"
    """The coordinator could not be asked: wait a heartbeat, then observe `Waited`."""
    CONNECT = "connect"
    """Build the generation's process group (`Action.gen`, `.members`, `.rank`)."""
    HEAL = "heal"
    """Take part in the heal (`Action.senders`, `.receivers`, `.lineage`)."""
    COMPUTE = "compute"
    """Ask the verdict for `Action.step` in the background and compute this member's share."""
    VERDICT = "verdict"
    """Wait for the verdict asked at COMPUTE."""
    ASK_AGAIN = "ask_again"
    """Ask the verdict for `Action.step` again, under the current incarnation."""
    REDUCE = "reduce"
    """All-reduce the contribution and wait for it (watchdog, supersession)."""
    APPLY = "apply"
    """Apply the reduced step: commit it."""
    EVALUATE = "evaluate"
    """Evaluate the model after `Action.step` committed steps with the generation
    (`Action.gen`, `.members`, `.rank`): every member at the same count."""
    EMERGENCY_CHECKPOINT = "emergency_checkpoint"
    """Write an emergency checkpoint of the committed state within `Action.grace_s`."""
    ABANDON = "abandon"
    """Drop the generation (`Action.phase`, `Action.error` say why), then observe `Abandoned`."""
    FINISH = "finish"
    """Tell the coordinator this member is done; `steps()` returns."""
    EXIT = "exit"
    """End this worker with `Action.code` (`Action.reason`)."""


EXIT_CODES = {
    ExitReason.LEFT: EXIT_LEFT,
    ExitReason.PREEMPTED: EXIT_PREEMPTED,
    ExitReason.REFUSED: EXIT_REFUSED,
    ExitReason.NO_COORDINATOR: EXIT_NO_COORDINATOR,
}


class AbortPhase(StrEnum):
    """Where a generation was abandoned; the `phase` of a `step_abort` event."""

    REGROUP = "regroup"
    HEAL = "heal"
    SUPERSEDED = "superseded"
    QUORUM = "quorum"
    WATCHDOG = "watchdog"
    ALLREDUCE = "allreduce"
    COMPUTE = "compute"
    EVAL = "eval"
    """The evaluation's collective failed, or its batches were not each computed once."""


@dataclass(frozen=True)
class Action:
    do: Do
    step: int = 0
    gen: int = 0
    members: tuple[str, ...] = ()
    rank: int = 0
    senders: tuple[int, ...] = ()
    """With HEAL, and with CONNECT as a preview (`Topology.prepare_heal`): the ranks
    that send in the generation's heal."""
    receivers: tuple[int, ...] = ()
    lineage: int = 0
    incarnation: int | None = None
    phase: AbortPhase | None = None
    error: str = ""
    code: int = 0
    reason: ExitReason | None = None
    grace_s: float = 0.0
    message: str = ""
    roll_forward: bool = False
    """With HEAL: first apply the step kept at `ReduceAborted` (`step` counts it)."""


# ---- observations ----------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The worker is up (resumed from a checkpoint if there was one)."""


@dataclass(frozen=True)
class Registered:
    incarnation: int


@dataclass(frozen=True)
class Refused:
    """The coordinator refused this member for good (409 model mismatch)."""

    why: str


@dataclass(frozen=True)
class Unreachable:
    """The coordinator could not be reached (`what` failed)."""

    what: str
    error: str


@dataclass(frozen=True)
class Waited:
    """A back-off ended."""


@dataclass(frozen=True)
class RendezvousAnswer:
    status: RendezvousStatus
    gen: int = 0
    members: tuple[str, ...] = ()
    committed: dict[str, int] = field(default_factory=dict)
    commit_gens: dict[str, int] = field(default_factory=dict)
    start_step: int = 0
    message: str = ""
    rolls_forward: tuple[str, ...] = ()
    """Members that apply the step they kept before the heal (`committed` already
    counts them one step further)."""


@dataclass(frozen=True)
class Connected:
    pass


@dataclass(frozen=True)
class ConnectFailed:
    error: str


@dataclass(frozen=True)
class Healed:
    """The heal ended on this member; `committed` is its count after it."""

    committed: int
    received: bool = False
    """This member was a receiver: its state is now the senders'."""


@dataclass(frozen=True)
class HealFailed:
    error: str


@dataclass(frozen=True)
class Computed:
    """This member's share of the step is summed (the verdict may still be pending)."""


@dataclass(frozen=True)
class Superseded:
    """The generation broke while computing (the coordinator said so)."""


@dataclass(frozen=True)
class ComputeFailed:
    """A collective inside the compute failed (a sharded model's replica group
    lost a member mid-step): nothing of the step was reduced yet."""

    error: str


@dataclass(frozen=True)
class VerdictSeen:
    verdict: Verdict
    asked_incarnation: int
    incarnation: int
    """This member's incarnation now (the heartbeat thread may have registered again)."""
    preempt_s: float = 0.0


@dataclass(frozen=True)
class VerdictFailed:
    """The coordinator answered the verdict with an error."""

    error: str


@dataclass(frozen=True)
class Reduced:
    """The all-reduce completed; `count` is the summed sample count."""

    count: int


@dataclass(frozen=True)
class ReduceAborted:
    """The all-reduce was given up (`reason`: superseded, watchdog, allreduce)."""

    reason: AbortPhase
    error: str
    kept: bool = False
    """Sharded: the shard's twins had reduced the gradient (this member keeps it)
    and only the commit vote's outcome was lost, so the step may have been
    committed by others; the next generation says (`RendezvousAnswer.rolls_forward`)."""


@dataclass(frozen=True)
class Applied:
    committed: int
    preempt_s: float


@dataclass(frozen=True)
class Evaluated:
    """The evaluation due at this count ended; every member of the generation holds its result."""


@dataclass(frozen=True)
class EvalAborted:
    """The evaluation was given up (`reason`: superseded, watchdog, eval): redo it in
    the next generation."""

    reason: AbortPhase
    error: str


@dataclass(frozen=True)
class CheckpointWritten:
    """The emergency checkpoint ended (durable or not)."""

    ok: bool


@dataclass(frozen=True)
class Abandoned:
    pass


@dataclass(frozen=True)
class Flags:
    """What other threads set, read by the engine just before `advance`."""

    leaving: bool = False
    expelled: bool = False


Observation = (
    Started
    | Registered
    | Refused
    | Unreachable
    | Waited
    | RendezvousAnswer
    | Connected
    | ConnectFailed
    | Healed
    | HealFailed
    | Computed
    | Superseded
    | ComputeFailed
    | VerdictSeen
    | VerdictFailed
    | Reduced
    | ReduceAborted
    | Applied
    | Evaluated
    | EvalAborted
    | CheckpointWritten
    | Abandoned
)


class ProtocolError(RuntimeError):
    """An observation that cannot happen in the current phase (a bug in the engine)."""


def heal_roles(
    members: tuple[str, ...],
    committed: dict[str, int],
    commit_gens: dict[str, int],
    start_step: int,
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(senders, receivers, lineage) of a generation's heal.

    Senders are the members at `start_step` whose state carries the newest
    commits (`lineage`, the highest `commit_gen` among them): a member that
    completed an all-reduce its peers abandoned (and re-ran without it) has
    the same step count but not the job's state, so it is a receiver.
    """
    at_start = [m for m in members if committed.get(m, 0) == start_step]
    lineage = max((commit_gens.get(m, 0) for m in at_start), default=0)
    senders = tuple(
        i for i, m in enumerate(members) if m in at_start and commit_gens.get(m, 0) == lineage
    )
    receivers = tuple(i for i in range(len(members)) if i not in senders)
    return senders, receivers, lineage


class MemberProtocol:
    """One member's view of the job, and the decision of what to do next.

    Not thread-safe and never blocks: the engine's training thread owns it.
    State: the phase, the committed step count and the generation it was
    committed in (`commit_gen`), the current generation (its number, ordered
    members and this member's rank; `gen` stays the last one seen after a
    failed connect, so the next rendezvous asks for a newer one).
    """

    def __init__(self, member: str, total_steps: int, global_batch_size: int) -> None:
        self.member = member
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self.phase = Phase.REGISTER
        self.committed = 0
        self.commit_gen = 0
        self.pending_gen = 0
        """Sharded: the generation whose reduced step at `committed` this member
        kept without learning the vote (0: none); told at rendezvous."""
        self.gen = 0
        self.members: tuple[str, ...] = ()
        self.rank = 0
        self.in_group = False
        self._asked_incarnation = 0
        self._preempt_s = 0.0
        self._ready = RendezvousAnswer(RendezvousStatus.PENDING)
        self._lineage = 0
        self.eval_every = 0
        """Evaluate after every this many committed steps (0: never; the trainer's
        `evaluate_every` sets it before the loop)."""
        self._eval_pending = False
        """The evaluation due at the committed count has not ended (a failure during
        the one after the last step must not finish the member without it)."""

    # ---- the transition function ------------------------------------------------

    def advance(self, obs: Observation, flags: Flags = Flags()) -> Action:
        """The action that follows `obs` in the current phase (and moves the phase)."""
        handler = _HANDLERS.get((self.phase, type(obs)))
        if handler is None:
            raise ProtocolError(
                f"{self.member}: {type(obs).__name__} cannot happen in {self.phase}"
            )
        return handler(self, obs, flags)

    def resumed(self, committed: int) -> None:
        """The member loaded a checkpoint holding `committed` steps (before registering)."""
        self.committed = committed

    # ---- helpers ------------------------------------------------------------------

    def _join(self, flags: Flags) -> Action:
        """Between generations: leave, register again, finish, or ask for a generation."""
        self.phase = Phase.JOIN
        self.in_group = False
        if flags.leaving:
            return self._exit(ExitReason.LEFT)
        if self.committed >= self.total_steps and not self._eval_pending:
            return self._finish()
        if flags.expelled:
            self.phase = Phase.REJOIN
            return Action(Do.REGISTER_AGAIN)
        return Action(Do.RENDEZVOUS, gen=self.gen, step=self.committed)

    def _exit(self, reason: ExitReason, message: str = "") -> Action:
        self.phase = Phase.DONE
        return Action(Do.EXIT, code=EXIT_CODES[reason], reason=reason, message=message)

    def _finish(self) -> Action:
        self.phase = Phase.DONE
        return Action(Do.FINISH, step=self.committed)

    def _abandon(self, phase: AbortPhase, error: str) -> Action:
        self.phase = Phase.ABANDON
        return Action(Do.ABANDON, gen=self.gen, step=self.committed, phase=phase, error=error)

    def _compute(self) -> Action:
        self.phase = Phase.COMPUTE
        return Action(Do.COMPUTE, step=self.committed, gen=self.gen)

    def _start_or_finish(self) -> Action:
        return self._finish() if self.committed >= self.total_steps else self._compute()

    def _evaluate_or_go_on(self) -> Action:
        """At a step boundary inside a generation: the evaluation due at this count
        (every member reaches the same boundary in the same generation), else on."""
        if eval_due(self.committed, self.eval_every, self.total_steps):
            self.phase = Phase.EVALUATE
            self._eval_pending = True
            return Action(
                Do.EVALUATE,
                step=self.committed,
                gen=self.gen,
                members=self.members,
                rank=self.rank,
            )
        return self._start_or_finish()

    # ---- handlers, one per (phase, observation) -----------------------------------

    def _on_started(self, obs: Started, flags: Flags) -> Action:
        return Action(Do.REGISTER)

    def _on_registered(self, obs: Registered, flags: Flags) -> Action:
        return self._join(flags)

    def _on_refused(self, obs: Refused, flags: Flags) -> Action:
        return self._exit(ExitReason.REFUSED, obs.why)

    def _on_unreachable_at_start(self, obs: Unreachable, flags: Flags) -> Action:
        # The session already retried for its register timeout.
        return self._exit(ExitReason.NO_COORDINATOR, obs.error)

    def _on_rendezvous(self, obs: RendezvousAnswer, flags: Flags) -> Action:
        status = obs.status
        if status == RendezvousStatus.FINISHED:
            return self._finish()
        if status in (RendezvousStatus.EXPELLED, RendezvousStatus.UNKNOWN):
            self.phase = Phase.REJOIN
            return Action(Do.REGISTER_AGAIN)
        if status != RendezvousStatus.READY:
            return self._join(flags)
        if self.member not in obs.members:
            raise ProtocolError(f"{self.member} is not a member of generation {obs.gen}")
        self.phase = Phase.CONNECT
        self._ready = obs
        # The heal's roles, known now, so that a sender prepares its share while the
        # group is built. A member that rolls forward gets none: its state changes
        # at the heal, and what it prepared would describe the step before.
        senders: tuple[int, ...] = ()
        receivers: tuple[int, ...] = ()
        if self.member not in obs.rolls_forward:
            senders, receivers, _ = heal_roles(
                tuple(obs.members), obs.committed, obs.commit_gens, obs.start_step
            )
        return Action(
            Do.CONNECT,
            gen=obs.gen,
            members=tuple(obs.members),
            rank=obs.members.index(self.member),
            step=self.committed,
            senders=senders,
            receivers=receivers,
        )

    def _on_rendezvous_unreachable(self, obs: Unreachable, flags: Flags) -> Action:
        return Action(Do.BACK_OFF)

    def _on_waited(self, obs: Waited, flags: Flags) -> Action:
        return self._join(flags)

    def _on_connect_failed(self, obs: ConnectFailed, flags: Flags) -> Action:
        # Remember the generation: the next rendezvous asks for a newer one.
        self.gen = self._ready.gen
        return self._join(flags)

    def _on_connected(self, obs: Connected, flags: Flags) -> Action:
        r = self._ready
        self.gen, self.members = r.gen, tuple(r.members)
        self.rank = r.members.index(self.member)
        self.in_group = True
        roll = self.member in r.rolls_forward
        if roll:
            if r.committed.get(self.member) != self.committed + 1 or not self.pending_gen:
                raise ProtocolError(
                    f"{self.member} told to roll forward from {self.committed} to "
                    f"{r.committed.get(self.member)} holding no step kept (pending generation "
                    f"{self.pending_gen})"
                )
            # Applying a kept step cannot fail: count it now, so a failed heal that
            # follows does not leave the count behind the state.
            self.committed += 1
            self.commit_gen = self.pending_gen
        # Kept or not, a kept step is spent: this generation re-runs it otherwise.
        self.pending_gen = 0
        senders, receivers, lineage = heal_roles(
            self.members, r.committed, r.commit_gens, r.start_step
        )
        self.phase = Phase.HEAL
        self._lineage = lineage
        return Action(
            Do.HEAL,
            gen=self.gen,
            members=self.members,
            rank=self.rank,
            senders=senders,
            receivers=receivers,
            lineage=lineage,
            step=self.committed,
            roll_forward=roll,
        )

    def _on_healed(self, obs: Healed, flags: Flags) -> Action:
        if obs.received:
            # The senders' state, committed in their lineage (a zombie commit's
            # count may be the same, its state is not).
            self.committed = obs.committed
            self.commit_gen = self._lineage
            self._eval_pending = False
        return self._evaluate_or_go_on()

    def _on_heal_failed(self, obs: HealFailed, flags: Flags) -> Action:
        return self._abandon(AbortPhase.HEAL, obs.error)

    def _on_superseded(self, obs: Superseded, flags: Flags) -> Action:
        return self._abandon(AbortPhase.SUPERSEDED, "generation changed during compute")

    def _on_compute_failed(self, obs: ComputeFailed, flags: Flags) -> Action:
        return self._abandon(AbortPhase.COMPUTE, obs.error)

    def _on_computed(self, obs: Computed, flags: Flags) -> Action:
        self.phase = Phase.VERDICT
        return Action(Do.VERDICT, step=self.committed, gen=self.gen)

    def _on_verdict(self, obs: VerdictSeen, flags: Flags) -> Action:
        v = obs.verdict
        if v == Verdict.PROCEED:
            return self._reduce(obs.preempt_s)
        if self.phase == Phase.REASK:
            # Asked twice: whatever it is now, it is not "proceed".
            return self._not_proceeding(str(v), flags)
        if v == Verdict.UNKNOWN:
            # A restarted coordinator: register (reporting this generation), ask again.
            self.phase = Phase.REREGISTER
            self._asked_incarnation = obs.asked_incarnation
            return Action(Do.REGISTER_AGAIN, incarnation=obs.asked_incarnation)
        if v in (Verdict.UNKNOWN, Verdict.EXPELLED) and obs.incarnation != obs.asked_incarnation:
            # Registered again since the question was sent: the answer was
            # about the old incarnation.
            return self._ask_again(obs.incarnation)
        return self._not_proceeding(str(v), flags)

    def _reduce(self, preempt_s: float) -> Action:
        self._preempt_s = preempt_s
        self.phase = Phase.REDUCE
        return Action(Do.REDUCE, step=self.committed, gen=self.gen)

    def _ask_again(self, incarnation: int) -> Action:
        self.phase = Phase.REASK
        return Action(Do.ASK_AGAIN, step=self.committed, incarnation=incarnation)

    def _not_proceeding(self, why: str, flags: Flags) -> Action:
        if flags.leaving:
            return self._exit(ExitReason.LEFT)
        return self._abandon(AbortPhase.QUORUM, why)

    def _on_reregistered(self, obs: Registered, flags: Flags) -> Action:
        if obs.incarnation != self._asked_incarnation:
            return self._ask_again(obs.incarnation)
        return self._not_proceeding(str(Verdict.UNKNOWN), flags)

    def _on_reregister_unreachable(self, obs: Unreachable, flags: Flags) -> Action:
        return self._not_proceeding(str(Verdict.UNKNOWN), flags)

    def _on_rejoin_unreachable(self, obs: Unreachable, flags: Flags) -> Action:
        return Action(Do.BACK_OFF)

    def _on_rejoin_waited(self, obs: Waited, flags: Flags) -> Action:
        return self._join(flags)

    def _on_verdict_unreachable(self, obs: Unreachable, flags: Flags) -> Action:
        # The coordinator's state is soft and it may be restarting: go on
        # without it; the all-reduce is the agreement.
        if flags.leaving:
            return self._exit(ExitReason.LEFT)
        return self._reduce(0.0)

    def _on_reask_failed(self, obs: VerdictFailed | Unreachable, flags: Flags) -> Action:
        return self._abandon(AbortPhase.QUORUM, obs.error)

    def _on_verdict_failed(self, obs: VerdictFailed, flags: Flags) -> Action:
        return self._abandon(AbortPhase.QUORUM, obs.error)

    def _on_reduced(self, obs: Reduced, flags: Flags) -> Action:
        if obs.count != self.global_batch_size:
            # Exactly-once would be violated: never apply such a step.
            return self._abandon(
                AbortPhase.ALLREDUCE,
                f"step {self.committed} summed {obs.count} samples, "
                f"expected {self.global_batch_size}",
            )
        self.phase = Phase.APPLY
        return Action(Do.APPLY, step=self.committed, gen=self.gen, grace_s=self._preempt_s)

    def _on_reduce_aborted(self, obs: ReduceAborted, flags: Flags) -> Action:
        self.pending_gen = self.gen if obs.kept else 0
        return self._abandon(obs.reason, obs.error)

    def _on_applied(self, obs: Applied, flags: Flags) -> Action:
        self.committed = obs.committed
        self.commit_gen = self.gen
        if obs.preempt_s > 0:
            self.phase = Phase.EMERGENCY
            return Action(
                Do.EMERGENCY_CHECKPOINT, step=self.committed, gen=self.gen, grace_s=obs.preempt_s
            )
        return self._evaluate_or_go_on()

    def _on_evaluated(self, obs: Evaluated, flags: Flags) -> Action:
        self._eval_pending = False
        return self._start_or_finish()

    def _on_eval_aborted(self, obs: EvalAborted, flags: Flags) -> Action:
        return self._abandon(obs.reason, obs.error)

    def _on_emergency(self, obs: CheckpointWritten, flags: Flags) -> Action:
        return self._exit(ExitReason.PREEMPTED)

    def _on_abandoned(self, obs: Abandoned, flags: Flags) -> Action:
        return self._join(flags)


_Handler = Callable[[MemberProtocol, Any, Flags], Action]


def _table() -> dict[tuple[Phase, type], _Handler]:
    P, M = Phase, MemberProtocol
    return {
        (P.REGISTER, Started): M._on_started,
        (P.REGISTER, Registered): M._on_registered,
        (P.REGISTER, Refused): M._on_refused,
        (P.REGISTER, Unreachable): M._on_unreachable_at_start,
        (P.REJOIN, Registered): M._on_registered,
        (P.REJOIN, Refused): M._on_refused,
        (P.REJOIN, Unreachable): M._on_rejoin_unreachable,
        (P.REJOIN, Waited): M._on_rejoin_waited,
        (P.JOIN, RendezvousAnswer): M._on_rendezvous,
        (P.JOIN, Unreachable): M._on_rendezvous_unreachable,
        (P.JOIN, Waited): M._on_waited,
        (P.CONNECT, Connected): M._on_connected,
        (P.CONNECT, ConnectFailed): M._on_connect_failed,
        (P.HEAL, Healed): M._on_healed,
        (P.HEAL, HealFailed): M._on_heal_failed,
        (P.COMPUTE, Computed): M._on_computed,
        (P.COMPUTE, Superseded): M._on_superseded,
        (P.COMPUTE, ComputeFailed): M._on_compute_failed,
        (P.VERDICT, VerdictSeen): M._on_verdict,
        (P.VERDICT, Unreachable): M._on_verdict_unreachable,
        (P.VERDICT, VerdictFailed): M._on_verdict_failed,
        (P.REREGISTER, Registered): M._on_reregistered,
        (P.REREGISTER, Refused): M._on_refused,
        (P.REREGISTER, Unreachable): M._on_reregister_unreachable,
        (P.REASK, VerdictSeen): M._on_verdict,
        (P.REASK, VerdictFailed): M._on_reask_failed,
        (P.REASK, Unreachable): M._on_reask_failed,
        (P.REDUCE, Reduced): M._on_reduced,
        (P.REDUCE, ReduceAborted): M._on_reduce_aborted,
        (P.APPLY, Applied): M._on_applied,
        (P.EVALUATE, Evaluated): M._on_evaluated,
        (P.EVALUATE, EvalAborted): M._on_eval_aborted,
        (P.EMERGENCY, CheckpointWritten): M._on_emergency,
        (P.ABANDON, Abandoned): M._on_abandoned,
    }


_HANDLERS = _table()
