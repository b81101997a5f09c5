"""Per-generation gloo process groups, abortable waits, and a graveyard.

A generation's group is built in-process on the coordinator's TCPStore under
the prefix `<job>/gen<g>` (no process restart, no default group). Waiting on a
collective is abortable: the wait returns when the work completes, when the
member learns its generation broke (coordinator notice), or when the step
watchdog expires. An aborted group may still have an operation in flight, and
dropping such a group blocks until that operation times out (see
ENGINE-NOTES), so it is parked in a graveyard whose reaper thread drops it once
its pending work has ended (an NCCL group is aborted there first:
`elastrain.runtime.collectives`). Groups whose work failed are dropped at once: their
sockets closing is what unblocks peers stuck on them.

A process must not exit while one of its threads is blocked in a collective
that may still end: a daemon thread that returns from gloo into Python after
interpreter shutdown has begun is unwound through C++ frames that do not allow
it, and the process dies of SIGABRT ("terminate called without an active
exception") instead of exiting with its code. A worker that leaves while an
abandoned all-reduce is still pending (its peers closing their sockets ends it
a moment later) hit exactly that. `settle_before_exit` waits for those threads.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from elastrain.threads import COLLECTIVE_WAIT, GRAVEYARD, name_native_thread

log = logging.getLogger("elastrain.group")


class AbortReason(StrEnum):
    """Why a wait on collectives was abandoned (`CollectiveAborted.reason`)."""

    SUPERSEDED = "superseded"
    """The generation broke (the coordinator superseded it) while waiting."""
    WATCHDOG = "watchdog"
    """The wait outlasted its deadline, or the coordinator confirmed a peer hung."""


class CollectiveAborted(RuntimeError):
    """The wait was abandoned, for `reason`. `confirmed`: with WATCHDOG at the
    soft deadline, the peers the coordinator found silent (empty when the hard
    deadline passed)."""

    def __init__(self, reason: AbortReason, message: str, confirmed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.confirmed = confirmed


@dataclass(frozen=True)
class HangCheck:
    """Asking whether a peer is hung while a collective is overdue (the soft
    deadline, `elastrain.runtime.watchdog`)."""

    from_s: float
    """First ask this long into the wait."""
    every_s: float
    """Then again this often, until the hard deadline."""
    ask: Callable[[float], tuple[str, ...]]
    """Called with the time waited so far; returns the peers found hung
    (non-empty: give up now) or () (alive, or no answer: keep waiting)."""


def build_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    host: str,
    connect_timeout_s: float,
    op_timeout_s: float,
) -> ProcessGroupGloo:
    """Build this member's group for one generation. Every member of the
    generation calls it with the same prefix once the coordinator says all are
    ready; blocks until all have arrived (at most `connect_timeout_s`)."""
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=connect_timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    pg = ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
    pg.set_timeout(datetime.timedelta(seconds=op_timeout_s))
    return pg


class _WaitThread:
    """A helper thread that runs collective waits handed to it, one at a time.

    Reused from one wait to the next (a thread started per wait cost ~0.5 ms of the
    training thread's time per step on a loaded 2-core machine), until the waiter
    abandons it inside a wait: it then ends when that wait does. Its native name is
    `COLLECTIVE_WAIT` throughout."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._abandoned = False
        self.thread = threading.Thread(target=self._run, name="elastrain-collective", daemon=True)
        self.thread.start()

    def run(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def abandon(self) -> None:
        """End after the current job (the waiter gave up on it) instead of taking another."""
        self._abandoned = True
        self._jobs.put(None)

    def _run(self) -> None:
        name_native_thread(COLLECTIVE_WAIT)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            # A job handed over always runs, even if abandoned before it began: the
            # abandoned work's end is what `Waiter.blocked` lets an exit wait for.
            job()
            if self._abandoned:
                return


class Waiter:
    """Waits for collective work with early wake-ups.

    The blocking `work.wait()` runs on a helper thread (a Python done-callback on
    a gloo future stalled gloo's own threads here), so the training thread can
    give up on it: `interrupt()` (from any thread) wakes the current wait and the
    waiter asks `should_abort()` whether to abandon. The helper of a wait that
    ended serves the next one; an abandoned helper thread ends when its operation
    does, and the next wait starts a new one. `close()` ends the idle helper.
    """

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._idle: _WaitThread | None = None
        self._abandoned: list[_WaitThread] = []

    def blocked(self) -> list[threading.Thread]:
        """Helper threads still inside a collective's wait (abandoned waits)."""
        self._abandoned = [h for h in self._abandoned if h.thread.is_alive()]
        return [h.thread for h in self._abandoned]

    def interrupt(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """End the idle helper thread (the training thread, before the worker exits)."""
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.abandon()
            idle.thread.join(1.0)

    def wait(
        self,
        works: list[Any],
        timeout_s: float,
        should_abort: Callable[[], bool],
        check: HangCheck | None = None,
    ) -> None:
        """Block until every work is done (re-raising its error), the
        generation is superseded, `check` finds a peer hung, or `timeout_s`
        passes."""
        done = threading.Event()
        errors: list[BaseException] = []
        wake = self._wake

        def finish() -> None:
            for w in works:
                try:
                    w.wait()
                except BaseException as e:  # noqa: BLE001 - handed to the training thread
                    errors.append(e)
                    break
            done.set()
            wake.set()

        helper, self._idle = self._idle or _WaitThread(), None
        helper.run(finish)
        try:
            self._until(done, errors, time.monotonic(), timeout_s, should_abort, check)
        finally:
            if done.is_set():
                self._idle = helper
            else:
                helper.abandon()
                self._abandoned.append(helper)

    def _until(
        self,
        done: threading.Event,
        errors: list[BaseException],
        t0: float,
        timeout_s: float,
        should_abort: Callable[[], bool],
        check: HangCheck | None,
    ) -> None:
        deadline = t0 + timeout_s
        next_ask = t0 + check.from_s if check is not None else math.inf
        while True:
            self._wake.clear()
            if done.is_set():
                if errors:
                    raise errors[0]
                return
            if should_abort():
                raise CollectiveAborted(
                    AbortReason.SUPERSEDED, "generation superseded while waiting"
                )
            now = time.monotonic()
            if check is not None and now >= next_ask:
                hung = check.ask(now - t0)
                if hung:
                    raise CollectiveAborted(
                        AbortReason.WATCHDOG,
                        f"collective overdue after {now - t0:.2f}s and the coordinator found "
                        f"{', '.join(hung)} silent",
                        confirmed=hung,
                    )
                next_ask = time.monotonic() + check.every_s
                continue  # the answer took time: look at the work again first
            remaining = deadline - now
            if remaining <= 0:
                raise CollectiveAborted(
                    AbortReason.WATCHDOG, f"collective did not finish in {timeout_s:.2f}s"
                )
            self._wake.wait(min(remaining, next_ask - now))

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block until `done()` is true, checking it whenever `interrupt()` is called
        (the session calls it when the coordinator announces a change)."""
        while True:
            self._wake.clear()
            if done():
                return
            self._wake.wait()


class Graveyard:
    """Destroys dropped groups off the training thread, once their work has ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reapers: list[threading.Thread] = []

    def bury(self, pg: Any, works: list[Any], *, abort: bool = False) -> None:
        """Drop `pg` once `works` have ended. `abort`: call `pg.abort()` first (an
        NCCL group, `elastrain.runtime.collectives`: its kernels waiting for a dead
        peer end only that way), on the reaper thread, so a slow abort never
        blocks the caller."""
        t = threading.Thread(
            target=self._reap,
            args=(pg, list(works), abort),
            daemon=True,
            name="elastrain-graveyard",
        )
        t.start()
        with self._lock:
            self._reapers = [r for r in self._reapers if r.is_alive()] + [t]

    def blocked(self) -> list[threading.Thread]:
        """Reaper threads whose group's work has not ended yet."""
        with self._lock:
            self._reapers = [r for r in self._reapers if r.is_alive()]
            return list(self._reapers)

    def _reap(self, pg: Any, works: list[Any], abort: bool) -> None:
        name_native_thread(GRAVEYARD)
        if abort:
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - the group is dropped either way
                log.warning("aborting a dropped group failed: %s", e)
        for w in works:
            try:
                w.wait()
            except Exception:  # noqa: BLE001 - the work failed or was abandoned; either way it ended
                pass
        works.clear()
        del pg  # closes its sockets (this is what unblocks peers stuck on it)

    def __len__(self) -> int:
        """Groups buried whose work has not ended yet."""
        return len(self.blocked())


EXIT_SETTLE_S = 5.0
"""How long an exiting worker waits for collectives it abandoned to end. Usually
they end within ~50 ms of the peers dropping their groups; one stuck on a hung
peer ends only at the group's timeout, and a leave should not wait for that."""


def settle_before_exit(
    waiter: Waiter, graveyard: Graveyard, who: str, timeout_s: float = EXIT_SETTLE_S
) -> int:
    """Wait until no thread of this process is blocked in a collective, at most
    `timeout_s`; returns how many still are (and logs a warning for `who` if any).

    Called by the training thread once, just before the worker exits (leave,
    preemption, refusal, end of training). Those threads must not return into
    Python during interpreter shutdown (see the module docstring). One still
    blocked after `timeout_s` waits for a hung peer and normally ends at the
    group's timeout, long after this process is gone."""
    deadline = time.monotonic() + timeout_s
    waiter.close()
    threads = waiter.blocked() + graveyard.blocked()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    left = sum(1 for t in threads if t.is_alive())
    if left:
        log.warning("%s: exiting with %d collective(s) still pending (a hung peer?)", who, left)
    return left


def tensor_allreduce(pg: Any, tensors: list[torch.Tensor]) -> list[Any]:
    """Issue one sum all-reduce per tensor on `pg` (a gloo group, or an
    `elastrain.runtime.collectives.NcclGroup`); returns the works (not waited)."""
    return [pg.allreduce([t]) for t in tensors]
