"""The step engine: one member's elastic step protocol, for every framework.

    user script ──▶ ElasticTrainer / JaxElasticTrainer   (public API, thin)
                        │ builds (with a Topology: replicated or sharded)
                        ▼
                    StepEngine ──── MemberProtocol (pure: observation -> action)
                        │ performs each action with one part:
        Rendezvous      register, rendezvous, the generation's groups (rendezvous.py)
        Healing         heal (the topology's), landing reserve, state hash (healing.py)
        StepRun         compute, verdict, reduce, apply (step_run.py)
        BetweenSteps    evaluation, pause barriers (between.py)
        Saving          due and emergency checkpoints (saving.py)
        StartState      resume before the loop, standby refresh (start_state.py)
                        ... over shared ones: DataFeed (feed.py), Carried (carried.py),
                        Context + Links (context.py), Topology (topology.py)

The engine is the loop that performs each `Action` the protocol returns and
reports what happened as the next observation; the action table maps each
action to the part that owns it. The parts share one `Context` (the worker's
services and the current generation's `Links`), never each other's attributes.
What differs between layouts (what a member computes, which reductions run,
who heals whom, what a checkpoint part is) is the `Topology`'s, chosen once by
the trainer. The step (docs/design/step-protocol.md has the argument):

1. Rendezvous: the coordinator answers with a generation (ordered members)
   once all of them are ready, with each one's committed step.
2. Build the generation's groups; heal members that are behind from the
   up-to-date ones; hash the state off the critical path.
3. Step `s`: ask the verdict for (gen, s) in the background while computing
   this rank's share of the step's micro-batches; on "proceed" reduce
   [gradient sum | loss sum, sample count, checkpoint measurements], check the
   count, divide by the global batch, update: committed. Anything else drops
   the groups and goes back to 1; the same step is retried.
4. After a commit: a due checkpoint snapshot; a preemption notice means one
   emergency checkpoint, then exit.

Invariants kept here: never reuse a buffer with a collective in flight
(`Backend.discard` on abandon), never apply a step without the full sample
count (the protocol), settle every background reader of the state (the state
hash, a checkpoint's deferred copy) before anything writes it: the loop calls
`_settle_readers` before every action not in `READ_ONLY` (apply, heal,
abandon, an emergency checkpoint, the end...) and at shutdown.

Exits: the engine raises `WorkerExit(code, reason)`; the worker entry point
(`elastrain.worker`) turns it into the process exit status.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from elastrain.checkpoint.manager import Checkpointing
from elastrain.checkpoint.restore import parse_resume, resolve_directory
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError
from elastrain.data import check_dataset
from elastrain.exitcodes import EXIT_DEVICE_POISONED, WorkerExit
from elastrain.observe.events import EventKind, EventLog
from elastrain.observe.scalars import check_scalar
from elastrain.observe.tally import WorkerTally
from elastrain.observe.worker import WorkerMetering
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.backend import Backend
from elastrain.runtime.between import BetweenSteps
from elastrain.runtime.carried import Carried
from elastrain.runtime.config import TrainerConfig, WorkerEnv
from elastrain.runtime.context import Context
from elastrain.runtime.device import check_device, is_poisoned
from elastrain.runtime.evaluate import EvalResult, Evaluation
from elastrain.runtime.feed import DataFeed, DataSource, MapDataset
from elastrain.runtime.group import Graveyard, Waiter, settle_before_exit
from elastrain.runtime.healing import Healing
from elastrain.runtime.leaving import announce_exit
from elastrain.runtime.preflight import batch_problems, exit_misconfigured
from elastrain.runtime.rendezvous import GroupFactory, Rendezvous
from elastrain.runtime.replicas import Replicated
from elastrain.runtime.saving import Saving
from elastrain.runtime.session import MemberSession
from elastrain.runtime.start_state import StartState
from elastrain.runtime.step_run import EXTRA_SLOTS, StepResult, StepRun
from elastrain.runtime.topology import TopologyFactory
from elastrain.runtime.watchdog import HangTimeout
from elastrain.transfer import HealAuth, HealFn, heal_with

__all__ = ["EXTRA_SLOTS", "DataSource", "MapDataset", "StepEngine", "StepResult"]

log = logging.getLogger("elastrain.engine")

READ_ONLY: frozenset[m.Do] = frozenset(
    {
        m.Do.REGISTER,
        m.Do.REGISTER_AGAIN,
        m.Do.RENDEZVOUS,
        m.Do.BACK_OFF,
        m.Do.COMPUTE,
        m.Do.VERDICT,
        m.Do.ASK_AGAIN,
        m.Do.REDUCE,
        m.Do.EVALUATE,
    }
)
"""The actions that never write the parameters nor the optimizer state (forward
writes only model buffers, which checkpoints copy at once). Background readers
of the state (the state hash, a checkpoint's deferred copy) run on through them;
the loop settles them before any other action, so an action added later is
treated as a writer unless it is listed here."""


class StepEngine:
    """Drives one member through the step protocol with a `Backend`.

    Contract: every member of the job builds one with the same backend type,
    topology, model architecture, optimizer, dataset and config, then iterates
    `steps()`. Survivors keep their process and state across failures; a
    joiner is healed from its peers. `steps()` yields after each committed
    step and returns when `total_steps` are committed; it raises `WorkerExit`
    when this worker must end (SIGTERM leave, preemption, refusal, no
    coordinator). `client`, `groups` and `heal_fn` are seams for in-process
    tests (tests/test_protocol.py); by default they are the coordinator's
    HTTP client, gloo groups over the coordinator's store and the striped heal.
    `topology` builds the job's layout (default: `Replicated`).
    """

    def __init__(
        self,
        backend: Backend,
        dataset: DataSource,
        collate_fn: Callable[[list[Any]], Any],
        config: TrainerConfig,
        where: WorkerEnv,
        *,
        client: CoordinatorClient | None = None,
        groups: GroupFactory | None = None,
        heal_fn: HealFn | None = None,
        topology: TopologyFactory = Replicated,
    ) -> None:
        # `config` already carries the launcher's overrides (`worker_setup`).
        if not where.coordinator and client is None:
            raise ValueError(
                "no coordinator: start workers with `elastrain run`, or set "
                "ELASTRAIN_COORDINATOR and ELASTRAIN_TOKEN (or pass coordinator= and token=)"
            )
        if not where.token and client is None:
            raise ValueError(
                "no job token: set ELASTRAIN_TOKEN or ELASTRAIN_TOKEN_FILE (or pass token=)"
            )
        check_dataset(dataset)
        self.backend = backend
        self.config = config
        self.member = where.member or f"pid{os.getpid()}"
        self.placement = {
            k: v
            for k, v in (("devices", where.visible_devices), ("local_rank", where.local_rank))
            if v is not None
        }
        """Where the launcher placed this worker (--devices), for `worker_start`."""
        self.events = EventLog(where.run_dir, self.member)
        self.tally = WorkerTally()
        """This worker's numbers for the coordinator's /metrics, from its own
        events, sent with each quorum request (elastrain.observe.tally)."""
        self.events.listen(self.tally.see)
        token = where.token or ""
        client = client or CoordinatorClient(
            where.coordinator or "", token, timeout_s=config.timeouts.coordinator_s
        )
        waiter = Waiter()
        self.ctx = Context(
            member=self.member,
            host=where.host,
            token=token,
            config=config,
            backend=backend,
            events=self.events,
            client=client,
            session=MemberSession(
                client,
                self.member,
                backend.signature(),
                host=where.host,
                on_change=waiter.interrupt,
                events=self.events,
            ),
            waiter=waiter,
            graveyard=Graveyard(),
            hang=HangTimeout(config.watchdog),
            proto=m.MemberProtocol(self.member, config.total_steps, config.global_batch_size),
            step_hooks=hooks.installed(),
        )
        ctx = self.ctx
        self.topology = topology(ctx)
        """How this job's members hold the model (`elastrain.runtime.topology`)."""
        self.transport = self.topology.transport(config.collectives, backend.device)
        """What carries the gradient all-reduce (`elastrain.runtime.collectives`)."""
        self.ckpt = Checkpointing(
            config.checkpoint,
            resolve_directory(config.checkpoint_dir, where.checkpoint_dir, where.run_dir),
            self.events,
            self.member,
            format=self.topology.checkpoint_format(config.checkpoint.format),
        )
        self.feed = DataFeed(dataset, collate_fn, config, self.member)
        self.carried = Carried(backend, self.feed, self.ckpt, ctx.session)
        self.saving = Saving(ctx, self.ckpt, self.carried, self.topology)
        self.start = StartState(
            ctx,
            self.ckpt,
            self.topology,
            self.feed,
            self.carried,
            parse_resume(where.resume, "latest" if config.checkpoints_periodic else "none"),
            where.resume_from,
            where.resume_step,
        )
        self.rendezvous = Rendezvous(
            ctx,
            self.topology,
            self.transport,
            groups,
            self.start.refresh_standby,
            lambda a: self.healing.prepare_heal(a),
        )
        self.healing = Healing(
            ctx,
            self.topology,
            self.carried,
            self.ckpt,
            heal_fn or heal_with(HealAuth(config.heal_auth)),
            self.saving.resume_hint,
            self._shutdown,
        )
        self.run = StepRun(ctx, self.topology, self.feed, self.carried, self.ckpt, self.tally)
        self.between = BetweenSteps(ctx, self.carried, self.topology)
        self._result: StepResult | None = None
        self._after_commit: Callable[[], None] | None = None
        self.started = False
        """`steps()` began: the state's layout (registered objects) is fixed."""
        self._metering: WorkerMetering | None = None
        self._closed = False
        self._perform: dict[m.Do, Callable[[m.Action], m.Observation]] = {
            m.Do.REGISTER: self._register,
            m.Do.REGISTER_AGAIN: self.rendezvous.register_again,
            m.Do.RENDEZVOUS: self.rendezvous.rendezvous,
            m.Do.BACK_OFF: self.rendezvous.back_off,
            m.Do.CONNECT: self.rendezvous.connect,
            m.Do.HEAL: self.healing.heal,
            m.Do.COMPUTE: self.run.compute,
            m.Do.VERDICT: self.run.verdict,
            m.Do.ASK_AGAIN: self.run.ask_again,
            m.Do.REDUCE: self.run.reduce,
            m.Do.APPLY: self._apply,
            m.Do.EVALUATE: self.between.evaluate,
            m.Do.EMERGENCY_CHECKPOINT: self.saving.emergency,
            m.Do.ABANDON: self._abandon,
        }

    # ---- the member's view -------------------------------------------------------

    @property
    def session(self) -> MemberSession:
        return self.ctx.session

    @property
    def proto(self) -> m.MemberProtocol:
        return self.ctx.proto

    @property
    def hang(self) -> HangTimeout:
        return self.ctx.hang

    @property
    def client(self) -> CoordinatorClient:
        return self.ctx.client

    @property
    def committed(self) -> int:
        return self.proto.committed

    @property
    def gen(self) -> int:
        return self.proto.gen

    @property
    def members(self) -> list[str]:
        return list(self.proto.members)

    @property
    def rank(self) -> int:
        return self.proto.rank

    @property
    def skipped_steps(self) -> int:
        """Committed steps that did not update the state (travels with the state)."""
        return self.carried.skipped_steps

    @property
    def eval_result(self) -> EvalResult | None:
        """The newest evaluation's result; travels with the state (heal, checkpoint)."""
        return self.carried.eval_result

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.session.request_leave("left")
        self.ctx.waiter.interrupt()

    def log(self, name: str, value: float) -> None:
        """Record the script's scalar `name` (see `EngineTrainer.log`): checked on
        every member, emitted as a `user_scalar` event on rank 0 only."""
        v = check_scalar(name, value)
        # Before the first generation every member's rank reads 0: nobody reports.
        if self.proto.members and self.proto.rank == 0:
            step = max(self.committed - 1, 0)
            self.events.emit(EventKind.USER_SCALAR, name=name, value=v, step=step)

    def set_evaluation(self, evaluation: Evaluation) -> None:
        """Evaluate with ``evaluation`` at the counts it names; before `steps()` only."""
        if self.started:
            raise RuntimeError("evaluate_every() after steps() began: set it up before the loop")
        self.between.set_evaluation(evaluation)

    def pause_barrier(self, began: float, timeout_s: float | None) -> None:
        """The end of `trainer.pause()` (`BetweenSteps.pause_barrier`)."""
        self.between.pause_barrier(began, timeout_s)

    # ---- the loop ----------------------------------------------------------------

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit.

        What the caller does with a result before asking for the next (stepping an
        LR scheduler) belongs to that step: the step's checkpoint is taken, and its
        commit hook called, only when the caller comes back."""
        self.started = True
        loader = self.feed.loader
        # Data worker processes are forked first, while this process has few threads.
        loader.start()
        self._install_sigterm()
        for h in self.ctx.step_hooks:
            h.attach(self.member, self.events)
        self.events.emit(
            EventKind.WORKER_START,
            member=self.member,
            data_workers=loader.worker_pids,
            collectives=self.transport.transport,
            collectives_why=self.transport.why,
            **self.placement,
        )
        try:
            self._check_setup()
            if (why := check_device(self.backend.device)) is not None:
                self._leave_poisoned(f"health check failed: {why}")
            self.start.resume()
            # One micro-batch serves both the warm-up and the FLOP count (loaded once).
            first = self.feed.first_batch(self.committed)
            t0 = time.monotonic()
            self.backend.warm_up(first, EXTRA_SLOTS)
            log.debug("%s: warm-up %.2f s", self.member, time.monotonic() - t0)
            self._metering = WorkerMetering.start(
                self.events, functools.partial(self._count_flops, first)
            )
            del first
            action = self.proto.advance(m.Started())
            while True:
                if action.do not in READ_ONLY:
                    self._settle_readers()
                if action.do is m.Do.FINISH:
                    self._finish()
                    return
                if action.do is m.Do.EXIT:
                    self._exit(action)
                try:
                    obs = self._perform[action.do](action)
                except WorkerExit:
                    raise  # the library's own exit, whatever its message says
                except Exception as e:  # noqa: BLE001 - only a poisoned device is handled
                    if not is_poisoned(e):
                        raise
                    lines = str(e).strip().splitlines()
                    self._leave_poisoned(f"{type(e).__name__}: {lines[0] if lines else ''}")
                action = self.proto.advance(obs, self._flags())
                if isinstance(obs, m.Applied):
                    assert self._result is not None
                    yield self._result
                    if self._after_commit is not None:
                        self._after_commit()
                        self._after_commit = None
        finally:
            self._shutdown()

    def _flags(self) -> m.Flags:
        return m.Flags(leaving=self.session.leaving, expelled=self.session.expelled)

    def _register(self, a: m.Action) -> m.Observation:
        obs = self.rendezvous.register()
        if isinstance(obs, m.Registered):
            self.healing.reserve_landing(self.rendezvous.joined)
        return obs

    def _apply(self, a: m.Action) -> m.Observation:
        obs, self._result = self.run.apply(a, self.between.take_fresh(a.step))
        if a.grace_s <= 0:
            # Once the caller's own work on this result is done (`steps`).
            self._after_commit = functools.partial(
                self.saving.after_commit, a.step, a.gen, list(self.proto.members), self.proto.rank
            )
        return obs

    def _abandon(self, a: m.Action) -> m.Observation:
        """Drop the current groups (parking them if work is in flight) and forget the
        generation."""
        assert a.phase is not None
        self.events.emit(
            EventKind.STEP_ABORT, step=a.step, gen=a.gen, error=a.error[:300], phase=a.phase
        )
        self.rendezvous.drop()
        self.ctx.links.inflight = []
        self.ctx.links.broken = None
        self.run.forget()
        # An abandoned all-reduce may still complete later and write into its
        # buffer: never reuse it.
        self.backend.discard()
        self.session.set_gen(0)
        log.warning("%s: generation %d abandoned in %s: %s", self.member, a.gen, a.phase, a.error)
        return m.Abandoned()

    def _settle_readers(self) -> None:
        """The state is about to be written: wait for the threads that read it (the
        state hash, the last checkpoint's deferred copy, whose wait counts as that
        checkpoint's blocking time)."""
        self.healing.settle()
        self.ckpt.settle()

    # ---- setup -------------------------------------------------------------------

    def _check_setup(self) -> None:
        """Well-known mistakes only this process can see (a DDP-wrapped model, a process
        group the script made itself) end it at once with what to change; so does a
        checkpoint format the job cannot write (checked at start, not at the first
        checkpoint, which would fail every time)."""
        cfg = self.config
        problems = (
            self.backend.problems()
            + batch_problems(cfg.global_batch_size, cfg.micro_batch_size)
            + self.topology.format_problems(cfg.checkpoint.format, self.ckpt.format)
        )
        if problems:
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.MISCONFIGURED, committed=self.committed
            )
            self._shutdown()
            exit_misconfigured("; ".join(problems))

    def _count_flops(self, batch: Any) -> dict[str, Any] | None:
        cfg = self.config
        fields = self.backend.count_flops(batch, cfg.micro_batch_size, cfg.global_batch_size)
        if fields is None:
            return None
        return {
            **fields,
            "micro_batch": cfg.micro_batch_size,
            "global_batch": cfg.global_batch_size,
        }

    # ---- leaving -------------------------------------------------------------------

    def _leave_poisoned(self, why: str) -> NoReturn:
        """End this worker for good (`EXIT_DEVICE_POISONED`): its device cannot be
        trusted again in this process, and its launcher or agent replaces it.

        No orderly shutdown: freeing a CUDA tensor after a sticky error makes torch
        abort the process (seen on an H200: a helper thread dropping a tensor turned
        exit 74 into SIGABRT), and the engine's threads, loader and checkpoint writer
        all hold some. So the coordinator is told, the event written, and the entry
        point ends the process at once (`WorkerExit.immediate`): what it leaves
        undone is what a SIGKILL leaves, which the peers and the checkpoints already
        survive."""
        announce_exit(
            self.client, self.events, self.member, EXIT_DEVICE_POISONED,
            m.ExitReason.DEVICE_POISONED, self.committed, f"device poisoned ({why})",
        )  # fmt: skip
        self.events.close()
        self._closed = True  # steps()' `finally` must not shut down in order either
        raise WorkerExit(
            EXIT_DEVICE_POISONED,
            m.ExitReason.DEVICE_POISONED,
            f"elastrain: {self.member}'s device failed ({why}); a fresh process takes its "
            "place (this one is never reused)",
            immediate=True,
        )

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(_sig: int, _frame: object) -> None:
            self.request_leave()

        signal.signal(signal.SIGTERM, on_term)

    def _finish(self) -> None:
        try:
            self.client.leave(
                p.LeaveRequest(self.member, self.session.incarnation, "done", self.committed)
            )
        except CoordinatorError as e:
            log.warning("could not tell the coordinator we are done: %s", e)
        self.events.emit(EventKind.WORKER_EXIT, reason=m.ExitReason.DONE, committed=self.committed)

    def _exit(self, a: m.Action) -> None:
        assert a.reason is not None
        if a.reason == m.ExitReason.REFUSED:
            print(f"[{self.member}] refused by the coordinator: {a.message}", flush=True)
        if a.reason == m.ExitReason.PREEMPTED:
            self.session.request_leave("left")
        self.events.emit(EventKind.WORKER_EXIT, reason=a.reason, committed=self.committed)
        self._shutdown()
        message = a.message if a.reason == m.ExitReason.NO_COORDINATOR else ""
        raise WorkerExit(a.code, a.reason, message)

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._settle_readers()
        self.feed.loader.close()
        self.ckpt.close()
        self.rendezvous.drop()
        self.topology.close()  # what `drop` kept for a next generation
        self.session.close()
        self.run.close()
        self.healing.close()
        self.rendezvous.wait_for_builds()
        settle_before_exit(self.ctx.waiter, self.ctx.graveyard, self.member)
        self.client.close()
        if self._metering is not None:
            self._metering.stop()
        self.events.close()
