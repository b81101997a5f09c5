"""`LaunchConfig`: how `elastrain run` (and `elastrain agent`) runs a job."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastrain.checkpoint.config import check_format
from elastrain.launch.faults import FaultSpec

HEAL_AUTHS = ("digest", "mac")
"""The values of `elastrain.transfer.HealAuth`, spelled out: the launcher stays
torch-free, and the transfer package imports torch (a test keeps them equal)."""


def check_heal_auth(value: str | None) -> None:
    """ValueError unless ``value`` is None (the script's mode) or one of `HEAL_AUTHS`:
    the one check of every place that takes --heal-auth (the launcher, `elastrain k8s render`)."""
    if value is not None and value not in HEAL_AUTHS:
        raise ValueError(f"--heal-auth must be one of {HEAL_AUTHS}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How `elastrain run` runs a job on this machine."""

    script: str
    """The training script (run with this Python)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed through to the script."""
    workers: int = 4
    """Workers to keep running (-n)."""
    min_workers: int = 0
    """Fewer members than this: training pauses until replacements arrive (--min).
    0 means one replica group: `shard_size` members (1 when unsharded)."""
    spares: int = 0
    """Hot spares kept beyond -n (--spares): worker processes that have started,
    built the model, warmed up and registered, and wait as standbys outside the
    generation (the coordinator admits at most -n members). A death promotes one
    at once: the coordinator forms the failure's generation with it, and the
    survivors heal it, instead of waiting for a process to start. The dead
    worker's replacement refills the pool, started once the job has moved past
    the step the worker died in (at most 30 s later: `elastrain.launch.refill`),
    so that its start does not take the host's CPU from the recovery. A standby
    loads each newer committed checkpoint while it waits, so that spares left
    alone (every member dead) go on from one checkpoint at most behind the
    newest (replicated jobs; in a sharded job a spare takes a dead rank's slot
    and is healed its shard, and takes no checkpoints while it waits)."""
    evict_stragglers: bool = False
    """Evict stragglers to hot spares (--evict-stragglers): a member of the running
    generation whose straggler score (`elastrain.observe.stragglers`: compute time
    per sample over the others' median, over a window of 10 steps) stays >=
    `evict_threshold` for 20 steps in a row is sent SIGTERM (it leaves at the next step boundary) while a spare
    waits, and the spare takes its place in the same generation change. Needs
    `spares` >= 1; `elastrain run` only (an agent sees only its node's events)."""
    evict_threshold: float = 1.5
    """--evict-stragglers: the straggler score (compute time per sample over the
    others' median, over a window of 10 steps) from which a member straggles; it
    is evicted after straggling for 20 steps in a row (--evict-threshold)."""
    replace_delay_s: float = 0.0
    """Seconds between a worker's death and its replacement's start (stands in for pod scheduling)."""
    replace: bool = True
    """Replace workers that die or leave."""
    run_dir: str | None = None
    """Where everything about the run goes (default runs/<job-id>)."""
    steps: int | None = None
    """Override the script's total steps."""
    shard_size: int | None = None
    """Members per replica group, each holding one shard of the model
    (--shard-size; `elastrain.control.layout`). Sets the coordinator's and
    overrides the script's `TrainerConfig.shard_size`, like --steps. None: the
    coordinator is unsharded and the workers keep the script's value (the ready
    answer carries the coordinator's `shard_size`, for a worker configured
    otherwise to refuse).
    Run mode: -n and --min must be multiples of it. An agent runs only its
    node's workers; the job's shape is its coordinator's (`elastrain
    coordinator --shard-size`), so an agent's -n need not be one."""
    replica_procs: int = 1
    """Processes per replica, JAX only (--replica-procs K): -n workers form -n/K
    replicas of K processes, each replica one `jax.distributed` runtime (its own
    coordinator address, new for every incarnation, loopback unless
    --advertise-host) with the model sharded over its processes; process k of
    every replica holds the same shard (twins). The launcher sets
    `TrainerConfig.replica_procs` for the workers. When a process of a replica
    exits, its replica-mates are killed and K fresh processes replace the whole
    replica (`elastrain.launch.replicas`); the other replicas go on. 1: a replica is
    one process."""
    reshard_after_s: float | None = None
    """Sharded jobs: regroup the members in memory to another shard size when a
    replica group has had a vacancy this long, and back when replacements
    return (--reshard-after; `CoordinatorConfig.reshard_after_s`). None: never."""
    memory_per_member: int | None = None
    """Bytes of training state a member can hold: reshards to a shard size that
    does not fit are refused (--memory-per-member; needs `reshard_after_s`)."""
    state_factor: float = 4.0
    """Bytes of training state per parameter byte, for `memory_per_member`
    (--state-factor; `CoordinatorConfig.state_factor`)."""
    faults: Sequence[FaultSpec] = field(default_factory=list)
    """Faults to inject (--fault), fired by the registered fault plugin
    (`elastrain.launch.faults`; the chaos package's fault schedule)."""
    fault_points: str | None = None
    """JSON of in-worker fault points (the chaos package's step hooks), for tests."""
    seed: int = 0
    """Seeds the fault schedule's choices."""
    lease_s: float = 5.0
    """Coordinator lease (see CoordinatorConfig)."""
    suspect_s: float = 1.0
    """Coordinator suspicion window (see CoordinatorConfig)."""
    hang_silence_s: float = 0.5
    """Silence that confirms an overdue collective's peer is hung (see CoordinatorConfig)."""
    max_fast_failures: int = 5
    """Give up after this many consecutive workers die within 10 s of their start."""
    max_coordinator_restarts: int = 5
    """Give up after the coordinator died this many times within 10 minutes."""
    max_same_error: int = 2
    """Stop the job (exit status 1) once this many worker exits within
    `replacement_window_s` raised the same Python exception at the same script
    line, whichever members and steps (--max-same-error): a bug in the script,
    which every replacement would hit again, not a hardware failure. The console
    shows the exception and the first failing member's last log lines. 0: never
    stop for it (every such exit is replaced, within `max_replacements`).
    Injected faults and exits by a signal never count (`elastrain.launch.startup`)."""
    max_replacements: int = 20
    """The restart budget (--max-replacements): stop the job (exit status 1) when a
    worker failure would be the (K+1)th replaced within `replacement_window_s`.
    20 per hour: a healthy job of hundreds of devices loses a few a day, so 20 in
    an hour means something systematic (a bad node pool, an out-of-memory loop)
    that replacing does not fix, and each replacement costs the survivors a
    regroup. Graceful leaves, preemptions and injected faults never count. 0: no
    budget."""
    replacement_window_s: float = 3600.0
    """Seconds over which `max_replacements` and `max_same_error` count failures
    (--replacement-window)."""
    progress: bool = True
    """Show live progress."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the workers."""
    checkpoint_every: int | None = None
    """Override the script's checkpoint interval, in steps (--ckpt-every; 0: none)."""
    checkpoint_mtbf_s: float | None = None
    """Override the script's MTBF for the automatic Young/Daly interval (--ckpt-mtbf)."""
    checkpoint_format: str | None = None
    """Override the script's checkpoint format, "flat" or "dcp" (--ckpt-format;
    `TrainerConfig.checkpoint_format`). None: the script's (flat by default)."""
    heal_auth: str | None = None
    """Override the script's heal mode, "digest" or "mac" (--heal-auth;
    `TrainerConfig.heal_auth`). None: the script's (digest by default)."""
    resume_from: str | None = None
    """A DCP checkpoint written by a plain torch job (DDP, FSDP2) to start from
    (--resume-from; docs/guide/checkpoints.md, "Starting from a plain DCP checkpoint").
    Refused when the run directory already has a committed elastrain checkpoint
    (run without it to resume that one); an agent's workers prefer the job's
    own newest checkpoint to it."""
    resume_step: int | None = None
    """The number of steps `resume_from` was trained for (--resume-step); needed
    when the checkpoint has no ``step`` entry, and must agree with it if it has."""
    grace_s: float = 30.0
    """Seconds between SIGTERM to the launcher and the end of the job (--grace):
    the emergency checkpoint and every worker's exit must fit in it."""
    coordinator: str | None = None
    """Agent mode (`elastrain agent`): HOST:PORT of a coordinator that runs
    elsewhere. This process then runs only its own `workers` and neither starts
    nor restarts a coordinator; SIGTERM drains its workers (a node leaving)."""
    token: str | None = None
    """Agent mode: the job token (from --token-file or $ELASTRAIN_TOKEN)."""
    name: str = ""
    """Agent mode: prefix of this agent's member ids ("node1" -> node1-w0, ...),
    unique per agent so members on different hosts never collide."""
    advertise_host: str | None = None
    """The address this host's workers give their peers (ELASTRAIN_HOST)."""
    group_readable: bool = False
    """Run directory 0750 and the job's files (checkpoints, logs) 0640, for shared
    filesystems where a group must read them (--group-readable); default 0700/0600."""
    hosts: int = 0
    """Spread the workers over this many simulated hosts (--hosts): Linux network
    namespaces on one bridge, built for the run and deleted after it
    (by the registered fault plugin, `elastrain.launch.faults`; the chaos
    package's needs root and iproute2). The coordinator listens
    on the bridge. What it is for: `cut` faults, which take one host off the
    network. 0: every process on this host's loopback."""
    devices: tuple[str, ...] | None = None
    """Local accelerators to place the workers on, one each (--devices 0,1,2,3):
    CUDA_VISIBLE_DEVICES, LOCAL_RANK and LOCAL_WORLD_SIZE per worker; a
    replacement keeps its predecessor's device unless that one exited with a
    poisoned device (`elastrain.launch.devices`). Needs at least -n + --spares
    entries. None: no placement (every worker sees what this process sees)."""
    prefork: bool = True
    """Fork the workers from a server that has imported torch once
    (`elastrain.launch.prefork`) instead of starting each as a fresh Python
    (--no-prefork): a start or a replacement then skips the ~1.5 s import. Not
    with --hosts (those workers start inside a network namespace)."""
    tensorboard: str | None = None
    """Write the job's step, loss, goodput, energy and the script's own scalars
    (`trainer.log`) as TensorBoard event files into this directory
    (--tensorboard; `elastrain.observe.tensorboard`). The launcher writes them
    from the run's events, so `elastrain run` only: an agent sees only its own
    node's events. None: no TensorBoard files."""

    def __post_init__(self) -> None:
        if self.coordinator is not None:
            if not self.token:
                raise ValueError(
                    "an agent needs the job token: --token-file FILE or $ELASTRAIN_TOKEN"
                )
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
            if self.faults and any(f.kind == "kill-coordinator" for f in self.faults):
                raise ValueError("an agent cannot kill a coordinator it does not run")
            if self.tensorboard is not None:
                raise ValueError(
                    "--tensorboard is for elastrain run: an agent sees only its node's events"
                )
        if self.name and not all(ch.isalnum() or ch in "-_." for ch in self.name):
            raise ValueError(f"--name may hold letters, digits, '-', '_', '.': {self.name!r}")
        if self.resume_step is not None:
            if self.resume_from is None:
                raise ValueError("--resume-step needs --resume-from DIR")
            if self.resume_step < 0:
                raise ValueError(f"--resume-step must be >= 0 (got {self.resume_step})")
        if self.workers < 1:
            raise ValueError(f"-n must be >= 1 (got {self.workers})")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1 (got {self.shard_size}; 1: unsharded)")
        self._check_replica_procs()
        shards = self.shard_size or 1
        if self.coordinator is None and self.workers % shards:
            raise ValueError(
                f"-n {self.workers} is not a multiple of --shard-size {shards}: the members "
                f"form replica groups of {shards} (try -n {self._multiples(self.workers)})"
            )
        if self.min_workers == 0:
            # (An agent's -n may be smaller than a group; its --min is unused.)
            object.__setattr__(self, "min_workers", min(shards * self.replica_procs, self.workers))
        if self.hosts < 0:
            raise ValueError(f"--hosts must be >= 0 (got {self.hosts})")
        if self.devices is not None and len(self.devices) < self.workers + self.spares:
            raise ValueError(
                f"--devices lists {len(self.devices)} device(s) for -n {self.workers} + "
                f"--spares {self.spares} workers: one device per worker"
            )
        if self.hosts and (self.coordinator is not None or self.advertise_host):
            raise ValueError(
                "--hosts builds simulated hosts for a one-machine job; an agent already runs "
                "on a host of its own (leave out --hosts, or --coordinator/--advertise-host)"
            )
        if self.faults and not self.hosts and any(f.kind == "cut" for f in self.faults):
            raise ValueError(
                "a cut fault takes a host off the network: run the workers on simulated "
                "hosts with --hosts N (N >= 2; root and iproute2 needed)"
            )
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"--min must be between 1 and -n={self.workers} (got {self.min_workers})"
            )
        if self.coordinator is None and self.min_workers % shards:
            raise ValueError(
                f"--min {self.min_workers} is not a multiple of --shard-size {shards}: "
                f"training needs whole replica groups of {shards} "
                f"(try --min {self._multiples(self.min_workers)})"
            )
        self._check_resharding()
        if self.spares < 0:
            raise ValueError(f"--spares must be >= 0 (got {self.spares})")
        if self.spares and not self.replace:
            raise ValueError(
                "--spares with --no-replace: a promoted spare would never be refilled; "
                "use -n for more workers instead"
            )
        if self.evict_stragglers and not self.spares:
            raise ValueError(
                "--evict-stragglers hands a straggler's place to a hot spare: add --spares K "
                "(K >= 1)"
            )
        if not (math.isfinite(self.evict_threshold) and self.evict_threshold > 1):
            raise ValueError(f"--evict-threshold must be a factor > 1 (got {self.evict_threshold})")
        if self.evict_stragglers and self.coordinator is not None:
            raise ValueError(
                "--evict-stragglers is for elastrain run: an agent sees only its own node's "
                "step times"
            )
        if self.replace_delay_s < 0:
            raise ValueError("--replace-delay must be >= 0")
        if self.max_same_error < 0 or self.max_same_error == 1:
            raise ValueError(
                "--max-same-error must be 0 (never stop) or >= 2 (one failure is not a pattern)"
            )
        if self.max_replacements < 0:
            raise ValueError("--max-replacements must be >= 0 (0: no budget)")
        if not (math.isfinite(self.replacement_window_s) and self.replacement_window_s > 0):
            raise ValueError("--replacement-window must be a number of seconds > 0")
        if not Path(self.script).is_file():
            raise ValueError(f"training script not found: {self.script}")
        if self.steps is not None and self.steps < 0:
            raise ValueError("--steps must be >= 0")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError("--ckpt-every must be >= 0 (0 turns periodic checkpoints off)")
        if self.checkpoint_mtbf_s is not None and not self.checkpoint_mtbf_s > 0:
            raise ValueError("--ckpt-mtbf must be a number of seconds > 0")
        check_format(self.checkpoint_format)
        check_heal_auth(self.heal_auth)
        if not self.grace_s > 0:
            raise ValueError("--grace must be > 0 seconds")

    def coordinator_policy_args(self) -> list[str]:
        """The flags that give the coordinator this job's shape and resharding
        policy (`elastrain coordinator`'s --shard-size, --reshard-after, ...)."""
        out = ["--shard-size", str(self.shard_size or 1)]
        if self.reshard_after_s is not None:
            out += ["--reshard-after", repr(self.reshard_after_s)]
        if self.memory_per_member is not None:
            out += ["--memory-per-member", str(self.memory_per_member)]
        out += ["--state-factor", repr(self.state_factor)]
        return out

    def _check_resharding(self) -> None:
        """The flags' own words for what `CoordinatorConfig` would refuse later, in
        the coordinator's process, where the user would not see why."""
        if self.reshard_after_s is not None:
            if not (math.isfinite(self.reshard_after_s) and self.reshard_after_s >= 0):
                raise ValueError(
                    f"--reshard-after must be a number of seconds >= 0 (got {self.reshard_after_s})"
                )
            if self.coordinator is not None:
                raise ValueError(
                    "--reshard-after is the coordinator's policy: pass it to "
                    "`elastrain coordinator`, not to an agent"
                )
            if (self.shard_size or 1) == 1:
                raise ValueError(
                    "--reshard-after regroups a sharded job's replica groups: "
                    "it needs --shard-size S with S > 1"
                )
        if self.memory_per_member is not None:
            if self.memory_per_member < 1:
                raise ValueError(
                    f"--memory-per-member must be a positive size (got {self.memory_per_member})"
                )
            if self.reshard_after_s is None:
                raise ValueError(
                    "--memory-per-member only limits what a reshard may choose: "
                    "pass --reshard-after S too"
                )
        if not (math.isfinite(self.state_factor) and self.state_factor > 0):
            raise ValueError(f"--state-factor must be > 0 (got {self.state_factor})")

    def _check_replica_procs(self) -> None:
        """--replica-procs K: what a job of K-process JAX replicas cannot be combined with."""
        k = self.replica_procs
        if k < 1:
            raise ValueError(f"--replica-procs must be >= 1 (got {k}; 1: one process a replica)")
        if k == 1:
            return
        why = []
        if self.workers % k:
            why.append(
                f"-n {self.workers} is not a multiple of --replica-procs {k} (-n counts processes)"
            )
        if self.shard_size not in (None, 1):
            why.append(
                "--shard-size shards a PyTorch model over members (FSDP2); a JAX replica of K processes shards it over its own mesh"
            )
        if self.coordinator is not None:
            why.append("agents (elastrain agent) are not built for multi-process replicas")
        if self.spares:
            why.append(
                "--spares: a hot spare is one process, a replica's rebuild needs K fresh ones"
            )
        if why:
            raise ValueError(f"--replica-procs {k}: " + "; ".join(why))

    def _multiples(self, n: int) -> str:
        """The multiples of the shard size around `n`, for an error message."""
        k = self.shard_size or 1
        below, above = n // k * k, (n // k + 1) * k
        return f"{below} or {above}" if below else str(above)
