"""The checkpoint manager inside the elastic trainer: when, who writes, who commits, resume.

The storage layer (`elastrain.checkpoint`) knows files; this module knows the
step protocol. Its distributed contract:

- **When.** After committing the step that makes the committed step count
  ``n``, a checkpoint is due iff `Schedule.due(n)` (periodic ones also at the
  job's last step, where a busy writer is waited for). The schedule is *agreed
  state*: it changes only through values every member of the generation got
  from the same all-reduce (the step's gradient all-reduce carries each
  member's measured save cost and step time, see `Checkpointing.contribution`),
  and it travels with heals and checkpoints. So every member of a generation
  decides the same, whatever it measured itself.
- **Who writes.** Every member of the generation that committed that step
  takes `Snapshot.take(shard=rank, num_shards=len(members))` of the flattened
  state on its training thread (the only part the training loop waits for)
  and hands it to its own `CheckpointWriter`, which writes that stripe in the
  background. What only the optimizer step writes (the parameters, the
  optimizer state) is copied by a background thread during the next step's
  compute; the trainer calls `Checkpointing.settle` before anything writes the
  state, which waits for that copy. A member's blocking time (``blocking_s``
  in the events, the save cost the schedule uses) is the take plus that wait. A member whose previous write is still running skips this one
  (never waiting on the disk); a failed write (ENOSPC, EIO) is an event and a
  log line, and training goes on.
- **Who commits.** Rank 0 of that generation, in a committer thread: it waits
  (bounded by ``checkpoint_commit_timeout_s``, polling the directory every
  `POLL_S`) until every shard manifest of the step exists, then calls
  `commit` (which verifies every shard and refuses missing shards, shards of
  another generation or membership) and `apply_retention`. A member that died,
  left, failed or skipped leaves its shard missing, so such a checkpoint is
  never claimed complete; a newer committed checkpoint supersedes older ones
  still waiting. If rank 0 dies, nobody commits that step: it is ignored.
  A member whose write failed or that skipped the checkpoint also leaves an
  empty ``shard-KKKKK-of-NNNNN.gen-G.failed`` file (best effort: it needs no
  data blocks, so it usually lands even on a full disk), so rank 0 gives up
  at once instead of at its timeout. Rank 0 deletes what was written of a
  checkpoint it gives up on (on a full disk those shards would keep every
  later save from fitting); committed checkpoints are never touched.
- **Resume.** `Checkpointing.restore`, on every worker at start before its
  first rendezvous, restores the checkpoint the launcher chose (or the newest
  verified one; with none, a plain torch DCP directory given as a source) into
  the worker's `RestoreTarget`; the trainer then reports that committed count
  at rendezvous, so the job goes on from there (members that are behind are
  healed from the ones that are not, as after any failure).

A checkpoint's *step* is the committed step count it holds (the next step to
run): ``step-00000020`` is the state after steps 0..19.

A sharded job writes sharded checkpoints instead (`elastrain.checkpoint.dcp`,
`elastrain.checkpoint.sharded_parts`): the same schedule, writer thread, failure
markers and committer, but its `SaveRole`s differ: one writer per shard index
(``num_shards`` is the shard size), members that hold a twin's copy write
nothing, and rank 0 commits whether it writes or not. A replicated job with
``--ckpt-format dcp`` writes the same format with the replicated roles: every
member writes its rows of every tensor (`elastrain.checkpoint.replicated_parts`),
``num_shards`` is the member count. `written_format` decides.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoint import (
    CheckpointConfig,
    CheckpointFormat,
    CheckpointWriter,
    CommitError,
    SaveHandle,
    Snapshot,
    apply_retention,
    commit,
)
from elastrain.checkpoint.config import CheckpointPolicy
from elastrain.checkpoint.dcp import (
    ShardedWriter,
    ShardParts,
    ShardSnapshot,
    commit_sharded,
    import_commit_modules,
)
from elastrain.checkpoint.files import MARKER, read_signed_json, shard_manifest_name, step_dir
from elastrain.checkpoint.policy import IntervalChoice, Schedule
from elastrain.checkpoint.restore import Restored, RestoreSource, RestoreTarget, restore_newest
from elastrain.control.protocol import GenerationReason
from elastrain.observe.events import EventKind, EventLog

log = logging.getLogger("elastrain.checkpoint")

POLL_S = 0.05
"""How often the committer looks for the shard manifests of a pending checkpoint."""

StateFn = Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any], frozenset[str]]]
"""Returns the flattened state (names -> live tensors), its JSON meta and the names
of the tensors only the optimizer step writes (`FlatState.stable`: copied later)."""

PartsFn = Callable[[], ShardParts]
"""A sharded job's: this writer's chunks (live tensors), the tensor list and the meta."""


@dataclass(frozen=True)
class SaveRole:
    """One member's part in one checkpoint: it writes part ``shard`` of
    ``num_shards`` (None: nothing), and ``commits`` it (rank 0)."""

    shard: int | None
    num_shards: int
    commits: bool

    @staticmethod
    def replicated(rank: int, members: list[str]) -> SaveRole:
        """Every member writes its stripe (flat) or its rows (DCP); rank 0 commits."""
        return SaveRole(rank, len(members), rank == 0)


def written_format(configured: CheckpointFormat, *, sharded: bool) -> CheckpointFormat:
    """The format a member writes: a sharded job's checkpoints are always DCP (the
    only format that holds rows per shard), a replicated job's the configured one
    (``--ckpt-format``). Pure."""
    return CheckpointFormat.DCP if sharded else configured


# ---- the committer (rank 0) ----------------------------------------------------


def failed_marker(directory: str, step: int, shard: int, num_shards: int, generation: int) -> Path:
    """The empty file saying "shard ``shard`` of this checkpoint will not be written"."""
    name = shard_manifest_name(shard, num_shards).removesuffix(".json")
    return step_dir(directory, step) / f"{name}.gen-{generation}.failed"


def mark_failed(directory: str, step: int, shard: int, num_shards: int, generation: int) -> None:
    """Best effort: leave the failure marker of a shard (never raises)."""
    try:
        path = failed_marker(directory, step, shard, num_shards, generation)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as e:
        log.debug("could not leave the failure marker for step %d shard %d: %s", step, shard, e)


@dataclass
class _CommitJob:
    step: int
    generation: int
    members: list[str]
    num_shards: int
    total_bytes: int
    blocking: Callable[[], float]
    """This member's blocking time for the checkpoint (known once its copy settled)."""
    deadline: float
    kind: CheckpointFormat = CheckpointFormat.FLAT
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class _Committer:
    """Commits checkpoints once all their shards are written; one thread, rank 0 only.

    Pending checkpoints are watched together (no head-of-line blocking): each
    is committed when its last shard manifest appears, given up at its
    deadline, or dropped when a newer one commits (retention would delete it).
    """

    def __init__(self, config: CheckpointConfig, events: EventLog, member: str) -> None:
        self.config = config
        self.events = events
        self.member = member
        self._cond = threading.Condition()
        self._pending: list[_CommitJob] = []
        self._stop_at: float | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: _CommitJob) -> None:
        with self._cond:
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="elastrain-ckpt-commit", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def close(self, deadline: float) -> None:
        """Finish pending commits, waiting for shards no later than ``deadline`` (monotonic)."""
        with self._cond:
            self._stop_at = deadline
            self._cond.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and self._stop_at is None:
                    self._cond.wait()
                if not self._pending:
                    return
                jobs = sorted(self._pending, key=lambda j: j.step)
                stop_at = self._stop_at
            for job in jobs:
                self._check(job, stop_at)
            with self._cond:
                if self._pending:
                    # A bounded poll of the directory: the shard manifests are
                    # written by other processes, which cannot notify us.
                    self._cond.wait(POLL_S)

    def _drop(self, job: _CommitJob) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
        job.done.set()

    def _give_up(
        self, job: _CommitJob, why: str, path: Path, *, delete: bool, errno: int | None = None
    ) -> None:
        """Drop a checkpoint that will never be committed (event + log line).

        ``delete``: also remove what was written of it, which the caller may ask
        only once no member can still be writing there (every shard has its
        manifest or its failure marker): on a full disk those shards would keep
        every later save from fitting. A committed step is never touched."""
        log.warning("checkpoint step %d not committed: %s", job.step, why)
        self.events.emit(
            EventKind.CHECKPOINT_FAILED,
            step=job.step,
            phase="commit",
            generation=job.generation,
            error=why[:1000],
            errno=errno,
            path=str(path),
        )
        self._drop(job)
        d = step_dir(self.config.directory, job.step)
        if delete and not (d / MARKER).exists():
            shutil.rmtree(d, ignore_errors=True)

    def _check(self, job: _CommitJob, stop_at: float | None) -> None:
        if job.done.is_set():
            return
        d = step_dir(self.config.directory, job.step)
        n = job.num_shards
        missing = [k for k in range(n) if not (d / shard_manifest_name(k, n)).exists()]
        now = time.monotonic()
        if missing:
            failed = [
                k
                for k in missing
                if failed_marker(self.config.directory, job.step, k, n, job.generation).exists()
            ]
            accounted = len(failed) == len(missing)
            late = now >= (job.deadline if stop_at is None else min(job.deadline, stop_at))
            first = d / shard_manifest_name(missing[0], n)
            # At the end too (stop_at), wait until every missing shard is accounted
            # for or the deadline passes: a shard still being written would keep its
            # step on disk (a full disk stays full), and its writer ends soon.
            if failed and (accounted or late):
                why = (
                    f"the member(s) writing shard(s) {failed} of {n} reported that their "
                    "write failed or was skipped (see their checkpoint_failed/skipped events)"
                )
                self._give_up(job, why, first, delete=accounted)
            elif late:
                why = (
                    f"gave up after {now - job.submitted:.1f} s: {first} (and "
                    f"{len(missing) - 1} more) never appeared; its member died, left, failed "
                    "or skipped this checkpoint"
                )
                self._give_up(job, why, first, delete=False)
            return
        t0 = time.monotonic()
        try:
            dcp = job.kind == CheckpointFormat.DCP
            marker = (commit_sharded if dcp else commit)(
                self.config.directory,
                job.step,
                generation=job.generation,
                members=job.members,
                num_shards=job.num_shards,
                fsync=self.config.fsync,
            )
            if dcp:
                job.total_bytes = int(read_signed_json(marker)["total_bytes"])
        except (CommitError, OSError, ValueError) as e:
            # Every shard is written: nobody writes here any more, so clean up.
            err = getattr(e, "errno", None)
            self._give_up(job, f"{type(e).__name__}: {e}", d, delete=True, errno=err)
            return
        commit_s = time.monotonic() - t0
        job.ok = True
        log.info(
            "checkpoint step %d committed: %d shards, %d bytes, %s",
            job.step,
            job.num_shards,
            job.total_bytes,
            marker,
        )
        self.events.emit(
            EventKind.CHECKPOINT_COMMITTED,
            step=job.step,
            generation=job.generation,
            members=job.members,
            num_shards=job.num_shards,
            bytes=job.total_bytes,
            path=str(marker.parent),
            blocking_s=job.blocking(),
            wait_s=t0 - job.submitted,
            commit_s=commit_s,
        )
        with self._cond:
            older = [j for j in self._pending if j.step < job.step]
        for j in older:
            self.events.emit(
                EventKind.CHECKPOINT_SKIPPED,
                step=j.step,
                phase="commit",
                reason=f"superseded by the newer checkpoint at step {job.step}",
            )
            self._drop(j)
        self._drop(job)
        try:
            apply_retention(self.config.directory, self.config, verified_step=job.step)
        except OSError as e:
            log.warning("checkpoint retention failed: %s", e)


# ---- per worker ----------------------------------------------------------------


class Checkpointing:
    """One worker's part in durable checkpoints (see the module docstring).

    Who calls: the trainer's training thread only (`contribution`, `absorb`,
    `save_due`, `save`, `emergency`, `settle`, `close`); the writer and committer
    threads it owns never touch the model, and its copier thread only reads
    the state, until `settle`. ``directory`` None disables everything
    (no run directory and no configured directory).
    """

    def __init__(
        self,
        config: CheckpointPolicy,
        directory: str | None,
        events: EventLog,
        member: str,
        *,
        format: CheckpointFormat = CheckpointFormat.FLAT,
    ) -> None:
        self.config = config
        self.directory = directory
        self.events = events
        self.member = member
        self.format = format
        """What this member writes (`written_format`): DCP (`save`'s state is
        then a `PartsFn`, a sharded or a replicated member's) or flat (a `StateFn`)."""
        self.schedule = Schedule(config.every, config.mtbf_s)
        self.store: CheckpointConfig | None = None
        self.writer: CheckpointWriter | None = None
        self._committer: _Committer | None = None
        if directory is not None:
            self.store = CheckpointConfig(
                directory=directory,
                keep_last=config.keep_last,
                keep_every=config.keep_every,
                fsync=config.fsync,
            )
            writer = ShardedWriter if format == CheckpointFormat.DCP else CheckpointWriter
            self.writer = writer(self.store, events=self._writer_event)
            if format == CheckpointFormat.DCP and (config.every or config.mtbf_s is not None):
                # Off the training thread: its first commit (rank 0's) needs them.
                threading.Thread(
                    target=import_commit_modules, name="elastrain-dcp-import", daemon=True
                ).start()
        self._snap: Snapshot | ShardSnapshot | None = None
        self._copying: tuple[Snapshot | ShardSnapshot, float] | None = None
        """The last snapshot while its deferred copy is not settled, and its take time."""
        self._handle: SaveHandle | None = None
        self._pending_cost: float | None = None
        self._cost_sent = False
        """`_pending_cost` went into an all-reduce: the next `absorb` clears it."""
        self._last_step_s: float | None = None
        self._last_commit: float | None = None
        self._saw_failure = False
        self._blocking: dict[int, tuple[float, Snapshot | ShardSnapshot]] = {}
        """Step -> (take seconds, snapshot) of the last snapshot taken."""

    @property
    def enabled(self) -> bool:
        """True when checkpoints can be written (a directory is known)."""
        return self.writer is not None

    # ---- schedule agreement (through the step's all-reduce) ----------------------

    def contribution(self) -> list[float]:
        """This member's `CONTRIB_SLOTS` values for the coming all-reduce: its save
        cost measured since the last committed step (if any) and its last step time."""
        cost = self._pending_cost
        self._cost_sent = cost is not None
        step = self._last_step_s
        since = time.monotonic() - self._last_commit if self._last_commit is not None else None
        return [
            cost or 0.0,
            1.0 if cost is not None else 0.0,
            step or 0.0,
            1.0 if step else 0.0,
            since or 0.0,
            1.0 if since is not None else 0.0,
            1.0 if self._saw_failure else 0.0,
        ]

    def note_step_time(self, step_s: float) -> None:
        self._last_step_s = step_s

    def note_generation(self, reason: str) -> None:
        """The member starts training in a generation formed for `reason`. The
        first one starts its clock for the MTBF; "failure" flags a failure,
        counted once by the next committed step however many re-forms it took."""
        if self._last_commit is None:
            self._last_commit = time.monotonic()
        if reason == GenerationReason.FAILURE:
            self._saw_failure = True

    def absorb(self, values: list[float]) -> None:
        """After a commit: fold in the all-reduced values (identical on every member)."""
        if self._cost_sent:
            # A cost measured after this step's all-reduce (`settle`) waits for the next.
            self._pending_cost, self._cost_sent = None, False
        self._last_commit = time.monotonic()
        self._saw_failure = False
        self.schedule.absorb(values)

    # ---- saving ------------------------------------------------------------------

    def save_due(self, n: int, rank: int, *, final: bool = False) -> bool:
        """Is checkpoint ``n`` due (the engine's first question, asked before it
        builds anything to snapshot)? Called by every member right after committing
        the step that made its committed count ``n``, with the same ``final`` (``n``
        is the job's last step: a periodic schedule takes a checkpoint there
        whatever its interval, `Schedule.due`). A pure function of the schedule and
        the committed count, so every member of the generation answers alike. A
        due answer marks ``n`` taken: the caller then calls `save` for it (even
        with checkpoints disabled, where `save` writes nothing); rank 0 announces
        an interval the schedule chose."""
        choice = self.schedule.plan(n)
        if choice is not None and rank == 0:
            self._announce(choice)
        if not self.schedule.due(n, final=final):
            return False
        self.schedule.taken(n)
        return True

    def save(
        self,
        n: int,
        gen: int,
        members: list[str],
        rank: int,
        state: StateFn | PartsFn,
        role: SaveRole | None = None,
        *,
        final: bool = False,
    ) -> None:
        """Take this member's shard of checkpoint ``n``, which `save_due` found due.

        Blocks only for the snapshot's synchronous copy (the rest runs until
        `settle`). ``role``: what this member writes and whether it commits
        (default: stripe ``rank`` of ``len(members)``, rank 0 commits); sharded,
        ``state`` is a `PartsFn`. ``final``: as `save_due`'s; the last save is not
        skipped for a previous one still writing: it waits for it (at most the
        commit timeout), since no later checkpoint will hold the trained state.
        Every member passes the same ``final``, so they all wait or all skip.
        """
        if not self.enabled:
            return
        assert self.writer is not None
        role = role or SaveRole.replicated(rank, members)
        if final and role.shard is not None and self._handle is not None:
            self.settle()  # the previous save may be waiting for its deferred copy
            try:
                self._handle.wait(timeout=self.config.commit_timeout_s)
            except TimeoutError:
                pass  # still busy: skipped below, as any other step's would be
        if role.shard is not None and self.writer.busy:
            log.warning(
                "checkpoint step %d skipped by %s: its previous save is still writing",
                n,
                self.member,
            )
            self.events.emit(
                EventKind.CHECKPOINT_SKIPPED,
                step=n,
                shard=role.shard,
                phase="snapshot",
                reason="previous save still writing",
            )
            assert self.directory is not None
            mark_failed(self.directory, n, role.shard, role.num_shards, gen)
            return
        self._save(n, gen, members, role, state, deadline=None)

    def emergency(
        self,
        n: int,
        gen: int,
        members: list[str],
        rank: int,
        state: StateFn | PartsFn,
        deadline: float,
        role: SaveRole | None = None,
    ) -> bool:
        """Write checkpoint ``n`` now and wait until it is durable (rank 0: committed),
        no later than ``deadline`` (monotonic). Every member of the generation
        calls it after committing the same step. Returns True on success (a
        member with nothing to write nor commit: at once)."""
        role = role or SaveRole.replicated(rank, members)
        if not self.enabled:
            log.warning("no checkpoint directory: cannot take the emergency checkpoint")
            return False
        if self._handle is not None and not self._handle.done():
            try:
                self._handle.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.events.emit(
                    EventKind.CHECKPOINT_FAILED,
                    step=n,
                    shard=rank,
                    phase="snapshot",
                    emergency=True,
                    error="the previous save did not finish within the grace period",
                )
                return False
        job = self._save(n, gen, members, role, state, deadline=deadline, emergency=True)
        if role.shard is not None:
            handle = self._handle
            if handle is None:
                return False
            try:
                res = handle.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            if res.status == "skipped" and "already committed" in (res.error or ""):
                return True
            if not res.ok:
                return False
        if job is None:
            return True
        job.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        return job.ok

    # ---- restoring ---------------------------------------------------------------

    def restore(
        self,
        mode: str | int,
        target: RestoreTarget,
        *,
        newer_than: int | None = None,
        plain: tuple[str, int | None] | None = None,
    ) -> Restored | None:
        """Restore the newest verified state into ``target`` (the engine's second
        question): the checkpoint ``mode`` names ("latest", "none" or the step the
        launcher chose), else the plain torch DCP directory ``plain``, else None.
        ``newer_than``: a standby's refresh (the newest verified one, only if it
        holds more committed steps). Emits ``checkpoint_loaded`` once the bytes are
        read. Raises `RestoreRefused` (the worker ends as misconfigured). Before
        the first rendezvous, training thread only; see `restore_newest`."""

        def loaded(r: Restored, nbytes: int, seconds: float) -> None:
            fields: dict[str, Any] = {}
            if r.source is RestoreSource.PLAIN:
                fields["plain"] = True
            self.events.emit(
                EventKind.CHECKPOINT_LOADED,
                step=r.step,
                path=r.path,
                generation=r.generation,
                bytes=nbytes,
                seconds=seconds,
                **fields,
            )

        return restore_newest(
            self.directory, mode, target, loaded, newer_than=newer_than, plain=plain
        )

    def settle(self) -> float:
        """The state is about to be written (the next optimizer step, a heal, a
        reshard, an abandoned generation, the end): wait until the last snapshot's
        deferred copy is done, copying what the copier has not started on this
        thread. Returns the seconds waited, which count as that checkpoint's
        blocking time (events, and the save cost the schedule agrees on). Never
        raises: a failed copy fails its save in the writer. Training thread only."""
        pending, self._copying = self._copying, None
        if pending is None:
            return 0.0
        snap, take_s = pending
        waited = snap.deferred.settle()
        self._pending_cost, self._cost_sent = take_s + waited, False
        return waited

    def _blocking_of(self, step: int) -> float:
        """The training thread's blocking time for checkpoint ``step`` (0: none taken):
        the take, plus its wait in `settle` (any thread; see `DeferredCopy.waited`)."""
        got = self._blocking.get(step)
        if got is None:
            return 0.0
        take_s, snap = got
        return take_s + snap.deferred.waited()

    def _save(
        self,
        n: int,
        gen: int,
        members: list[str],
        role: SaveRole,
        state: StateFn | PartsFn,
        *,
        deadline: float | None,
        emergency: bool = False,
    ) -> _CommitJob | None:
        assert self.writer is not None and self.store is not None
        self.settle()  # never two copies in flight: the new one may reuse the buffers
        blocking, total = 0.0, 0
        if role.shard is not None:
            t0 = time.perf_counter()
            snap: Snapshot | ShardSnapshot
            try:
                if self.format == CheckpointFormat.DCP:
                    parts = state()
                    assert isinstance(parts, ShardParts)
                    snap = ShardSnapshot.take(
                        parts,
                        shard=role.shard,
                        num_shards=role.num_shards,
                        into=self._snap if isinstance(self._snap, ShardSnapshot) else None,
                    )
                else:
                    tensors, meta, stable = state()  # type: ignore[misc]
                    snap = Snapshot.take(
                        tensors,
                        meta,
                        shard=role.shard,
                        num_shards=role.num_shards,
                        into=self._snap if isinstance(self._snap, Snapshot) else None,
                        defer=stable,
                    )
            except Exception as e:  # noqa: BLE001 - a checkpoint failure must not stop training
                log.error("checkpoint step %d: snapshot failed: %s", n, e)
                mark_failed(self.store.directory, n, role.shard, role.num_shards, gen)
                self.events.emit(
                    EventKind.CHECKPOINT_FAILED,
                    step=n,
                    shard=role.shard,
                    phase="snapshot",
                    emergency=emergency,
                    error=f"{type(e).__name__}: {e}"[:500],
                )
                return None
            blocking = time.perf_counter() - t0
            total = snap.layout.total if isinstance(snap, Snapshot) else snap.nbytes
            self._blocking = {n: (blocking, snap)}
            self._snap = snap
            self._copying = (snap, blocking)
            self._pending_cost, self._cost_sent = blocking, False
            self._handle = self.writer.save_async(n, snap, generation=gen, members=list(members))
            if self._handle.done() and self._handle.wait().status == "skipped":
                return None
        if not role.commits:
            return None
        if self._committer is None:
            self._committer = _Committer(self.store, self.events, self.member)
        limit = time.monotonic() + self.config.commit_timeout_s
        job = _CommitJob(
            step=n,
            generation=gen,
            members=list(members),
            num_shards=role.num_shards,
            total_bytes=total,
            blocking=lambda: self._blocking_of(n),
            deadline=limit if deadline is None else min(limit, deadline),
            kind=self.format,
        )
        self._committer.submit(job)
        return job

    def _writer_event(self, kind: str, fields: dict[str, Any]) -> None:
        extra: dict[str, Any] = {}
        step = int(fields.get("step", -1))
        if step in self._blocking:
            extra["blocking_s"] = self._blocking_of(step)
        if kind in ("checkpoint_failed", "checkpoint_skipped") and "phase" not in fields:
            extra["phase"] = "write"
        self.events.emit(EventKind(kind), **fields, **extra)
        if kind == "checkpoint_failed" and self.store is not None:
            try:
                step, shard = int(fields["step"]), int(fields["shard"])
                num, gen = int(fields["num_shards"]), int(fields["generation"])
            except (KeyError, TypeError, ValueError):
                return
            mark_failed(self.store.directory, step, shard, num, gen)

    def _announce(self, c: IntervalChoice) -> None:
        if c.interval_steps:
            log.warning("checkpoint interval: every %d steps (%s)", c.interval_steps, c.reason)
        else:
            log.warning("checkpoint interval: %s", c.reason)
        self.events.emit(
            EventKind.CHECKPOINT_INTERVAL,
            interval_steps=c.interval_steps,
            interval_s=c.interval_s,
            save_cost_s=c.save_cost_s,
            step_s=c.step_s,
            mtbf_s=c.mtbf_s,
            next_step=c.next_step,
            reason=c.reason,
            failures=c.failures,
            elapsed_s=c.elapsed_s,
        )

    def close(self) -> None:
        """Let the last save and commit finish (bounded by the commit timeout), then stop."""
        self.settle()
        deadline = time.monotonic() + self.config.commit_timeout_s
        if self._handle is not None:
            try:
                self._handle.wait(timeout=self.config.commit_timeout_s)
            except TimeoutError:
                log.warning("the last checkpoint save is still writing; cancelling it")
        if self.writer is not None:
            self.writer.close(wait=False)
        if self._committer is not None:
            self._committer.close(deadline)
