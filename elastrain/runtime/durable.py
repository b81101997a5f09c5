"""Durable checkpoints inside the elastic trainer: when, who writes, who commits, resume.

The storage layer (`elastrain.checkpoint`) knows files; this module knows the
step protocol. Its distributed contract:

- **When.** After committing the step that makes the committed step count
  ``n``, a checkpoint is due iff `Schedule.due(n)`. The schedule is *agreed
  state*: it changes only through values every member of the generation got
  from the same all-reduce (the step's gradient all-reduce carries each
  member's measured save cost and step time, see `Checkpointing.contribution`),
  and it travels with heals and checkpoints. So every member of a generation
  decides the same, whatever it measured itself.
- **Who writes.** Every member of the generation that committed that step
  takes `Snapshot.take(shard=rank, num_shards=len(members))` of the flattened
  state on its training thread (the only part the training loop waits for)
  and hands it to its own `CheckpointWriter`, which writes that stripe in the
  background. A member whose previous write is still running skips this one
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
- **Resume.** `load_resume`, on every worker at start before its first
  rendezvous, loads the checkpoint the launcher chose (or the newest verified
  one) into the model and optimizer; the trainer then reports that committed
  count at rendezvous, so the job goes on from there (members that are
  behind are healed from the ones that are not, as after any failure).

A checkpoint's *step* is the committed step count it holds (the next step to
run): ``step-00000020`` is the state after steps 0..19.
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
    CheckpointCorrupt,
    CheckpointWriter,
    CommitError,
    SaveHandle,
    Snapshot,
    VerifiedCheckpoint,
    apply_retention,
    commit,
    latest_verified,
    load,
    young_daly_interval,
)
from elastrain.checkpoint.files import MARKER, shard_manifest_name, step_dir
from elastrain.observe.events import EventLog
from elastrain.runtime.config import TrainerConfig
from elastrain.transfer import HealError, model_signature
from elastrain.transfer.dtypes import byte_view
from elastrain.transfer.flatten import Landing, install
from elastrain.transfer.manifest import (
    MODEL_PREFIX,
    build_manifest,
    check_model,
    check_optimizer,
    validate_manifest,
)

log = logging.getLogger("elastrain.checkpoint")

POLL_S = 0.05
"""How often the committer looks for the shard manifests of a pending checkpoint."""

CONTRIB_SLOTS = 7
"""Values each member adds to the step's all-reduce for the schedule:
save-cost sum, save-cost count, step-time sum, step-time count, time since
its previous commit (sum, count), and a failure flag (it joined a generation
formed after a failure since its previous commit)."""

StateFn = Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]]
"""Returns the flattened state (names -> live tensors) and its JSON meta."""


class ResumeError(RuntimeError):
    """The checkpoint to resume from cannot be loaded into this model and optimizer."""


# ---- the schedule (agreed state) ---------------------------------------------


@dataclass(frozen=True)
class IntervalChoice:
    """An automatic interval decision, for the log and the `checkpoint_interval` event."""

    interval_steps: int
    interval_s: float | None
    save_cost_s: float | None
    step_s: float | None
    mtbf_s: float
    next_step: int
    reason: str
    failures: int = 0
    elapsed_s: float = 0.0


@dataclass
class Schedule:
    """When checkpoints are due. Fixed (every ``every`` steps) or automatic (Young/Daly).

    Every field but ``every`` and ``mtbf_s`` is agreed state: identical on all
    members of a generation, carried in heal and checkpoint meta (`to_json`).
    Local and pure apart from its own fields; called on the training thread.
    """

    every: int
    mtbf_s: float | None
    last: int | None = None
    """Committed count of the last checkpoint that was due."""
    next: int | None = None
    """Automatic mode: the committed count at which the next one is due (None: not chosen)."""
    cost_s: float | None = None
    """Agreed blocking save cost: the members' mean of their last measured one."""
    step_s: float | None = None
    """Agreed step time: the members' mean of their last step's duration, smoothed
    (exponential moving average, weight 0.2 for the newest step)."""
    interval_steps: int | None = None
    """Automatic mode: the interval last chosen, in steps."""
    elapsed_s: float = 0.0
    """Agreed training time so far: per committed step, the members' mean time
    since their previous commit (recoveries included; carried over resumes)."""
    failures: int = 0
    """Agreed count of failures observed: committed steps that were the first
    after a generation was re-formed because of a failure."""

    _AGREED = ("last", "next", "cost_s", "step_s", "interval_steps", "elapsed_s", "failures")

    @property
    def automatic(self) -> bool:
        return self.mtbf_s is not None

    @property
    def periodic(self) -> bool:
        return self.every > 0 or self.automatic

    def due(self, n: int) -> bool:
        """Is a checkpoint due at committed count ``n``? Same answer on every member."""
        if n <= 0:
            return False
        if not self.automatic:
            return self.every > 0 and n % self.every == 0
        return self.next is not None and n >= self.next

    def absorb(self, values: list[float]) -> None:
        """Take the all-reduced `CONTRIB_SLOTS` values of the step just committed."""
        cost_sum, cost_n, step_sum, step_n, since_sum, since_n, failed = values
        if round(since_n) >= 1:
            self.elapsed_s += since_sum / round(since_n)
        if failed >= 0.5:
            self.failures += 1
        if round(cost_n) >= 1:
            self.cost_s = cost_sum / round(cost_n)
        if round(step_n) >= 1:
            mean = step_sum / round(step_n)
            # Smoothed (one step is noisy); every member computes the same from the same input.
            self.step_s = mean if self.step_s is None else 0.8 * self.step_s + 0.2 * mean

    def mtbf_estimate(self) -> float | None:
        """The MTBF the interval uses: the user's value as a prior worth one
        failure, updated with what this job observed (the mean of an
        exponential's gamma posterior): (given + elapsed) / (1 + failures).
        A job that runs long without failing trusts a longer MTBF; one that
        fails often, a shorter one."""
        if self.mtbf_s is None:
            return None
        return (self.mtbf_s + self.elapsed_s) / (1 + self.failures)

    def _mtbf_why(self, mtbf: float) -> str:
        assert self.mtbf_s is not None
        return (
            f"MTBF {mtbf:.4g} s = (given {self.mtbf_s:g} s + {self.elapsed_s:.4g} s trained) / "
            f"(1 + {self.failures} failure(s) observed)"
        )

    def plan(self, n: int) -> IntervalChoice | None:
        """Automatic mode: choose the next checkpoint if none is chosen; returns the
        choice when the interval changed (or on the first one), else None."""
        mtbf = self.mtbf_estimate()
        if mtbf is None or self.next is not None:
            return None
        if self.cost_s is None or not self.step_s:
            self.next = max(n, self.every or 1)
            if self.interval_steps is not None:
                return None
            self.interval_steps = 0
            return IntervalChoice(
                0,
                None,
                self.cost_s,
                self.step_s,
                mtbf,
                self.next,
                f"no save cost measured yet: the first checkpoint, at step {self.next}, "
                "measures it",
                self.failures,
                self.elapsed_s,
            )
        cost = max(self.cost_s, 1e-6)
        try:
            interval_s = young_daly_interval(mtbf, cost)
            why = (
                f"Young/Daly sqrt(2 x MTBF {mtbf:.4g} s x blocking save cost "
                f"{cost:.4g} s) = {interval_s:.3g} s"
            )
        except ValueError:
            interval_s = mtbf
            why = (
                f"blocking save cost {cost:.4g} s is not much below MTBF {mtbf:.4g} s "
                "(Young/Daly does not apply): one checkpoint per MTBF"
            )
        why += f"; {self._mtbf_why(mtbf)}"
        k = max(1, round(interval_s / self.step_s))
        why += f" = {k} steps of {self.step_s:.4g} s"
        self.next = max(n, (self.last or 0) + k)
        changed = k != self.interval_steps
        self.interval_steps = k
        if not changed:
            return None
        return IntervalChoice(
            k, interval_s, cost, self.step_s, mtbf, self.next, why, self.failures, self.elapsed_s
        )

    def taken(self, n: int) -> None:
        """Record that the checkpoint at ``n`` was due (whatever happened to the writes)."""
        self.last = n
        if self.automatic:
            self.next = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._AGREED}

    def load_json(self, d: dict[str, Any] | None) -> None:
        if not d:
            return
        for k in self._AGREED:
            if k in d:
                setattr(self, k, d[k])


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
    blocking_s: float
    deadline: float
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
            "checkpoint_failed",
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
            if failed and (accounted or late or stop_at is not None):
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
            marker = commit(
                self.config.directory,
                job.step,
                generation=job.generation,
                members=job.members,
                num_shards=job.num_shards,
                fsync=self.config.fsync,
            )
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
            "checkpoint_committed",
            step=job.step,
            generation=job.generation,
            members=job.members,
            num_shards=job.num_shards,
            bytes=job.total_bytes,
            path=str(marker.parent),
            blocking_s=job.blocking_s,
            wait_s=t0 - job.submitted,
            commit_s=commit_s,
        )
        with self._cond:
            older = [j for j in self._pending if j.step < job.step]
        for j in older:
            self.events.emit(
                "checkpoint_skipped",
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
    `after_commit`, `emergency`, `close`); the writer and committer threads
    it owns never touch the model. ``directory`` None disables everything
    (no run directory and no configured directory).
    """

    def __init__(
        self,
        config: TrainerConfig,
        directory: str | None,
        events: EventLog,
        member: str,
    ) -> None:
        self.config = config
        self.directory = directory
        self.events = events
        self.member = member
        self.schedule = Schedule(config.checkpoint_every, config.checkpoint_mtbf_s)
        self.store: CheckpointConfig | None = None
        self.writer: CheckpointWriter | None = None
        self._committer: _Committer | None = None
        if directory is not None:
            self.store = CheckpointConfig(
                directory=directory,
                keep_last=config.checkpoint_keep_last,
                keep_every=config.checkpoint_keep_every,
                fsync=config.checkpoint_fsync,
            )
            self.writer = CheckpointWriter(self.store, events=self._writer_event)
        self._snap: Snapshot | None = None
        self._handle: SaveHandle | None = None
        self._pending_cost: float | None = None
        self._last_step_s: float | None = None
        self._last_commit: float | None = None
        self._saw_failure = False
        self._blocking: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        """True when checkpoints can be written (a directory is known)."""
        return self.writer is not None

    # ---- schedule agreement (through the step's all-reduce) ----------------------

    def contribution(self) -> list[float]:
        """This member's `CONTRIB_SLOTS` values for the coming all-reduce: its save
        cost measured since the last committed step (if any) and its last step time."""
        cost = self._pending_cost
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
        if reason == "failure":
            self._saw_failure = True

    def absorb(self, values: list[float]) -> None:
        """After a commit: fold in the all-reduced values (identical on every member)."""
        self._pending_cost = None
        self._last_commit = time.monotonic()
        self._saw_failure = False
        self.schedule.absorb(values)

    # ---- saving ------------------------------------------------------------------

    def after_commit(self, n: int, gen: int, members: list[str], rank: int, state: StateFn) -> bool:
        """Take this member's shard of checkpoint ``n`` if one is due; returns whether it was due.

        Called by every member right after committing the step that made its
        committed count ``n``. Blocks only for the snapshot copy.
        """
        choice = self.schedule.plan(n)
        if choice is not None and rank == 0:
            self._announce(choice)
        if not self.schedule.due(n):
            return False
        self.schedule.taken(n)
        if not self.enabled:
            return True
        assert self.writer is not None
        if self.writer.busy:
            log.warning(
                "checkpoint step %d skipped by %s: its previous save is still writing",
                n,
                self.member,
            )
            self.events.emit(
                "checkpoint_skipped",
                step=n,
                shard=rank,
                phase="snapshot",
                reason="previous save still writing",
            )
            assert self.directory is not None
            mark_failed(self.directory, n, rank, len(members), gen)
            return True
        self._save(n, gen, members, rank, state, deadline=None)
        return True

    def emergency(
        self, n: int, gen: int, members: list[str], rank: int, state: StateFn, deadline: float
    ) -> bool:
        """Write checkpoint ``n`` now and wait until it is durable (rank 0: committed),
        no later than ``deadline`` (monotonic). Every member of the generation
        calls it after committing the same step. Returns True on success."""
        if not self.enabled:
            log.warning("no checkpoint directory: cannot take the emergency checkpoint")
            return False
        if self._handle is not None and not self._handle.done():
            try:
                self._handle.wait(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.events.emit(
                    "checkpoint_failed",
                    step=n,
                    shard=rank,
                    phase="snapshot",
                    emergency=True,
                    error="the previous save did not finish within the grace period",
                )
                return False
        job = self._save(n, gen, members, rank, state, deadline=deadline, emergency=True)
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

    def _save(
        self,
        n: int,
        gen: int,
        members: list[str],
        rank: int,
        state: StateFn,
        *,
        deadline: float | None,
        emergency: bool = False,
    ) -> _CommitJob | None:
        assert self.writer is not None and self.store is not None
        t0 = time.perf_counter()
        try:
            tensors, meta = state()
            snap = Snapshot.take(
                tensors, meta, shard=rank, num_shards=len(members), into=self._snap
            )
        except Exception as e:  # noqa: BLE001 - a checkpoint failure must not stop training
            log.error("checkpoint step %d: snapshot failed: %s", n, e)
            mark_failed(self.store.directory, n, rank, len(members), gen)
            self.events.emit(
                "checkpoint_failed",
                step=n,
                shard=rank,
                phase="snapshot",
                emergency=emergency,
                error=f"{type(e).__name__}: {e}"[:500],
            )
            return None
        blocking = time.perf_counter() - t0
        self._blocking = {n: blocking}
        self._snap = snap
        self._handle = self.writer.save_async(n, snap, generation=gen, members=list(members))
        self._pending_cost = blocking
        if self._handle.done() and self._handle.wait().status == "skipped":
            return None
        if rank != 0:
            return None
        if self._committer is None:
            self._committer = _Committer(self.store, self.events, self.member)
        limit = time.monotonic() + self.config.checkpoint_commit_timeout_s
        job = _CommitJob(
            step=n,
            generation=gen,
            members=list(members),
            num_shards=len(members),
            total_bytes=snap.layout.total,
            blocking_s=blocking,
            deadline=limit if deadline is None else min(limit, deadline),
        )
        self._committer.submit(job)
        return job

    def _writer_event(self, kind: str, fields: dict[str, Any]) -> None:
        extra: dict[str, Any] = {}
        blocking = self._blocking.get(int(fields.get("step", -1)))
        if blocking is not None:
            extra["blocking_s"] = blocking
        if kind in ("checkpoint_failed", "checkpoint_skipped"):
            extra["phase"] = "write"
        self.events.emit(kind, **fields, **extra)
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
            "checkpoint_interval",
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
        deadline = time.monotonic() + self.config.checkpoint_commit_timeout_s
        if self._handle is not None:
            try:
                self._handle.wait(timeout=self.config.checkpoint_commit_timeout_s)
            except TimeoutError:
                log.warning("the last checkpoint save is still writing; cancelling it")
        if self.writer is not None:
            self.writer.close(wait=False)
        if self._committer is not None:
            self._committer.close(deadline)


# ---- resume ----------------------------------------------------------------------


def install_checkpoint(
    tensors: dict[str, torch.Tensor],
    optimizer_section: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    where: str,
) -> None:
    """Make loaded checkpoint tensors the live model and optimizer state (local).

    Checks the checkpoint against this model and optimizer first (names,
    shapes, dtypes, optimizer class and groups), like a heal does; raises
    ResumeError naming ``where`` without touching the state if it does not fit.
    """
    m = build_manifest(list(tensors.items()), optimizer_section, [0], {}, 0)
    try:
        validate_manifest(m, [0])
        check_model(m, model_signature(model))
        check_optimizer(m, optimizer)
    except HealError as e:
        raise ResumeError(
            f"checkpoint {where} does not fit this model/optimizer: {e}. "
            "Resume with the same script, or start in a fresh --run-dir."
        ) from e
    landing = Landing.allocate(m.entries)
    for ent in m.entries:
        if ent.nbytes:
            if ent.name.startswith(MODEL_PREFIX):
                landing.target(ent, ent.offset, ent.nbytes).copy_(byte_view(tensors[ent.name]))
            else:
                landing.optim[ent.name] = tensors[ent.name]
    try:
        install(m.entries, landing, m.optimizer, model, optimizer)
    except HealError as e:
        raise ResumeError(f"checkpoint {where}: {e}") from e


_DICT = "$dict"


def ordered_json(value: Any) -> Any:
    """Encode JSON ``value`` so that dict key order survives canonical (sorted) JSON.

    Checkpoint meta is stored with sorted keys, but the order of an optimizer's
    state keys decides the order of its tensors when the state is flattened
    again (the next checkpoint's layout, the state hash). Dicts become
    ``{"$dict": [[key, value], ...]}``; `from_ordered_json` undoes it.
    """
    if isinstance(value, dict):
        return {_DICT: [[k, ordered_json(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [ordered_json(v) for v in value]
    return value


def from_ordered_json(value: Any) -> Any:
    """Inverse of `ordered_json`."""
    if isinstance(value, dict):
        if set(value) == {_DICT}:
            return {str(k): from_ordered_json(v) for k, v in value[_DICT]}
        return {k: from_ordered_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_ordered_json(v) for v in value]
    return value


def parse_resume(value: str | None, default: str) -> str | int:
    """The resume mode from $ELASTRAIN_RESUME: "none", "latest" or a step number."""
    v = (value or default).strip().lower()
    if v in ("none", "latest"):
        return v
    if v.isdigit():
        return int(v)
    raise ValueError(f"ELASTRAIN_RESUME must be 'none', 'latest' or a step number, got {value!r}")


def load_resume(
    directory: str | None, mode: str | int
) -> tuple[VerifiedCheckpoint, dict[str, torch.Tensor], dict[str, Any]] | None:
    """Find and read the checkpoint to resume from: ``(checkpoint, tensors, meta)`` or None.

    Who calls: every worker at start, before its first rendezvous (local,
    blocking, reads the checkpoint once). ``mode`` "none": None. A step
    number: exactly that checkpoint (the launcher chose and verified it and
    discarded newer ones); RuntimeError if it is not the newest committed one
    any more. "latest": the newest checkpoint that verifies; one that fails
    verification is skipped with a warning naming the file.
    """
    if mode == "none" or directory is None:
        return None
    if isinstance(mode, int):
        ckpt = latest_verified(directory, verify_checksums=False)
        if ckpt is None or ckpt.step != mode:
            raise RuntimeError(
                f"the launcher chose checkpoint step {mode} in {directory}, but the newest "
                f"committed one is {ckpt.step if ckpt else 'none'}; was the directory changed?"
            )
        tensors, meta = load(ckpt)  # checks every CRC-32 while reading
        return ckpt, tensors, meta
    for attempt in range(3):
        ckpt = latest_verified(directory, verify_checksums=attempt > 0)
        if ckpt is None:
            return None
        try:
            tensors, meta = load(ckpt)
        except (CheckpointCorrupt, OSError) as e:
            log.warning("checkpoint %s could not be loaded (%s); looking again", ckpt.path, e)
            continue
        return ckpt, tensors, meta
    raise RuntimeError(f"no checkpoint in {directory} could be loaded after 3 attempts")


def resolve_directory(
    configured: str | None, env_dir: str | None, run_dir: str | None
) -> str | None:
    """The checkpoint directory: the launcher's, else the configured one, else <run_dir>/checkpoints."""
    if env_dir:
        return env_dir
    if configured:
        return configured
    if run_dir:
        return str(Path(run_dir) / "checkpoints")
    return None
