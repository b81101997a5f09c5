"""The heal at a generation's start, the joiner's landing reserve, the state hash.

At the start of each generation the members that are behind are healed from
the up-to-date ones; who heals whom and how is the topology's
(`Topology.heal`). Around it: a joiner reserves its landing while it waits to
be admitted (`reserve_landing`), and after the heal the state is hashed off
the critical path for the `generation_start` event (`start_hash`); the engine
settles that reader before anything writes the state (`settle`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import NoReturn

from elastrain.checkpoint.manager import Checkpointing
from elastrain.exitcodes import EXIT_STATE_LOST, EXIT_STATE_TORN, WorkerExit
from elastrain.exitrecord import from_exception, root_cause
from elastrain.observe.events import EventKind
from elastrain.runtime import member as m
from elastrain.runtime.carried import Carried
from elastrain.runtime.context import Context
from elastrain.runtime.device import is_poisoned
from elastrain.runtime.leaving import announce_exit
from elastrain.runtime.preflight import exit_misconfigured
from elastrain.runtime.topology import HealJob, StateLost, Topology, Unfillable
from elastrain.threads import HASH, name_native_thread, yield_cpu
from elastrain.transfer import HealError, HealFn, LandingReserve, TornHeal, section_bytes

log = logging.getLogger("elastrain.engine")


class Healing:
    """This member's heals (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        topology: Topology,
        carried: Carried,
        ckpt: Checkpointing,
        heal_fn: HealFn,
        resume_hint: Callable[[], str],
        shutdown: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.topology = topology
        self.carried = carried
        self.ckpt = ckpt
        self.heal_fn = heal_fn
        self.resume_hint = resume_hint
        self.shutdown = shutdown
        self.reserve: LandingReserve | None = None
        """The landing a joiner prepared for its heal (`reserve_landing`)."""
        self._hash_pool = concurrent.futures.ThreadPoolExecutor(1, "elastrain-hash", _hash_thread)
        self._hashing: concurrent.futures.Future[None] | None = None

    def reserve_landing(self, joined: bool) -> None:
        """A joiner (never yet in a generation) that has committed fewer steps than
        the job will be healed when it is admitted: it maps and touches its landing
        now, in the background, while it waits (`LandingReserve`), so the heal lands
        in resident memory (as large as the topology expects: a sharded joiner
        reserves for the largest shard of the configured shard size)."""
        if joined or self.reserve is not None:
            return
        ctx = self.ctx
        if ctx.session.progress_step <= ctx.proto.committed:
            return
        self.reserve = LandingReserve(section_bytes(self.topology.landing_estimate()))
        log.info(
            "%s: the job is at step %d, this member at %d: reserving %.1f MB of landing",
            ctx.member,
            ctx.session.progress_step,
            ctx.proto.committed,
            self.reserve.nbytes / 1e6,
        )

    def prepare_heal(self, a: m.Action) -> None:
        """At a generation's connect: this member's share of the heal to come
        (`Topology.prepare_heal`), a receiver's laid out in its landing reserve."""
        self.topology.prepare_heal(a, self.reserve)

    def heal(self, a: m.Action) -> m.Observation:
        # The first heal after registration uses the landing reserve up, whatever
        # this member's role in it (a retry lands in fresh memory); what the heal
        # did not take is let go.
        reserve, self.reserve = self.reserve, None
        ctx = self.ctx
        job = HealJob(
            a, ctx.links, self.carried.meta, self.carried.load_meta, self.heal_fn, reserve
        )
        try:
            out = self.topology.heal(job)
        except StateLost as e:
            ctx.events.emit(
                EventKind.WORKER_EXIT,
                reason=m.ExitReason.STATE_LOST,
                committed=ctx.proto.committed,
            )
            self.shutdown()
            raise WorkerExit(
                EXIT_STATE_LOST, m.ExitReason.STATE_LOST, f"elastrain: {e}; {self.resume_hint()}"
            ) from None
        except TornHeal as e:
            if is_poisoned(e):  # the install's copy hit a sticky device error: exit 74
                raise
            self._leave_torn(e)
        except Unfillable as e:
            # Every member of a fresh job built on the meta device gets here alike:
            # no retry or replacement can fill it, so stop the job and say why.
            self.shutdown()
            exit_misconfigured(str(e))
        except (HealError, RuntimeError, ValueError) as e:
            if is_poisoned(e):
                raise
            return m.HealFailed(str(e))
        finally:
            if reserve is not None:
                reserve.release()
        assert ctx.links.ready is not None
        self.ckpt.note_generation(ctx.links.ready.reason)
        self.start_hash(a.gen, out.committed, list(a.members), a.rank)
        return m.Healed(out.committed, out.received)

    def _leave_torn(self, e: TornHeal) -> NoReturn:
        """End this worker (`EXIT_STATE_TORN`): its heal failed after it began landing
        in the live tensors, so it holds no valid state and must not regroup, where
        it could be picked as a sender. The coordinator is told first, so its peers
        regroup at once without it; the launcher starts a fresh process, which is
        healed again. A failure of its own (`TornHeal.own`) would tear the fresh
        process too: its cause becomes the exit record, which the launcher's
        same-error rule counts."""
        ctx = self.ctx
        announce_exit(
            ctx.client, ctx.events, ctx.member, EXIT_STATE_TORN, m.ExitReason.STATE_TORN,
            ctx.proto.committed, str(e),
        )  # fmt: skip
        self.shutdown()
        raise WorkerExit(
            EXIT_STATE_TORN,
            m.ExitReason.STATE_TORN,
            f"elastrain: {ctx.member}'s heal failed midway and left its state torn ({e}); "
            "a fresh process takes its place",
            record=from_exception(root_cause(e)) if e.own else None,
        ) from None

    def start_hash(self, gen: int, step: int, members: list[str], rank: int) -> None:
        """Hash the state off the recovery's critical path: it overlaps the first
        step's compute, which only reads the parameters; `settle` joins it before
        anything writes them (every action not in `READ_ONLY`)."""
        ctx = self.ctx

        def start_event() -> None:
            digest = ctx.backend.state_hash() if ctx.config.hash_state else ""
            ctx.events.emit(
                EventKind.GENERATION_START,
                gen=gen,
                step=step,
                state_hash=digest,
                members=members,
                rank=rank,
                **self.topology.event_fields(),
            )

        self._hashing = self._hash_pool.submit(start_event)

    def settle(self) -> None:
        """Wait for the state hash, if one runs."""
        if self._hashing is not None:
            self._hashing.result()
            self._hashing = None

    def close(self) -> None:
        self._hash_pool.shutdown(wait=False)


def _hash_thread() -> None:
    """The state-hash thread: named, and at the lowest CPU priority (`yield_cpu`).
    A generation's members that take no part in its heal hash their state while
    the heal's senders and receivers move bytes; on a machine with fewer free
    cores than busy threads the hash took the heal's CPU (a sharded twins' heal
    ran at a third of the loopback rate while the other pair hashed its shards).
    Nothing waits longer for it in sum: the first step joins it before it writes
    the state (`settle`), and while the training thread waits there the hash has
    that core."""
    name_native_thread(HASH)
    yield_cpu()
