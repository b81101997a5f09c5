"""Where a process of a multi-process replica sits (pure; read from the environment).

`elastrain run -n R*K --replica-procs K` starts R replicas of K processes. The
launcher hands each process its `ReplicaPlace` through the environment
(`elastrain.env`): the replica slot, the slot's incarnation (a rebuilt
replica is a new JAX runtime), the process id inside the replica and the
replica's `jax.distributed` coordinator address. The JAX side
(`elastrain.jax.replica`) initialises its runtime from it; the topology
(`elastrain.jax.replica_topology`) publishes it to the generation, so that
members with the same `proc` (twins) find each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastrain import env


@dataclass(frozen=True)
class ReplicaPlace:
    """One process of a K-process replica."""

    procs: int
    """K: processes per replica."""
    replica: int
    """The replica slot (0..R-1); a rebuilt replica keeps its slot."""
    incarnation: int
    """The slot's incarnation: (replica, incarnation) names one JAX runtime."""
    proc: int
    """This process's JAX process id inside the replica: the shard it holds."""
    coordinator: str
    """host:port of the replica's `jax.distributed` coordinator."""

    def __post_init__(self) -> None:
        if self.procs < 2:
            raise ValueError(f"a multi-process replica has >= 2 processes (got {self.procs})")
        if not 0 <= self.proc < self.procs:
            raise ValueError(f"process id {self.proc} is outside 0..{self.procs - 1}")
        if self.replica < 0 or self.incarnation < 0:
            raise ValueError(f"bad replica {self.replica} / incarnation {self.incarnation}")

    @property
    def runtime(self) -> tuple[int, int]:
        """The JAX runtime this process belongs to: (replica, incarnation)."""
        return (self.replica, self.incarnation)

    def wire(self) -> str:
        """What the topology publishes to its generation's peers."""
        return f"{self.replica}:{self.incarnation}:{self.proc}:{self.procs}"

    def environ(self) -> dict[str, str]:
        """The variables the launcher sets for this process."""
        return {
            env.REPLICA_PROCS: str(self.procs),
            env.REPLICA: str(self.replica),
            env.REPLICA_INCARNATION: str(self.incarnation),
            env.REPLICA_PROC: str(self.proc),
            env.JAX_COORDINATOR: self.coordinator,
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ReplicaPlace | None:
        """This process's place, or None where a replica is one process (unset or 1).
        Raises ValueError when the variables are set but incomplete or malformed."""
        raw = environ.get(env.REPLICA_PROCS, "")
        if raw in ("", "1"):
            return None
        try:
            return cls(
                int(raw),
                int(environ[env.REPLICA]),
                int(environ[env.REPLICA_INCARNATION]),
                int(environ[env.REPLICA_PROC]),
                environ[env.JAX_COORDINATOR],
            )
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"${env.REPLICA_PROCS}={raw} but the replica's place is incomplete or "
                f"malformed ({e}): a multi-process replica is started by `elastrain run "
                "--replica-procs K`"
            ) from None


def parse_wire(text: str) -> tuple[tuple[int, int], int, int]:
    """((replica, incarnation), proc, procs) from `ReplicaPlace.wire`."""
    r, inc, k, procs = (int(x) for x in text.split(":"))
    return (r, inc), k, procs
