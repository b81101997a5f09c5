"""The configuration of `elastrain k8s render`: one validated, keyword-only dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from elastrain.checkpoint.config import check_format
from elastrain.launch.config import check_heal_auth
from elastrain.quantity import parse_quantity

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""An RFC 1123 label (Kubernetes names of Services, Jobs, ...): lower-case alphanumerics and '-'."""

MAX_NAME = 40
"""Longest job name: JobSet names its pods `<name>-workers-0-<index>-<5 random>` and
its Services `<name>`; 40 keeps those within the 63-character label limit."""


def _check_name(what: str, value: str, limit: int = 63) -> None:
    if not DNS1123_LABEL.match(value) or len(value) > limit:
        raise ValueError(
            f"{what} {value!r} is not a valid Kubernetes name: use at most {limit} lower-case "
            "letters, digits and '-', starting and ending with a letter or digit (RFC 1123)"
        )


@dataclass(frozen=True, kw_only=True)
class K8sConfig:
    """What `render` needs to write a job's manifests. Times are seconds.

    Validated on construction; a bad combination raises ValueError saying what to change.
    """

    name: str = "elastrain"
    """Job name: prefix of every object (`<name>-coordinator`, `<name>-token`, JobSet `<name>`)."""

    namespace: str | None = None
    """Namespace of the namespaced objects; None leaves it to `kubectl apply -n`."""

    image: str
    """Container image with elastrain, torch and the training script (coordinator and workers)."""

    command: tuple[str, ...] = ("python", "train.py")
    """The worker's command line (the training script and its arguments)."""

    workers: int = 2
    """Workers the job wants (the coordinator's --target; Indexed Job completions)."""

    spares: int = 0
    """Hot spare pods beyond `workers` (--spares): more indexes of the workers' Job,
    whose members register and wait as standbys (the coordinator admits `workers`);
    a dead worker's place is taken by one at once and the replaced pod becomes the
    new spare (`elastrain run --spares`, docs/design/spares.md). Replicated
    jobs only."""

    min_workers: int = 1
    """Fewest members that may train (the coordinator's --min). Also sets the Job's
    maxFailedIndexes = workers - min_workers: once more indexes than that have failed
    for good, fewer than min_workers can ever run, so the Job fails."""

    gpus_per_worker: int = 0
    """`nvidia.com/gpu` per worker pod; > 0 adds the NCCL environment, /dev/shm and a
    toleration for the usual GPU node taint."""

    cpu: str = "1"
    """CPU request of each worker pod (a Kubernetes quantity)."""

    memory: str = "2Gi"
    """Memory request and limit of each worker pod."""

    coordinator_cpu: str = "500m"
    """CPU request of the coordinator pod."""

    coordinator_memory: str = "1Gi"
    """Memory request and limit of the coordinator pod (it imports torch for the TCPStore)."""

    coordinator: str = "deployment"
    """Where the coordinator runs: "deployment" (a Deployment, 1 replica, Recreate) or
    "jobset" (a replicated job of the workers' JobSet, so Kueue admits and preempts it
    together with the workers; see docs/guide/kubernetes.md)."""

    queue: str | None = None
    """Kueue LocalQueue: sets `kueue.x-k8s.io/queue-name` on the JobSet."""

    priority: str | None = None
    """Kueue WorkloadPriorityClass name: sets `kueue.x-k8s.io/priority-class`. Needs `queue`."""

    kueue_setup: bool = False
    """Also write the LocalQueue, an example ClusterQueue and ResourceFlavor (and the
    WorkloadPriorityClass when `priority` is set), with quota for exactly this job."""

    cluster_queue: str = "elastrain-cluster-queue"
    """Name of the example ClusterQueue the LocalQueue points to."""

    ckpt_pvc: str | None = None
    """PersistentVolumeClaim (ReadWriteMany) for durable checkpoints and the run directory,
    mounted at /ckpt in every pod; None keeps the run directory in an emptyDir and
    writes no durable checkpoints."""

    ckpt_every: int | None = None
    """ELASTRAIN_CKPT_EVERY: checkpoint every N committed steps (needs `ckpt_pvc`)."""

    ckpt_format: str | None = None
    """ELASTRAIN_CKPT_FORMAT: how the workers write checkpoints, "flat" or "dcp" (a
    `CheckpointFormat`; the launcher's --ckpt-format). None: the script's (flat by default)."""

    heal_auth: str | None = None
    """ELASTRAIN_HEAL_AUTH: how the workers' heals vouch for the state they install,
    "digest" or "mac" (`TrainerConfig.heal_auth`; the launcher's --heal-auth). None:
    the script's (digest by default)."""

    grace_s: float = 30.0
    """Seconds for the emergency checkpoint after a whole-job preemption notice
    (the coordinator's --grace)."""

    prestop_s: int = 10
    """Worker preStop sleep: how long a terminating worker keeps training before its own
    SIGTERM (a leave), so the coordinator's preemption notice, sent at once, reaches it
    first when the whole job is stopped. Should exceed one step plus one quorum call."""

    margin_s: int = 15
    """Extra seconds in terminationGracePeriodSeconds beyond the grace (process exit, flush)."""

    retries_per_worker: int = 6
    """Job backoffLimitPerIndex: failures of one worker index (crashes, not evictions or
    graceful leaves) before that index is given up."""

    max_restarts: int = 0
    """JobSet failurePolicy.maxRestarts: whole-set restarts after a child Job failed
    (only when > maxFailedIndexes indexes are lost; never for a single pod)."""

    http_port: int = 29400
    """The coordinator's HTTP port (container and Service)."""

    store_port: int = 29401
    """The coordinator's TCPStore port (container and Service)."""

    socket_ifname: str | None = "eth0"
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the pod network interface; None: unset."""

    shm_size: str = "8Gi"
    """Size limit of the in-memory /dev/shm of GPU workers (NCCL and data loaders)."""

    env: tuple[tuple[str, str], ...] = ()
    """Extra (NAME, value) environment variables for the workers."""

    token: str = field(default="", repr=False)
    """The job token, stored in the Secret `<name>-token` and mounted as a file
    (ELASTRAIN_TOKEN_FILE); never on a command line. The CLI generates one."""

    @property
    def pods(self) -> int:
        """Worker pods: the workers and the hot spares (Indexed Job completions)."""
        return self.workers + self.spares

    def __post_init__(self) -> None:
        _check_name("job name (--name)", self.name, MAX_NAME)
        if self.namespace is not None:
            _check_name("namespace", self.namespace)
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"image {self.image!r} must be a non-empty image reference")
        if not self.command:
            raise ValueError("command must name the training script, e.g. python train.py")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1 (got {self.workers})")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0 (got {self.spares})")
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"min_workers must be between 1 and workers={self.workers} "
                f"(got {self.min_workers}); lower --min or raise --workers"
            )
        if self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be >= 0 (got {self.gpus_per_worker})")
        for what in ("cpu", "memory", "coordinator_cpu", "coordinator_memory", "shm_size"):
            if parse_quantity(getattr(self, what)) <= 0:
                raise ValueError(f"{what} must be positive (got {getattr(self, what)!r})")
        if self.coordinator not in ("deployment", "jobset"):
            raise ValueError(
                f"coordinator must be 'deployment' or 'jobset' (got {self.coordinator!r})"
            )
        if self.queue is not None:
            _check_name("queue", self.queue)
        if self.priority is not None:
            _check_name("priority class", self.priority)
            if self.queue is None:
                raise ValueError("a Kueue priority needs a queue: pass --queue with --priority")
        if self.kueue_setup and self.queue is None:
            raise ValueError("--kueue-setup writes the queue's objects: pass --queue too")
        _check_name("cluster queue", self.cluster_queue)
        if self.ckpt_pvc is not None:
            _check_name("checkpoint PVC", self.ckpt_pvc)
        if self.ckpt_every is not None:
            if self.ckpt_every < 1:
                raise ValueError(f"ckpt_every must be >= 1 (got {self.ckpt_every})")
            if self.ckpt_pvc is None:
                raise ValueError(
                    "checkpoints need storage every worker shares: pass --ckpt-pvc with "
                    "--ckpt-every"
                )
        check_format(self.ckpt_format)
        check_heal_auth(self.heal_auth)
        if not self.grace_s > 0:
            raise ValueError(f"grace_s must be > 0 (got {self.grace_s})")
        if self.prestop_s < 0 or self.margin_s < 0:
            raise ValueError("prestop_s and margin_s must be >= 0")
        if self.retries_per_worker < 1:
            raise ValueError(
                f"retries_per_worker must be >= 1 (got {self.retries_per_worker}): with 0 the "
                "first crash of a worker gives its index up instead of replacing the pod"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0 (got {self.max_restarts})")
        for what in ("http_port", "store_port"):
            if not 1 <= getattr(self, what) <= 65535:
                raise ValueError(f"{what} must be a port number 1-65535")
        if self.http_port == self.store_port:
            raise ValueError("http_port and store_port must differ")
        for k, _ in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise ValueError(f"environment variable name {k!r} is not valid")
        if not self.token or any(c.isspace() for c in self.token):
            raise ValueError("token must be a non-empty string without whitespace")

    @property
    def termination_grace_s(self) -> int:
        """terminationGracePeriodSeconds of the coordinator: the grace plus the margin."""
        return int(-(-self.grace_s // 1)) + self.margin_s

    @property
    def worker_termination_grace_s(self) -> int:
        """terminationGracePeriodSeconds of a worker: preStop sleep + grace + margin (the
        period counts from the deletion, preStop included)."""
        return self.prestop_s + self.termination_grace_s
