"""Which replica each worker of a `--replica-procs K` job belongs to (decisions pure).

`elastrain run -n R*K --replica-procs K` keeps R replica slots of K processes.
Each slot's processes share one `jax.distributed` runtime, named by (slot,
incarnation) and served at an address of its own. The launcher asks
`ReplicaBook.place_for` for every worker it spawns, in spawn order: a slot's
open incarnation takes processes 0..K-1, and a slot whose incarnation was lost
starts the next one at a fresh address. When a worker of a slot exits (dies,
or leaves because a mate died), `lost` closes the incarnation and names the
mates still running: the launcher kills them (their runtime cannot outlive a
dead peer) and spawns K fresh processes, which form the next incarnation.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrain.runtime.replica_place import ReplicaPlace


def free_address(host: str) -> str:
    """host:port with a port free right now (the replica's process 0 binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


@dataclass
class _Slot:
    incarnation: int
    address: str
    members: list[str] = field(default_factory=list)
    lost: bool = False


class ReplicaBook:
    """The replica slots of a job (see the module docstring). `address` makes a new
    `jax.distributed` coordinator address (`free_address` in the launcher)."""

    def __init__(self, procs: int, replicas: int, address: Callable[[], str]) -> None:
        if procs < 2 or replicas < 1:
            raise ValueError(
                f"need >= 2 processes per replica and >= 1 replica ({procs}, {replicas})"
            )
        self.procs = procs
        self.replicas = replicas
        self._address = address
        self._slots: list[_Slot] = []
        self._of: dict[str, int] = {}
        """member -> its slot."""

    def place_for(self, member: str) -> ReplicaPlace:
        """The place of a worker about to be spawned: the first slot missing a process
        of its open incarnation, or the first lost one (its next incarnation), or a new
        slot. Raises ValueError with every slot full (more workers than R*K)."""
        slot = next(
            (i for i, s in enumerate(self._slots) if s.lost or len(s.members) < self.procs),
            None,
        )
        if slot is None:
            if len(self._slots) == self.replicas:
                raise ValueError(f"all {self.replicas} replicas have their {self.procs} processes")
            self._slots.append(_Slot(0, self._address()))
            slot = len(self._slots) - 1
        s = self._slots[slot]
        if s.lost:
            s = self._slots[slot] = _Slot(s.incarnation + 1, self._address())
        s.members.append(member)
        self._of[member] = slot
        return ReplicaPlace(self.procs, slot, s.incarnation, len(s.members) - 1, s.address)

    def lost(self, member: str) -> list[str]:
        """`member` exited: its incarnation is lost. Returns its mates of that
        incarnation (to stop); [] if it belonged to one lost already."""
        slot = self._of.pop(member, None)
        if slot is None:
            return []
        s = self._slots[slot]
        if s.lost or member not in s.members:
            return []
        s.lost = True
        return [w for w in s.members if w != member]


def stop_mates(book: ReplicaBook, member: str, workers: Mapping[str, Any]) -> list[tuple[str, int]]:
    """`member` failed: SIGKILL its running replica-mates (their JAX runtime cannot
    outlive it, and a JAX shutdown would wait for it) and mark them stopped (their
    exits are no failures of their own). Returns (mate, PID) of each, for the
    replica's rebuild. `workers`: the launcher's member -> `Worker`."""
    out = []
    for mate in book.lost(member):
        w = workers.get(mate)
        if w is not None and w.proc.poll() is None:
            w.stopped = True
            w.proc.send_signal(signal.SIGKILL)
            out.append((mate, w.proc.pid))
    return out


def expelled(
    status: Mapping[str, Any], holders: Collection[str], running: Iterable[str], ending: bool
) -> list[str]:
    """The running workers the coordinator expelled (a hang it confirmed): they held
    the state (`holders`) and are no longer registered. None while the job ends or
    the status lists nobody registered (a coordinator that just restarted)."""
    registered = status.get("registered") or {}
    if ending or not registered or status.get("finished"):
        return []
    return [m for m in running if m in holders and m not in registered]
