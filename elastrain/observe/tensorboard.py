"""`elastrain run --tensorboard DIR`: the job's numbers as TensorBoard event files.

**Who writes: the launcher**, reading the run's events (`EventTail`), never a
worker. The launcher is the one process that lives from the job's start to its
end: workers die and are replaced, rank 0 moves between generations and the
coordinator may be restarted, so a writer among them would leave one file per
incarnation, overlapping ones when an old rank 0 outlives its generation, and
none for the steps between a death and the next writer. The events already hold
every number (the workers write them anyway), so the launcher adds no work or
dependency to the training processes. A rerun of the job (a resume) is a new
launcher and a new event file in the same DIR; TensorBoard reads them together.

What is written (tags), each at the step it belongs to (``step_commit``'s step,
the index of the committed step, as in ``StepResult.step``):

- ``train/loss``, ``train/step_seconds``, ``train/samples_per_second``: from each
  step's first ``step_commit`` (every member reports the same step);
- ``user/<name>``: each ``trainer.log(name, value)`` (rank 0's ``user_scalar``);
- ``goodput/time``: the time goodput so far (`elastrain.observe.goodput`), and
  ``energy/joules``: the energy so far (`elastrain.observe.efficiency`, from the
  power meters; an estimate without one), every `SUMMARY_INTERVAL_S` at the
  newest step, and once more at the end.

Scalars are TensorBoard's own `Summary.Value.simple_value` records written by
its `EventFileWriter` (what `SummaryWriter.add_scalar` writes), so
`EventAccumulator(...).Scalars(tag)` and the TensorBoard UI read them.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastrain.observe.events import EventKind, EventTail

LOSS = "train/loss"
STEP_SECONDS = "train/step_seconds"
SAMPLES_PER_SECOND = "train/samples_per_second"
GOODPUT = "goodput/time"
ENERGY = "energy/joules"
USER_PREFIX = "user/"

POLL_S = 1.0
"""How often the launcher reads new events (and flushes the files)."""

SUMMARY_INTERVAL_S = 10.0
"""How often goodput and energy so far are recomputed (over every event so far)."""

INSTALL_HINT = "--tensorboard needs the tensorboard package: pip install 'elastrain[tensorboard]'"


@dataclass(frozen=True)
class Point:
    """One scalar for TensorBoard."""

    tag: str
    value: float
    step: int
    wall_time: float


class Points:
    """The scalars in a stream of events, each once (a pure state machine: `feed`
    events in any batches, in time order; no I/O)."""

    def __init__(self) -> None:
        self.last_step = -1
        """The newest step written (its first ``step_commit``)."""
        self.events: list[dict[str, Any]] = []
        """Every event fed so far (what goodput and energy are computed from)."""

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[Point]:
        """The new points in ``events``."""
        out: list[Point] = []
        for e in events:
            self.events.append(dict(e))
            kind, t = e.get("kind"), float(e.get("t") or time.time())
            step = e.get("step")
            if not isinstance(step, int):
                continue
            if kind == EventKind.STEP_COMMIT and step > self.last_step:
                self.last_step = step
                for tag, key in (
                    (LOSS, "loss"),
                    (STEP_SECONDS, "step_s"),
                    (SAMPLES_PER_SECOND, "samples_per_s"),
                ):
                    v = e.get(key)
                    if isinstance(v, int | float) and math.isfinite(v):
                        out.append(Point(tag, float(v), step, t))
            elif kind == EventKind.USER_SCALAR and isinstance(e.get("value"), int | float):
                out.append(Point(USER_PREFIX + str(e.get("name")), float(e["value"]), step, t))
        return out

    def summary(self) -> list[Point]:
        """Goodput and energy so far, at the newest step (none before a step)."""
        from elastrain.observe.efficiency import efficiency
        from elastrain.observe.goodput import goodput

        if self.last_step < 0:
            return []
        self.events.sort(key=lambda e: e.get("t", 0.0))
        gp = goodput(self.events)
        now = time.time()
        out = []
        if gp.total_s > 0:
            out.append(Point(GOODPUT, gp.time_goodput, self.last_step, now))
        energy = efficiency(self.events, gp).energy_j
        if energy is not None and math.isfinite(energy):
            out.append(Point(ENERGY, energy, self.last_step, now))
        return out


class TensorBoardSink:
    """The launcher's TensorBoard writer (see the module docstring): `start` a
    thread that follows ``run_dir``'s events and writes event files into
    ``logdir``; `close` writes what is left and closes them. ImportError (with
    `INSTALL_HINT`) at construction when tensorboard is not installed."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        logdir: str | os.PathLike[str],
        *,
        poll_s: float = POLL_S,
        summary_s: float = SUMMARY_INTERVAL_S,
    ) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        self._event, self._summary = Event, Summary
        self.logdir = str(logdir)
        self._writer = EventFileWriter(self.logdir)
        self._tail = EventTail(run_dir)
        self._points = Points()
        self._poll_s, self._summary_s = poll_s, summary_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written = 0
        """Points written so far."""

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name="elastrain-tensorboard", daemon=True
        )
        self._thread.start()

    def _write(self, points: Iterable[Point]) -> None:
        for p in points:
            value = self._summary.Value(tag=p.tag, simple_value=p.value)
            self._writer.add_event(
                self._event(
                    wall_time=p.wall_time, step=p.step, summary=self._summary(value=[value])
                )
            )
            self.written += 1

    def poll(self) -> None:
        """Write the points of the events written since the last poll."""
        batch = sorted(self._tail.poll(), key=lambda e: e.get("t", 0.0))
        self._write(self._points.feed(batch))

    def _loop(self) -> None:
        last_summary = time.monotonic()
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
                if time.monotonic() - last_summary >= self._summary_s:
                    t = time.monotonic()
                    self._write(self._points.summary())
                    # recomputing over every event: keep this thread's share of a core small
                    last_summary = time.monotonic() + 20 * (time.monotonic() - t)
                self._writer.flush()
            except Exception:  # noqa: BLE001 - a dashboard must never stop the job
                continue

    def close(self) -> None:
        """Stop following, write the last events' points and the final goodput and
        energy, and close the event file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.poll()
        self._write(self._points.summary())
        self._writer.close()
