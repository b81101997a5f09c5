"""A worker's session with the coordinator: registration, heartbeats, notices.

The heartbeat thread long-polls the coordinator with the generation the
training thread is running. The coordinator answers early when that generation
breaks or is superseded; the thread then records the broken generation and
interrupts the training thread's collective wait (`Waiter.interrupt`), which
drops the group at once instead of waiting out a timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastrain.control import protocol as p
from elastrain.control.client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnavailable,
)

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
    ) -> None:
        self.client = client
        self.member = member
        self.signature = signature
        self.host = host
        self.on_change = on_change
        self.incarnation = 0
        self.job_id = ""
        self.heartbeat_s = 0.25
        self.store_addr: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._gen = 0
        self._broken_gen = 0
        self._expelled_inc = 0
        self._leave_reason: str | None = None
        self._leave_sent = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    # ---- registration ------------------------------------------------------

    def register(self) -> None:
        """Register (again); blocks. Raises JoinRefused on a 4xx answer."""
        try:
            r = self.client.register(
                p.RegisterRequest(
                    self.member, os.getpid(), self.host or socket.gethostname(), self.signature
                )
            )
        except CoordinatorRefused as e:
            raise JoinRefused(e.message) from e
        with self._lock:
            self.incarnation = r.incarnation
            self.job_id = r.job_id
            self.heartbeat_s = r.heartbeat_s
            if self.store_addr != (r.store_host, r.store_port):
                self.store_addr = (r.store_host, r.store_port)
                self._store = None
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._beat, name="elastrain-heartbeat", daemon=True
            )
            self._thread.start()

    def store(self, timeout_s: float) -> Any:
        """The TCPStore client (made on first use, and again after a coordinator move)."""
        with self._lock:
            if self._store is None:
                from torch.distributed import TCPStore

                assert self.store_addr is not None
                host, port = self.store_addr
                self._store = TCPStore(
                    host,
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s),
                )
            return self._store

    # ---- state shared with the training thread -------------------------------

    def set_gen(self, gen: int) -> None:
        with self._lock:
            self._gen = gen

    def gen_broken(self, gen: int) -> bool:
        with self._lock:
            return gen != 0 and self._broken_gen >= gen

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
            except (CoordinatorUnavailable, CoordinatorRefused) as e:
                log.warning("heartbeat failed: %s", e)
                self._stop.wait(self.heartbeat_s)
                continue
            if r.status == "ok":
                continue
            with self._lock:
                if r.status == "expelled":
                    self._expelled_inc = max(self._expelled_inc, inc)
                if gen:
                    self._broken_gen = max(self._broken_gen, gen)
            self.on_change()
            # Nothing more to learn until the training thread moves on; keep the lease.
            self._stop.wait(self.heartbeat_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + self.client.timeout_s)
