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
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

from elastrain import env


class EventKind(StrEnum):
    """Every event kind; the event files carry its string value."""

    # launcher
    JOB_START = "job_start"
    WORKER_SPAWNED = "worker_spawned"
    WORKER_NOT_PLACED = "worker_not_placed"
    WORKER_EXITED = "worker_exited"
    FAULT_INJECTED = "fault_injected"
    JOB_END = "job_end"
    DRAIN = "drain"
    STRAGGLER_EVICTED = "straggler_evicted"
    CHECKPOINT_RESUME = "checkpoint_resume"
    # coordinator (preempt_notice: also the launcher)
    COORDINATOR_START = "coordinator_start"
    MEMBER_REGISTERED = "member_registered"
    MEMBER_REFUSED = "member_refused"
    MEMBER_REMOVED = "member_removed"
    GENERATION_FORMED = "generation_formed"
    GENERATION_READY = "generation_ready"
    WAITING_FOR_MEMBERS = "waiting_for_members"
    PREEMPT_NOTICE = "preempt_notice"
    GENERATION_ADOPTED = "generation_adopted"
    EXIT_REPORTED = "exit_reported"
    LAYOUT_CHANGED = "layout_changed"
    RESHARD_REFUSED = "reshard_refused"
    HANG_CONFIRMED = "hang_confirmed"
    # launcher: coordinator restarts; worker: losing and finding it again
    COORDINATOR_EXITED = "coordinator_exited"
    COORDINATOR_RESTARTED = "coordinator_restarted"
    COORDINATOR_UNREACHABLE = "coordinator_unreachable"
    COORDINATOR_REACHABLE = "coordinator_reachable"
    # worker
    WORKER_START = "worker_start"
    RENDEZVOUS_BEGIN = "rendezvous_begin"
    GROUP_BUILT = "group_built"
    HEAL_BEGIN = "heal_begin"
    HEAL_END = "heal_end"
    RESHARD_END = "reshard_end"
    GENERATION_START = "generation_start"
    STEP_CONTRIB = "step_contrib"
    STEP_COMMIT = "step_commit"
    STEP_SKIPPED = "step_skipped"
    STEP_ROLLED_FORWARD = "step_rolled_forward"
    STEP_ABORT = "step_abort"
    WATCHDOG_FIRED = "watchdog_fired"
    WORKER_EXIT = "worker_exit"
    # worker: evaluation (elastrain.runtime.evaluate)
    EVAL_BEGIN = "eval_begin"
    EVAL_END = "eval_end"
    # worker: durable checkpoints
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_EMERGENCY = "checkpoint_emergency"
    # worker: the script's own scalars (trainer.log; elastrain.observe.scalars)
    USER_SCALAR = "user_scalar"
    # worker: metering (elastrain.observe.worker)
    FLOPS_MEASURED = "flops_measured"
    POWER_SAMPLE = "power_sample"


KINDS = frozenset(EventKind)

FIELDS: dict[EventKind, frozenset[str]] = {
    EventKind.JOB_START: frozenset(["job_id", "min", "script", "target"]),
    EventKind.WORKER_SPAWNED: frozenset(["member", "pid", "replacement", "replaces"]),
    EventKind.WORKER_NOT_PLACED: frozenset(["message", "replaces"]),
    EventKind.WORKER_EXITED: frozenset(["member", "pid", "returncode"]),
    EventKind.FAULT_INJECTED: frozenset(["fault", "member", "pid", "step"]),
    EventKind.JOB_END: frozenset(["message", "status", "steps"]),
    EventKind.DRAIN: frozenset(["members"]),
    EventKind.STRAGGLER_EVICTED: frozenset(["member", "pid", "score", "steps", "streak"]),
    EventKind.CHECKPOINT_RESUME: frozenset(["discarded", "path", "skipped", "step"]),
    EventKind.COORDINATOR_START: frozenset(["host", "port", "store_port"]),
    EventKind.MEMBER_REGISTERED: frozenset(["gen", "incarnation", "member", "pid", "running"]),
    EventKind.MEMBER_REFUSED: frozenset(["member", "reason"]),
    EventKind.MEMBER_REMOVED: frozenset(["member", "reason"]),
    # generation_formed, _ready and _adopted also carry `layout` (`Layout.describe()`,
    # e.g. "2x2: r0=[w0,w1] r1=[w2,-]") and `shard_size` (the generation's) when
    # the job is sharded, and only then.
    EventKind.GENERATION_FORMED: frozenset(["gen", "members", "reason"]),
    EventKind.GENERATION_READY: frozenset(["gen", "members", "start_step", "steps"]),
    EventKind.WAITING_FOR_MEMBERS: frozenset(["have", "message", "min"]),
    EventKind.PREEMPT_NOTICE: frozenset(["grace_s"]),
    EventKind.GENERATION_ADOPTED: frozenset(["awaiting", "gen", "members", "step"]),
    EventKind.EXIT_REPORTED: frozenset(["member", "pid", "returncode"]),
    EventKind.LAYOUT_CHANGED: frozenset(["gen", "new", "old", "reason"]),
    EventKind.RESHARD_REFUSED: frozenset(
        ["alive", "budget", "message", "needed", "preferred", "shard_size"]
    ),
    # hang_confirmed: `by`'s collective in (gen, step) was overdue after waited_s
    # and the members in `silent` had stopped heartbeating (they are expelled).
    EventKind.HANG_CONFIRMED: frozenset(["by", "gen", "silent", "step", "waited_s"]),
    EventKind.COORDINATOR_EXITED: frozenset(["pid", "returncode"]),
    EventKind.COORDINATOR_RESTARTED: frozenset(["down_s", "pid", "restarts"]),
    EventKind.COORDINATOR_UNREACHABLE: frozenset(["error", "gen", "op"]),
    EventKind.COORDINATOR_REACHABLE: frozenset(["down_s", "gen"]),
    EventKind.WORKER_START: frozenset(["member"]),
    EventKind.RENDEZVOUS_BEGIN: frozenset(["committed", "known_gen"]),
    EventKind.GROUP_BUILT: frozenset(["build_s", "gen", "rank", "size"]),
    EventKind.HEAL_BEGIN: frozenset(["bytes", "gen", "role"]),
    # heal_end: payload_s is the part of seconds that moved the payload
    # (`HealStats.payload_s`); the rest is the manifest rounds and the install.
    EventKind.HEAL_END: frozenset(["bytes", "gen", "payload_s", "rate_mb_s", "role", "seconds"]),
    EventKind.RESHARD_END: frozenset(
        ["gen", "old_size", "new_size", "sent", "received", "seconds"]
    ),
    EventKind.GENERATION_START: frozenset(["gen", "members", "rank", "state_hash", "step"]),
    EventKind.STEP_CONTRIB: frozenset(["gen", "samples", "step"]),
    # step_commit from the engine also carries verdict_s (time blocked on the quorum
    # verdict after computing) and apply_s (the update: state-hash settle, unscale,
    # norm, clip, optimizer); step_s less compute_s, verdict_s, allreduce_s and apply_s
    # is the engine's own cost between them. Older event files lack both. computed:
    # the micro-batches this member computed (padding not counted); held: those its
    # sharded group kept from a generation that broke in this step (not computed again).
    EventKind.STEP_COMMIT: frozenset(
        [
            "allreduce_s",
            "compute_s",
            "data_s",
            "gen",
            "grad_norm",
            "loss",
            "samples",
            "samples_per_s",
            "skipped",
            "step",
            "step_s",
        ]
    ),
    EventKind.STEP_SKIPPED: frozenset(["gen", "grad_norm", "reason", "skipped_total", "step"]),
    EventKind.STEP_ROLLED_FORWARD: frozenset(["gen", "step"]),
    EventKind.STEP_ABORT: frozenset(["error", "gen", "phase", "step"]),
    EventKind.WATCHDOG_FIRED: frozenset(["gen", "step", "timeout_s"]),
    EventKind.WORKER_EXIT: frozenset(["committed", "reason"]),
    EventKind.EVAL_BEGIN: frozenset(["batches", "gen", "members", "step"]),
    EventKind.EVAL_END: frozenset(
        ["batches", "computed", "gen", "samples", "seconds", "step", "sums", "wait_s"]
    ),
    EventKind.CHECKPOINT_SAVED: frozenset(["step"]),
    EventKind.CHECKPOINT_FAILED: frozenset(["step"]),
    EventKind.CHECKPOINT_SKIPPED: frozenset(["step"]),
    EventKind.CHECKPOINT_COMMITTED: frozenset(
        [
            "blocking_s",
            "bytes",
            "commit_s",
            "generation",
            "members",
            "num_shards",
            "path",
            "step",
            "wait_s",
        ]
    ),
    EventKind.CHECKPOINT_INTERVAL: frozenset(
        [
            "elapsed_s",
            "failures",
            "interval_s",
            "interval_steps",
            "mtbf_s",
            "next_step",
            "reason",
            "save_cost_s",
            "step_s",
        ]
    ),
    EventKind.CHECKPOINT_LOADED: frozenset(["bytes", "generation", "path", "seconds", "step"]),
    EventKind.CHECKPOINT_EMERGENCY: frozenset(["ok", "rank", "seconds", "step"]),
    EventKind.POWER_SAMPLE: frozenset(["joules", "source", "watts"]),
    EventKind.USER_SCALAR: frozenset(["name", "step", "value"]),
}
"""The fields every event of a kind carries (more may follow): `emit` refuses an
event without them, so a missing field fails the first test that emits it, not a
report that reads it later."""


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
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        if run_dir is not None:
            d = Path(run_dir) / "events"
            d.mkdir(parents=True, exist_ok=True)
            self._file = open(d / f"{proc}-{self.pid}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: EventKind, **fields: Any) -> dict[str, Any]:
        """Write one event. `kind` is an `EventKind` (mypy refuses a string) and the
        event must carry the kind's `FIELDS`; ValueError otherwise."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; add it to EventKind")
        missing = FIELDS.get(EventKind(kind), frozenset()) - fields.keys()
        if missing:
            raise ValueError(f"event {kind} lacks {sorted(missing)}")
        rec: dict[str, Any] = {
            "t": time.time(),
            "mono": time.monotonic(),
            "proc": self.proc,
            "pid": self.pid,
            "kind": str(kind),
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
        for listen in self._listeners:
            listen(rec)
        return rec

    def listen(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn` with every record emitted from now on, on the emitting
        thread (a worker's `WorkerTally`); `fn` must be quick and not raise."""
        self._listeners.append(fn)

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
