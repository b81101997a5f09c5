"""Rendezvous and the generation's groups: how a member gets into a generation.

Registration (once, and again after an expulsion), the rendezvous poll that
answers with a generation (ordered members, each one's committed step), and
the generation's groups: the gloo group over the coordinator's store, the NCCL
group where the transport is NCCL, and whatever the topology builds besides
(`Topology.connect`). A group build is given up when the coordinator forms a
newer generation meanwhile; a generation's groups are parked in the graveyard
when it ends (`drop`). Writes the context's `Links`; nothing else does.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorError, CoordinatorUnavailable
from elastrain.exitcodes import WorkerExit
from elastrain.observe.events import EventKind
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime.collectives import NcclGroup, Transport, TransportChoice, build_nccl_group
from elastrain.runtime.context import Context
from elastrain.runtime.group import build_group
from elastrain.runtime.preflight import batch_problems
from elastrain.runtime.session import JoinRefused
from elastrain.runtime.topology import Topology

log = logging.getLogger("elastrain.engine")

RENDEZVOUS_POLL_S = 5.0
"""How long one rendezvous call may wait at the coordinator for the generation."""

BUILD_END_MARGIN_S = 2.0
"""An abandoned group build has ended this long after its rendezvous timeout."""


class GroupFactory(Protocol):
    def __call__(self, gen: int, rank: int, size: int) -> Any:
        """Build this member's process group for generation `gen` (blocks for all members)."""


class GroupBuildAbandoned(RuntimeError):
    """The coordinator formed a newer generation while this one's group was being built."""


class Rendezvous:
    """Registration, rendezvous and the generation's groups (module docstring)."""

    def __init__(
        self,
        ctx: Context,
        topology: Topology,
        transport: TransportChoice,
        groups: GroupFactory | None,
        on_standby: Callable[[], None],
        prepare_heal: Callable[[m.Action], None],
    ) -> None:
        self.ctx = ctx
        self.topology = topology
        self.prepare_heal = prepare_heal
        """Begins this member's share of the heal to come, at a generation's connect
        (`Healing.prepare_heal`)."""
        self.transport = transport
        self.groups: GroupFactory = groups or self._gloo_group
        """Builds the generation's group (a seam for in-process tests)."""
        self.on_standby = on_standby
        """Called at each "pending" answer while this member is a standby."""
        self.joined = False
        """This member has built a generation's group once: no longer a standby."""
        self.abandoned_builds: list[tuple[threading.Thread, float]] = []
        """Group builds given up while still waiting (`_build_until_superseded`), with
        the monotonic time by which each has ended; an exit waits for them."""
        self._last_wait_msg = 0.0

    def register(self) -> m.Observation:
        session = self.ctx.session
        try:
            session.register()
        except JoinRefused as e:
            return m.Refused(str(e))
        except CoordinatorUnavailable as e:
            return m.Unreachable(
                "register",
                f"[{self.ctx.member}] cannot reach the coordinator after "
                f"{session.register_timeout_s:g} s: {e}",
            )
        return m.Registered(session.incarnation)

    def register_again(self, a: m.Action) -> m.Observation:
        session = self.ctx.session
        if session.expelled:
            log.warning("%s was expelled from the job; registering again", self.ctx.member)
        stale = session.incarnation if a.incarnation is None else a.incarnation
        try:
            session.ensure_registered(stale)
        except JoinRefused as e:
            return m.Refused(str(e))
        except CoordinatorUnavailable as e:
            log.warning("registering again failed: %s; retrying", e)
            return m.Unreachable("register", str(e))
        return m.Registered(session.incarnation)

    def rendezvous(self, a: m.Action) -> m.Observation:
        ctx = self.ctx
        ctx.events.emit(EventKind.RENDEZVOUS_BEGIN, known_gen=a.gen, committed=a.step)
        try:
            r = ctx.client.rendezvous(
                p.RendezvousRequest(
                    ctx.member,
                    ctx.session.incarnation,
                    a.gen,
                    a.step,
                    wait_s=RENDEZVOUS_POLL_S,
                    commit_gen=ctx.proto.commit_gen,
                    pending_gen=ctx.proto.pending_gen,
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
            log.info("the job finished while %s was waiting", ctx.member)
        elif status == p.RendezvousStatus.PENDING and r.message:
            now = time.monotonic()
            if now - self._last_wait_msg > 5:
                log.warning("waiting: %s", r.message)
                print(f"[{ctx.member}] waiting: {r.message}", flush=True)
                self._last_wait_msg = now
        if status == p.RendezvousStatus.READY:
            ctx.links.ready = r
        elif status == p.RendezvousStatus.PENDING and not self.joined:
            self.on_standby()
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

    def back_off(self, a: m.Action) -> m.Observation:
        # Pace retries against an unreachable or restarting coordinator.
        time.sleep(self.ctx.session.heartbeat_s)
        return m.Waited()

    def _gloo_group(self, gen: int, rank: int, size: int) -> Any:
        ctx = self.ctx
        ready = ctx.links.ready
        assert ready is not None and ready.gen == gen
        return build_group(
            # Its own client: `_build_until_superseded` may abandon this build.
            ctx.session.new_store(ctx.config.timeouts.rendezvous_s),
            ctx.session.group_prefix(ready),
            rank,
            size,
            host=ctx.host,
            connect_timeout_s=ctx.config.timeouts.rendezvous_s,
            op_timeout_s=ctx.config.watchdog.ceiling_s,
        )

    def _nccl_group(self, rank: int, size: int) -> NcclGroup:
        ctx = self.ctx
        assert ctx.links.ready is not None
        return build_nccl_group(
            ctx.session.store(ctx.config.timeouts.rendezvous_s),
            ctx.session.group_prefix(ctx.links.ready) + "/nccl",
            rank,
            size,
            ctx.backend.device,
            # A backstop only: the step's watchdog gives up and aborts first.
            op_timeout_s=2 * ctx.config.watchdog.ceiling_s,
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
        ctx = self.ctx
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
                ctx.waiter.interrupt()

        thread = threading.Thread(target=run, name="elastrain-group-build", daemon=True)
        # It ends by then, whatever happens: every wait of the build is bounded by it.
        ends_by = time.monotonic() + ctx.config.timeouts.rendezvous_s + BUILD_END_MARGIN_S
        thread.start()
        session = ctx.session
        ctx.waiter.wait_until(
            lambda: done.is_set() or session.gen_broken(gen) or session.leaving or session.expelled
        )
        if not done.is_set():
            self.abandoned_builds.append((thread, ends_by))
            raise GroupBuildAbandoned(
                f"generation {gen} was superseded while its group was being built"
            )
        if errors:
            raise errors[0]
        return box[0]

    def connect(self, a: m.Action) -> m.Observation:
        ctx = self.ctx
        links = ctx.links
        t0 = time.monotonic()
        ctx.hook(a.step, hooks.StepPoint.CONNECT)
        r = links.ready
        # The heartbeats carry the generation being built (see `_build_until_superseded`).
        ctx.session.set_gen(a.gen, a.members, r.slots if r else None, r.shard_size if r else 0)
        try:
            # This member's share of the heal begins now, beside the wait for peers.
            self.prepare_heal(a)
            links.pg = self._build_until_superseded(
                a.gen, lambda: self.groups(a.gen, a.rank, len(a.members))
            )
            if self.transport.transport is Transport.NCCL:
                links.nccl = self._nccl_group(a.rank, len(a.members))
            self.topology.connect(links)
        except WorkerExit:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to connect means: next generation
            log.warning("building group for generation %d failed: %s", a.gen, e)
            self.drop()
            ctx.session.set_gen(0)
            ctx.events.emit(
                EventKind.STEP_ABORT,
                step=a.step,
                gen=a.gen,
                error=str(e)[:300],
                phase=m.AbortPhase.REGROUP,
            )
            return m.ConnectFailed(str(e))
        ctx.events.emit(
            EventKind.GROUP_BUILT,
            gen=a.gen,
            rank=a.rank,
            size=len(a.members),
            build_s=time.monotonic() - t0,
        )
        self.joined = True
        if a.rank == 0:
            cfg = ctx.config
            for problem in batch_problems(
                cfg.global_batch_size, cfg.micro_batch_size, len(a.members)
            ):
                log.warning("generation %d: %s", a.gen, problem)
                print(f"elastrain: warning: {problem}", file=sys.stderr, flush=True)
        return m.Connected()

    def drop(self) -> None:
        """Hand the generation's groups to the graveyard: gloo parked until its work in
        flight ends, NCCL aborted first (`elastrain.runtime.collectives`)."""
        links, graveyard = self.ctx.links, self.ctx.graveyard
        if links.nccl is not None:
            graveyard.bury(links.nccl, links.inflight, abort=True)
            links.nccl = None
        if links.pg is not None:
            graveyard.bury(links.pg, links.inflight)
            links.pg = None
        self.topology.drop(links.inflight)

    def wait_for_builds(self) -> None:
        """An abandoned group build must not return into Python during interpreter
        shutdown (`settle_before_exit`); it ends at its own deadline."""
        for thread, ends_by in self.abandoned_builds:
            thread.join(max(0.0, ends_by - time.monotonic()))
