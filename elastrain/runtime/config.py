"""The worker runtime's configuration."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from elastrain import env
from elastrain.checkpoint.config import CheckpointFormat, CheckpointPolicy, check_format
from elastrain.transfer.auth import HealAuth, check_auth


@dataclass(frozen=True)
class WatchdogConfig:
    """The step watchdog's section of `TrainerConfig` (what `HangTimeout` reads)."""

    floor_s: float
    """The watchdog never fires sooner than this."""
    ceiling_s: float
    """...nor later than this; also the process group's own operation timeout."""
    multiplier: float
    """Timeout = multiplier x the slowest recent all-reduce wait, clamped."""
    initial_s: float
    """Timeout before any wait was measured."""
    confirm_multiplier: float = 4.0
    """Soft deadline = this x the p99 of the recent waits + `confirm_margin_s`:
    past it the member asks the coordinator whether a peer stopped
    heartbeating, and gives up at once if one did. 0: never ask (only the
    hard timeout above)."""
    confirm_margin_s: float = 0.1
    """The soft deadline's absolute margin, for steps whose waits are tiny."""


@dataclass(frozen=True)
class TimeoutsConfig:
    """The bounds on the engine's waits for others (what `StepEngine` reads)."""

    rendezvous_s: float
    """Building a generation's process group."""
    heal_s: float
    """One heal, all of it."""
    coordinator_s: float
    """One coordinator call (long polls add their wait)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What the user decides about an elastic training job. Times are seconds.

    Flat, as a training script writes it; each component reads only its own
    section (`watchdog`, `timeouts`, `checkpoint`), built from these fields, so
    no component sees, or depends on, another's settings."""

    global_batch_size: int
    """Samples per step, fixed whatever the membership (the math does not change)."""

    micro_batch_size: int
    """Samples per forward/backward; must divide global_batch_size. A step's
    micro-batches are split over the members alive for it."""

    total_steps: int
    """Steps to train; the launcher's --steps overrides it."""

    seed: int = 0
    """Seeds the global sample order and the per-micro-batch RNG."""

    shuffle: bool = True
    """Shuffle the global order (a fresh seeded permutation per epoch)."""

    sample_order: str | None = None
    """How the global order shuffles each epoch: "feistel" (a seeded bijection,
    computed per position: O(1) memory and start-up at any dataset size) or
    "randperm" (`torch.randperm` per epoch, held in memory: the order of jobs
    before "feistel"). None: a resumed job keeps its checkpoint's order (an old
    checkpoint that records none: "randperm") and a new job uses "feistel". A
    value that differs from the checkpoint's is refused at resume: the job
    would otherwise consume a different sample sequence than it started with.
    Ignored for a streaming dataset (its own order)."""

    num_workers: int = 0
    """Data worker processes per member (forked, like a DataLoader's): each runs
    the dataset and collate function on the micro-batches this member computes
    next. 0: none (loading happens on the training thread, or, with
    `prefetch_steps`, on one background thread)."""

    prefetch_steps: int = 0
    """Steps ahead of the current one whose micro-batches (this member's, under
    the current membership) are loaded while it computes. A membership change
    re-plans: prefetched batches nobody will compute here are dropped, never
    counted (exactly-once holds whatever is prefetched). 0 with workers: the
    current step's micro-batches load in parallel, nothing ahead."""

    hang_timeout_floor_s: float = 3.0
    """The step watchdog never fires sooner than this."""

    hang_timeout_ceiling_s: float = 60.0
    """...nor later than this. It is also the process group's own timeout."""

    hang_timeout_multiplier: float = 8.0
    """Watchdog = multiplier x the slowest all-reduce wait of the recent steps,
    clamped to [floor, ceiling]."""

    initial_hang_timeout_s: float = 30.0
    """Watchdog before any step has been measured (first steps, warm-up)."""

    hang_confirm_multiplier: float = 4.0
    """Sub-second hangs: once a step's all-reduce has waited this x the p99
    of the recent waits, plus `hang_confirm_margin_s`, the member asks the
    coordinator whether a peer of the generation has stopped heartbeating
    (for the coordinator's `hang_silence_s`, 0.5 s by default). If one has,
    it is expelled and the survivors regroup at once, well before the
    watchdog above; if every peer is alive the step is slow, not hung, and
    the member keeps waiting (asking again every 0.1 s) up to the watchdog.
    A hang is thus called only on two independent signals. 0: never ask."""

    hang_confirm_margin_s: float = 0.1
    """The absolute part of that soft deadline, so that steps whose waits are
    a few milliseconds do not ask the coordinator on every scheduling hiccup."""

    rendezvous_timeout_s: float = 15.0
    """How long building a process group may wait for its members in the store."""

    heal_timeout_s: float = 120.0
    """Upper bound on receiving the state from peers."""

    coordinator_timeout_s: float = 10.0
    """Timeout of one coordinator call (long polls add their wait)."""

    collectives: str = "auto"
    """What carries the step's gradient all-reduce (`elastrain.runtime.collectives`).
    "auto" (the default): NCCL when the model is on a CUDA device, the model is
    replicated (not sharded) and torch's NCCL is new enough (>= 2.14.3), else
    gloo. "nccl": the same, but an error naming what is missing instead of gloo.
    "gloo": always gloo (a GPU's tensors through host copies), e.g. for several
    processes sharing one GPU, which NCCL refuses. Either way one group per
    generation, built when it forms; an NCCL one is aborted when the
    generation breaks. Heals and the rest of a generation's traffic stay on gloo."""
    reduce_dtype: str = "auto"
    """What the step's gradients are summed in, on each member and across members.
    "auto" (the default): "float64" when the model's parameters are on the CPU,
    "native" on an accelerator (`elastrain.runtime.device.resolve_reduce_dtype`).
    "float64": each micro-batch's gradient is added into a float64 buffer and the
    all-reduce sums those; the float32 sums it stands for are exact there (in
    practice: unless one micro-batch's entry is ~2^29 times another's), so the
    gradient rounded back to the parameters' dtype has the same bits whichever
    members computed which micro-batches. The loss curve of a run with failures
    then equals the failure-free run's bit for bit, not just to float32 noise
    that grows over thousands of steps. Costs a float64 copy of the gradients
    and twice the all-reduce bytes. "native": sum in the parameters' dtype (half
    the bytes; the result depends on membership in the last bits).
    Sharded (`shard_size` > 1): "float64" reduce-scatters every micro-batch's
    gradient in float64 inside the replica group (exact, as above; at 2
    micro-batches per member per step 4x the bytes of plain FSDP2 HSDP);
    "native" accumulates the unsharded gradient across the step's micro-batches
    and reduce-scatters it once, in the parameters' dtype (plain HSDP's
    reductions, and its memory: the unsharded gradient lives across
    micro-batches), then the twins all-reduce it in that dtype. A sharded
    "native" model needs its trainable parameters in one dtype."""

    max_grad_norm: float | None = None
    """Clip the mean gradient to this global L2 norm before the optimizer step
    (torch's `clip_grad_norm_` rule: scale by min(1, max_norm / (norm + 1e-6))),
    on every member alike: the norm is computed in float64 in an order fixed by
    the model's layout (`elastrain.runtime.update.grad_norm`), not by thread
    count. None: no clipping. The norm is measured either way (`grad_norm` in
    `StepResult` and the `step_commit` event). JAX too (`JaxElasticTrainer`: in a
    multi-process replica, the norm over all its parts)."""

    hash_state: bool = True
    """Hash the full state at every generation start (logged as an event, so
    tests and chaos runs can check that every member holds the same state)."""

    checkpoint_dir: str | None = None
    """Where durable checkpoints go. None: ``<run_dir>/checkpoints`` (the run
    directory the launcher gives the workers); under `elastrain run` the
    launcher's directory always wins, like --steps. With neither a directory
    nor a run directory, checkpointing is off. All members must see the same
    directory (one host, or a shared filesystem)."""

    checkpoint_every: int = 0
    """Take a checkpoint after every this many committed steps (0: no periodic
    checkpoints). The launcher's --ckpt-every overrides it. With
    `checkpoint_mtbf_s` set, it only places the first checkpoint (the one that
    measures the save cost); 0 then means after the first step."""

    checkpoint_mtbf_s: float | None = None
    """Mean time between failures of the whole job, in seconds. When set, the
    interval is automatic (Young/Daly: sqrt(2 x MTBF x save cost), with the
    members' mean measured blocking save cost and step time, agreed through
    the step's all-reduce) and re-chosen after every checkpoint; each choice is
    logged and emitted as a `checkpoint_interval` event. The value is a prior
    that the job's observed failures update: MTBF = (given + trained time) /
    (1 + failures observed). --ckpt-mtbf overrides it."""

    checkpoint_keep_last: int = 3
    """Committed checkpoints kept (the newest verified one is always kept too)."""

    checkpoint_keep_every: int = 0
    """Also keep forever every checkpoint whose step is a multiple of this (0: off)."""

    checkpoint_commit_timeout_s: float = 120.0
    """How long rank 0 waits for every member's shard of a checkpoint before
    giving that checkpoint up (a member died, left, or skipped it because its
    previous write was still running). Also bounds how long a finishing
    worker waits for its last save and commit."""

    checkpoint_fsync: bool = True
    """fsync checkpoint files and directories (turn off only on throw-away storage)."""

    checkpoint_format: str = CheckpointFormat.FLAT
    """How a replicated torch job writes its checkpoints: "flat" (elastrain's
    striped safetensors files; the default) or "dcp" (`torch.distributed.checkpoint`
    format: every member writes its rows of every parameter and optimizer state,
    and torch's ``dcp.load`` reads the checkpoint into a plain model and
    optimizer; docs/guide/checkpoints.md). Registered objects (LR schedulers, grad
    scalers) travel in both. A JAX job writes "flat" only ("dcp" is refused at
    start); a sharded job always writes "dcp". Resume reads either, whatever
    this says. The launcher's --ckpt-format overrides it."""

    heal_auth: str = HealAuth.DIGEST
    """How a heal vouches for the state it installs (docs/design/trust.md, "Trust
    boundary"): "digest" (the default) sends the payload bare over the
    generation's group, as the gradients go, and the receiver installs it only
    if its state digest equals the root's, which the root sends sealed under
    the job token; "mac" also seals every stripe with Poly1305 under the job
    token, for a data plane that is not trusted at all (a MAC pass over the
    bytes on each end). Every member of a job must use the same (a heal between
    members that differ is refused). The launcher's --heal-auth overrides it."""

    shard_size: int = 1
    """Members per replica group (issue 16). Inside a replica group the model is
    sharded, one shard per member; across groups the members holding the same
    shard reduce its gradients. 1: unsharded (every member a whole replica).
    Must equal the coordinator's (its ready answer says it); the launcher's
    --shard-size overrides it and sets the coordinator's. With `reduce_dtype`
    "float64" (the default on the CPU, where sharded jobs run) the gradient is the exact float64 sum, so the loss
    curve equals the replicated job's bit for bit; "native" reduces as FSDP2's
    HSDP does, once per step in the parameters' dtype: faster, and its curve
    with failures differs from the failure-free one in the last bits
    (docs/design/sharded.md)."""

    replica_procs: int = 1
    """Processes per replica, JAX only (issue 44): a replica's K processes run one
    `jax.distributed` runtime and shard the model over their joint mesh (MaxText
    inside a slice); process k of every replica holds the same rows (twins), whose
    gradients are reduced across replicas; elasticity is across replicas (a
    replica that loses a process is rebuilt as K fresh ones). 1: a replica is one
    process. The launcher's --replica-procs K sets it and starts -n workers as
    -n/K replicas; a worker not started that way refuses a value > 1."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("global_batch_size and micro_batch_size must be positive")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide global_batch_size "
                f"({self.global_batch_size}); pick e.g. {self._suggest()}"
            )
        if self.total_steps < 0:
            raise ValueError("total_steps must be >= 0")
        if not 0 < self.hang_timeout_floor_s <= self.hang_timeout_ceiling_s:
            raise ValueError(
                "need 0 < hang_timeout_floor_s <= hang_timeout_ceiling_s "
                f"(got {self.hang_timeout_floor_s}, {self.hang_timeout_ceiling_s})"
            )
        if self.max_grad_norm is not None and not (
            math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0
        ):
            raise ValueError(f"max_grad_norm must be > 0 (or None), got {self.max_grad_norm}")
        if self.hang_timeout_multiplier < 1:
            raise ValueError("hang_timeout_multiplier must be >= 1")
        if not (math.isfinite(self.hang_confirm_multiplier) and self.hang_confirm_multiplier >= 0):
            raise ValueError(
                f"hang_confirm_multiplier must be >= 0 (0: never ask the coordinator), "
                f"got {self.hang_confirm_multiplier}"
            )
        if not (math.isfinite(self.hang_confirm_margin_s) and self.hang_confirm_margin_s >= 0):
            raise ValueError(
                f"hang_confirm_margin_s must be a number of seconds >= 0, "
                f"got {self.hang_confirm_margin_s}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 0 (0: no periodic checkpoints), "
                f"got {self.checkpoint_every}"
            )
        if self.checkpoint_mtbf_s is not None and not (
            math.isfinite(self.checkpoint_mtbf_s) and self.checkpoint_mtbf_s > 0
        ):
            raise ValueError(
                f"checkpoint_mtbf_s must be a number of seconds > 0 (or None for a fixed "
                f"interval), got {self.checkpoint_mtbf_s}"
            )
        if self.checkpoint_keep_last < 1 or self.checkpoint_keep_every < 0:
            raise ValueError(
                "need checkpoint_keep_last >= 1 and checkpoint_keep_every >= 0 "
                f"(got {self.checkpoint_keep_last}, {self.checkpoint_keep_every})"
            )
        if self.collectives not in ("auto", "gloo", "nccl"):
            raise ValueError(
                "collectives must be 'auto' (NCCL for a CUDA model, else gloo), 'gloo' or "
                f"'nccl', got {self.collectives!r}"
            )
        if self.reduce_dtype not in ("auto", "float64", "native"):
            raise ValueError(
                f"reduce_dtype must be 'auto' (float64 on the CPU, native on an accelerator), "
                f"'float64' (membership-independent sums) or 'native' (the parameters' dtype, "
                f"half the all-reduce bytes), got {self.reduce_dtype!r}"
            )
        if self.checkpoint_commit_timeout_s <= 0:
            raise ValueError("checkpoint_commit_timeout_s must be > 0")
        if self.sample_order is not None and self.sample_order not in ("feistel", "randperm"):
            raise ValueError(
                f"sample_order must be 'feistel', 'randperm' or None (the checkpoint's, else "
                f"'feistel'), got {self.sample_order!r}"
            )
        if self.num_workers < 0 or self.prefetch_steps < 0:
            raise ValueError(
                f"num_workers and prefetch_steps must be >= 0, got {self.num_workers} and "
                f"{self.prefetch_steps}"
            )
        if self.replica_procs < 1:
            raise ValueError(
                f"replica_procs must be >= 1 (1: one process), got {self.replica_procs}"
            )
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1 (1: unsharded), got {self.shard_size}")
        check_format(self.checkpoint_format, "checkpoint_format")
        check_auth(self.heal_auth, "heal_auth")

    def _suggest(self) -> int:
        return max(
            d for d in range(1, self.micro_batch_size + 1) if self.global_batch_size % d == 0
        )

    @property
    def watchdog(self) -> WatchdogConfig:
        """The watchdog's section (its fields are the hang_timeout_* ones)."""
        return WatchdogConfig(
            floor_s=self.hang_timeout_floor_s,
            ceiling_s=self.hang_timeout_ceiling_s,
            multiplier=self.hang_timeout_multiplier,
            initial_s=self.initial_hang_timeout_s,
            confirm_multiplier=self.hang_confirm_multiplier,
            confirm_margin_s=self.hang_confirm_margin_s,
        )

    @property
    def timeouts(self) -> TimeoutsConfig:
        """The engine's waits for others (the *_timeout_s fields)."""
        return TimeoutsConfig(
            rendezvous_s=self.rendezvous_timeout_s,
            heal_s=self.heal_timeout_s,
            coordinator_s=self.coordinator_timeout_s,
        )

    @property
    def checkpoint(self) -> CheckpointPolicy:
        """The durable checkpoints' section (the checkpoint_* fields)."""
        return CheckpointPolicy(
            directory=self.checkpoint_dir,
            every=self.checkpoint_every,
            mtbf_s=self.checkpoint_mtbf_s,
            keep_last=self.checkpoint_keep_last,
            keep_every=self.checkpoint_keep_every,
            commit_timeout_s=self.checkpoint_commit_timeout_s,
            fsync=self.checkpoint_fsync,
            format=CheckpointFormat(self.checkpoint_format),
        )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def checkpoints_periodic(self) -> bool:
        """True when checkpoints are taken during training (fixed or automatic interval)."""
        return self.checkpoint_every > 0 or self.checkpoint_mtbf_s is not None


@dataclass(frozen=True)
class WorkerEnv:
    """What the launcher (or a pod spec) tells a worker through the environment.

    Read once, by `read_worker_env`, when a trainer is built: nothing else in
    the worker runtime reads `os.environ`. Explicit constructor arguments win
    over these; these win over the script's `TrainerConfig` where they overlap
    (--steps, --ckpt-every, --ckpt-mtbf, --ckpt-format, --shard-size: the launcher's flags are
    the user's last word)."""

    coordinator: str | None = None
    token: str | None = None
    member: str | None = None
    run_dir: str | None = None
    host: str = "127.0.0.1"
    checkpoint_dir: str | None = None
    resume: str | None = None
    resume_from: str | None = None
    """A plain torch job's DCP checkpoint to start from when no elastrain
    checkpoint is loaded ($ELASTRAIN_RESUME_FROM)."""
    resume_step: int | None = None
    """The step `resume_from` holds, if the user gave it ($ELASTRAIN_RESUME_STEP)."""
    steps: int | None = None
    checkpoint_every: int | None = None
    checkpoint_mtbf_s: float | None = None
    checkpoint_format: str | None = None
    heal_auth: str | None = None
    """$ELASTRAIN_HEAL_AUTH: the launcher's --heal-auth (`TrainerConfig.heal_auth`)."""
    shard_size: int | None = None
    replica_procs: int | None = None
    """$ELASTRAIN_REPLICA_PROCS (the launcher's --replica-procs): overrides
    TrainerConfig.replica_procs."""
    visible_devices: str | None = None
    """$CUDA_VISIBLE_DEVICES: the accelerators this worker sees (the launcher's
    --devices places one per worker); reported in its `worker_start` event."""
    local_rank: int | None = None
    """$LOCAL_RANK: this worker's index among its launcher's (or agent's) devices."""

    def overridden(
        self,
        coordinator: str | None = None,
        token: str | None = None,
        member: str | None = None,
        run_dir: str | None = None,
    ) -> WorkerEnv:
        """This environment with a trainer's explicit constructor arguments winning."""
        given = {"coordinator": coordinator, "token": token, "member": member, "run_dir": run_dir}
        changes = {k: v for k, v in given.items() if v is not None}
        return replace(self, **changes) if changes else self  # type: ignore[arg-type]

    def apply(self, config: TrainerConfig) -> TrainerConfig:
        """`config` with the launcher's overrides applied (the one place they are)."""
        changes: dict[str, object] = {}
        if self.steps is not None:
            changes["total_steps"] = self.steps
        if self.checkpoint_every is not None:
            changes["checkpoint_every"] = self.checkpoint_every
        if self.checkpoint_mtbf_s is not None:
            changes["checkpoint_mtbf_s"] = self.checkpoint_mtbf_s
        if self.checkpoint_format is not None:
            changes["checkpoint_format"] = self.checkpoint_format
        if self.heal_auth is not None:
            changes["heal_auth"] = self.heal_auth
        if self.shard_size is not None:
            changes["shard_size"] = self.shard_size
        if self.replica_procs is not None:
            changes["replica_procs"] = self.replica_procs
        return replace(config, **changes) if changes else config  # type: ignore[arg-type]


def read_worker_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """The worker's environment (`elastrain.env` names every variable). The token
    comes from $ELASTRAIN_TOKEN or, failing that, the file $ELASTRAIN_TOKEN_FILE."""
    e = os.environ if environ is None else environ
    token = env.read_token(e)

    def num(name: str, kind: type[int] | type[float]) -> Any:
        raw = e.get(name)
        if not raw:
            return None
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"${name}={raw!r} is not a number") from None

    return WorkerEnv(
        coordinator=e.get(env.COORDINATOR) or None,
        token=token,
        member=e.get(env.MEMBER_ID) or None,
        run_dir=e.get(env.RUN_DIR) or None,
        host=e.get(env.ADVERTISE_HOST) or "127.0.0.1",
        checkpoint_dir=e.get(env.CKPT_DIR) or None,
        resume=e.get(env.RESUME) or None,
        resume_from=e.get(env.RESUME_FROM) or None,
        resume_step=num(env.RESUME_STEP, int),
        steps=num(env.STEPS, int),
        checkpoint_every=num(env.CKPT_EVERY, int),
        checkpoint_mtbf_s=num(env.CKPT_MTBF, float),
        checkpoint_format=e.get(env.CKPT_FORMAT) or None,
        heal_auth=e.get(env.HEAL_AUTH) or None,
        shard_size=num(env.SHARD_SIZE, int),
        replica_procs=num(env.REPLICA_PROCS, int),
        visible_devices=e.get(env.VISIBLE_DEVICES),
        local_rank=num(env.LOCAL_RANK, int),
    )


def worker_setup(
    config: TrainerConfig,
    coordinator: str | None,
    token: str | None,
    member: str | None,
    run_dir: str | None,
) -> tuple[WorkerEnv, TrainerConfig]:
    """A trainer's view of where it runs and the config in force: the environment,
    read once, with the constructor's explicit arguments winning, and the
    launcher's overrides applied to the script's config."""
    where = read_worker_env().overridden(coordinator, token, member, run_dir)
    return where, where.apply(config)
