"""The step engine: one member's elastic step protocol, for every framework.

    user script ──▶ ElasticTrainer / JaxElasticTrainer   (public API, thin)
                        │ builds
                        ▼
                    StepEngine ──── MemberProtocol (pure: observation -> action)
                     │  │  │
       coordinator ◀─┘  │  └─▶ Backend (TorchBackend | JaxBackend: moves tensors only)
       (client,         │
        session)        └─▶ gloo group, Waiter, Graveyard, heal (transfer), Checkpointing,
                            EventLog, step hooks (chaos, installed by the entry point)

The engine is the thin loop that performs each `Action` the protocol returns
and reports what happened as the next observation. It owns every piece of
I/O: coordinator calls, the generation's gloo group, the all-reduce and its
watchdog, heal and checkpoint scheduling, events, signals. A backend only
computes gradients into buffers, applies them, and exposes its state as named
buffers. The step (docs/design.md has the argument):

1. Rendezvous: the coordinator answers with a generation (ordered members)
   once all of them are ready, with each one's committed step.
2. Build the generation's gloo group; heal members that are behind from the
   up-to-date ones; hash the state off the critical path.
3. Step `s`: ask the verdict for (gen, s) in the background while computing
   this rank's share of the step's micro-batches; on "proceed" all-reduce
   [gradient sum | loss sum, sample count, checkpoint measurements], check the
   count, divide by the global batch, update: committed. Anything else drops
   the group and goes back to 1; the same step is retried.
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

import concurrent.futures
import contextlib
import datetime
import functools
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from elastrain.checkpoint import CheckpointFormat, VerifiedCheckpoint
from elastrain.checkpoint.dcp import ShardedReader, ShardParts
from elastrain.checkpoint.files import committed_steps
from elastrain.checkpoint.manager import (
    Checkpointing,
    PartsFn,
    SaveRole,
    StateFn,
    written_format,
)
from elastrain.checkpoint.plain import (
    PlainCheckpointError,
    PlainReader,
    read_layout,
    read_step,
    resume_step,
)
from elastrain.checkpoint.plain_state import (
    ScriptState,
    plain_problem,
    plain_schema,
    with_script_objects,
)
from elastrain.checkpoint.policy import CONTRIB_SLOTS
from elastrain.checkpoint.replicated_parts import replicated_parts, replicated_schema, saved_objects
from elastrain.checkpoint.restore import (
    ResumeError,
    from_ordered_json,
    install_checkpoint,
    load_resume,
    ordered_json,
    parse_resume,
    resolve_directory,
)
from elastrain.checkpoint.sharded_parts import (
    ResumeMismatch,
    replicated_state,
    schema_problem,
    shard_parts,
    shard_source,
    writer_shard,
)
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from elastrain.data import (
    DEFAULT_ORDER,
    BatchLoader,
    DataPosition,
    GlobalOrder,
    LoaderConfig,
    MapFetch,
    OrderKind,
    StreamFetch,
    StreamingDataset,
    StreamOrder,
    assign_microbatches,
    check_dataset,
    is_stream,
)
from elastrain.exitcodes import EXIT_DEVICE_POISONED, EXIT_STATE_LOST, WorkerExit
from elastrain.observe.events import EventKind, EventLog
from elastrain.observe.scalars import check_scalar
from elastrain.observe.tally import WorkerTally
from elastrain.observe.worker import WorkerMetering
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.backend import Backend, SkipReason, Update
from elastrain.runtime.collectives import (
    NcclGroup,
    Transport,
    build_nccl_group,
    choose_transport,
    runtime_nccl_version,
)
from elastrain.runtime.config import TrainerConfig, WorkerEnv
from elastrain.runtime.device import check_device, is_poisoned
from elastrain.runtime.evaluate import (
    EvalResult,
    EvalTable,
    Evaluation,
    HandoverFailed,
    Post,
    eval_wait_timeout,
    hand_over,
    metric_values,
    my_batches,
    pause_timeout,
)
from elastrain.runtime.group import (
    CollectiveAborted,
    Graveyard,
    HangCheck,
    Waiter,
    build_group,
    settle_before_exit,
    tensor_allreduce,
)
from elastrain.runtime.preflight import batch_problems, exit_misconfigured, format_problem
from elastrain.runtime.session import JoinRefused, MemberSession
from elastrain.runtime.shard_member import NoCompleteGroup, ShardedMember, ShardLost
from elastrain.runtime.sharded import MetaModelUnfilled, ShardedBackend
from elastrain.runtime.watchdog import HangTimeout
from elastrain.threads import HASH, QUORUM, name_native_thread
from elastrain.transfer import (
    HealError,
    HealFn,
    LandingReserve,
    TorchState,
    heal,
    section_bytes,
)
from elastrain.transfer.flatten import OBJECTS_KEY

log = logging.getLogger("elastrain.engine")

EXTRA_SLOTS = 2 + CONTRIB_SLOTS
"""Values riding at the end of the first reduce buffer in the step's all-reduce:
loss sum, sample count, then the checkpoint schedule's measurements."""

RENDEZVOUS_POLL_S = 5.0
"""How long one rendezvous call may wait at the coordinator for the generation."""

HANG_ASK_EVERY_S = 0.1
"""Past the soft watchdog deadline, how often an overdue all-reduce asks the
coordinator whether a peer is hung: a hang is confirmed within this of the
peer's silence reaching `hang_silence_s`."""

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


class MapDataset(Protocol):
    """A map-style dataset: `len()` and integer indexing (torch Datasets qualify).
    A replayable stream (`elastrain.data.StreamingDataset`, with
    `iter_from(position)`) is accepted wherever a MapDataset is."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


DataSource = MapDataset | StreamingDataset
"""What a trainer takes as its data: a map-style dataset or a replayable stream."""


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


def dist_errors() -> type[BaseException]:
    """torch.distributed's error base (a backend's failed collective)."""
    import torch.distributed as dist

    return dist.DistError


def _collective_error(e: BaseException) -> bool:
    """A failed collective, not the user's loss function: gloo and c10d say who they are."""
    if isinstance(e, dist_errors()):
        return True
    text = str(e)
    return "gloo" in text or "Connection closed by peer" in text or "c10d" in text


class GroupFactory(Protocol):
    def __call__(self, gen: int, rank: int, size: int) -> Any:
        """Build this member's process group for generation `gen` (blocks for all members)."""


BUILD_END_MARGIN_S = 2.0
"""An abandoned group build has ended this long after its rendezvous timeout."""


class GroupBuildAbandoned(RuntimeError):
    """The coordinator formed a newer generation while this one's group was being built."""


class _Aborted(Exception):
    """A collective between steps (an evaluation's, a pause's) was given up."""

    def __init__(self, phase: m.AbortPhase, message: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.message = message


@dataclass
class _Step:
    """What one step carries between its actions."""

    t0: float
    incarnation: int
    verdict: concurrent.futures.Future[p.QuorumResponse]
    samples: list[int]
    loss_sum: float | torch.Tensor = 0.0
    """The member's micro-batches' loss sums (`Backend.compute`), read at the reduce."""
    data_s: float = 0.0
    t_compute: float = 0.0
    verdict_s: float = 0.0
    """Time blocked on the quorum verdict after computing (it is asked for at the start)."""
    t_reduce: float = 0.0
    t_done: float = 0.0
    extras: tuple[float, ...] = ()


class StepEngine:
    """Drives one member through the step protocol with a `Backend`.

    Contract: every member of the job builds one with the same backend type,
    model architecture, optimizer, dataset and config, then iterates
    `steps()`. Survivors keep their process and state across failures; a
    joiner is healed from its peers. `steps()` yields after each committed
    step and returns when `total_steps` are committed; it raises `WorkerExit`
    when this worker must end (SIGTERM leave, preemption, refusal, no
    coordinator). `client`, `groups` and `heal_fn` are seams for in-process
    tests (tests/test_protocol.py); by default they are the coordinator's
    HTTP client, gloo groups over the coordinator's store and the striped heal.
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
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.config = config
        self.member = where.member or f"pid{os.getpid()}"
        self.placement = {
            k: v
            for k, v in (("devices", where.visible_devices), ("local_rank", where.local_rank))
            if v is not None
        }
        """Where the launcher placed this worker (--devices), for `worker_start`."""
        device = getattr(backend, "device", None)
        cuda = device is not None and device.type == "cuda"
        self.transport = choose_transport(
            config.collectives,
            device.type if device is not None else "cpu",
            sharded=isinstance(backend, ShardedBackend),
            nccl_version=runtime_nccl_version() if cuda else None,
        )
        """What carries the gradient all-reduce (`elastrain.runtime.collectives`)."""
        self.host = where.host
        self.run_dir = where.run_dir
        self.token = where.token or ""
        self.events = EventLog(where.run_dir, self.member)
        self.tally = WorkerTally()
        """This worker's numbers for the coordinator's /metrics, from its own
        events, sent with each quorum request (elastrain.observe.tally)."""
        self.events.listen(self.tally.see)
        self.ckpt = Checkpointing(
            config.checkpoint,
            resolve_directory(config.checkpoint_dir, where.checkpoint_dir, where.run_dir),
            self.events,
            self.member,
            format=written_format(
                config.checkpoint.format, sharded=isinstance(backend, ShardedBackend)
            ),
        )
        self._resume_mode = parse_resume(
            where.resume, "latest" if config.checkpoints_periodic else "none"
        )
        self._plain_from, self._plain_step = where.resume_from, where.resume_step
        """A plain torch job's DCP checkpoint to start from when no elastrain one loads."""
        self.client = client or CoordinatorClient(
            where.coordinator or "", self.token, timeout_s=config.timeouts.coordinator_s
        )
        self.waiter = Waiter()
        self.session = MemberSession(
            self.client,
            self.member,
            backend.signature(),
            host=self.host,
            on_change=self.waiter.interrupt,
            events=self.events,
        )
        self._groups = groups or self._gloo_group
        self._abandoned_builds: list[tuple[threading.Thread, float]] = []
        """Group builds given up while still waiting (`_build_until_superseded`), with
        the monotonic time by which each has ended; an exit waits for them."""
        self._heal_fn: HealFn = heal_fn or heal
        self.hooks = hooks.installed()
        self._stream = is_stream(dataset)
        self.order: GlobalOrder | StreamOrder = self._make_order(None)
        self.data_pos = DataPosition()
        """Where each step's window of the order starts (travels with the state)."""
        self.loader = BatchLoader(
            StreamFetch(dataset, collate_fn) if self._stream else MapFetch(dataset, collate_fn),  # type: ignore[arg-type]
            LoaderConfig(config.num_workers, config.prefetch_steps),
            name=f"data-{self.member}",
        )
        """Loads this member's micro-batches, ahead of the step with prefetch."""
        self.hang = HangTimeout(config.watchdog)
        self.graveyard = Graveyard()
        self.proto = m.MemberProtocol(self.member, config.total_steps, config.global_batch_size)
        self._quorum_pool = concurrent.futures.ThreadPoolExecutor(
            1, "elastrain-quorum", name_native_thread, (QUORUM,)
        )
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(
            1, "elastrain-hash", name_native_thread, (HASH,)
        )
        self._hashing: concurrent.futures.Future[None] | None = None
        self._pg: Any = None
        self._nccl: NcclGroup | None = None
        """The generation's NCCL group for the gradient all-reduce (transport NCCL)."""
        self._inflight: list[Any] = []
        self.shards = (
            ShardedMember(backend, self.member, config, self.host, self.events, self.graveyard)
            if isinstance(backend, ShardedBackend)
            else None
        )
        """The sharded layout's work, when the model is sharded (`TrainerConfig.shard_size` > 1)."""
        self._ready: p.RendezvousResponse | None = None
        self._step: _Step | None = None
        self._result: StepResult | None = None
        self._after_commit: Callable[[], None] | None = None
        self._joined = False
        """This member has built a generation's group once: no longer a standby."""
        self._reserve: LandingReserve | None = None
        """The landing a joiner prepared for its heal (`_reserve_landing`)."""
        self.evaluation: Evaluation | None = None
        """The evaluation the script asked for (`set_evaluation`), if any."""
        self.eval_result: EvalResult | None = None
        """The newest evaluation's result; travels with the state (heal, checkpoint)."""
        self._fresh_eval: EvalResult | None = None
        """The evaluation ended at this boundary, for the next step's `StepResult`."""
        self._broken: str | None = None
        """Why the generation must be abandoned at the next step (a failed pause)."""
        self.started = False
        """`steps()` began: the state's layout (registered objects) is fixed."""
        self.skipped_steps = 0
        """Committed steps that did not update the state (travels with the state)."""
        self.last_loss: float | None = None
        self._last_wait_msg = 0.0
        self._metering: WorkerMetering | None = None
        self._closed = False
        self._perform: dict[m.Do, Callable[[m.Action], m.Observation]] = {
            m.Do.REGISTER: self._register,
            m.Do.REGISTER_AGAIN: self._register_again,
            m.Do.RENDEZVOUS: self._rendezvous,
            m.Do.BACK_OFF: self._back_off,
            m.Do.CONNECT: self._connect,
            m.Do.HEAL: self._heal,
            m.Do.COMPUTE: self._compute,
            m.Do.VERDICT: self._verdict,
            m.Do.ASK_AGAIN: self._ask_again,
            m.Do.REDUCE: self._reduce,
            m.Do.APPLY: self._apply,
            m.Do.EVALUATE: self._evaluate,
            m.Do.EMERGENCY_CHECKPOINT: self._emergency,
            m.Do.ABANDON: self._abandon,
        }

    # ---- the member's view -------------------------------------------------------

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

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.session.request_leave("left")
        self.waiter.interrupt()

    def log(self, name: str, value: float) -> None:
        """Record the script's scalar `name` (see `EngineTrainer.log`): checked on
        every member, emitted as a `user_scalar` event on rank 0 only."""
        v = check_scalar(name, value)
        # Before the first generation every member's rank reads 0: nobody reports.
        if self.proto.members and self.proto.rank == 0:
            step = max(self.committed - 1, 0)
            self.events.emit(EventKind.USER_SCALAR, name=name, value=v, step=step)

    # ---- the loop ----------------------------------------------------------------

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit.

        What the caller does with a result before asking for the next (stepping an
        LR scheduler) belongs to that step: the step's checkpoint is taken, and its
        commit hook called, only when the caller comes back."""
        self.started = True
        # Data worker processes are forked first, while this process has few threads.
        self.loader.start()
        self._install_sigterm()
        for h in self.hooks:
            h.attach(self.member, self.events)
        self.events.emit(
            EventKind.WORKER_START,
            member=self.member,
            data_workers=self.loader.worker_pids,
            collectives=self.transport.transport,
            collectives_why=self.transport.why,
            **self.placement,
        )
        try:
            self._check_setup()
            self._check_device()
            self._resume()
            # One micro-batch serves both the warm-up and the FLOP count (loaded once).
            first = self._first_batch()
            self._warm_up(first)
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

    def _check_device(self) -> None:
        """Leave at once if this process's device fails its health check."""
        device = getattr(self.backend, "device", None)
        if device is not None and (why := check_device(device)) is not None:
            self._leave_poisoned(f"health check failed: {why}")

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
        log.error("%s: device poisoned (%s); leaving for a fresh process", self.member, why)
        # Tell the coordinator the exit status first: the peers regroup at once, and
        # the failure is recorded as a failed device, not suspected as a hang. (The
        # launcher reports the same exit again; harmless.)
        with contextlib.suppress(CoordinatorError):
            self.client.exit(p.ExitRequest(self.member, os.getpid(), EXIT_DEVICE_POISONED))
        self.events.emit(
            EventKind.WORKER_EXIT,
            reason=m.ExitReason.DEVICE_POISONED,
            committed=self.committed,
            error=why[:300],
        )
        self.events.close()
        self._closed = True  # steps()' `finally` must not shut down in order either
        raise WorkerExit(
            EXIT_DEVICE_POISONED,
            m.ExitReason.DEVICE_POISONED,
            f"elastrain: {self.member}'s device failed ({why}); a fresh process takes its "
            "place (this one is never reused)",
            immediate=True,
        )

    def _flags(self) -> m.Flags:
        return m.Flags(leaving=self.session.leaving, expelled=self.session.expelled)

    def _check_setup(self) -> None:
        """Well-known mistakes only this process can see (a DDP-wrapped model, a process
        group the script made itself) end it at once with what to change."""
        cfg = self.config
        problems = (
            self.backend.problems()
            + batch_problems(cfg.global_batch_size, cfg.micro_batch_size)
            + self._format_problems()
        )
        if problems:
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.MISCONFIGURED, committed=self.committed
            )
            self._shutdown()
            exit_misconfigured("; ".join(problems))

    def _format_problems(self) -> list[str]:
        """Why this job cannot write the checkpoint format it was asked for (checked
        at start, not at the first checkpoint, which would fail every time)."""
        fmt = self.config.checkpoint.format
        why = format_problem(fmt, self.backend.framework, self.shards is not None)
        if why is not None:
            return [why]
        if self.shards is None and self.ckpt.format == CheckpointFormat.DCP:
            state = self.backend.state()
            assert isinstance(state, TorchState)  # format_problem: a torch job
            try:
                replicated_schema(state)
            except ValueError as e:
                return [f"--ckpt-format {fmt}: {e}"]
        return []

    def _first_batch(self) -> Any:
        # The next step's first samples (a stream may no longer hold position 0).
        start = self.data_pos.start(self.committed, self.config.global_batch_size)
        return self.loader.fetch(self.order.ids(start, start + self.config.micro_batch_size))

    # ---- the data order ---------------------------------------------------------------

    def _make_order(self, kind: str | None) -> GlobalOrder | StreamOrder:
        """The order of `kind` (None: the config's, else the default) for this dataset."""
        if self._stream:
            return StreamOrder()
        cfg = self.config
        return GlobalOrder(
            len(self.dataset),  # type: ignore[arg-type]
            cfg.seed,
            shuffle=cfg.shuffle,
            kind=kind or cfg.sample_order or DEFAULT_ORDER,
        )

    def _data_meta(self, committed: int) -> dict[str, Any]:
        """The order's kind and the next step's position, as of `committed`."""
        pos = self.data_pos.at(committed, self.config.global_batch_size)
        return {"order": str(self.order.kind), "position": pos.to_json()}

    def _order_problem(self, kind: Any) -> str | None:
        """Why this job cannot go on with state trained on the order `kind` (None: it can)."""
        if not isinstance(kind, str) or kind not in {k.value for k in OrderKind}:
            return f"it records an unknown sample order {kind!r}"
        if self._stream != (kind == OrderKind.STREAM):
            have = "a stream" if self._stream else "a map-style dataset"
            return f"it was trained on a {kind} order and this job's dataset is {have}"
        wanted = self.config.sample_order
        if not self._stream and wanted is not None and wanted != kind:
            return (
                f"it was trained with sample_order={kind!r} and this config says {wanted!r}: "
                f"set sample_order={kind!r} (or None: the checkpoint's) to resume it, or start "
                "in a fresh --run-dir"
            )
        return None

    def _adopt_data(self, data: dict[str, Any]) -> None:
        """Take the order and position of a sender's or a checkpoint's state."""
        problem = self._order_problem(data.get("order"))
        if problem is not None:
            raise ValueError(f"the state's data order does not fit this job: {problem}")
        if data["order"] != self.order.kind:
            self.order = self._make_order(data["order"])
            self.loader.reset()
        self.data_pos = DataPosition.from_json(data.get("position"))

    def _plan_loads(self, step: int, mine: list[int] | list[int | None]) -> None:
        """Tell the loader this member's micro-batches of `step` and the next
        `prefetch_steps` ones (under this generation's assignment)."""
        if not self.loader.config.background:
            return
        cfg = self.config
        wanted: list[tuple[tuple[int, int], list[int]]] = []
        for t in range(step, min(cfg.total_steps, step + 1 + cfg.prefetch_steps)):
            mbs = self.data_pos.microbatches(t, cfg.global_batch_size, cfg.micro_batch_size)
            wanted.extend(
                ((t, i), self.order.ids(mbs[i].start, mbs[i].stop)) for i in mine if i is not None
            )
        self.loader.plan(wanted)

    def _count_flops(self, batch: Any) -> dict[str, Any] | None:
        cfg = self.config
        fields = self.backend.count_flops(batch, cfg.micro_batch_size, cfg.global_batch_size)
        if fields is None:
            return None
        return {
            **fields,
            "micro_batch": self.config.micro_batch_size,
            "global_batch": self.config.global_batch_size,
        }

    def _warm_up(self, batch: Any) -> None:
        t0 = time.monotonic()
        self.backend.warm_up(batch, EXTRA_SLOTS)
        log.debug("%s: warm-up %.2f s", self.member, time.monotonic() - t0)

    # ---- registration and rendezvous -------------------------------------------------

    def _register(self, a: m.Action) -> m.Observation:
        try:
            self.session.register()
        except JoinRefused as e:
            return m.Refused(str(e))
        except CoordinatorUnavailable as e:
            return m.Unreachable(
                "register",
                f"[{self.member}] cannot reach the coordinator after "
                f"{self.session.register_timeout_s:g} s: {e}",
            )
        self._reserve_landing()
        return m.Registered(self.session.incarnation)

    def _reserve_landing(self) -> None:
        """A joiner (never yet in a generation) that has committed fewer steps than
        the job will be healed when it is admitted: it maps and touches its landing
        now, in the background, while it waits (`LandingReserve`), so the heal lands
        in resident memory. A sharded joiner does not hold a shard yet: it reserves
        for the largest shard of the configured shard size."""
        if self._joined or self._reserve is not None:
            return
        if self.session.progress_step <= self.proto.committed:
            return
        estimate = (
            self.shards.backend.landing_estimate()
            if self.shards is not None
            else self.backend.state().landing_estimate()
        )
        self._reserve = LandingReserve(section_bytes(estimate))
        log.info(
            "%s: the job is at step %d, this member at %d: reserving %.1f MB of landing",
            self.member,
            self.session.progress_step,
            self.proto.committed,
            self._reserve.nbytes / 1e6,
        )

    def _register_again(self, a: m.Action) -> m.Observation:
        if self.session.expelled:
            log.warning("%s was expelled from the job; registering again", self.member)
        stale = self.session.incarnation if a.incarnation is None else a.incarnation
        try:
            self.session.ensure_registered(stale)
        except JoinRefused as e:
            return m.Refused(str(e))
        except CoordinatorUnavailable as e:
            log.warning("registering again failed: %s; retrying", e)
            return m.Unreachable("register", str(e))
        return m.Registered(self.session.incarnation)

    def _rendezvous(self, a: m.Action) -> m.Observation:
        self.events.emit(EventKind.RENDEZVOUS_BEGIN, known_gen=a.gen, committed=a.step)
        try:
            r = self.client.rendezvous(
                p.RendezvousRequest(
                    self.member,
                    self.session.incarnation,
                    a.gen,
                    a.step,
                    wait_s=RENDEZVOUS_POLL_S,
                    commit_gen=self.proto.commit_gen,
                    pending_gen=self.proto.pending_gen,
                )
            )
        except CoordinatorError as e:
            log.warning("rendezvous failed: %s; retrying", e)
            return m.Unreachable("rendezvous", str(e))
        try:
            status = p.RendezvousStatus(r.status)
        except ValueError:
            log.warning("rendezvous answered an unknown status %r; asking again", r.status)
            return m.Unreachable("rendezvous", f"unknown status {r.status!r}")
        if status == p.RendezvousStatus.FINISHED:
            log.info("the job finished while %s was waiting", self.member)
        elif status == p.RendezvousStatus.PENDING and r.message:
            now = time.monotonic()
            if now - self._last_wait_msg > 5:
                log.warning("waiting: %s", r.message)
                print(f"[{self.member}] waiting: {r.message}", flush=True)
                self._last_wait_msg = now
        if status == p.RendezvousStatus.READY:
            self._ready = r
        elif status == p.RendezvousStatus.PENDING and not self._joined:
            self._refresh_standby()
        return m.RendezvousAnswer(
            status,
            r.gen,
            tuple(r.members),
            dict(r.committed),
            dict(r.commit_gens),
            r.start_step,
            r.message,
            tuple(r.rolls_forward),
        )

    def _refresh_standby(self) -> None:
        """A standby (a hot spare, registered and never yet in a generation) takes
        each newer committed checkpoint while it waits: a spare promoted beside
        survivors is healed by them anyway, but spares left alone (every member
        dead) go on from their own state, which is then one checkpoint interval
        at most behind the newest (a rendezvous poll, `RENDEZVOUS_POLL_S`, sees
        each commit). Replicated members only (a sharded one reads its rows when
        it takes a slot)."""
        if self.shards is not None:
            return
        steps = committed_steps(self.ckpt.directory)
        if steps and steps[-1] > self.proto.committed:
            self._resume(newer_than=self.proto.committed)

    def _back_off(self, a: m.Action) -> m.Observation:
        # Pace retries against an unreachable or restarting coordinator.
        time.sleep(self.session.heartbeat_s)
        return m.Waited()

    def _gloo_group(self, gen: int, rank: int, size: int) -> Any:
        assert self._ready is not None and self._ready.gen == gen
        return build_group(
            # Its own client: `_build_until_superseded` may abandon this build.
            self.session.new_store(self.config.timeouts.rendezvous_s),
            self.session.group_prefix(self._ready),
            rank,
            size,
            host=self.host,
            connect_timeout_s=self.config.timeouts.rendezvous_s,
            op_timeout_s=self.config.watchdog.ceiling_s,
        )

    def _nccl_group(self, rank: int, size: int) -> NcclGroup:
        assert self._ready is not None
        return build_nccl_group(
            self.session.store(self.config.timeouts.rendezvous_s),
            self.session.group_prefix(self._ready) + "/nccl",
            rank,
            size,
            self.backend.device,  # type: ignore[attr-defined]
            # A backstop only: the step's watchdog gives up and aborts first.
            op_timeout_s=2 * self.config.watchdog.ceiling_s,
        )

    def _build_until_superseded(self, gen: int, build: Callable[[], Any]) -> Any:
        """``build()`` (the generation's group) on a helper thread; GroupBuildAbandoned
        if the coordinator moves on first.

        The group's constructor waits in the store for every member, up to the
        rendezvous timeout. A member stopped after the coordinator said "ready" and
        before its build (SIGSTOP, a paused VM) would hold the others there for all
        of it, although the coordinator expels it at its lease and forms a
        generation without it. The heartbeats carry `gen` during the build, so the
        coordinator's change reaches `session.gen_broken` and wakes this wait. An
        abandoned build ends by itself (at that timeout, or when the late member
        arrives) and its group is dropped unused; it waits on a store client of its
        own (`Session.new_store`), not on the one this thread uses next."""
        box: list[Any] = []
        errors: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(build())
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                errors.append(e)
            finally:
                done.set()
                self.waiter.interrupt()

        thread = threading.Thread(target=run, name="elastrain-group-build", daemon=True)
        # It ends by then, whatever happens: every wait of the build is bounded by it.
        ends_by = time.monotonic() + self.config.timeouts.rendezvous_s + BUILD_END_MARGIN_S
        thread.start()
        self.waiter.wait_until(
            lambda: (
                done.is_set()
                or self.session.gen_broken(gen)
                or self.session.leaving
                or self.session.expelled
            )
        )
        if not done.is_set():
            self._abandoned_builds.append((thread, ends_by))
            raise GroupBuildAbandoned(
                f"generation {gen} was superseded while its group was being built"
            )
        if errors:
            raise errors[0]
        return box[0]

    def _connect(self, a: m.Action) -> m.Observation:
        t0 = time.monotonic()
        self._hook(a.step, hooks.StepPoint.CONNECT)
        r = self._ready
        # The heartbeats carry the generation being built (see `_build_until_superseded`).
        self.session.set_gen(a.gen, a.members, r.slots if r else None, r.shard_size if r else 0)
        try:
            self._pg = self._build_until_superseded(
                a.gen, lambda: self._groups(a.gen, a.rank, len(a.members))
            )
            if self.transport.transport is Transport.NCCL:
                self._nccl = self._nccl_group(a.rank, len(a.members))
            if self.shards is not None:
                assert self._ready is not None
                self.shards.connect(
                    self._ready,
                    self.session.store(self.config.timeouts.rendezvous_s),
                    self.session.group_prefix(self._ready),
                )
        except WorkerExit:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to connect means: next generation
            log.warning("building group for generation %d failed: %s", a.gen, e)
            self._drop_groups()
            self.session.set_gen(0)
            self.events.emit(
                EventKind.STEP_ABORT,
                step=a.step,
                gen=a.gen,
                error=str(e)[:300],
                phase=m.AbortPhase.REGROUP,
            )
            return m.ConnectFailed(str(e))
        self.events.emit(
            EventKind.GROUP_BUILT,
            gen=a.gen,
            rank=a.rank,
            size=len(a.members),
            build_s=time.monotonic() - t0,
        )
        self._joined = True
        if a.rank == 0:
            cfg = self.config
            for problem in batch_problems(
                cfg.global_batch_size, cfg.micro_batch_size, len(a.members)
            ):
                log.warning("generation %d: %s", a.gen, problem)
                print(f"elastrain: warning: {problem}", file=sys.stderr, flush=True)
        return m.Connected()

    # ---- heal -----------------------------------------------------------------------

    def _heal(self, a: m.Action) -> m.Observation:
        # The first heal after registration uses the landing reserve up, whatever
        # this member's role in it (a retry lands in fresh memory); what the heal
        # did not take is let go.
        reserve, self._reserve = self._reserve, None
        try:
            if self.shards is not None:
                return self._heal_shards(a, reserve)
            if not a.receivers:
                return self._healed(a, a.step, False)
            return self._heal_replicated(a, reserve)
        finally:
            if reserve is not None:
                reserve.release()

    def _heal_replicated(self, a: m.Action, reserve: LandingReserve | None) -> m.Observation:
        committed, received = a.step, False
        role = "send" if a.rank in a.senders else "recv" if a.rank in a.receivers else "idle"
        self.events.emit(EventKind.HEAL_BEGIN, gen=a.gen, role=role, bytes=0)
        state = self.backend.state()
        landing = {"reserve": reserve} if role == "recv" and reserve is not None else {}
        try:
            got, stats = self._heal_fn(
                self._pg,
                a.rank,
                list(a.senders),
                list(a.receivers),
                state,
                self._meta(committed) if role == "send" else None,
                self.config.timeouts.heal_s,
                key=self.token.encode() or None,
                **landing,
            )
            if role == "recv":
                self.backend.adopt(state)
                committed, received = self._load_meta(got), True
        except (HealError, RuntimeError, ValueError) as e:
            if is_poisoned(e):
                raise
            return m.HealFailed(str(e))
        self.events.emit(EventKind.HEAL_END, gen=a.gen, **stats.event_fields())
        return self._healed(a, committed, received)

    def _heal_shards(self, a: m.Action, reserve: LandingReserve | None) -> m.Observation:
        """Sharded: heal inside twins' groups, or reshard to a new shard size
        (`ShardedMember.heal`). Rows nobody holds end the worker: nothing in memory
        restores them."""
        assert self.shards is not None and self._ready is not None
        try:
            out = self.shards.heal(
                a.gen,
                a.roll_forward,
                self._ready,
                self._pg,
                self._meta,
                self._load_meta,
                self._heal_fn,
                self.token.encode() or None,
                reserve,
            )
        except ShardLost as e:
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.STATE_LOST, committed=self.committed
            )
            self._shutdown()
            raise WorkerExit(
                EXIT_STATE_LOST, "shard_lost", f"elastrain: {e}; {self._resume_hint()}"
            ) from None
        except MetaModelUnfilled as e:
            # Every member of a fresh job built on the meta device gets here alike:
            # no retry or replacement can fill it, so stop the job and say why.
            self._shutdown()
            exit_misconfigured(str(e))
        except (HealError, RuntimeError, ValueError) as e:
            if is_poisoned(e):
                raise
            return m.HealFailed(str(e))
        return self._healed(a, out.committed, out.received)

    def _healed(self, a: m.Action, committed: int, received: bool) -> m.Observation:
        assert self._ready is not None
        self.ckpt.note_generation(self._ready.reason)
        self._start_hash(a.gen, committed, list(a.members), a.rank)
        return m.Healed(committed, received)

    def _start_hash(self, gen: int, step: int, members: list[str], rank: int) -> None:
        """Hash the state off the recovery's critical path: it overlaps the first
        step's compute, which only reads the parameters; `_settle_readers` joins it
        before anything writes them (every action not in `READ_ONLY`)."""

        def start_event() -> None:
            digest = self.backend.state_hash() if self.config.hash_state else ""
            shard = self.shards.event_fields() if self.shards is not None else {}
            self.events.emit(
                EventKind.GENERATION_START,
                gen=gen,
                step=step,
                state_hash=digest,
                members=members,
                rank=rank,
                **shard,
            )

        self._hashing = self._hash_pool.submit(start_event)

    def _settle_readers(self) -> None:
        """The state is about to be written: wait for the threads that read it (the
        state hash, the last checkpoint's deferred copy, whose wait counts as that
        checkpoint's blocking time)."""
        if self._hashing is not None:
            self._hashing.result()
            self._hashing = None
        self.ckpt.settle()

    def _meta(self, committed: int) -> dict[str, Any]:
        """What travels with the state in a heal or a checkpoint, besides the buffers."""
        return {
            "committed": committed,
            "last_loss": self.last_loss,
            "skipped_steps": self.skipped_steps,
            "ckpt": self.ckpt.schedule.to_json(),
            "evaluation": self.eval_result.to_json() if self.eval_result is not None else None,
            "data": self._data_meta(committed),
            **self.backend.meta(),
        }

    def _load_meta(self, meta: dict[str, Any]) -> int:
        """Install a sender's or a checkpoint's meta; returns its committed count."""
        committed = int(meta["committed"])
        self.session.note_committed(committed)
        self.last_loss = meta.get("last_loss")
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.backend.load_meta(meta)
        self.ckpt.schedule.load_json(meta.get("ckpt"))
        self.eval_result = EvalResult.from_json(meta.get("evaluation"))
        if meta.get("data") is not None:
            self._adopt_data(meta["data"])
        return committed

    # ---- one step --------------------------------------------------------------------

    def _compute(self, a: m.Action) -> m.Observation:
        if self._broken is not None:
            why, self._broken = self._broken, None
            return m.ComputeFailed(why)
        cfg = self.config
        s = a.step
        inc = self.session.incarnation
        st = _Step(
            time.monotonic(),
            inc,
            self._quorum_pool.submit(self.client.quorum, self._quorum_request(s, inc)),
            [],
        )
        self._step = st
        self.backend.begin_step(EXTRA_SLOTS)
        mbs = self.data_pos.microbatches(s, cfg.global_batch_size, cfg.micro_batch_size)
        if self.shards is not None:
            return self._compute_shard(s, st, mbs)
        mine = assign_microbatches(len(mbs), len(self.proto.members), self.proto.rank)
        self._plan_loads(s, mine)
        for k, i in enumerate(mine):
            if self.session.gen_broken(self.proto.gen):
                return m.Superseded()
            ids = self.order.ids(mbs[i].start, mbs[i].stop)
            t_data = time.monotonic()
            batch = self.loader.get((s, i), ids)
            st.data_s += time.monotonic() - t_data
            st.loss_sum += self.backend.compute(s, i, batch, len(ids))
            st.samples.extend(ids)
            if k == 0:
                self._hook(s, hooks.StepPoint.COMPUTE)
        st.t_compute = time.monotonic()
        return m.Computed()

    def _compute_shard(self, s: int, st: _Step, mbs: list[range]) -> m.Observation:
        """Sharded: this member's turns in its replica group's rounds (none for a shadow).
        A failed collective inside (a group-mate died) abandons the generation."""
        assert self.shards is not None
        pad: Any = None
        try:
            rounds = self.shards.rounds(len(mbs), self.hang.timeout_s)
        except NoCompleteGroup as e:
            # No step can commit in this generation, so the coordinator treats it as
            # always at a step boundary: wait for the one it forms next (a joiner
            # admitted, or a reshard once the vacancy lasted --reshard-after).
            log.warning("%s: %s", self.member, e)
            print(f"[{self.member}] waiting: {e}", flush=True)
            gen = self.proto.gen
            self.waiter.wait_until(
                lambda: (
                    self.session.gen_broken(gen) or self.session.leaving or self.session.expelled
                )
            )
            return m.Superseded()
        self._plan_loads(s, rounds)
        # No "superseded?" check between rounds: a group's members run every round
        # together (FSDP2's collectives), and two members that answered that question
        # differently would leave one waiting in a collective for the other until the
        # timeout. A superseded generation is seen at the verdict, one step later.
        for k, i in enumerate(rounds):
            t_data = time.monotonic()
            ids: list[int] = []
            if i is None:
                # Padding turn: the group's collectives need this member; weight 0.
                batch = pad = pad if pad is not None else self._load((s, 0), mbs[0])
            else:
                ids = self.order.ids(mbs[i].start, mbs[i].stop)
                batch = pad = self._load((s, i), mbs[i])
            st.data_s += time.monotonic() - t_data
            try:
                st.loss_sum += self.backend.compute(s, -1 if i is None else i, batch, len(ids))
            except (RuntimeError, dist_errors()) as e:
                if not _collective_error(e):
                    raise
                return m.ComputeFailed(str(e)[:300])
            st.samples.extend(ids)
            if k == 0:
                self._hook(s, hooks.StepPoint.COMPUTE)
        st.t_compute = time.monotonic()
        return m.Computed()

    def _load(self, key: tuple[int, int], positions: range) -> Any:
        return self.loader.get(key, self.order.ids(positions.start, positions.stop))

    def _verdict(self, a: m.Action) -> m.Observation:
        st = self._step
        assert st is not None
        t = time.monotonic()
        try:
            v = st.verdict.result(timeout=self.config.timeouts.coordinator_s)
        except (CoordinatorUnavailable, concurrent.futures.TimeoutError) as e:
            self.session.coordinator_unreachable("quorum", str(e))
            return m.Unreachable("quorum", str(e))
        except CoordinatorError as e:
            return m.VerdictFailed(str(e))
        finally:
            st.verdict_s += time.monotonic() - t
        return self._seen(v, st.incarnation)

    def _ask_again(self, a: m.Action) -> m.Observation:
        assert a.incarnation is not None
        try:
            v = self.client.quorum(self._quorum_request(a.step, a.incarnation))
        except CoordinatorError as e:
            return m.VerdictFailed(str(e))
        return self._seen(v, a.incarnation)

    def _seen(self, v: p.QuorumResponse, asked: int) -> m.Observation:
        try:
            verdict = p.Verdict(v.verdict)
        except ValueError:
            return m.VerdictFailed(f"unknown verdict {v.verdict!r}")
        return m.VerdictSeen(verdict, asked, self.session.incarnation, v.preempt_s)

    def _quorum_request(self, step: int, inc: int) -> p.QuorumRequest:
        return p.QuorumRequest(
            self.member,
            inc,
            self.proto.gen,
            step,
            self.session.leaving,
            self.last_loss,
            self.config.global_batch_size,
            self.tally.take(),
            self.tally.take_scalars(),
        )

    def _reduce(self, a: m.Action) -> m.Observation:
        st = self._step
        assert st is not None
        s, gen = a.step, a.gen
        extras = self.backend.extras()
        extras.copy_(
            torch.tensor(
                [float(st.loss_sum), float(len(st.samples)), *self.ckpt.contribution()],
                dtype=extras.dtype,
            )
        )
        self.events.emit(EventKind.STEP_CONTRIB, step=s, gen=gen, samples=st.samples)
        st.t_reduce = time.monotonic()
        timeout = self.hang.timeout_s
        kept = False
        try:
            if self.shards is None:
                grads = self._nccl or self._pg
                self._inflight = tensor_allreduce(grads, self.backend.reduce_buffers())
                self._hook(s, hooks.StepPoint.ALLREDUCE)
                self._await_reduce(gen, s, timeout)
            else:
                # The shard's twins first; the whole generation's all-reduce of the
                # extras after, as the commit vote: one member through it proves that
                # every member reduced its shard, so any member that then loses the
                # vote's answer can apply the step it kept (`plan.roll_forwards`).
                self._inflight = self.shards.reduce()
                self._hook(s, hooks.StepPoint.ALLREDUCE)
                self._await_reduce(gen, s, timeout)
                kept = True
                self._inflight = self.shards.vote(self._pg, extras)
                self._await_reduce(gen, s, timeout)
                try:
                    self._hook(s, hooks.StepPoint.VOTE)
                except hooks.InjectedFailure:
                    self._await_lost_answer(gen, s, timeout)
        except CollectiveAborted as e:
            if e.reason == "watchdog":
                # A confirmed hang fires at the soft deadline: record how long it waited.
                confirmed = {"confirmed": list(e.confirmed)} if e.confirmed else {}
                waited = time.monotonic() - st.t_reduce if e.confirmed else timeout
                self.events.emit(
                    EventKind.WATCHDOG_FIRED, step=s, gen=gen, timeout_s=waited, **confirmed
                )
            return self._reduce_aborted(m.AbortPhase(e.reason), str(e), s, gen, kept)
        except RuntimeError as e:
            if is_poisoned(e):
                raise
            self._inflight = []
            return self._reduce_aborted(m.AbortPhase.ALLREDUCE, str(e)[:300], s, gen, kept)
        self._inflight = []
        st.t_done = time.monotonic()
        self.hang.observe(st.t_done - st.t_reduce)
        st.extras = tuple(float(x) for x in self.backend.extras().tolist())
        return m.Reduced(int(round(st.extras[1])))

    def _await_reduce(self, gen: int, step: int, timeout_s: float) -> None:
        """Wait for `_inflight` under the step's deadlines, counted from the start of
        the step's reduction (`_Step.t_reduce`): a sharded step waits twice."""
        st = self._step
        assert st is not None
        waited = time.monotonic() - st.t_reduce
        self.waiter.wait(
            self._inflight,
            max(timeout_s - waited, 0.0),
            lambda: self.session.gen_broken(gen),
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

        self._inflight = [Lost()]
        try:
            self._await_reduce(gen, step, timeout_s)
        finally:
            never.set()
            self._inflight = []

    def _reduce_aborted(
        self, phase: m.AbortPhase, error: str, step: int, gen: int, kept: bool
    ) -> m.ReduceAborted:
        """Give the reduction up; a sharded member whose twins had reduced keeps the
        sum (`ShardedMember.keep`) in case another member committed the step."""
        if kept:
            assert self.shards is not None
            self.shards.keep(step, gen)
            error = f"{error} (after the twins' reduction: the step is kept)"
        return m.ReduceAborted(phase, error, kept)

    def _hang_check(
        self, gen: int, step: int, timeout_s: float, waited_s: float = 0.0
    ) -> HangCheck | None:
        """Past the soft deadline, ask the coordinator whether a peer of `gen`
        stopped heartbeating (`elastrain.runtime.watchdog`); None: do not ask.
        `waited_s`: how long this reduction has waited already (the deadlines
        count from its start)."""
        soft = self.hang.soft_s
        if soft is None or soft >= timeout_s:
            return None

        def ask(waited: float) -> tuple[str, ...]:
            waited += waited_s
            left = timeout_s - waited
            return self.session.confirm_hang(gen, step, waited, max(0.05, min(left, 2.0)))

        return HangCheck(max(soft - waited_s, 0.0), HANG_ASK_EVERY_S, ask)

    def _apply(self, a: m.Action) -> m.Observation:
        st = self._step
        assert st is not None
        s = a.step
        t_apply = time.monotonic()
        update = self.backend.apply() or Update()
        n = s + 1
        self.session.note_committed(n)
        total_loss, count = st.extras[0], int(round(st.extras[1]))
        loss_mean = total_loss / count
        self.last_loss = loss_mean
        t_end = time.monotonic()
        norm = update.grad_norm
        shown_norm = norm if norm is not None and math.isfinite(norm) else None
        if update.skipped is not None:
            self.skipped_steps += 1
            log.warning(
                "%s: step %d committed without an update (%s)", self.member, s, update.skipped
            )
            self.events.emit(
                EventKind.STEP_SKIPPED,
                step=s,
                gen=a.gen,
                reason=update.skipped,
                grad_norm=shown_norm,
                skipped_total=self.skipped_steps,
            )
        self.events.emit(
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
        )
        self.ckpt.absorb(list(st.extras[2:]))
        self.ckpt.note_step_time(t_end - st.t0)
        self._result = StepResult(
            s,
            loss_mean,
            a.gen,
            len(self.proto.members),
            self.proto.rank,
            t_end - st.t0,
            norm,
            update.skipped,
            # The evaluation of the model this step started from, if one ended at
            # that boundary (the same on every member that ran the step).
            fresh if (fresh := self._fresh_eval) is not None and fresh.step == s else None,
        )
        self._fresh_eval = None
        self._step = None
        if a.grace_s <= 0:
            members, rank = list(self.proto.members), self.proto.rank

            def after_commit() -> None:
                # Once the caller's own work on this result is done (`steps`).
                self.ckpt.after_commit(
                    n, a.gen, members, rank, *self._save_args(n),
                    final=n >= self.config.total_steps,
                )  # fmt: skip
                self._hook(s, hooks.StepPoint.COMMIT)

            self._after_commit = after_commit
        return m.Applied(n, a.grace_s)

    def _hook(self, step: int, point: hooks.StepPoint) -> None:
        for h in self.hooks:
            h.at(step, point)

    # ---- between steps: evaluation and pauses --------------------------------------------

    def set_evaluation(self, evaluation: Evaluation) -> None:
        """Evaluate with ``evaluation`` at the counts it names; before `steps()` only."""
        if self.started:
            raise RuntimeError("evaluate_every() after steps() began: set it up before the loop")
        if self.evaluation is not None:
            raise ValueError("an evaluation is set up already (one per trainer)")
        self.evaluation = evaluation
        self.proto.eval_every = evaluation.every

    def _evaluate(self, a: m.Action) -> m.Observation:
        """Evaluate the model after ``a.step`` committed steps with this generation.

        Every member of the generation is here at the same count: the protocol
        enters EVALUATE after the commit that reaches it, or after the heal that
        starts a generation at it. One small collective first asks who already
        holds this count's result (a member whose table all-reduce completed
        before a peer died, or one healed or resumed with it); if one does, it
        hands it over and nobody computes. Otherwise each member computes its
        block of batches (`evaluate.my_batches`) and the table is all-reduced
        (`EvalTable`). A failure aborts like a failed step; the next generation
        evaluates again. The wait for the peers is bounded by this member's own
        time (`eval_wait_timeout`), never by the step watchdog's timeout."""
        ev = self.evaluation
        assert ev is not None
        n, gen, size, rank = a.step, a.gen, len(a.members), a.rank
        batches = ev.batches()
        mine = my_batches(len(batches), size, rank)
        t0 = time.monotonic()
        self.events.emit(EventKind.EVAL_BEGIN, step=n, gen=gen, members=size, batches=len(mine))
        held = self.eval_result if self.eval_result and self.eval_result.step == n else None
        wait_s = 0.0
        try:
            result = self._eval_handover(held, n, gen, size, rank)
            computed = result is None
            if result is None:
                table = self._eval_compute(ev, n, gen, batches, mine)
                t_wait = time.monotonic()
                timeout = eval_wait_timeout(
                    t_wait - t0, self.hang.timeout_s, self.config.watchdog.multiplier
                )
                self._between_steps([table.table], n, gen, timeout, "eval")
                wait_s = time.monotonic() - t_wait
                reduced = table.reduce()
                if isinstance(reduced, str):
                    return m.EvalAborted(m.AbortPhase.EVAL, reduced)
                result = EvalResult(n, *reduced)
        except _Aborted as e:
            return m.EvalAborted(e.phase, e.message)
        self.eval_result = self._fresh_eval = result
        seconds = time.monotonic() - t0
        self.events.emit(
            EventKind.EVAL_END,
            step=n,
            gen=gen,
            seconds=seconds,
            wait_s=wait_s,
            batches=len(mine) if computed else 0,
            samples=result.samples,
            sums=result.sums,
            computed=computed,
        )
        log.info("%s: evaluation after %d steps in %.2f s: %s", self.member, n, seconds,
                 result.means)  # fmt: skip
        return m.Evaluated()

    def _eval_handover(
        self, held: EvalResult | None, n: int, gen: int, size: int, rank: int
    ) -> EvalResult | None:
        """`evaluate.hand_over` over this generation's group, each collective waited
        for like the evaluation's (the step timeout: everyone arrives together)."""
        if size == 1:
            return held

        def run(tensors: list[torch.Tensor], post: Post | None) -> None:
            self._between_steps(tensors, n, gen, self.hang.timeout_s, "eval", post)

        try:
            return hand_over(self._pg, run, held, n, rank, size)
        except HandoverFailed as e:
            raise _Aborted(m.AbortPhase.EVAL, f"eval: {e}") from None

    def _eval_compute(
        self, ev: Evaluation, n: int, gen: int, batches: list[range], mine: list[int]
    ) -> EvalTable:
        """This member's rows of the table: its block of batches, in order."""
        table: EvalTable | None = None
        for k, b in enumerate(mine):
            if self.session.gen_broken(gen):
                raise _Aborted(m.AbortPhase.SUPERSEDED, "generation changed during the evaluation")
            values = metric_values(ev.compute(n, b, ev.load(batches[b])))
            if table is None:
                table = EvalTable(tuple(sorted(values)), batches)
            table.fill(b, values)
            if k == 0:
                self._hook(n - 1, hooks.StepPoint.EVAL)
        if table is None:
            # More members than batches: this one has none, and learns the metrics'
            # names from batch 0 (another member's) to shape its all-zero rows.
            values = metric_values(ev.compute(n, 0, ev.load(batches[0])))
            table = EvalTable(tuple(sorted(values)), batches)
        return table

    def pause_barrier(self, began: float, timeout_s: float | None) -> None:
        """The end of `trainer.pause()`: wait until every member of the generation
        has ended its own (one small all-reduce of [1, committed count]).

        Bounded by ``timeout_s``, or by default by `pause_timeout`: work that one
        member does for all (the leader writing samples) leaves the others with no
        time of their own to scale, so the default is at least the watchdog's
        ceiling. A failed or timed-out barrier
        (a peer died or hung in its pause, or entered none) abandons the generation
        at the next step; the caller's code is not run again."""
        if self._pg is None or not self.proto.in_group:
            return
        gen, n, size = self.proto.gen, self.proto.committed, len(self.proto.members)
        own = time.monotonic() - began
        wd = self.config.watchdog
        timeout = timeout_s
        if timeout is None:
            timeout = pause_timeout(own, self.hang.timeout_s, wd.multiplier, wd.ceiling_s)
        t = torch.tensor([1.0, float(n)], dtype=torch.float64)
        try:
            self._between_steps([t], n, gen, timeout, "pause")
        except _Aborted as e:
            log.warning("%s: %s", self.member, e.message)
            self._broken = e.message
            return
        if t.tolist() != [float(size), float(size * n)]:
            self._broken = (
                "pause: not every member was in trainer.pause() after the same step "
                "(enter it on every member, deciding from the step, never from the rank)"
            )
            log.warning("%s: %s", self.member, self._broken)

    def _between_steps(
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
        `_Aborted`."""
        pg = self._pg
        assert pg is not None
        set_timeout = getattr(pg, "set_timeout", None)
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_s + 5.0))
        work = post(tensors) if post is not None else pg.allreduce(tensors)
        self._inflight = [work]
        try:
            self.waiter.wait(self._inflight, timeout_s, lambda: self.session.gen_broken(gen))
        except CollectiveAborted as e:
            if e.reason == "watchdog":
                self.events.emit(
                    EventKind.WATCHDOG_FIRED, step=step, gen=gen, timeout_s=timeout_s, during=during
                )
            raise _Aborted(m.AbortPhase(e.reason), f"{during}: {e}") from None
        except RuntimeError as e:
            self._inflight = []
            raise _Aborted(m.AbortPhase.EVAL, f"{during}: {str(e)[:300]}") from None
        self._inflight = []
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=self.config.watchdog.ceiling_s))

    def _abandon(self, a: m.Action) -> m.Observation:
        """Drop the current group (parking it if work is in flight) and forget the generation."""
        assert a.phase is not None
        self.events.emit(
            EventKind.STEP_ABORT, step=a.step, gen=a.gen, error=a.error[:300], phase=a.phase
        )
        self._drop_groups()
        self._inflight = []
        self._step = None
        self._broken = None
        # An abandoned all-reduce may still complete later and write into its
        # buffer: never reuse it.
        self.backend.discard()
        self.session.set_gen(0)
        log.warning("%s: generation %d abandoned in %s: %s", self.member, a.gen, a.phase, a.error)
        return m.Abandoned()

    def _drop_groups(self) -> None:
        """Hand the generation's groups to the graveyard: gloo parked until its work in
        flight ends, NCCL aborted first (`elastrain.runtime.collectives`)."""
        if self._nccl is not None:
            self.graveyard.bury(self._nccl, self._inflight, abort=True)
            self._nccl = None
        if self._pg is not None:
            self.graveyard.bury(self._pg, self._inflight)
            self._pg = None
        if self.shards is not None:
            self.shards.drop(self._inflight)

    # ---- checkpoints -------------------------------------------------------------------

    def _state_at(self, committed: int) -> StateFn:
        """What a checkpoint snapshot of the state after `committed` steps reads: the
        flattened state (aliases of the live tensors), its JSON meta and the names
        of what only the optimizer step writes (copied until `_settle_readers`)."""
        return lambda: self._checkpoint_state(committed)

    def _checkpoint_state(
        self, committed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
        flat = self.backend.state().flatten()
        meta = self._checkpoint_meta(committed)
        meta["optimizer"] = ordered_json(flat.section)
        return dict(flat.tensors), meta, flat.stable

    def _checkpoint_meta(self, committed: int) -> dict[str, Any]:
        meta = self._meta(committed)
        meta["extra"] = ordered_json(meta.get("extra"))
        meta["framework"] = self.backend.framework
        return meta

    def _save_args(self, committed: int) -> tuple[StateFn | PartsFn, SaveRole]:
        """What this member snapshots for checkpoint `committed` and its role in it:
        its stripe of the flattened state (rank 0 commits), or, sharded, its shard's
        rows if it is its shard's writer (`writer_shard`) and rank 0 commits."""
        rank, members = self.proto.rank, list(self.proto.members)
        if self.shards is None:
            role = SaveRole.replicated(rank, members)
            if self.ckpt.format == CheckpointFormat.DCP:
                return (lambda: self._replicated_parts(committed, rank, len(members))), role
            return self._state_at(committed), role
        layout = self.shards.layout
        if layout is None:  # between generations: no layout, nothing to write
            return self._state_at(committed), SaveRole(None, 1, False)
        backend = self.backend
        assert isinstance(backend, ShardedBackend)
        shard = writer_shard(layout, self.member)
        role = SaveRole(shard, layout.shard_size, rank == 0)
        return (
            lambda: shard_parts(backend, self._checkpoint_meta(committed), shard or 0),
            role,
        )

    def _replicated_parts(self, committed: int, rank: int, members: int) -> ShardParts:
        """A replicated member's rows of the DCP checkpoint of `committed` steps
        (`elastrain.checkpoint.replicated_parts`; aliases of the live tensors)."""
        state = self.backend.state()
        assert isinstance(state, TorchState)  # `format_problem` refused DCP for others
        return replicated_parts(state, self._checkpoint_meta(committed), rank, members)

    def _resume_hint(self) -> str:
        """Where the job can resume from (a worker ending because rows are lost)."""
        d = self.ckpt.directory
        steps = committed_steps(d)
        if not steps:
            return "no checkpoint was committed (--ckpt-every, --ckpt-mtbf) to resume from"
        return (
            f"the newest committed checkpoint is step {steps[-1]} in {d}: run the same command "
            "again (same --run-dir) to resume the whole job from it, with any --shard-size"
        )

    def _resume(self, newer_than: int | None = None) -> None:
        """Load the checkpoint to resume from, if any (before the first rendezvous).

        Every initial member of a resumed job loads the same one (the launcher
        chose it and passed its step in $ELASTRAIN_RESUME); a replacement loads
        the newest verified one and is healed by its peers if they are further.
        ``newer_than``: a standby's refresh (`_refresh_standby`): the newest
        verified one, only if it holds more than that many committed steps.
        """
        t0 = time.monotonic()
        mode = self._resume_mode if newer_than is None else "latest"
        got = load_resume(self.ckpt.directory, mode)
        if newer_than is not None and (got is None or got[0].step <= newer_than):
            return
        if got is None:
            if self._plain_from is not None:
                self._resume_plain(self._plain_from, t0)
            return
        ckpt, tensors, meta = got
        if self.shards is not None and ckpt.kind != "dcp":
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.MISCONFIGURED, committed=self.committed
            )
            exit_misconfigured(
                f"{ckpt.path} is a whole-model checkpoint (a replicated job's) and a sharded "
                "model resumes only from sharded ones: resume it without --shard-size, or start "
                "in a fresh run directory"
            )
        saved = meta.get("framework", "torch")
        if saved != self.backend.framework:
            raise RuntimeError(
                f"checkpoint {ckpt.path} was written by a {saved} job, this is {self.backend.framework}"
            )
        meta["extra"] = from_ordered_json(meta.get("extra"))
        if meta.get("data") is None:
            # Written before the order was recorded: those jobs used randperm from 0.
            meta["data"] = {"order": OrderKind.RANDPERM.value, "position": None}
        problem = self._order_problem(meta["data"].get("order"))
        if problem is not None:
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.MISCONFIGURED, committed=self.committed
            )
            exit_misconfigured(f"checkpoint {ckpt.path} cannot be resumed: {problem}")
        loaded: int | None = ckpt.total_bytes
        if ckpt.kind == "dcp":
            loaded = self._resume_sharded(ckpt, meta, t0)
        else:
            state = self.backend.state()
            install_checkpoint(state, tensors, from_ordered_json(meta["optimizer"]), str(ckpt.path))
            self.backend.adopt(state)
        committed = self._load_meta(meta)
        if committed != ckpt.step:
            raise RuntimeError(
                f"checkpoint {ckpt.path} holds committed count {committed}, not {ckpt.step}"
            )
        self.proto.resumed(committed)
        seconds = time.monotonic() - t0
        log.info(
            "%s resumed from %s (step %d) in %.2f s", self.member, ckpt.path, ckpt.step, seconds
        )
        print(f"[{self.member}] resumed from checkpoint step {ckpt.step} ({ckpt.path})", flush=True)
        if loaded is not None:
            self._loaded(ckpt, loaded, seconds)

    def _resume_plain(self, directory: str, t0: float) -> None:
        """Start from a plain torch job's DCP checkpoint (`elastrain run --resume-from`):
        its model and optimizer state, at its step; the hyperparameters, the data
        order's kind and everything else from the script. A replicated member
        installs it now; a sharded one reads its slot's rows when it takes its slot,
        as from a sharded checkpoint. A checkpoint that does not fit this model and
        optimizer ends the worker as misconfigured (exit 78), naming the first
        differing tensor, before any step."""
        backend = self.backend
        state: TorchState | None = None
        try:
            if isinstance(backend, ShardedBackend):
                mine = backend.model_schema()
                if backend.on_meta and mine["nonpersistent_buffers"]:
                    raise PlainCheckpointError(
                        "this model is built on the meta device and its buffers "
                        f"{mine['nonpersistent_buffers'][:3]} are not in its state_dict "
                        "(persistent=False), so no plain checkpoint holds them: build the "
                        "model on a real device to start from one"
                    )
                script = ScriptState.of_sharded(mine)
            else:
                named = backend.state()
                if not isinstance(named, TorchState):
                    raise PlainCheckpointError(
                        "a JAX job cannot start from a torch.distributed.checkpoint"
                    )
                state = named
                script = ScriptState.of_torch(state.model, state.optimizer)
            layout = read_layout(directory)
            step = resume_step(read_step(directory, layout), self._plain_step, directory)
            problem = plain_problem(layout, script)
            if problem is not None:
                raise PlainCheckpointError(
                    f"{directory} does not fit this script's model and optimizer: {problem}"
                )
            schema = plain_schema(layout, script)
            reader = PlainReader(directory, layout)
            if state is not None:
                reader.read_all()
                tensors, section = replicated_state(reader, schema, state)
                with_script_objects(state, tensors, section)
                install_checkpoint(state, tensors, section, directory)
            else:
                assert isinstance(backend, ShardedBackend)
                problem = schema_problem(schema, backend)
                if problem is not None:
                    raise PlainCheckpointError(f"{directory}: {problem}")
        except (PlainCheckpointError, ResumeMismatch, ResumeError, ValueError) as e:
            self.events.emit(
                EventKind.WORKER_EXIT, reason=m.ExitReason.MISCONFIGURED, committed=self.committed
            )
            exit_misconfigured(f"--resume-from: {e}")
        before = time.monotonic() - t0

        def loaded(nbytes: int, seconds: float) -> None:
            self.events.emit(
                EventKind.CHECKPOINT_LOADED,
                step=step,
                path=str(directory),
                generation=None,
                bytes=nbytes,
                seconds=before + seconds,
                plain=True,
            )

        if state is not None:
            backend.adopt(state)
            loaded(reader.bytes_read, 0.0)
        else:
            assert isinstance(backend, ShardedBackend)
            backend.resume_from(shard_source(reader, schema, loaded))
        self.session.note_committed(step)
        self.proto.resumed(step)
        log.info("%s starts from %s (step %d) after %.2f s", self.member, directory, step, before)
        print(f"[{self.member}] started from DCP checkpoint {directory} at step {step}", flush=True)

    def _loaded(self, ckpt: VerifiedCheckpoint, nbytes: int, seconds: float) -> None:
        self.events.emit(
            EventKind.CHECKPOINT_LOADED,
            step=ckpt.step,
            path=str(ckpt.path),
            generation=ckpt.generation,
            bytes=nbytes,
            seconds=seconds,
        )

    def _resume_sharded(
        self, ckpt: VerifiedCheckpoint, meta: dict[str, Any], t0: float
    ) -> int | None:
        """Resume from a sharded checkpoint (`elastrain.checkpoint.sharded_parts`). A
        replicated member reads every tensor whole now; returns the bytes read. A
        sharded member reads its slot's rows when it takes its slot (its first
        `place`, in the first generation's heal, whatever the layout) and says
        so then (`checkpoint_loaded`); returns None."""
        schema = meta["schema"]
        reader = ShardedReader(ckpt)
        if self.shards is None:
            state = self.backend.state()
            if not isinstance(state, TorchState):
                raise ResumeError(f"checkpoint {ckpt.path} is a torch model's, not this one's")
            try:
                tensors, section = replicated_state(reader, schema, state)
                objects = saved_objects(reader, meta)
            except (ResumeMismatch, ValueError) as e:
                raise ResumeError(
                    f"checkpoint {ckpt.path} does not fit this model and optimizer: {e}. "
                    "Resume with the same script, or start in a fresh --run-dir."
                ) from None
            if objects is not None:  # a replicated job's: its registered objects too
                section[OBJECTS_KEY], more = objects
                tensors.update(more)
            install_checkpoint(state, tensors, section, str(ckpt.path))
            self.backend.adopt(state)
            return reader.bytes_read
        backend = self.backend
        assert isinstance(backend, ShardedBackend)
        problem = schema_problem(schema, backend)
        if problem is not None:
            reader.close()
            raise ResumeError(
                f"checkpoint {ckpt.path} does not fit this model and optimizer: {problem}. "
                "Resume with the same script, or start in a fresh --run-dir."
            )

        before = time.monotonic() - t0

        def on_read(nbytes: int, seconds: float) -> None:
            log.info("%s read its shard of %s: %d bytes in %.3f s", self.member, ckpt.path,
                     nbytes, seconds)  # fmt: skip
            self._loaded(ckpt, nbytes, before + seconds)

        backend.resume_from(shard_source(reader, schema, on_read))
        return None

    def _emergency(self, a: m.Action) -> m.Observation:
        """The job is being preempted: write an emergency checkpoint of the step just
        committed (every member of the generation got the same notice with the same
        step's verdict) and wait until it is durable within the grace period."""
        deadline = time.monotonic() + a.grace_s
        n = a.step
        log.warning("%s: preemption notice; emergency checkpoint at step %d", self.member, n)
        print(f"[{self.member}] preempted: emergency checkpoint at step {n}", flush=True)
        members, rank = list(self.proto.members), self.proto.rank
        state, role = self._save_args(n)
        ok = self.ckpt.emergency(n, a.gen, members, rank, state, deadline, role)
        self.events.emit(
            EventKind.CHECKPOINT_EMERGENCY,
            step=n,
            ok=ok,
            rank=rank,
            seconds=a.grace_s - max(0.0, deadline - time.monotonic()),
        )
        return m.CheckpointWritten(ok)

    # ---- leaving -------------------------------------------------------------------

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
        raise WorkerExit(a.code, str(a.reason), message)

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._settle_readers()
        self.loader.close()
        self.ckpt.close()
        self._drop_groups()
        self.session.close()
        self._quorum_pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False)
        # An abandoned group build must not return into Python during interpreter
        # shutdown either (`settle_before_exit`); it ends at its own deadline.
        for thread, ends_by in self._abandoned_builds:
            thread.join(max(0.0, ends_by - time.monotonic()))
        settle_before_exit(self.waiter, self.graveyard, self.member)
        self.client.close()
        if self._metering is not None:
            self._metering.stop()
        self.events.close()


class EngineTrainer:
    """What the public trainers (`ElasticTrainer`, `JaxElasticTrainer`) share: a
    face over one `StepEngine`. Subclasses build the backend and the engine."""

    engine: StepEngine
    backend: Backend

    def attach(
        self,
        backend: Backend,
        optimizer: Any,
        dataset: DataSource,
        loss_fn: Any,
        collate_fn: Callable[[list[Any]], Any],
        config: TrainerConfig,
        where: WorkerEnv,
    ) -> None:
        """Keep the user's objects and build the engine over `backend`."""
        self.backend = backend
        self.optimizer = optimizer
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.collate_fn = collate_fn
        self.engine = StepEngine(backend, dataset, collate_fn, config, where)

    @property
    def config(self) -> TrainerConfig:
        """The config in force (the launcher's --steps, --ckpt-* applied)."""
        return self.engine.config

    @property
    def member(self) -> str:
        return self.engine.member

    @property
    def committed(self) -> int:
        """Steps committed so far (this member's count)."""
        return self.engine.committed

    @property
    def gen(self) -> int:
        return self.engine.gen

    @property
    def members(self) -> list[str]:
        return self.engine.members

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def skipped_steps(self) -> int:
        """Committed steps that did not update the state (non-finite gradient, or the
        `before_step` hook said so); the job's count, carried with the state."""
        return self.engine.skipped_steps

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of the current generation (for logging, not for correctness)."""
        return self.engine.rank == 0

    @property
    def holds_final_state(self) -> bool:
        """True once this member holds the state after the last step (False on a
        joiner that arrived after the job had finished: its model is untrained)."""
        return self.engine.committed >= self.engine.config.total_steps

    @property
    def last_evaluation(self) -> EvalResult | None:
        """The newest evaluation's result (`evaluate_every`), on every member alike:
        also on a member that joined after it (it travels with the state)."""
        return self.engine.eval_result

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.engine.request_leave()

    def log(self, name: str, value: float) -> None:
        """Log a scalar of the script's own (``trainer.log("lr", sched.get_last_lr()[0])``)
        at the step of the last result ``steps()`` yielded (0 before the first).

        Contract: call it on every member, or at least on rank 0: **only rank 0's
        value is reported** (rank 0 of the current generation, at the time of the
        call), so a value that differs between members is rank 0's; the other
        members only check the call, and so does every member before its first
        generation (a call before ``steps()`` reports nothing). Where it goes: a ``user_scalar`` event
        (name, value, step), the live view and ``elastrain report`` (the last value
        per name), the coordinator's ``/metrics`` as
        ``elastrain_user_scalar{name="lr"}`` (the last value per name, sent with
        the next quorum request; at most
        `elastrain.observe.scalars.MAX_METRIC_SCALARS` names, later ones are
        left out of ``/metrics`` only) and, with ``elastrain run --tensorboard
        DIR``, TensorBoard under ``user/<name>``. ``name``: 1-64 characters of
        letters, digits and ``_ . / -`` (ValueError otherwise); ``value``: a finite
        number, or a one-element tensor or array (ValueError or TypeError
        otherwise). Cheap: one event line on rank 0, nothing on the others."""
        self.engine.log(name, value)

    @contextlib.contextmanager
    def pause(self, timeout_s: float | None = None) -> Iterator[None]:
        """Work of the script's own between two steps, which every member does.

        Contract: inside ``for r in trainer.steps():``, every member enters it
        after the same step, deciding from the step alone (``if r.step % 100 ==
        99:``), never from the rank; work only one member should do goes inside
        (``if trainer.is_leader: save_samples()``). On leaving it, each member
        waits for the others (one small all-reduce), so nobody starts the next
        step's all-reduce while a peer is still in its pause, and the step
        watchdog never sees the pause. The wait is bounded by ``timeout_s``, or
        by default by ``hang_timeout_ceiling_s`` (60 s) or, if longer, this
        member's own time in the pause times ``hang_timeout_multiplier`` (pass
        ``timeout_s`` for work that one member does for minutes). A peer that dies or hangs
        meanwhile (the coordinator's lease, or that bound) makes the generation
        regroup at the next step; the code in the pause is not run again. An
        exception inside skips the wait and ends the loop as usual.

            for r in trainer.steps():
                if r.step % 500 == 499:
                    with trainer.pause():
                        if trainer.is_leader:
                            write_samples(trainer.model)
        """
        began = time.monotonic()
        yield
        self.engine.pause_barrier(began, timeout_s)

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit.
        Raises `elastrain.WorkerExit` when this worker must end (leave,
        preemption, refusal, no coordinator)."""
        return self.engine.steps()

    def run(self) -> list[StepResult]:
        """`steps()` to completion; returns every result."""
        return list(self.steps())
