"""One step's run: compute, the verdict, the reduction, apply.

Step `s` of a generation: the verdict for (gen, s) is asked for in the
background while this member computes its micro-batches (the topology's
`turns`); on "proceed" the step's collectives run in the topology's order
(`reductions`: the gradient with [loss sum, sample count, checkpoint
measurements] at the end of the first buffer) under the step watchdog; the
protocol checks the sample count, and `apply` divides by the global batch and
updates: committed. Anything else is the protocol's to handle (abandon, retry).

Invariants kept here: a collective's buffers are never reused while it may
still write them (`Links.inflight`, `Backend.discard` on abandon); a wait for
peers is bounded by the watchdog's deadline and ends early when the
generation breaks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from elastrain.checkpoint.manager import Checkpointing
from elastrain.checkpoint.policy import CONTRIB_SLOTS
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorError, CoordinatorUnavailable
from elastrain.observe.events import EventKind
from elastrain.observe.tally import WorkerTally
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.backend import SkipReason, Update
from elastrain.runtime.carried import Carried
from elastrain.runtime.context import Context
from elastrain.runtime.device import is_poisoned
from elastrain.runtime.evaluate import EvalResult
from elastrain.runtime.feed import DataFeed
from elastrain.runtime.group import AbortReason, CollectiveAborted, HangCheck
from elastrain.runtime.topology import CannotCompute, Reduction, Topology, Turns
from elastrain.runtime.watchdog import HANG_ASK_EVERY_S
from elastrain.threads import QUORUM, name_native_thread

log = logging.getLogger("elastrain.engine")

EXTRA_SLOTS = 2 + CONTRIB_SLOTS
"""Values riding at the end of the first reduce buffer in the step's all-reduce:
loss sum, sample count, then the checkpoint schedule's measurements."""


@dataclass(frozen=True)
class StepResult:
    step: int
    """0-based index of the step just committed."""
    loss: float
    """Mean loss over the step's global batch."""
    gen: int
    members: int
    rank: int
    step_s: float
    grad_norm: float | None = None
    """Global L2 norm of the mean gradient before clipping (None: the backend does
    not measure it); the same on every member."""
    skipped: SkipReason | None = None
    """Not None: the step committed without updating the state (and why)."""
    evaluation: EvalResult | None = None
    """The evaluation of the model this step started from (after `step` committed
    steps and the loop's code for the last of them), when one was due there
    (`ElasticTrainer.evaluate_every`): ``evaluation.step == step``. The same on every
    member. The one after the last step: `last_evaluation`."""


def waits_whole_step(turns: Turns) -> bool:
    """The member has no turn and its reduction waits through its peers' whole
    compute (`Turns.waits_whole_step`: a sharded shadow), so it waits up to the
    watchdog's ceiling rather than the step timeout."""
    return not turns.mine and turns.waits_whole_step


def dist_errors() -> type[BaseException]:
    """torch.distributed's error base (a backend's failed collective)."""
    import torch.distributed as dist

    return dist.DistError


def collective_error(e: BaseException) -> bool:
    """A failed collective, not the user's loss function: gloo and c10d say who they are."""
    if isinstance(e, dist_errors()):
        return True
    text = str(e)
    return "gloo" in text or "Connection closed by peer" in text or "c10d" in text


@dataclass
class _Step:
    """What one step carries between its actions."""

    step: int
    t0: float
    incarnation: int
    verdict: concurrent.futures.Future[p.QuorumResponse]
    samples: list[int]
    loss_sum: float | torch.Tensor = 0.0
    """The member's micro-batches' loss sums (`Backend.compute`), read at the reduce."""
    computed: int = 0
    """Micro-batches this member computed in this generation (padding not counted)."""
    held: int = 0
    """Micro-batches of the step its group kept from an earlier generation."""
    complete: bool = False
    """Every turn of this member ran: its gradient buffers hold its group's sums."""
    handed: bool = False
    """A collective took the gradient buffers (`Reduction.hands_over`)."""
    idle: bool = False
    """This member has no turn in the step and waits through the others' whole
    compute (a sharded generation's shadow, `waits_whole_step`)."""
    data_s: float = 0.0
    t_compute: float = 0.0
    verdict_s: float = 0.0
    """Time blocked on the quorum verdict after computing (it is asked for at the start)."""
    t_reduce: float = 0.0
    t_done: float = 0.0
    extras: tuple[float, ...] = ()


class StepRun:
    """The actions of one step (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        topology: Topology,
        feed: DataFeed,
        carried: Carried,
        ckpt: Checkpointing,
        tally: WorkerTally,
    ) -> None:
        self.ctx = ctx
        self.topology = topology
        self.feed = feed
        self.carried = carried
        self.ckpt = ckpt
        self.tally = tally
        self._quorum_pool = concurrent.futures.ThreadPoolExecutor(
            1, "elastrain-quorum", name_native_thread, (QUORUM,)
        )
        self._step: _Step | None = None

    def forget(self) -> None:
        """The generation was abandoned: the step in progress is dropped, but what
        this member summed of it is kept when it ran all its turns and no
        collective took its buffers (`Topology.hold`; before `Backend.discard`)."""
        st, self._step = self._step, None
        if st is not None and st.complete and not st.handed:
            # The loss sum as it is (a device tensor on a GPU member): reading it
            # here would sync the device, behind a collective given up on.
            self.topology.hold(st.step, st.samples, st.loss_sum)

    def close(self) -> None:
        self._quorum_pool.shutdown(wait=False, cancel_futures=True)

    # ---- compute and the verdict -----------------------------------------------------

    def compute(self, a: m.Action) -> m.Observation:
        ctx = self.ctx
        if ctx.links.broken is not None:
            why, ctx.links.broken = ctx.links.broken, None
            return m.ComputeFailed(why)
        s = a.step
        inc = ctx.session.incarnation
        st = _Step(
            s,
            time.monotonic(),
            inc,
            self._quorum_pool.submit(ctx.client.quorum, self._quorum_request(s, inc)),
            [],
        )
        self._step = st
        ctx.backend.begin_step(EXTRA_SLOTS)
        mbs = self.feed.microbatches(s)
        try:
            turns = self.topology.turns(s, len(mbs))
        except CannotCompute as e:
            # No step can commit in this generation, so the coordinator treats it as
            # always at a step boundary: wait for the one it forms next (a joiner
            # admitted, or a reshard once the vacancy lasted --reshard-after).
            log.warning("%s: %s", ctx.member, e)
            print(f"[{ctx.member}] waiting: {e}", flush=True)
            gen, session = ctx.proto.gen, ctx.session
            ctx.waiter.wait_until(lambda: session.moved_on_from(gen))
            return m.Superseded()
        except CollectiveAborted as e:
            # The generation's exchange of held sums (sharded, first step) was given up.
            if e.reason is not AbortReason.WATCHDOG:
                return m.Superseded()
            confirmed = {"confirmed": list(e.confirmed)} if e.confirmed else {}
            ctx.events.emit(EventKind.WATCHDOG_FIRED, step=s, gen=ctx.proto.gen,
                            timeout_s=ctx.config.watchdog.ceiling_s,
                            during="the held sums' exchange", **confirmed)  # fmt: skip
            return m.ComputeFailed(str(e)[:300])
        except (RuntimeError, dist_errors()) as e:
            # The generation's exchange of held sums (sharded, first step) failed.
            if not collective_error(e):
                raise
            return m.ComputeFailed(str(e)[:300])
        st.samples.extend(turns.held_samples)
        st.loss_sum, st.held, st.idle = turns.held_loss, turns.held, waits_whole_step(turns)
        self.feed.plan(s, turns.mine)
        pad = None
        for k, i in enumerate(turns.mine):
            if turns.stop_when_superseded and ctx.gen_broken(ctx.proto.gen):
                return m.Superseded()
            t_data = time.monotonic()
            ids: list[int] = []
            if i is None:
                # Padding turn: the group's collectives need this member; weight 0.
                batch = pad = pad if pad is not None else self.feed.load((s, 0), mbs[0])
            else:
                ids = self.feed.ids(mbs[i])
                batch = pad = self.feed.loader.get((s, i), ids)
            st.data_s += time.monotonic() - t_data
            try:
                st.loss_sum += ctx.backend.compute(s, -1 if i is None else i, batch, len(ids))
            except (RuntimeError, dist_errors()) as e:
                if not turns.collectives_inside or not collective_error(e):
                    raise
                return m.ComputeFailed(str(e)[:300])
            st.samples.extend(ids)
            if i is not None:
                st.computed += 1
            if k == 0:
                ctx.hook(s, hooks.StepPoint.COMPUTE)
        st.complete = True
        st.t_compute = time.monotonic()
        return m.Computed()

    def verdict(self, a: m.Action) -> m.Observation:
        st = self._step
        assert st is not None
        t = time.monotonic()
        try:
            v = st.verdict.result(timeout=self.ctx.config.timeouts.coordinator_s)
        except (CoordinatorUnavailable, concurrent.futures.TimeoutError) as e:
            self.ctx.session.coordinator_unreachable("quorum", str(e))
            return m.Unreachable("quorum", str(e))
        except CoordinatorError as e:
            return m.VerdictFailed(str(e))
        finally:
            st.verdict_s += time.monotonic() - t
        return self._seen(v, st.incarnation)

    def ask_again(self, a: m.Action) -> m.Observation:
        assert a.incarnation is not None
        try:
            v = self.ctx.client.quorum(self._quorum_request(a.step, a.incarnation))
        except CoordinatorError as e:
            return m.VerdictFailed(str(e))
        return self._seen(v, a.incarnation)

    def _seen(self, v: p.QuorumResponse, asked: int) -> m.Observation:
        try:
            verdict = p.Verdict(v.verdict)
        except ValueError:
            return m.VerdictFailed(f"unknown verdict {v.verdict!r}")
        return m.VerdictSeen(verdict, asked, self.ctx.session.incarnation, v.preempt_s)

    def _quorum_request(self, step: int, inc: int) -> p.QuorumRequest:
        ctx = self.ctx
        return p.QuorumRequest(
            ctx.member,
            inc,
            ctx.proto.gen,
            step,
            ctx.session.leaving,
            self.carried.last_loss,
            ctx.config.global_batch_size,
            self.tally.take(),
            self.tally.take_scalars(),
        )

    # ---- the reduction ---------------------------------------------------------------

    def reduce(self, a: m.Action) -> m.Observation:
        ctx, links = self.ctx, self.ctx.links
        st = self._step
        assert st is not None
        s, gen = a.step, a.gen
        extras = ctx.backend.extras()
        loss_sum = float(st.loss_sum)
        extras.copy_(
            torch.tensor(
                [loss_sum, float(len(st.samples)), *self.ckpt.contribution()],
                dtype=extras.dtype,
            )
        )
        # loss_sum: this member's share of the step's loss, so a curve that differs
        # from a reference can be traced to the member (and samples) that differ.
        ctx.events.emit(
            EventKind.STEP_CONTRIB, step=s, gen=gen, samples=st.samples, loss_sum=loss_sum
        )
        st.t_reduce = time.monotonic()
        # A sharded shadow (no turn, `Turns.waits_whole_step`) reaches its reduction
        # at once and waits there for the others' whole compute: it has no time of
        # its own that the step timeout scales with, and the others' share may be
        # twice a steady step's (a group alone after a kill). So it waits up to the
        # watchdog's ceiling; a peer that dies or stops is caught sooner (the
        # coordinator's lease breaks the generation, which ends this wait), and the
        # soft deadline's hang check still asks about silent peers. A replica with no
        # micro-batch waits as any member does.
        timeout = ctx.config.watchdog.ceiling_s if st.idle else ctx.hang.timeout_s
        kept: Reduction | None = None
        try:
            for r in self.topology.reductions(links, extras):
                if r.hands_over:
                    if ctx.gen_broken(gen):
                        # Not handed over: the buffers stay this member's to keep.
                        return m.ReduceAborted(
                            m.AbortPhase.SUPERSEDED, f"the generation broke before {r.what}"
                        )
                    st.handed = True
                links.inflight = r.start()
                if r.before_wait is not None:
                    ctx.hook(s, r.before_wait)
                self._await_reduce(gen, s, timeout)
                if r.keep is not None:
                    kept = r
                if r.after_wait is not None:
                    try:
                        ctx.hook(s, r.after_wait)
                    except hooks.InjectedFailure:
                        self._await_lost_answer(gen, s, timeout)
        except CollectiveAborted as e:
            if e.reason is AbortReason.WATCHDOG:
                # A confirmed hang fires at the soft deadline: record how long it waited.
                confirmed = {"confirmed": list(e.confirmed)} if e.confirmed else {}
                waited = time.monotonic() - st.t_reduce if e.confirmed else timeout
                ctx.events.emit(
                    EventKind.WATCHDOG_FIRED, step=s, gen=gen, timeout_s=waited, **confirmed
                )
            return self._reduce_aborted(m.AbortPhase(e.reason), str(e), s, gen, kept)
        except RuntimeError as e:
            if is_poisoned(e):
                raise
            links.inflight = []
            return self._reduce_aborted(m.AbortPhase.ALLREDUCE, str(e)[:300], s, gen, kept)
        links.inflight = []
        st.t_done = time.monotonic()
        ctx.hang.observe(st.t_done - st.t_reduce)
        st.extras = tuple(float(x) for x in ctx.backend.extras().tolist())
        return m.Reduced(int(round(st.extras[1])))

    def _await_reduce(self, gen: int, step: int, timeout_s: float) -> None:
        """Wait for the works in flight under the step's deadlines, counted from the
        start of the step's reduction (`_Step.t_reduce`): a step of several
        collectives waits several times under one deadline."""
        st = self._step
        assert st is not None
        ctx = self.ctx
        waited = time.monotonic() - st.t_reduce
        ctx.waiter.wait(
            ctx.links.inflight,
            max(timeout_s - waited, 0.0),
            lambda: ctx.gen_broken(gen),
            self._hang_check(gen, step, timeout_s, waited),
        )

    def _await_lost_answer(self, gen: int, step: int, timeout_s: float) -> None:
        """An injected fault (`hooks.InjectedFailure`): this member's answer is lost,
        so it waits as for one that never comes, until a deadline or the generation's
        end (raises `CollectiveAborted`), while its peers' collective completed."""
        never = threading.Event()

        class Lost:
            def wait(self) -> None:
                never.wait()
                raise RuntimeError("lost")

        self.ctx.links.inflight = [Lost()]
        try:
            self._await_reduce(gen, step, timeout_s)
        finally:
            never.set()
            self.ctx.links.inflight = []

    def _reduce_aborted(
        self, phase: m.AbortPhase, error: str, step: int, gen: int, kept: Reduction | None
    ) -> m.ReduceAborted:
        """Give the reduction up; a member that completed a collective that keeps
        (a sharded member's twins' reduction) keeps the sum in case another member
        committed the step."""
        if kept is not None:
            assert kept.keep is not None
            kept.keep(step, gen)
            error = f"{error} (after {kept.what}: the step is kept)"
        return m.ReduceAborted(phase, error, kept is not None)

    def _hang_check(
        self, gen: int, step: int, timeout_s: float, waited_s: float = 0.0
    ) -> HangCheck | None:
        """Past the soft deadline, ask the coordinator whether a peer of `gen`
        stopped heartbeating (`elastrain.runtime.watchdog`); None: do not ask.
        `waited_s`: how long this reduction has waited already (the deadlines
        count from its start)."""
        soft = self.ctx.hang.soft_s
        if soft is None or soft >= timeout_s:
            return None
        session = self.ctx.session

        def ask(waited: float) -> tuple[str, ...]:
            waited += waited_s
            left = timeout_s - waited
            return session.confirm_hang(gen, step, waited, max(0.05, min(left, 2.0)))

        return HangCheck(max(soft - waited_s, 0.0), HANG_ASK_EVERY_S, ask)

    # ---- apply -----------------------------------------------------------------------

    def apply(self, a: m.Action, fresh: EvalResult | None) -> tuple[m.Observation, StepResult]:
        """Apply the reduced step; `fresh`: the evaluation of the model this step
        started from, if one ended at that boundary."""
        ctx, carried = self.ctx, self.carried
        st = self._step
        assert st is not None
        s = a.step
        t_apply = time.monotonic()
        update = ctx.backend.apply() or Update()
        n = s + 1
        ctx.session.note_committed(n)
        total_loss, count = st.extras[0], int(round(st.extras[1]))
        loss_mean = total_loss / count
        carried.last_loss = loss_mean
        t_end = time.monotonic()
        norm = update.grad_norm
        shown_norm = norm if norm is not None and math.isfinite(norm) else None
        if update.skipped is not None:
            carried.skipped_steps += 1
            log.warning(
                "%s: step %d committed without an update (%s)", ctx.member, s, update.skipped
            )
            ctx.events.emit(
                EventKind.STEP_SKIPPED,
                step=s,
                gen=a.gen,
                reason=update.skipped,
                grad_norm=shown_norm,
                skipped_total=carried.skipped_steps,
            )
        ctx.events.emit(
            EventKind.STEP_COMMIT,
            step=s,
            gen=a.gen,
            loss=loss_mean,
            step_s=t_end - st.t0,
            compute_s=st.t_compute - st.t0,
            allreduce_s=st.t_done - st.t_reduce,
            data_s=st.data_s,
            verdict_s=st.verdict_s,
            apply_s=t_end - t_apply,
            samples=count,
            samples_per_s=count / max(t_end - st.t0, 1e-9),
            grad_norm=shown_norm,
            skipped=update.skipped is not None,
            computed=st.computed,
            held=st.held,
        )
        self.ckpt.absorb(list(st.extras[2:]))
        self.ckpt.note_step_time(t_end - st.t0)
        result = StepResult(
            s,
            loss_mean,
            a.gen,
            len(ctx.proto.members),
            ctx.proto.rank,
            t_end - st.t0,
            norm,
            update.skipped,
            fresh,
        )
        self._step = None
        return m.Applied(n, a.grace_s), result
