"""ElasticTrainer: data-parallel training that survives dead, hung and leaving peers.

Run one per worker process (the launcher starts them with the coordinator's
address, the job token and a member id in the environment):

    trainer = ElasticTrainer(model, optimizer, dataset, loss_fn,
                             TrainerConfig(global_batch_size=64, micro_batch_size=8, total_steps=100))
    for result in trainer.steps():
        ...

The step protocol (docs/design.md has the full argument):
1. Rendezvous: ask the coordinator for a generation (ordered members); it
   answers once every member of it is ready, with each one's committed step.
2. Build the generation's gloo group; heal members that are behind from the
   up-to-date ones (striped, checksummed, no pickle); hash the state.
3. Each step `s`: ask the coordinator's verdict for (gen, s) in the
   background while computing this rank's share of the step's micro-batches;
   on "proceed" all-reduce [gradient sum, loss sum, sample count], divide by
   the global batch, step the optimizer: committed. Anything else (a peer died,
   the watchdog fired, the coordinator announced a new generation) discards the
   step's gradients and goes back to 1; the same step is retried.
4. Durable checkpoints (`elastrain.runtime.durable`): after committing a step
   where one is due, every member snapshots its stripe of the state and
   writes it in the background; rank 0 commits it once every stripe is on
   disk. At start, before the first rendezvous, a worker loads the checkpoint
   to resume from and reports its step count. A preemption notice from the
   coordinator (the whole job got SIGTERM) makes every member take one
   emergency checkpoint after the step it is told, then exit.
5. Coordinator outages: a verdict that cannot be fetched counts as "proceed"
   (the all-reduce is the agreement); a restarted coordinator that does not
   know this member gets a registration reporting the running generation.

This module is longer than our ~600-line norm on purpose: it is the one state
machine of the step protocol, and its invariants (never reuse a buffer with a
collective in flight, never apply a step without the full sample count, settle
the state hash before anything writes the parameters) are easier to check in
one place. Checkpointing, resume, sessions, groups and heals live beside it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from elastrain import env
from elastrain.chaos.inject import inbox_path
from elastrain.chaos.points import FaultPoint, FaultPoints, parse_points
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches
from elastrain.exitcodes import EXIT_LEFT, EXIT_PREEMPTED, EXIT_REFUSED
from elastrain.observe.events import EventLog
from elastrain.observe.worker import WorkerMetering
from elastrain.runtime.ckpt_schedule import CONTRIB_SLOTS
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.durable import Checkpointing
from elastrain.runtime.group import (
    CollectiveAborted,
    Graveyard,
    Waiter,
    build_group,
    settle_before_exit,
    tensor_allreduce,
)
from elastrain.runtime.resume import (
    from_ordered_json,
    install_checkpoint,
    load_resume,
    ordered_json,
    parse_resume,
    resolve_directory,
)
from elastrain.runtime.session import JoinRefused, MemberSession
from elastrain.runtime.watchdog import HangTimeout
from elastrain.transfer import HealError, TorchState, heal, model_signature, state_hash
from elastrain.transfer.flatten import flatten_state

log = logging.getLogger("elastrain.trainer")


_EXTRA = 2 + CONTRIB_SLOTS
"""Values riding at the end of the first reduce buffer in the step's all-reduce:
loss sum, sample count, then the checkpoint schedule's measurements."""

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class MapDataset(Protocol):
    """A map-style dataset: `len()` and integer indexing (torch Datasets qualify)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


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


class _Regroup(Exception):
    def __init__(self, phase: str, error: str) -> None:
        super().__init__(f"{phase}: {error}")
        self.phase = phase
        self.error = error


class ElasticTrainer:
    """Elastic data-parallel training of one model replica per worker process.

    Contract: every worker of the job constructs it with the same model
    architecture, optimizer type, dataset and config, then iterates `steps()`.
    Survivors keep their process and state across failures; a joiner is healed
    from its peers. `steps()` yields after each committed step and returns when
    `total_steps` are committed. A SIGTERM makes this worker leave at the next
    step boundary and exit with EXIT_LEFT. With a checkpoint directory (the
    run directory's ``checkpoints/`` by default) it resumes from the
    checkpoint the launcher chose before its first rendezvous, takes the
    periodic checkpoints `TrainerConfig` asks for, and, on a preemption
    notice, one emergency checkpoint before exiting with EXIT_PREEMPTED.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: MapDataset,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        coordinator: str | None = None,
        token: str | None = None,
        member_id: str | None = None,
        run_dir: str | None = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        load_extra_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        config = _env_overrides(config)
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.config = config
        self.collate_fn = collate_fn
        self.extra_state = extra_state
        self.load_extra_state = load_extra_state
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
        self.ckpt = Checkpointing(
            config,
            resolve_directory(config.checkpoint_dir, os.environ.get(env.CKPT_DIR), run_dir),
            self.events,
            self.member,
        )
        self._resume_mode = parse_resume(
            os.environ.get(env.RESUME), "latest" if config.checkpoints_periodic else "none"
        )
        self.client = CoordinatorClient(address, tok, timeout_s=config.coordinator_timeout_s)
        self.waiter = Waiter()
        self.session = MemberSession(
            self.client,
            self.member,
            model_signature(model),
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
        self.committed = 0
        self._commit_gen = 0
        self.gen = 0
        self.members: list[str] = []
        self.rank = 0
        self._pg: Any = None
        self._flats: list[torch.Tensor] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._reduce: list[torch.Tensor] = []
        self._last_loss: float | None = None
        self._last_wait_msg = 0.0
        self._job_finished = False
        self._inflight: list[Any] = []
        self._hashing: concurrent.futures.Future[None] | None = None
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="elastrain-hash"
        )

    # ---- public ----------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of the current generation (for logging, not for correctness)."""
        return self.rank == 0

    @property
    def holds_final_state(self) -> bool:
        """True once this member holds the state after the last step (False on a
        joiner that arrived after the job had finished: its model is untrained)."""
        return self.committed >= self.config.total_steps

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.session.request_leave("left")
        self.waiter.interrupt()

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit."""
        self._install_sigterm()
        self.events.emit("worker_start", member=self.member)
        self._resume()
        self._metering = WorkerMetering.start(self)
        try:
            self.session.register()
        except JoinRefused as e:
            self._refused(str(e))
        except CoordinatorUnavailable as e:
            self.events.emit("worker_exit", reason="no_coordinator", committed=self.committed)
            self._shutdown()
            raise SystemExit(
                f"[{self.member}] cannot reach the coordinator after "
                f"{self.session.register_timeout_s:g} s: {e}"
            ) from e
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
            time.sleep(
                self.session.heartbeat_s
            )  # back-off before retrying an unreachable coordinator
            return
        if r.status == "finished":
            log.info("the job finished while %s was waiting", self.member)
            self._job_finished = True
            return
        if r.status in ("expelled", "unknown"):
            self._register_again(inc)
            return
        if r.status != "ready":
            now = time.monotonic()
            if r.message and now - self._last_wait_msg > 5:
                log.warning("waiting: %s", r.message)
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
        except (HealError, RuntimeError) as e:
            self.events.emit(
                "step_abort", step=self.committed, gen=self.gen, error=str(e)[:300], phase="heal"
            )
            self._abandon("heal", str(e))
            return
        self.ckpt.note_generation(r.reason)
        # Hash the state off the recovery's critical path: it overlaps the first
        # step's compute, which only reads the parameters; `_settle_hash` joins
        # it before anything writes them (optimizer step, heal, shutdown).
        gen, step, members, rank = self.gen, self.committed, self.members, self.rank

        def start_event() -> None:
            digest = state_hash(self.model, self.optimizer) if self.config.hash_state else ""
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
        meta = self._meta() if role == "send" else None
        got, stats = heal(
            self._pg,
            self.rank,
            senders,
            receivers,
            TorchState(self.model, self.optimizer),
            meta,
            self.config.heal_timeout_s,
            key=self.client.token.encode(),
        )
        if role == "recv":
            self._load_meta(got)
            self._commit_gen = lineage
        self.events.emit(
            "heal_end",
            gen=r.gen,
            role=role,
            bytes=stats.bytes,
            seconds=stats.seconds,
            rate_mb_s=stats.rate_mb_s,
        )

    def _meta(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "last_loss": self._last_loss,
            "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "extra": self.extra_state() if self.extra_state else None,
            "ckpt": self.ckpt.schedule.to_json(),
        }

    def _checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The flattened state (aliases of the live tensors) and its JSON meta, for a snapshot."""
        flat = flatten_state(self.model, self.optimizer)
        meta = self._meta()
        meta["extra"] = ordered_json(meta["extra"])
        meta["optimizer"] = ordered_json(flat.optimizer)
        return dict(flat.tensors), meta

    def _resume(self) -> None:
        """Load the checkpoint to resume from, if any (before the first rendezvous).

        Every initial member of a resumed job loads the same one (the launcher
        chose it and passed its step in $ELASTRAIN_RESUME); a replacement loads
        the newest verified one and is healed by its peers if they are further.
        """
        t0 = time.monotonic()
        got = load_resume(self.ckpt.directory, self._resume_mode)
        if got is None:
            return
        ckpt, tensors, meta = got
        meta["extra"] = from_ordered_json(meta.get("extra"))
        optimizer_section = from_ordered_json(meta["optimizer"])
        install_checkpoint(tensors, optimizer_section, self.model, self.optimizer, str(ckpt.path))
        self._load_meta(meta)
        if self.committed != ckpt.step:
            raise RuntimeError(
                f"checkpoint {ckpt.path} holds committed count {self.committed}, not {ckpt.step}"
            )
        seconds = time.monotonic() - t0
        log.info(
            "%s resumed from %s (step %d) in %.2f s", self.member, ckpt.path, ckpt.step, seconds
        )
        print(f"[{self.member}] resumed from checkpoint step {ckpt.step} ({ckpt.path})", flush=True)
        self.events.emit(
            "checkpoint_loaded",
            step=ckpt.step,
            path=str(ckpt.path),
            generation=ckpt.generation,
            bytes=ckpt.total_bytes,
            seconds=seconds,
        )

    def _load_meta(self, meta: dict[str, Any]) -> None:
        self.committed = int(meta["committed"])
        self.session.note_committed(self.committed)
        self._last_loss = meta.get("last_loss")
        rng = torch.frombuffer(bytearray(base64.b64decode(meta["rng"])), dtype=torch.uint8)
        torch.set_rng_state(rng)
        if self.load_extra_state is not None and meta.get("extra") is not None:
            self.load_extra_state(meta["extra"])
        self.ckpt.schedule.load_json(meta.get("ckpt"))

    def _abandon(self, phase: str, error: str) -> None:
        """Drop the current group (parking it if work is in flight) and forget the generation."""
        self._settle_hash()
        if self._pg is not None:
            self.graveyard.bury(self._pg, self._inflight)
        self._pg = None
        self._inflight = []
        # An abandoned all-reduce may still complete later and write into its
        # buffer: never reuse it (fresh buffers, fresh .grad views).
        self._flats, self._views, self._reduce = [], [], []
        self.session.set_gen(0)
        log.warning("%s: generation %d abandoned in %s: %s", self.member, self.gen, phase, error)

    # ---- one step --------------------------------------------------------------

    def _ensure_grad_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(grads, reduce): point every parameter's .grad at a slice of one flat
        buffer per dtype (`grads`), so backward accumulates in place; `reduce` are
        the buffers the all-reduce sums, the extras riding at the end of the
        first. With reduce_dtype "native" they are the grad buffers themselves
        (no copy); with "float64" one float64 buffer that every micro-batch's
        gradient is added into (see `TrainerConfig.reduce_dtype`)."""
        if self._flats and all(
            prm.grad is not None and prm.grad.data_ptr() == v.data_ptr() for prm, v in self._views
        ):
            return self._flats, self._reduce
        params = [q for q in self.model.parameters() if q.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for q in params:
            by_dtype.setdefault(q.dtype, []).append(q)
        native = self.config.reduce_dtype == "native"
        flats: list[torch.Tensor] = []
        views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for i, (dtype, group) in enumerate(by_dtype.items()):
            extra = _EXTRA if i == 0 and native else 0  # loss sum, sample count, ...
            flat = torch.zeros(sum(q.numel() for q in group) + extra, dtype=dtype)
            off = 0
            for q in group:
                v = flat[off : off + q.numel()].view_as(q)
                q.grad = v
                views.append((q, v))
                off += q.numel()
            flats.append(flat)
        self._flats, self._views = flats, views
        if native:
            self._reduce = flats
        else:
            n = sum(f.numel() for f in flats)
            self._reduce = [torch.zeros(n + _EXTRA, dtype=torch.float64)]
        return self._flats, self._reduce

    def _widen(self, grads: list[torch.Tensor], wide: torch.Tensor) -> None:
        """Add one micro-batch's gradient into the float64 sum and clear it."""
        off = 0
        for g in grads:
            wide[off : off + g.numel()].add_(g)
            g.zero_()
            off += g.numel()

    def _narrow(self, grads: list[torch.Tensor], reduce: list[torch.Tensor]) -> None:
        """The summed gradient over the global batch, into the parameters' .grad."""
        b = self.config.global_batch_size
        if reduce is grads:
            for i, f in enumerate(grads):
                (f[:-_EXTRA] if i == 0 else f).div_(b)
            return
        wide, off = reduce[0], 0
        for g in grads:
            # One rounding, from the exact float64 mean: same bits on every member.
            g.copy_(wide[off : off + g.numel()].div_(b))
            off += g.numel()

    def _run_step(self) -> StepResult:
        cfg = self.config
        s = self.committed
        t0 = time.monotonic()
        inc = self.session.incarnation
        verdict = self._quorum_pool.submit(self.client.quorum, self._quorum_request(s, inc))
        grads, bufs = self._ensure_grad_views()
        for f in grads if bufs is grads else (*grads, *bufs):
            f.zero_()
        mbs = step_microbatches(s, cfg.global_batch_size, cfg.micro_batch_size)
        mine = assign_microbatches(len(mbs), len(self.members), self.rank)
        samples: list[int] = []
        loss_sum = 0.0
        data_s = 0.0
        self.model.train()
        for k, i in enumerate(mine):
            if self.session.gen_broken(self.gen):
                raise _Regroup("superseded", "generation changed during compute")
            ids = self.order.ids(mbs[i].start, mbs[i].stop)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((cfg.seed * 0x9E3779B1 + s * 1_000_003 + i) & 0x7FFF_FFFF_FFFF)
                t_data = time.monotonic()
                batch = self.collate_fn([self.dataset[j] for j in ids])
                data_s += time.monotonic() - t_data
                loss = self.loss_fn(self.model, batch)
                (loss * len(ids)).backward()
            if bufs is not grads:
                self._widen(grads, bufs[0])
            loss_sum += float(loss.detach()) * len(ids)
            samples.extend(ids)
            if k == 0:
                self.faults.hit(s, "compute")
        t_compute = time.monotonic()
        v = self._verdict(verdict, s, inc)
        if v.verdict != "proceed":
            if self.session.leaving:
                self._exit_left()
            raise _Regroup("quorum", v.verdict)
        bufs[0][-_EXTRA:] = torch.tensor(
            [loss_sum, float(len(samples)), *self.ckpt.contribution()], dtype=bufs[0].dtype
        )
        self.events.emit("step_contrib", step=s, gen=self.gen, samples=samples)
        t_ar = time.monotonic()
        self._inflight = tensor_allreduce(self._pg, bufs)
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
        extras = bufs[0][-_EXTRA:].tolist()
        total_loss, count = float(extras[0]), int(round(float(extras[1])))
        if count != cfg.global_batch_size:
            # Exactly-once would be violated: never apply such a step.
            raise _Regroup(
                "allreduce", f"step {s} summed {count} samples, expected {cfg.global_batch_size}"
            )
        self._narrow(grads, bufs)
        self._settle_hash()
        self.optimizer.step()
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
        self.ckpt.absorb([float(x) for x in extras[2:]])
        self.ckpt.note_step_time(t_end - t0)
        if v.preempt_s > 0:
            self._preempted(v.preempt_s)
        self.ckpt.after_commit(
            self.committed, self.gen, self.members, self.rank, self._checkpoint_state
        )
        self.faults.hit(s, "commit")
        return StepResult(s, loss_mean, self.gen, len(self.members), self.rank, t_end - t0)

    def _verdict(
        self, pending: concurrent.futures.Future[p.QuorumResponse], step: int, inc: int
    ) -> p.QuorumResponse:
        """The coordinator's verdict for `step` (asked with incarnation `inc`), or
        "proceed" when it cannot be reached: its state is soft and it may be
        restarting. Going on without it is safe because the all-reduce is the
        real agreement: a dead or departed peer makes it fail, and the sample
        count checks the rest."""
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
            # A restarted coordinator: register (reporting this generation), ask again.
            self._register_again(inc)
        if v.verdict in ("unknown", "expelled") and self.session.incarnation != inc:
            # Registered again since the question was sent (the heartbeat thread
            # may have done it): the answer was about the old incarnation.
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

    def _preempted(self, grace_s: float) -> None:
        """The job is being preempted: write an emergency checkpoint of the step just
        committed (every member of the generation got the same notice with the same
        step's verdict), wait until it is durable within the grace period, exit."""
        deadline = time.monotonic() + grace_s
        n = self.committed
        log.warning("%s: preemption notice; emergency checkpoint at step %d", self.member, n)
        print(f"[{self.member}] preempted: emergency checkpoint at step {n}", flush=True)
        ok = self.ckpt.emergency(
            n, self.gen, self.members, self.rank, self._checkpoint_state, deadline
        )
        self.events.emit(
            "checkpoint_emergency",
            step=n,
            ok=ok,
            rank=self.rank,
            seconds=grace_s - max(0.0, deadline - time.monotonic()),
        )
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
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._settle_hash()
        self.ckpt.close()
        if self._pg is not None:
            self.graveyard.bury(self._pg, self._inflight)
            self._pg = None
        self.session.close()
        self._quorum_pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False)
        settle_before_exit(self.waiter, self.graveyard, self.member)
        self.client.close()
        if getattr(self, "_metering", None) is not None:
            self._metering.stop()
        self.events.close()


def heal_senders(r: p.RendezvousResponse) -> tuple[list[int], int]:
    """Ranks whose state a generation starts from, and the generation that state
    was committed in. They are the members at `start_step` whose state carries
    the newest commits: a member that completed a step its peers abandoned and
    re-ran without it has the same count but not the job's state, and is healed."""
    at_start = [m for m in r.members if r.committed[m] == r.start_step]
    lineage = max((r.commit_gens.get(m, 0) for m in at_start), default=0)
    ranks = [
        i for i, m in enumerate(r.members) if m in at_start and r.commit_gens.get(m, 0) == lineage
    ]
    return ranks, lineage


def _env_overrides(config: TrainerConfig) -> TrainerConfig:
    """The launcher's --steps, --ckpt-every and --ckpt-mtbf override the script's config."""
    from dataclasses import replace

    changes: dict[str, Any] = {}
    if os.environ.get(env.STEPS):
        changes["total_steps"] = int(os.environ[env.STEPS])
    if os.environ.get(env.CKPT_EVERY):
        changes["checkpoint_every"] = int(os.environ[env.CKPT_EVERY])
    if os.environ.get(env.CKPT_MTBF):
        changes["checkpoint_mtbf_s"] = float(os.environ[env.CKPT_MTBF])
    return replace(config, **changes) if changes else config
