"""JaxElasticTrainer: the elastic step protocol for a jitted JAX/optax training loop.

One per worker process, started by `elastrain run` exactly like the PyTorch
trainer (it reads the same environment):

    trainer = JaxElasticTrainer(params, optax.adam(1e-3), dataset, loss_fn,
                                TrainerConfig(global_batch_size=64, micro_batch_size=8,
                                              total_steps=100))
    for result in trainer.steps():
        ...
    trainer.params  # the trained parameters

`loss_fn(params, batch, key) -> scalar` is the mean loss of one micro-batch;
the trainer jits its `value_and_grad`. The protocol is the PyTorch path's
(`elastrain.runtime.trainer`, docs/design.md), on the same coordinator,
session, gloo groups, waiter, graveyard and watchdog:

1. Rendezvous: the coordinator answers with a generation once all its
   members are ready. Build its gloo group; heal the members that are behind
   from the up-to-date ones (`elastrain.transfer.heal` over a `JaxState`: JSON
   manifest + raw bytes, sealed with the job token, no pickle): params,
   optimizer state, PRNG key, step count (the data position is `step x global
   batch`); hash the state (`generation_start`).
2. Step `s`: ask the coordinator's verdict in the background while computing
   this rank's micro-batches of the fixed global batch (`assign_microbatches`).
   Micro-batch `i` gets the key `fold_in(fold_in(key, s), i)`, so neither the
   data nor the randomness depends on who is alive. The gradients (of the loss
   sums) go into one writable float64 buffer (float32 with reduce_dtype
   "native") with two extra slots, loss sum and
   sample count; on "proceed" it is all-reduced (SUM) as a torch tensor; then
   the sample count is checked against the global batch, the gradient is
   divided by it and one jitted optax update is applied: committed.
   Any error discards the step and goes back to 1 (the group is parked in the
   graveyard if work is in flight); the same step is retried.

Not here: checkpoints/resume, resharding inside a member (docs/jax.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import jax
import numpy as np
import torch

from elastrain import env
from elastrain.chaos.inject import inbox_path
from elastrain.chaos.points import FaultPoint, FaultPoints, parse_points
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches
from elastrain.exitcodes import EXIT_LEFT, EXIT_PREEMPTED, EXIT_REFUSED
from elastrain.jax.state import (
    GradLayout,
    JaxState,
    LossFn,
    Tree,
    is_typed_key,
    key_data,
    make_apply_fn,
    make_grad_fn,
    named_leaves,
    signature,
    stack_collate,
    state_hash,
)
from elastrain.observe.events import EventLog
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.group import (
    CollectiveAborted,
    Graveyard,
    Waiter,
    build_group,
    settle_before_exit,
)
from elastrain.runtime.session import JoinRefused, MemberSession
from elastrain.runtime.trainer import MapDataset, StepResult, heal_senders
from elastrain.runtime.watchdog import HangTimeout
from elastrain.transfer import HealError, heal

log = logging.getLogger("elastrain.jax")

_EXTRA = 2
"""Slots at the end of the all-reduce buffer: loss sum, sample count."""


class _Regroup(Exception):
    def __init__(self, phase: str, error: str) -> None:
        super().__init__(f"{phase}: {error}")
        self.phase = phase
        self.error = error


class JaxElasticTrainer:
    """Elastic data-parallel training of one JAX replica per worker process.

    Contract: every worker constructs it with the same initial params (same
    init and seed), the same optax optimizer, dataset and config, then
    iterates `steps()`. Survivors keep their process and state across
    failures; a joiner is healed from its peers. `steps()` yields after each
    committed step and returns when `total_steps` are committed. SIGTERM makes
    the worker leave at the next step boundary (exit EXIT_LEFT).
    """

    def __init__(
        self,
        params: Tree,
        optimizer: Any,
        dataset: MapDataset,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        key: Any = None,
        collate_fn: Callable[[list[Any]], Any] = stack_collate,
        coordinator: str | None = None,
        token: str | None = None,
        member_id: str | None = None,
        run_dir: str | None = None,
    ) -> None:
        if os.environ.get(env.STEPS):
            config = replace(config, total_steps=int(os.environ[env.STEPS]))
        if config.checkpoints_periodic or os.environ.get(env.CKPT_EVERY):
            log.warning("the JAX trainer takes no checkpoints; checkpoint settings are ignored")
        self.config = config
        self.params: Tree = jax.tree_util.tree_map(jax.numpy.asarray, params)
        self.optimizer = optimizer
        self.opt_state: Tree = optimizer.init(self.params)
        self._typed_key = key is not None and is_typed_key(key)
        self._key_impl = jax.random.key_impl(key) if self._typed_key else None
        self.key: jax.Array = key_data(jax.random.PRNGKey(config.seed) if key is None else key)
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.collate_fn = collate_fn
        self._layout = GradLayout.of(self.params)
        self._grad = make_grad_fn(loss_fn, self._layout, config.micro_batch_size)
        self._apply = make_apply_fn(optimizer, self._layout, config.global_batch_size)

        address = coordinator or os.environ.get(env.COORDINATOR)
        tok = token or os.environ.get(env.TOKEN)
        if tok is None and os.environ.get(env.TOKEN_FILE):
            with open(os.environ[env.TOKEN_FILE]) as f:
                tok = f.read().strip()
        if not address or not tok:
            raise ValueError(
                f"no coordinator: start workers with `elastrain run`, or set {env.COORDINATOR} "
                f"and {env.TOKEN} (or pass coordinator= and token=)"
            )
        self.member = member_id or os.environ.get(env.MEMBER_ID) or f"pid{os.getpid()}"
        self.host = os.environ.get(env.ADVERTISE_HOST, "127.0.0.1")
        run_dir = run_dir or os.environ.get(env.RUN_DIR)
        self.events = EventLog(run_dir, self.member)
        self.client = CoordinatorClient(address, tok, timeout_s=config.coordinator_timeout_s)
        self.waiter = Waiter()
        self.session = MemberSession(
            self.client,
            self.member,
            signature(self.params),
            host=self.host,
            on_change=self.waiter.interrupt,
            events=self.events,
        )
        self.faults = FaultPoints(
            self.member,
            parse_points(os.environ.get(env.FAULTS)),
            on_fire=self._fault_fired,
            inbox=inbox_path(run_dir, self.member) if run_dir else None,
        )
        self.order = GlobalOrder(len(dataset), config.seed, shuffle=config.shuffle)
        self.hang = HangTimeout(config)
        self.graveyard = Graveyard()
        self._quorum_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="elastrain-quorum"
        )
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="elastrain-hash"
        )
        self._hashing: concurrent.futures.Future[None] | None = None
        self.committed = 0
        self._commit_gen = 0
        self.gen = 0
        self.members: list[str] = []
        self.rank = 0
        self._pg: Any = None
        self._inflight: list[Any] = []
        self._last_loss: float | None = None
        self._last_wait_msg = 0.0
        self._job_finished = False
        self._closed = False

    # ---- public ----------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of the current generation (for logging, not for correctness)."""
        return self.rank == 0

    @property
    def holds_final_state(self) -> bool:
        """True once this member holds the state after the last step."""
        return self.committed >= self.config.total_steps

    def step_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key micro-batch `microbatch` of step `step` gets (membership-free)."""
        base = (
            jax.random.wrap_key_data(self.key, impl=self._key_impl) if self._typed_key else self.key
        )
        return jax.random.fold_in(jax.random.fold_in(base, step), microbatch)

    def state_tree(self) -> Tree:
        """Everything a member holds that must be identical across members."""
        return {"params": self.params, "opt_state": self.opt_state, "key": self.key}

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.session.request_leave("left")
        self.waiter.interrupt()

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit."""
        self._install_sigterm()
        self.events.emit("worker_start", member=self.member)
        self._warm_up()
        try:
            self.session.register()
        except JoinRefused as e:
            self._refused(str(e))
        except CoordinatorUnavailable as e:
            self.events.emit("worker_exit", reason="no_coordinator", committed=self.committed)
            self._shutdown()
            raise SystemExit(f"[{self.member}] cannot reach the coordinator: {e}") from e
        try:
            while self.committed < self.config.total_steps and not self._job_finished:
                if self._pg is None:
                    self._join_generation()
                    continue
                try:
                    result = self._run_step()
                except _Regroup as e:
                    self.events.emit(
                        "step_abort",
                        step=self.committed,
                        gen=self.gen,
                        error=e.error[:300],
                        phase=e.phase,
                    )
                    self._abandon(e.phase, e.error)
                    continue
                yield result
            self._finish()
        finally:
            self._shutdown()

    def run(self) -> list[StepResult]:
        """`steps()` to completion; returns every result."""
        return list(self.steps())

    # ---- generation ------------------------------------------------------------

    def _warm_up(self) -> None:
        """Compile the gradient and update functions before registering, so that a
        replacement's compile time does not stall its peers' first step with it."""
        t0 = time.monotonic()
        ids = self.order.ids(0, self.config.micro_batch_size)
        batch = self.collate_fn([self.dataset[j] for j in ids])
        _, flat = self._grad(self.params, batch, self.step_key(0, 0))
        out = self._apply(self.params, self.opt_state, flat)
        jax.block_until_ready(out)
        log.info("%s: jit compile + first run %.2f s", self.member, time.monotonic() - t0)

    def _join_generation(self) -> None:
        if self.session.leaving:
            self._exit_left()
        if self.session.expelled:
            log.warning("%s was expelled from the job; registering again", self.member)
            self._register_again(self.session.incarnation)
        self.events.emit("rendezvous_begin", known_gen=self.gen, committed=self.committed)
        inc = self.session.incarnation
        try:
            r = self.client.rendezvous(
                p.RendezvousRequest(
                    self.member,
                    inc,
                    self.gen,
                    self.committed,
                    wait_s=5.0,
                    commit_gen=self._commit_gen,
                )
            )
        except CoordinatorError as e:
            log.warning("rendezvous failed: %s; retrying", e)
            time.sleep(self.session.heartbeat_s)
            return
        if r.status == "finished":
            self._job_finished = True
            return
        if r.status in ("expelled", "unknown"):
            self._register_again(inc)
            return
        if r.status != "ready":
            now = time.monotonic()
            if r.message and now - self._last_wait_msg > 5:
                print(f"[{self.member}] waiting: {r.message}", flush=True)
                self._last_wait_msg = now
            return
        rank = r.members.index(self.member)
        t0 = time.monotonic()
        try:
            store = self.session.store(self.config.rendezvous_timeout_s)
            pg = build_group(
                store,
                f"{self.session.job_id}/gen{r.gen}",
                rank,
                len(r.members),
                host=self.host,
                connect_timeout_s=self.config.rendezvous_timeout_s,
                op_timeout_s=self.config.hang_timeout_ceiling_s,
            )
        except Exception as e:  # noqa: BLE001 - any failure to connect means: next generation
            log.warning("building group for generation %d failed: %s", r.gen, e)
            self.events.emit(
                "step_abort", step=self.committed, gen=r.gen, error=str(e)[:300], phase="regroup"
            )
            self.gen = r.gen
            return
        self.events.emit(
            "group_built", gen=r.gen, rank=rank, size=len(r.members), build_s=time.monotonic() - t0
        )
        self._pg, self.gen, self.members, self.rank = pg, r.gen, list(r.members), rank
        self.session.set_gen(r.gen, r.members)
        try:
            self._heal(r)
        except (HealError, RuntimeError, ValueError) as e:
            self.events.emit(
                "step_abort", step=self.committed, gen=self.gen, error=str(e)[:300], phase="heal"
            )
            self._abandon("heal", str(e))
            return
        # JAX arrays are immutable: hash this generation's starting state off the
        # critical path, overlapping the first step (nothing can change it).
        tree, gen, step, members = self.state_tree(), self.gen, self.committed, self.members

        def start_event() -> None:
            digest = state_hash(named_leaves(tree), step) if self.config.hash_state else ""
            self.events.emit(
                "generation_start",
                gen=gen,
                step=step,
                state_hash=digest,
                members=members,
                rank=rank,
            )

        self._hashing = self._hash_pool.submit(start_event)

    def _settle_hash(self) -> None:
        if self._hashing is not None:
            self._hashing.result()
            self._hashing = None

    def _heal(self, r: p.RendezvousResponse) -> None:
        senders, lineage = heal_senders(r)
        receivers = [i for i in range(len(r.members)) if i not in senders]
        if not receivers:
            return
        role = "send" if self.rank in senders else "recv" if self.rank in receivers else "idle"
        self.events.emit("heal_begin", gen=r.gen, role=role, bytes=0)
        meta = {"committed": self.committed, "last_loss": self._last_loss}
        state = JaxState(self.state_tree())
        got, stats = heal(
            self._pg,
            self.rank,
            senders,
            receivers,
            state,
            meta if role == "send" else None,
            self.config.heal_timeout_s,
            key=self.client.token.encode(),
        )
        if role == "recv" and (new := state.healed) is not None:
            self.params, self.opt_state, self.key = new["params"], new["opt_state"], new["key"]
            self.committed = int(got["committed"])
            self._last_loss = got.get("last_loss")
            self._commit_gen = lineage
            self.session.note_committed(self.committed)
        self.events.emit(
            "heal_end",
            gen=r.gen,
            role=role,
            bytes=stats.bytes,
            seconds=stats.seconds,
            rate_mb_s=stats.rate_mb_s,
        )

    def _abandon(self, phase: str, error: str) -> None:
        """Drop the current group (parking it if work is in flight) and forget the generation."""
        self._settle_hash()
        if self._pg is not None:
            self.graveyard.bury(self._pg, self._inflight)
        self._pg = None
        self._inflight = []
        self.session.set_gen(0)
        log.warning("%s: generation %d abandoned in %s: %s", self.member, self.gen, phase, error)

    # ---- one step --------------------------------------------------------------

    def _run_step(self) -> StepResult:
        cfg = self.config
        s = self.committed
        t0 = time.monotonic()
        inc = self.session.incarnation
        verdict = self._quorum_pool.submit(self.client.quorum, self._quorum_request(s, inc))
        mbs = step_microbatches(s, cfg.global_batch_size, cfg.micro_batch_size)
        mine = assign_microbatches(len(mbs), len(self.members), self.rank)
        # A fresh buffer every step: an abandoned all-reduce may still write into
        # the old one. JAX hands numpy read-only views, so sum into our own array.
        # float64 (reduce_dtype's default): exact sums of the float32 micro-batch
        # gradients, so the rounded result does not depend on who computed what.
        wide = cfg.reduce_dtype == "float64"
        buf: np.ndarray[Any, np.dtype[np.floating[Any]]] = np.zeros(
            self._layout.numel + _EXTRA, dtype=np.float64 if wide else np.float32
        )
        grad = buf[: self._layout.numel]
        samples: list[int] = []
        losses: list[Any] = []
        data_s = 0.0
        for k, i in enumerate(mine):
            if self.session.gen_broken(self.gen):
                raise _Regroup("superseded", "generation changed during compute")
            ids = self.order.ids(mbs[i].start, mbs[i].stop)
            t_data = time.monotonic()
            batch = self.collate_fn([self.dataset[j] for j in ids])
            data_s += time.monotonic() - t_data
            loss, flat = self._grad(self.params, batch, self.step_key(s, i))
            grad += np.asarray(flat)
            losses.append(loss)
            samples.extend(ids)
            if k == 0:
                self.faults.hit(s, "compute")
        loss_sum = float(sum(float(x) for x in losses)) * cfg.micro_batch_size
        t_compute = time.monotonic()
        v = self._verdict(verdict, s, inc)
        if v.verdict != "proceed":
            if self.session.leaving:
                self._exit_left()
            raise _Regroup("quorum", v.verdict)
        buf[-_EXTRA:] = (loss_sum, float(len(samples)))
        wire = torch.from_numpy(buf)  # shares buf's memory: the all-reduce sums in place
        self.events.emit("step_contrib", step=s, gen=self.gen, samples=samples)
        t_ar = time.monotonic()
        self._inflight = [self._pg.allreduce([wire])]
        self.faults.hit(s, "allreduce")
        timeout = self.hang.timeout_s
        try:
            self.waiter.wait(self._inflight, timeout, lambda: self.session.gen_broken(self.gen))
        except CollectiveAborted as e:
            if e.reason == "watchdog":
                self.events.emit("watchdog_fired", step=s, gen=self.gen, timeout_s=timeout)
            raise _Regroup(e.reason, str(e)) from e
        except RuntimeError as e:
            self._inflight = []
            raise _Regroup("allreduce", str(e)[:300]) from e
        self._inflight = []
        t_done = time.monotonic()
        self.hang.observe(t_done - t_ar)
        total_loss, count = float(buf[-2]), int(round(float(buf[-1])))
        if count != cfg.global_batch_size:
            # Exactly-once would be violated: never apply such a step.
            raise _Regroup(
                "allreduce", f"step {s} summed {count} samples, expected {cfg.global_batch_size}"
            )
        self._settle_hash()
        summed = jax.numpy.asarray(grad.astype(np.float32) if wide else grad)
        params, opt_state = self._apply(self.params, self.opt_state, summed)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state
        self.committed = s + 1
        self._commit_gen = self.gen
        self.session.note_committed(self.committed)
        loss_mean = total_loss / count
        self._last_loss = loss_mean
        t_end = time.monotonic()
        self.events.emit(
            "step_commit",
            step=s,
            gen=self.gen,
            loss=loss_mean,
            step_s=t_end - t0,
            compute_s=t_compute - t0,
            allreduce_s=t_done - t_ar,
            data_s=data_s,
            samples=count,
            samples_per_s=count / max(t_end - t0, 1e-9),
        )
        if v.preempt_s > 0:
            self._preempted()
        self.faults.hit(s, "commit")
        return StepResult(s, loss_mean, self.gen, len(self.members), self.rank, t_end - t0)

    def _verdict(
        self, pending: concurrent.futures.Future[p.QuorumResponse], step: int, inc: int
    ) -> p.QuorumResponse:
        """The coordinator's verdict, or "proceed" when it cannot be reached (the
        all-reduce and the sample count are the real agreement; see the PyTorch path)."""
        try:
            v = pending.result(timeout=self.config.coordinator_timeout_s)
        except (CoordinatorUnavailable, concurrent.futures.TimeoutError) as e:
            if self.session.leaving:
                self._exit_left()
            self.session.coordinator_unreachable("quorum", str(e))
            return p.QuorumResponse("proceed", self.gen)
        except CoordinatorError as e:
            raise _Regroup("quorum", str(e)) from e
        if v.verdict == "unknown":
            self._register_again(inc)
        if v.verdict in ("unknown", "expelled") and self.session.incarnation != inc:
            try:
                v = self.client.quorum(self._quorum_request(step, self.session.incarnation))
            except CoordinatorError as e:
                raise _Regroup("quorum", str(e)) from e
        return v

    def _quorum_request(self, step: int, inc: int) -> p.QuorumRequest:
        return p.QuorumRequest(
            self.member,
            inc,
            self.gen,
            step,
            self.session.leaving,
            self._last_loss,
            self.config.global_batch_size,
        )

    def _register_again(self, stale_incarnation: int) -> None:
        try:
            self.session.ensure_registered(stale_incarnation)
        except JoinRefused as e:
            self._refused(str(e))
        except CoordinatorUnavailable as e:
            log.warning("registering again failed: %s; retrying", e)

    # ---- leaving ---------------------------------------------------------------

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(_sig: int, _frame: object) -> None:
            self.request_leave()

        signal.signal(signal.SIGTERM, on_term)

    def _fault_fired(self, f: FaultPoint) -> None:
        self.events.emit(
            "fault_injected",
            fault=f.action,
            member=self.member,
            pid=os.getpid(),
            step=self.committed,
            phase=f.phase,
        )

    def _preempted(self) -> None:
        """The whole job is being preempted. The JAX path takes no checkpoint: exit."""
        print(f"[{self.member}] preempted at step {self.committed} (no checkpoint)", flush=True)
        self.events.emit("worker_exit", reason="preempted", committed=self.committed)
        self.session.request_leave("left")
        self._shutdown()
        raise SystemExit(EXIT_PREEMPTED)

    def _exit_left(self) -> None:
        self.events.emit("worker_exit", reason="left", committed=self.committed)
        self._shutdown()
        raise SystemExit(EXIT_LEFT)

    def _refused(self, why: str) -> None:
        print(f"[{self.member}] refused by the coordinator: {why}", flush=True)
        self.events.emit("worker_exit", reason="refused", committed=self.committed)
        self._shutdown()
        raise SystemExit(EXIT_REFUSED)

    def _finish(self) -> None:
        try:
            self.client.leave(
                p.LeaveRequest(self.member, self.session.incarnation, "done", self.committed)
            )
        except CoordinatorError as e:
            log.warning("could not tell the coordinator we are done: %s", e)
        self.events.emit("worker_exit", reason="done", committed=self.committed)

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._settle_hash()
        if self._pg is not None:
            self.graveyard.bury(self._pg, self._inflight)
            self._pg = None
        self.session.close()
        self._quorum_pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False)
        settle_before_exit(self.waiter, self.graveyard, self.member)
        self.client.close()
        self.events.close()
