"""Structured events: one JSONL file per process in `<run_dir>/events/`.

Every line is a JSON object with at least:
  t     wall-clock seconds (time.time()), comparable across processes on one host
  mono  time.monotonic() of the writing process (for durations inside one process)
  proc  the writer: "coordinator", "launcher", or a member id such as "w3"
  pid   the writer's PID
  kind  the event kind (see KINDS)
Further fields depend on the kind. Writers append and flush each line, so a
SIGKILLed process loses at most the line it was writing; readers skip a torn
last line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastrain import env

KINDS = frozenset(
    {
        # launcher
        "job_start", "worker_spawned", "worker_exited", "fault_injected", "job_end", "drain",
        "checkpoint_resume",
        # coordinator (preempt_notice: also the launcher)
        "coordinator_start", "member_registered", "member_refused", "member_removed",
        "generation_formed", "generation_ready", "waiting_for_members", "preempt_notice",
        "generation_adopted",
        # launcher: coordinator restarts; worker: losing and finding it again
        "coordinator_exited", "coordinator_restarted",
        "coordinator_unreachable", "coordinator_reachable",
        # worker
        "worker_start", "rendezvous_begin", "group_built", "heal_begin", "heal_end",
        "generation_start", "step_contrib", "step_commit", "step_abort",
        "watchdog_fired", "worker_exit",
        # worker: durable checkpoints
        "checkpoint_saved", "checkpoint_failed", "checkpoint_skipped", "checkpoint_committed",
        "checkpoint_interval", "checkpoint_loaded", "checkpoint_emergency",
        # worker: metering (elastrain.observe.worker)
        "flops_measured", "power_sample",
    }
)  # fmt: skip


class EventLog:
    """Append-only JSONL event writer for one process.

    Thread-safe; each `emit` is one flushed line. A `None` directory makes a
    log that drops everything (a worker started outside a run directory).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str] | None, proc: str, *, echo: bool | None = None
    ) -> None:
        self.proc = proc
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._file = None
        # Cluster mode: a pod's stdout is where its logs go, so every event is
        # printed there too (one JSON line each) when $ELASTRAIN_EVENTS_STDOUT=1.
        self.echo = (
            os.environ.get(env.EVENTS_STDOUT, "") in ("1", "true", "yes") if echo is None else echo
        )
        if run_dir is not None:
            d = Path(run_dir) / "events"
            d.mkdir(parents=True, exist_ok=True)
            self._file = open(d / f"{proc}-{self.pid}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        if kind not in KINDS:
            raise ValueError(
                f"unknown event kind {kind!r}; add it to elastrain.observe.events.KINDS"
            )
        rec: dict[str, Any] = {
            "t": time.time(),
            "mono": time.monotonic(),
            "proc": self.proc,
            "pid": self.pid,
            "kind": kind,
        }
        rec.update(fields)
        if self._file is not None or self.echo:
            line = json.dumps(rec, separators=(",", ":"))
            with self._lock:
                if self._file is not None:
                    self._file.write(line + "\n")
                if self.echo:
                    sys.stdout.write(line + "\n")
                    sys.stdout.flush()
        return rec

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, from every process, sorted by wall time."""
    out: list[dict[str, Any]] = []
    for rec in iter_events(run_dir):
        out.append(rec)
    out.sort(key=lambda r: r["t"])
    return out


def iter_events(run_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    d = Path(run_dir) / "events"
    if not d.is_dir():
        return
    for path in sorted(d.glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn last line of a killed process


class EventTail:
    """Follows a run directory's event files: each `poll()` returns the complete
    lines written since the previous one (files that appear later included).
    For live views in the launcher's process; never blocks on a writer."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir) / "events"
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.dir.is_dir():
            return out
        for path in sorted(self.dir.glob("*.jsonl")):
            off = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(off)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # a torn last line waits for the next poll
            self._offsets[path] = off + end
            for line in chunk[:end].splitlines():
                try:
                    out.append(json.loads(line))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
        return out
