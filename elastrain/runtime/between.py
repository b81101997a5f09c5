"""Between steps: the evaluation and the script's pauses.

Both run at a step boundary on every member of the generation, and both end
with a collective over the generation's group that is waited for like a
step's (bounded, ended early when the generation breaks) but never by the
step watchdog's history: a failure aborts the generation as a failed step
does (an evaluation at once, a pause at the next step), and the work is done
again only where the protocol says so (an evaluation in the next generation;
a pause never).
"""

from __future__ import annotations

import datetime
import json
import logging
import time

import torch
import torch.distributed as dist

from elastrain.observe.events import EventKind
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.carried import Carried
from elastrain.runtime.context import Context
from elastrain.runtime.evaluate import (
    EvalProblem,
    EvalResult,
    EvalShare,
    EvalTable,
    Evaluation,
    HandoverFailed,
    Post,
    eval_wait_timeout,
    hand_over,
    idle_wait_timeout,
    metric_values,
    pause_timeout,
)
from elastrain.runtime.group import AbortReason, CollectiveAborted
from elastrain.runtime.step_run import collective_error, dist_errors
from elastrain.runtime.topology import CannotCompute, Topology

log = logging.getLogger("elastrain.engine")


class Aborted(Exception):
    """A collective between steps (an evaluation's, a pause's) was given up."""

    def __init__(self, phase: m.AbortPhase, message: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.message = message


class BetweenSteps:
    """Evaluations and pause barriers (see the module docstring)."""

    def __init__(self, ctx: Context, carried: Carried, topology: Topology) -> None:
        self.ctx = ctx
        self.carried = carried
        self.topology = topology
        """Who runs and reports which evaluation batches (`Topology.eval_share`)."""
        self.evaluation: Evaluation | None = None
        """The evaluation the script asked for (`set_evaluation`), if any."""
        self._fresh: EvalResult | None = None
        """The evaluation ended at this boundary, for the next step's `StepResult`."""

    def set_evaluation(self, evaluation: Evaluation) -> None:
        if self.evaluation is not None:
            raise ValueError("an evaluation is set up already (one per trainer)")
        self.evaluation = evaluation
        self.ctx.proto.eval_every = evaluation.every

    def take_fresh(self, step: int) -> EvalResult | None:
        """The evaluation of the model step `step` started from, if one ended at that
        boundary (the same on every member that ran the step); forgotten after."""
        fresh, self._fresh = self._fresh, None
        return fresh if fresh is not None and fresh.step == step else None

    def evaluate(self, a: m.Action) -> m.Observation:
        """Evaluate the model after ``a.step`` committed steps with this generation.

        Every member of the generation is here at the same count: the protocol
        enters EVALUATE after the commit that reaches it, or after the heal that
        starts a generation at it. One small collective first asks who already
        holds this count's result (a member whose table all-reduce completed
        before a peer died, or one healed or resumed with it); if one does, it
        hands it over and nobody computes. Otherwise each member runs the batches
        its layout gives it (`Topology.eval_share`: a block per member, or per
        complete replica group of a sharded job) and the table is all-reduced
        (`EvalTable`). A failure aborts like a failed step; the next generation
        evaluates again. The wait for the peers is bounded by this member's own
        time (`eval_wait_timeout`), or for a member that runs none of the batches
        by the watchdog's ceiling per batch (`idle_wait_timeout`), never by the
        step watchdog's timeout."""
        ctx, ev = self.ctx, self.evaluation
        assert ev is not None
        n, gen, size, rank = a.step, a.gen, len(a.members), a.rank
        batches = ev.batches()
        t0 = time.monotonic()
        last = self.carried.eval_result
        held = last if last and last.step == n else None
        wait_s = 0.0
        try:
            share = self._share(len(batches), size, rank, gen)
            ctx.events.emit(
                EventKind.EVAL_BEGIN, step=n, gen=gen, members=size, batches=len(share.batches)
            )
            result = self._handover(held, n, gen, size, rank)
            computed = result is None
            if result is None:
                names, table = self._compute(ev, n, gen, batches, share)
                t_wait = time.monotonic()
                if share.batches or not batches:
                    timeout = eval_wait_timeout(
                        t_wait - t0, ctx.hang.timeout_s, ctx.config.watchdog.multiplier
                    )
                else:  # runs nothing while the runners run every batch
                    timeout = idle_wait_timeout(len(batches), ctx.config.watchdog.ceiling_s)
                if share.names_shared:
                    names = self._agree_names(names, n, gen, timeout)
                if table is None:
                    assert names is not None
                    table = EvalTable(names, batches)
                self.collective([table.table], n, gen, timeout, "eval")
                wait_s = time.monotonic() - t_wait
                reduced = table.reduce()
                if isinstance(reduced, str):
                    return m.EvalAborted(m.AbortPhase.EVAL, reduced)
                result = EvalResult(n, *reduced)
        except Aborted as e:
            return m.EvalAborted(e.phase, e.message)
        self.carried.eval_result = self._fresh = result
        seconds = time.monotonic() - t0
        ctx.events.emit(
            EventKind.EVAL_END,
            step=n,
            gen=gen,
            seconds=seconds,
            wait_s=wait_s,
            batches=len(share.batches) if computed else 0,
            samples=result.samples,
            sums=result.sums,
            computed=computed,
        )
        log.info("%s: evaluation after %d steps in %.2f s: %s", ctx.member, n, seconds,
                 result.means)  # fmt: skip
        return m.Evaluated()

    def _handover(
        self, held: EvalResult | None, n: int, gen: int, size: int, rank: int
    ) -> EvalResult | None:
        """`evaluate.hand_over` over this generation's group, each collective waited
        for like the evaluation's (the step timeout: everyone arrives together)."""
        if size == 1:
            return held

        def run(tensors: list[torch.Tensor], post: Post | None) -> None:
            self.collective(tensors, n, gen, self.ctx.hang.timeout_s, "eval", post)

        try:
            return hand_over(self.ctx.links.pg, run, held, n, rank, size)
        except HandoverFailed as e:
            raise Aborted(m.AbortPhase.EVAL, f"eval: {e}") from None

    def _share(self, num_batches: int, size: int, rank: int, gen: int) -> EvalShare:
        """The topology's share for this member; with nobody able to evaluate (a
        sharded generation without a complete group), wait for the next generation."""
        try:
            return self.topology.eval_share(num_batches, size, rank)
        except CannotCompute as e:
            ctx, session = self.ctx, self.ctx.session
            log.warning("%s: %s", ctx.member, e)
            ctx.waiter.wait_until(lambda: session.moved_on_from(gen))
            raise Aborted(m.AbortPhase.SUPERSEDED, f"eval: {e}") from None

    def _compute(
        self, ev: Evaluation, n: int, gen: int, batches: list[range], share: EvalShare
    ) -> tuple[tuple[str, ...] | None, EvalTable | None]:
        """Run this member's batches, in order: the metric names (None if it ran
        none and the names are shared) and its rows of the table (None then too;
        the rows of batches it does not report stay zero)."""
        names: tuple[str, ...] | None = None
        table: EvalTable | None = None
        for k, b in enumerate(share.batches):
            if not share.collectives_inside and self.ctx.gen_broken(gen):
                raise Aborted(m.AbortPhase.SUPERSEDED, "generation changed during the evaluation")
            values = self._run(ev, n, b, batches, share.collectives_inside)
            if table is None:
                names = tuple(sorted(values))
                table = EvalTable(names, batches)
            if share.reports:
                table.fill(b, values)
            if k == 0:
                self.ctx.hook(n - 1, hooks.StepPoint.EVAL)
        if table is None and not share.names_shared:
            # More runners than batches: this one has none, and learns the metrics'
            # names from batch 0 (another member's) to shape its all-zero rows.
            values = self._run(ev, n, 0, batches, share.collectives_inside)
            names = tuple(sorted(values))
            table = EvalTable(names, batches)
        return names, table

    def _run(
        self, ev: Evaluation, n: int, b: int, batches: list[range], collectives_inside: bool
    ) -> dict[str, float]:
        """One batch through the script's function. A failed collective inside it (a
        group-mate of a sharded member died or hung) aborts the evaluation."""
        try:
            return metric_values(ev.compute(n, b, ev.load(batches[b])))
        except (RuntimeError, dist_errors()) as e:
            if not collectives_inside or not collective_error(e):
                raise
            raise Aborted(m.AbortPhase.EVAL, f"eval: {str(e)[:300]}") from None

    def _agree_names(
        self, names: tuple[str, ...] | None, n: int, gen: int, timeout: float
    ) -> tuple[str, ...]:
        """The metric names, for members that ran no batch (a sharded job's shadows):
        the JSON of the names, whose length and bytes are MAX all-reduced (a member
        without names contributes zeros; every member that has them has the same,
        else EvalProblem)."""
        raw = json.dumps(list(names)).encode() if names is not None else b""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        pg = self.ctx.links.pg

        def post(t: list[torch.Tensor]) -> object:
            return pg.allreduce(t, opts)

        length = torch.tensor([float(len(raw))], dtype=torch.float64)
        self.collective([length], n, gen, timeout, "eval", post)
        buf = torch.zeros(int(length.item()), dtype=torch.float64)
        if raw:
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.float64)
        self.collective([buf], n, gen, timeout, "eval", post)
        try:
            agreed = tuple(json.loads(bytes(int(x) for x in buf.tolist())))
        except ValueError:
            agreed = ()
        if not agreed or (names is not None and agreed != names):
            raise EvalProblem(
                f"the members returned different evaluation metric names (this member: "
                f"{list(names or ())}): return the same names on every member"
            )
        return agreed

    def pause_barrier(self, began: float, timeout_s: float | None) -> None:
        """The end of `trainer.pause()`: wait until every member of the generation
        has ended its own (one small all-reduce of [1, committed count]).

        Bounded by ``timeout_s``, or by default by `pause_timeout`: work that one
        member does for all (the leader writing samples) leaves the others with no
        time of their own to scale, so the default is at least the watchdog's
        ceiling. A failed or timed-out barrier
        (a peer died or hung in its pause, or entered none) abandons the generation
        at the next step; the caller's code is not run again."""
        ctx, links = self.ctx, self.ctx.links
        if links.pg is None or not ctx.proto.in_group:
            return
        gen, n, size = ctx.proto.gen, ctx.proto.committed, len(ctx.proto.members)
        own = time.monotonic() - began
        wd = ctx.config.watchdog
        timeout = timeout_s
        if timeout is None:
            timeout = pause_timeout(own, ctx.hang.timeout_s, wd.multiplier, wd.ceiling_s)
        t = torch.tensor([1.0, float(n)], dtype=torch.float64)
        try:
            self.collective([t], n, gen, timeout, "pause")
        except Aborted as e:
            log.warning("%s: %s", ctx.member, e.message)
            links.broken = e.message
            return
        if t.tolist() != [float(size), float(size * n)]:
            links.broken = (
                "pause: not every member was in trainer.pause() after the same step "
                "(enter it on every member, deciding from the step, never from the rank)"
            )
            log.warning("%s: %s", ctx.member, links.broken)

    def collective(
        self,
        tensors: list[torch.Tensor],
        step: int,
        gen: int,
        timeout_s: float,
        during: str,
        post: Post | None = None,
    ) -> None:
        """One collective on ``tensors`` (default: SUM all-reduce) over the
        generation's group, waited for at most ``timeout_s`` (gloo's own operation
        timeout is raised to match for it) or until the generation breaks; raises
        `Aborted`."""
        ctx, links = self.ctx, self.ctx.links
        pg = links.pg
        assert pg is not None
        set_timeout = getattr(pg, "set_timeout", None)
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_s + 5.0))
        work = post(tensors) if post is not None else pg.allreduce(tensors)
        links.inflight = [work]
        try:
            ctx.waiter.wait(links.inflight, timeout_s, lambda: ctx.gen_broken(gen))
        except CollectiveAborted as e:
            if e.reason is AbortReason.WATCHDOG:
                ctx.events.emit(
                    EventKind.WATCHDOG_FIRED, step=step, gen=gen, timeout_s=timeout_s, during=during
                )
            raise Aborted(m.AbortPhase(e.reason), f"{during}: {e}") from None
        except RuntimeError as e:
            links.inflight = []
            raise Aborted(m.AbortPhase.EVAL, f"{during}: {str(e)[:300]}") from None
        links.inflight = []
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=ctx.config.watchdog.ceiling_s))
