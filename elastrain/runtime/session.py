"""A worker's session with the coordinator: registration, heartbeats, notices.

The heartbeat thread long-polls the coordinator with the generation the
training thread is running. The coordinator answers early when that generation
breaks or is superseded; the thread then records the broken generation and
interrupts the training thread's collective wait (`Waiter.interrupt`), which
drops the group at once instead of waiting out a timeout.

Coordinator restarts: while the coordinator cannot be reached, the session
keeps trying (one warning and one event per outage) and training goes on in
the current generation. A coordinator that answers "unknown" was restarted:
the session registers again, reporting the generation it runs, and the new
coordinator adopts it. Registrations are serialised, and `ensure_registered`
makes the training thread and the heartbeat thread register once, not twice.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastrain.control import protocol as p
from elastrain.control.client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnavailable,
    backoff_s,
)
from elastrain.control.store import group_prefix
from elastrain.observe.events import EventKind, EventLog
from elastrain.threads import HEARTBEAT, name_native_thread

log = logging.getLogger("elastrain.session")


class JoinRefused(RuntimeError):
    """The coordinator refused this worker (e.g. its model does not match the job)."""


class MemberSession:
    """Who calls: the worker's training thread creates it and calls
    `register`; the heartbeat thread runs on its own. Thread-safe."""

    def __init__(
        self,
        client: CoordinatorClient,
        member: str,
        signature: list[Any],
        *,
        host: str,
        on_change: Callable[[], None],
        events: EventLog | None = None,
        register_timeout_s: float = 60.0,
    ) -> None:
        self.client = client
        self.member = member
        self.signature = signature
        self.host = host
        self.on_change = on_change
        self.events = events if events is not None else EventLog(None, member)
        self.register_timeout_s = register_timeout_s
        self.incarnation = 0
        self.job_id = ""
        self.heartbeat_s = 0.25
        self.progress_step = 0
        """The job's progress when this member last registered (`RegisterResponse`)."""
        self.store_addr: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._reg_lock = threading.Lock()
        self._gen = 0
        self._members: tuple[str, ...] = ()
        self._slots: dict[str, list[int]] = {}
        self._shard_size = 0
        self._last_gen = 0
        self._committed = 0
        self._unreachable_since: float | None = None
        self._broken_gen = 0
        self._newest_gen = 0
        """The newest generation a heartbeat named (`HeartbeatStatus.SUPERSEDED`)."""
        self._expelled_inc = 0
        self._leave_reason: str | None = None
        self._leave_sent = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    # ---- registration ------------------------------------------------------

    def register(self) -> None:
        """Register (again); blocks, retrying an unreachable or busy coordinator
        (408, 429, 5xx: jittered backoff, one log line each) for up to
        `register_timeout_s`. Raises JoinRefused on a refusal (409 model
        mismatch, 400, 401) and CoordinatorUnavailable once the time is up."""
        with self._reg_lock:
            self._register()
        self._start_heartbeats()

    def ensure_registered(self, stale_incarnation: int) -> None:
        """Register again unless somebody already did since `stale_incarnation`
        was current (the coordinator answered "unknown" or "expelled" to it)."""
        with self._reg_lock:
            if self.incarnation == stale_incarnation:
                self._register()

    def _register(self) -> None:
        deadline = time.monotonic() + self.register_timeout_s
        attempt = 0
        while True:
            with self._lock:
                req = p.RegisterRequest(
                    self.member,
                    os.getpid(),
                    self.host or socket.gethostname(),
                    self.signature,
                    gen=self._last_gen,
                    gen_members=list(self._members) if self._gen else [],
                    gen_slots=dict(self._slots) if self._gen else {},
                    gen_shard_size=self._shard_size if self._gen and self._slots else 0,
                    committed=self._committed,
                    prev_incarnation=self.incarnation,
                )
            try:
                r = self.client.register(req)
                break
            except CoordinatorRefused as e:
                if not e.transient:
                    raise JoinRefused(e.message) from e
                # Busy or slow, not a refusal (e.g. its connection limit): ask again.
                if time.monotonic() >= deadline:
                    raise CoordinatorUnavailable(
                        f"registering: still {e} after {self.register_timeout_s:g} s"
                    ) from e
                delay = backoff_s(attempt, base_s=0.1, cap_s=2.0, jitter=random.uniform(0.5, 1.5))
                log.warning(
                    "register answered %d %s (%s); trying again in %.2f s",
                    e.status,
                    e.code,
                    e.message,
                    delay,
                )
                attempt += 1
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            except CoordinatorUnavailable as e:
                self._note_unreachable("register", str(e))
                if time.monotonic() >= deadline:
                    raise
                time.sleep(self.heartbeat_s)  # back-off while the coordinator restarts
        self._note_reachable()
        with self._lock:
            self.incarnation = r.incarnation
            self.job_id = r.job_id
            self.progress_step = r.progress_step
            self.heartbeat_s = r.heartbeat_s
            # A new registration may mean a new store server behind the same
            # address (a restarted coordinator): old clients never recover.
            self.store_addr = (r.store_host, r.store_port)
            self._store = None

    def _start_heartbeats(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._beat, name="elastrain-heartbeat", daemon=True
            )
            self._thread.start()

    def group_prefix(self, r: p.RendezvousResponse) -> str:
        """The store prefix of the gloo group of the generation `r` announces
        ready (see `elastrain.control.store.group_prefix`)."""
        return group_prefix(self.job_id, r.gen, r.group_key)

    def store(self, timeout_s: float) -> Any:
        """The TCPStore client (made on first use, and again after a coordinator move)."""
        with self._lock:
            if self._store is None:
                self._store = self.new_store(timeout_s)
            return self._store

    def new_store(self, timeout_s: float) -> Any:
        """A TCPStore client of its own, for a call that may be abandoned while it
        waits in the store: a client serves one call at a time, so a wait left
        running on the shared one (`store`) would hold up every later call on it."""
        from torch.distributed import TCPStore

        assert self.store_addr is not None
        host, port = self.store_addr
        return TCPStore(
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )

    # ---- state shared with the training thread -------------------------------

    def set_gen(
        self,
        gen: int,
        members: tuple[str, ...] | list[str] = (),
        slots: dict[str, list[int]] | None = None,
        shard_size: int = 0,
    ) -> None:
        """The generation the training thread runs now (0: none), its members and,
        sharded, their slots (a restarted coordinator adopts them from us)."""
        with self._lock:
            self._gen = gen
            self._members = tuple(members)
            self._slots = dict(slots or {})
            self._shard_size = shard_size
            self._last_gen = max(self._last_gen, gen)

    def note_committed(self, committed: int) -> None:
        with self._lock:
            self._committed = committed

    def coordinator_unreachable(self, what: str, error: str) -> None:
        """The training thread could not reach the coordinator (`what` failed)."""
        log.debug("%s failed: %s", what, error)
        self._note_unreachable(what, error)

    def _note_unreachable(self, what: str, error: str = "") -> None:
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
            log.warning(
                "coordinator unreachable (%s: %s); training goes on in generation %d meanwhile",
                what,
                error or "no answer",
                self._gen,
            )
            self.events.emit(
                EventKind.COORDINATOR_UNREACHABLE, gen=self._gen, op=what, error=error[:300]
            )

    def _note_reachable(self) -> None:
        since = self._unreachable_since
        if since is not None:
            self._unreachable_since = None
            down = time.monotonic() - since
            log.warning("coordinator reachable again after %.2f s", down)
            self.events.emit(EventKind.COORDINATOR_REACHABLE, gen=self._gen, down_s=down)

    def gen_broken(self, gen: int) -> bool:
        with self._lock:
            return gen != 0 and self._broken_gen >= gen

    def moved_on_from(self, gen: int) -> bool:
        """What a member that can compute no step in `gen` waits for: `gen` broke,
        the coordinator formed a newer generation (at a step boundary too), or this
        member is leaving or was expelled."""
        with self._lock:
            over = gen != 0 and (self._broken_gen >= gen or self._newest_gen > gen)
        return over or self.leaving or self.expelled

    def confirm_hang(
        self, gen: int, step: int, waited_s: float, timeout_s: float
    ) -> tuple[str, ...]:
        """The training thread's collective of (`gen`, `step`) is overdue: ask
        the coordinator whether a peer stopped heartbeating. Returns the peers
        it found silent (they are expelled and `gen` is broken) or (): all
        alive, `gen` already over, or no answer within `timeout_s` (the hard
        watchdog deadline still applies)."""
        with self._lock:
            inc = self.incarnation
        try:
            r = self.client.hang(p.HangRequest(self.member, inc, gen, step, waited_s), timeout_s)
        except (CoordinatorUnavailable, CoordinatorRefused) as e:
            log.warning("asking whether a peer is hung failed: %s", e)
            return ()
        if r.status != p.HangStatus.CONFIRMED or not r.silent:
            return ()
        with self._lock:
            self._broken_gen = max(self._broken_gen, gen)
        return tuple(r.silent)

    @property
    def expelled(self) -> bool:
        with self._lock:
            return self._expelled_inc == self.incarnation

    def request_leave(self, reason: str = "left") -> None:
        """Announce a leave (safe from a signal handler: the heartbeat thread sends it)."""
        self._leave_reason = reason

    @property
    def leaving(self) -> bool:
        return self._leave_reason is not None

    # ---- heartbeat thread ----------------------------------------------------

    def _beat(self) -> None:
        name_native_thread(HEARTBEAT)
        while not self._stop.is_set():
            with self._lock:
                gen, inc = self._gen, self.incarnation
            try:
                if self._leave_reason == "left" and not self._leave_sent:
                    self.client.leave(p.LeaveRequest(self.member, inc, "left"))
                    self._leave_sent = True
                r = self.client.heartbeat(
                    p.HeartbeatRequest(self.member, inc, gen, self.heartbeat_s)
                )
            except CoordinatorUnavailable as e:
                self._note_unreachable("heartbeat", str(e))
                self._stop.wait(self.heartbeat_s)
                continue
            except CoordinatorRefused as e:
                log.warning("heartbeat refused: %s", e)
                self._stop.wait(self.heartbeat_s)
                continue
            self._note_reachable()
            if r.status == p.HeartbeatStatus.OK:
                continue
            if r.status == p.HeartbeatStatus.UNKNOWN:
                # A restarted coordinator: register again, keep the generation.
                try:
                    self.ensure_registered(inc)
                except (CoordinatorUnavailable, JoinRefused) as e:
                    log.warning("registering again failed: %s", e)
                    self._stop.wait(self.heartbeat_s)
                continue
            with self._lock:
                if r.status == p.HeartbeatStatus.EXPELLED:
                    self._expelled_inc = max(self._expelled_inc, inc)
                if r.status == p.HeartbeatStatus.SUPERSEDED:
                    self._newest_gen = max(self._newest_gen, r.gen)  # nothing to abort
                elif gen:
                    self._broken_gen = max(self._broken_gen, gen)
            self.on_change()
            # Nothing more to learn until the training thread moves on (the coordinator
            # answers at once meanwhile); keep the lease.
            self._stop.wait(self.heartbeat_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + self.client.timeout_s)
