"""What the step engine's parts share: one context object, built once per worker.

The engine (`elastrain.runtime.engine`) is a loop over the member protocol's
actions; each action is performed by one part (rendezvous, the step run,
between-steps work, the data feed, the start state, the checkpoint saves) and
the layout work by the job's `Topology`. The parts never read each other's
attributes: what they have in common is here. `Context` holds the worker's
long-lived services (fixed for its life); `Links` the current generation's
groups (replaced by rendezvous, dropped on abandon).

Contract: only the engine's training thread reads or writes a `Links`; the
services are thread-safe where a background thread uses them (events, waiter,
session).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient
from elastrain.observe.events import EventLog
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.backend import Backend
from elastrain.runtime.collectives import NcclGroup
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.group import Graveyard, Waiter
from elastrain.runtime.session import MemberSession
from elastrain.runtime.watchdog import HangTimeout


@dataclass
class Links:
    """The current generation's connections (all None/empty between generations)."""

    ready: p.RendezvousResponse | None = None
    """The coordinator's last "ready" answer: the generation being joined or run."""
    pg: Any = None
    """The generation's gloo group (every member): heal, votes, evaluations, pauses."""
    nccl: NcclGroup | None = None
    """The generation's NCCL group for the gradient all-reduce (transport NCCL)."""
    inflight: list[Any] = field(default_factory=list)
    """Collective works started and not yet waited for: a dropped group is parked
    until they end (`Graveyard`), and their buffers are never reused."""
    broken: str | None = None
    """Why the generation must be abandoned at the next step (a failed pause)."""


@dataclass
class Context:
    """One worker's services, shared by the engine's parts."""

    member: str
    host: str
    token: str
    config: TrainerConfig
    backend: Backend
    events: EventLog
    client: CoordinatorClient
    session: MemberSession
    waiter: Waiter
    graveyard: Graveyard
    hang: HangTimeout
    proto: m.MemberProtocol
    step_hooks: list[hooks.StepHook]
    links: Links = field(default_factory=Links)

    def hook(self, step: int, point: hooks.StepPoint) -> None:
        """Run the installed step hooks (chaos, tests) at `point` of `step`."""
        for h in self.step_hooks:
            h.at(step, point)

    @property
    def key(self) -> bytes | None:
        """The job token's bytes, sealing heal manifests (None: no token)."""
        return self.token.encode() or None

    def gen_broken(self, gen: int) -> bool:
        """The coordinator moved past generation `gen` (seen by the heartbeats)."""
        return self.session.gen_broken(gen)
