"""What a worker tells the coordinator for its `/metrics`: step, heal and
recovery seconds, healed bytes.

Workers open no port of their own. Each worker's `WorkerTally` watches the
worker's own events (it listens on its `EventLog`) and turns them into
observations; the step engine hands what is pending to the coordinator in the
next quorum request (`QuorumRequest.observed`, which every member sends once
per step), and the coordinator adds them to its Prometheus histograms and
counters (`elastrain.observe.metrics.CoordinatorMetrics`).

Who reports what, so that the coordinator can add everything it receives
without counting anything twice:

- `step_s`: the leader (rank 0 of the current generation), each committed
  step's seconds (`step_commit.step_s`): one observation per step.
- `heal_s`, `healed_bytes`: every member that *received* state in a heal
  (`heal_end` with role "recv"): the bytes it received and how long it took.
- `scalars` (`QuorumRequest.scalars`, not `observed`): the script's own
  scalars (`trainer.log`), the last value per name since the previous request;
  only rank 0 emits them (`user_scalar` events), so only rank 0 sends any.
- `recovery_<phase>_s` (`RECOVERY_PHASES`): the leader of the generation the
  job resumed in, once per interruption, measured on the worker's monotonic
  clock from its own first `step_abort`: quorum (abort -> its generation was
  ready: `group_built` less its `build_s`), regroup (`build_s`), heal (->
  `heal_end`, 0 without one), first_step (-> the first `step_commit`). The
  detect phase (the failure -> that abort) needs the failure's own time, which
  only the run's events have (`elastrain report`, `elastrain.observe.recovery`).

Best effort: observations of a quorum request that never reached the
coordinator are lost, and at most `MAX_PENDING` per kind wait for the next one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from elastrain.observe.events import EventKind
from elastrain.observe.scalars import MAX_METRIC_SCALARS

RECOVERY_PHASES = ("quorum", "regroup", "heal", "first_step")
"""The recovery phases a worker can time (`elastrain.observe.recovery.PHASES`
less detect), in order."""


class Observed(StrEnum):
    """The kinds of observation in `QuorumRequest.observed`; each value lists
    seconds (`*_s`) or bytes."""

    STEP_S = "step_s"
    HEAL_S = "heal_s"
    HEALED_BYTES = "healed_bytes"
    RECOVERY_QUORUM_S = "recovery_quorum_s"
    RECOVERY_REGROUP_S = "recovery_regroup_s"
    RECOVERY_HEAL_S = "recovery_heal_s"
    RECOVERY_FIRST_STEP_S = "recovery_first_step_s"


RECOVERY_KEYS = {
    "quorum": Observed.RECOVERY_QUORUM_S,
    "regroup": Observed.RECOVERY_REGROUP_S,
    "heal": Observed.RECOVERY_HEAL_S,
    "first_step": Observed.RECOVERY_FIRST_STEP_S,
}
assert tuple(RECOVERY_KEYS) == RECOVERY_PHASES

MAX_PENDING = 64
"""Observations of one kind that wait for the next quorum request (the newest
are kept); bounds the request when the coordinator is away for a while."""


class WorkerTally:
    """One per worker process: `see` each of its events (from any thread),
    `take` what is pending for the next quorum request. A state machine over
    the events' `mono` times; no I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[float]] = {}
        self._scalars: dict[str, float] = {}
        """The last value per name of the script's scalars since the last request."""
        self._rank: int | None = None
        self._abort: float | None = None
        """`mono` of the first abort of the interruption under way, if any."""
        self._ready: float | None = None
        self._built: float | None = None
        self._healed: float | None = None

    def _add(self, key: Observed, value: float) -> None:
        values = self._pending.setdefault(str(key), [])
        values.append(float(value))
        del values[:-MAX_PENDING]

    def see(self, ev: Mapping[str, Any]) -> None:
        """Take in one of this worker's events (an `EventLog` record)."""
        kind, mono = ev.get("kind"), ev.get("mono")
        if not isinstance(mono, int | float):
            return
        with self._lock:
            if kind == EventKind.STEP_ABORT:
                if self._abort is None:
                    self._abort = mono
                    self._ready = self._built = self._healed = None
            elif kind == EventKind.GROUP_BUILT:
                self._rank = ev.get("rank")
                if self._abort is not None:
                    self._built = mono
                    self._ready = mono - float(ev.get("build_s") or 0.0)
            elif kind == EventKind.HEAL_END:
                if ev.get("role") == "recv":
                    self._add(Observed.HEAL_S, ev.get("seconds") or 0.0)
                    self._add(Observed.HEALED_BYTES, ev.get("bytes") or 0)
                if self._abort is not None and self._built is not None:
                    self._healed = mono
            elif kind == EventKind.USER_SCALAR:
                name, value = str(ev.get("name")), ev.get("value")
                fits = name in self._scalars or len(self._scalars) < MAX_METRIC_SCALARS
                if fits and isinstance(value, int | float):
                    self._scalars[name] = float(value)
            elif kind == EventKind.STEP_COMMIT:
                if self._rank == 0:
                    self._add(Observed.STEP_S, ev.get("step_s") or 0.0)
                self._end_recovery(mono)

    def _end_recovery(self, commit: float) -> None:
        """A step committed: an interruption under way is over; its leader
        reports its phases. Holds the lock."""
        abort, ready, built, healed = self._abort, self._ready, self._built, self._healed
        self._abort = None
        if abort is None or ready is None or built is None or self._rank != 0:
            return
        marks = {
            "quorum": max(ready, abort),
            "regroup": built,
            "heal": healed if healed is not None else built,
            "first_step": commit,
        }
        last = abort
        for phase in RECOVERY_PHASES:
            self._add(RECOVERY_KEYS[phase], max(0.0, marks[phase] - last))
            last = max(last, marks[phase])

    def take_scalars(self) -> dict[str, float]:
        """The script's scalars pending for the next quorum request (at most
        `MAX_METRIC_SCALARS` names: the first ones logged since the previous
        request); pending is then empty."""
        with self._lock:
            out, self._scalars = self._scalars, {}
        return out

    def take(self) -> dict[str, list[float]]:
        """What is pending, for the next quorum request; pending is then empty."""
        with self._lock:
            out, self._pending = self._pending, {}
        return out
