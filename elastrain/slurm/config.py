"""The configuration of `elastrain slurm render`: one validated, keyword-only dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastrain.checkpoint.config import check_format
from elastrain.launch.config import check_heal_auth

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""A job name that is also a safe path component and member-id prefix."""

PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
"""One partition name, or a comma-separated list of them (what sbatch accepts)."""

_TIME = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
    r"|(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)"
    r"|(?P<mm>\d+):(?P<ss>\d+)"
    r"|(?P<min>\d+))$"
)
"""sbatch's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""


def parse_slurm_time(text: str) -> int:
    """Seconds of a Slurm time limit (`--time`); ValueError naming the accepted
    formats for anything else ("UNLIMITED" and "infinite" included: a job that
    can be preempted needs a limit its grace can be measured against)."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(
            f"time limit {text!r} is not one of Slurm's formats: minutes, minutes:seconds, "
            "hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds"
        )
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "min" in g:
        return g["min"] * 60
    if "mm" in g:
        return g["mm"] * 60 + g["ss"]
    if "h" in g:
        return g["h"] * 3600 + g["m"] * 60 + g["s"]
    return g["days"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """What `render` needs to write a job's sbatch script. Times are seconds.

    Validated on construction; a bad value or combination raises ValueError
    saying what to change.
    """

    script: str
    """The training script each worker runs (a path on the nodes; relative paths are
    relative to the job's working directory, sbatch's --chdir, the submit directory
    by default)."""

    script_args: tuple[str, ...] = ()
    """Arguments for the training script."""

    nodes: int
    """Nodes that run an agent (one `elastrain agent` per node)."""

    gpus_per_node: int = 0
    """GPUs requested per node (`--gpus-per-node`); 0 requests none (CPU workers)."""

    workers_per_node: int | None = None
    """Workers per agent (`elastrain agent --nproc`); None: `gpus_per_node`, one
    worker per GPU. Required when gpus_per_node is 0."""

    spare_nodes: int = 0
    """Extra nodes held in the allocation without an agent: the job asks for
    nodes + spare_nodes nodes and starts agents on the first `nodes` of them;
    when an agent node is lost, a replacement agent starts on the next unused
    spare (docs/guide/slurm.md, "Node loss")."""

    min_workers: int = 1
    """Fewest members that may train (the coordinator's --min)."""

    job_name: str = "elastrain"
    """sbatch --job-name, the coordinator's --job-id and the default run directory's name."""

    run_dir: str | None = None
    """The run directory, on storage every node shares: events, logs, the token file
    and checkpoints. A requeued job reruns the same script on the same directory and
    resumes from its newest checkpoint. None: runs/<job_name> (relative to the job's
    working directory)."""

    time: str | None = None
    """sbatch --time (Slurm's formats); None leaves the partition's default."""

    partition: str | None = None
    """sbatch --partition; None leaves the cluster's default."""

    grace_s: int = 120
    """How long before the time limit Slurm signals the batch script
    (`--signal=B:TERM@grace_s`). The script turns it into the whole job's preemption
    notice: an emergency checkpoint, then exit and requeue."""

    margin_s: int = 15
    """Part of grace_s kept for the processes to exit and the requeue: the
    coordinator's --grace (the emergency checkpoint's time) is grace_s - margin_s."""

    ckpt_every: int | None = None
    """Periodic checkpoints every N committed steps (the agents' --ckpt-every); None
    leaves it to the script. A requeued job can only resume from a checkpoint."""

    ckpt_format: str | None = None
    """How the workers write checkpoints, "flat" or "dcp" (a `CheckpointFormat`; the
    agents' --ckpt-format); None leaves it to the script (flat by default)."""

    heal_auth: str | None = None
    """How the workers' heals vouch for the state they install, "digest" or "mac"
    (the agents' --heal-auth; docs/design/trust.md); None leaves it to the script
    (digest by default)."""

    requeue: bool = True
    """sbatch --requeue, and after the time-limit notice the script requeues the job
    itself (`scontrol requeue`) unless training finished."""

    exclusive: bool = True
    """sbatch --exclusive: whole nodes (one agent and its workers per node)."""

    elastrain: tuple[str, ...] = ("elastrain",)
    """The command that runs elastrain on the nodes (e.g. `/shared/venv/bin/elastrain`
    or `python -m elastrain.cli`)."""

    coordinator_host: str | None = None
    """The address the coordinator binds and the agents connect to; None: the
    NodeAddr of the batch node (the first node of the allocation) from `scontrol`."""

    http_port: int = 0
    """The coordinator's HTTP port; 0: a free port chosen when it starts."""

    store_port: int = 0
    """The coordinator's TCPStore port; 0: a free port chosen when it starts."""

    def __post_init__(self) -> None:
        if not self.script or "\n" in self.script:
            raise ValueError("script must name the training script, e.g. train.py")
        if any("\n" in a or "\0" in a for a in self.script_args):
            raise ValueError("script arguments must not contain newlines or NUL")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1 (got {self.nodes})")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0 (got {self.gpus_per_node})")
        if self.workers_per_node is None and self.gpus_per_node == 0:
            raise ValueError(
                "with --gpus-per-node 0 say how many CPU workers each node runs: "
                "--workers-per-node W"
            )
        if self.workers_per_node is not None and self.workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1 (got {self.workers_per_node})")
        if self.spare_nodes < 0:
            raise ValueError(f"spare_nodes must be >= 0 (got {self.spare_nodes})")
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"min_workers must be between 1 and the job's {self.workers} workers "
                f"(nodes x workers per node; got {self.min_workers})"
            )
        if not JOB_NAME.match(self.job_name):
            raise ValueError(
                f"job name {self.job_name!r}: use 1-64 letters, digits, '.', '_' and '-', "
                "starting with a letter or digit"
            )
        if self.run_dir is not None and (not self.run_dir or "\n" in self.run_dir):
            raise ValueError("run_dir must be a non-empty path without newlines")
        if self.partition is not None and not PARTITION.match(self.partition):
            raise ValueError(f"partition {self.partition!r} is not a valid Slurm partition name")
        if self.margin_s < 1:
            raise ValueError(f"margin_s must be >= 1 (got {self.margin_s})")
        if self.grace_s <= self.margin_s:
            raise ValueError(
                f"grace_s ({self.grace_s}) must exceed margin_s ({self.margin_s}): the "
                "emergency checkpoint gets grace_s - margin_s seconds"
            )
        if self.time is not None:
            limit = parse_slurm_time(self.time)
            if limit <= self.grace_s:
                raise ValueError(
                    f"time limit {self.time!r} ({limit} s) must be longer than the grace "
                    f"({self.grace_s} s): the notice would come before the job starts"
                )
        if self.ckpt_every is not None and self.ckpt_every < 1:
            raise ValueError(f"ckpt_every must be >= 1 (got {self.ckpt_every})")
        check_format(self.ckpt_format)
        check_heal_auth(self.heal_auth)
        if not self.elastrain or any(not a or "\n" in a for a in self.elastrain):
            raise ValueError("elastrain must be a command, e.g. ('elastrain',)")
        if self.coordinator_host is not None and not re.match(
            r"^[A-Za-z0-9_.:\[\]-]+$", self.coordinator_host
        ):
            raise ValueError(f"coordinator_host {self.coordinator_host!r} is not a host name")
        for what in ("http_port", "store_port"):
            if not 0 <= getattr(self, what) <= 65535:
                raise ValueError(f"{what} must be 0 (free) or a port number 1-65535")
        if self.http_port and self.http_port == self.store_port:
            raise ValueError("http_port and store_port must differ")

    @property
    def procs_per_node(self) -> int:
        """Workers each agent runs (`--nproc`)."""
        return self.workers_per_node if self.workers_per_node is not None else self.gpus_per_node

    @property
    def workers(self) -> int:
        """Workers the job wants: the coordinator's --target."""
        return self.nodes * self.procs_per_node

    @property
    def total_nodes(self) -> int:
        """Nodes the job asks Slurm for: agents' nodes plus spares."""
        return self.nodes + self.spare_nodes

    @property
    def job_dir(self) -> str:
        """The run directory, with the default filled in."""
        return self.run_dir if self.run_dir is not None else f"runs/{self.job_name}"

    @property
    def coordinator_grace_s(self) -> int:
        """The coordinator's --grace: the emergency checkpoint's time."""
        return self.grace_s - self.margin_s
