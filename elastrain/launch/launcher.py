"""The local launcher behind `elastrain run`: coordinator + N workers on this machine.

It starts the coordinator as a process of its own, spawns the workers with the
coordinator's address and the job token in their environment, tells the
coordinator at once when a child exits, replaces dead workers after
`replace_delay_s` (the stand-in for scheduling a pod), fires the fault
schedule, shows progress, and shuts everything down on Ctrl-C. Everything
about the run lands in the run directory.

Durable state: before spawning anyone, the launcher picks the checkpoint to
resume from in ``<run_dir>/checkpoints`` (the newest that verifies; damaged
ones are skipped with a warning naming the file) and clears the step
directories newer than it, so running `elastrain run` again on the same run
directory continues the job.

Coordinator restarts: the coordinator's state is soft. If its process dies,
the launcher starts a new one on the same ports with the same job id; workers
keep training meanwhile, register again and the new coordinator adopts their
generation (see elastrain.control.quorum). Exits seen while it was down are
reported to the new one. SIGTERM to the launcher (a preemption notice for
the whole job) asks the coordinator to have every member take one emergency
checkpoint at the next step boundary; the launcher waits for the workers to
exit within the grace period, then stops everything.
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastrain import env
from elastrain.checkpoint.files import CHECKPOINTS
from elastrain.children import spawn_env
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError
from elastrain.exitcodes import EXIT_DEVICE_POISONED, EXIT_LEFT, EXIT_PREEMPTED, EXIT_REFUSED
from elastrain.exitrecord import read_record
from elastrain.launch import faults
from elastrain.launch.config import LaunchConfig
from elastrain.launch.devices import DevicePool
from elastrain.launch.faults import FaultView, SimHosts
from elastrain.launch.lock import RunDirLock, child_umask, make_run_dir, write_private
from elastrain.launch.prefork import Preforker, Proc
from elastrain.launch.refill import Refill, refill_at, refill_due
from elastrain.launch.replicas import ReplicaBook, expelled, free_address, stop_mates
from elastrain.launch.resume import (
    NO_CHECKPOINT,
    choose_checkpoint,
    newest_checkpoint_note,
    plain_start,
)
from elastrain.launch.startup import FailureWatch, Stop, read_exit, stop_fields, stop_text
from elastrain.observe.events import EventKind, EventLog, EventTail
from elastrain.observe.stragglers import StragglerScores, choose_evictions
from elastrain.observe.tensorboard import TensorBoardSink

__all__ = ["CHECKPOINTS", "LaunchConfig", "Launcher", "RunResult"]


EXIT_READ_POLL_S = 0.02
"""How often a replacement's start held for unread exits asks again (`_hold_spawn`)."""
EXIT_READ_WAIT_S = 2.0
"""The longest a replacement's start waits for exits already happening to be read: a
reaper queues a worker's exit as it dies, so this bound is never met but by a bug."""


class _Failed(Exception):
    """The job cannot go on; the message says why and what to do."""


@dataclass
class Worker:
    member: str
    proc: Proc
    started: float
    replacement: bool
    stopped: bool = False


@dataclass
class RunResult:
    status: str
    """"done", "interrupted" or "failed"."""
    run_dir: Path
    pids: dict[str, list[int]]
    """member -> PIDs it had (one unless it was replaced under the same id, which we never do)."""
    steps: int
    message: str = ""
    resumed_from: int | None = None
    """The checkpoint step the job resumed from (None: it started from scratch)."""


class Launcher:
    """Runs one job to completion. `run()` blocks; `stop()` (any thread) ends it."""

    def __init__(
        self, config: LaunchConfig, on_status: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.config = config
        self.job_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        self.run_dir = Path(config.run_dir or Path("runs") / self.job_id).resolve()
        make_run_dir(self.run_dir, config.group_readable)
        self.agent = config.coordinator is not None
        # Local mode: one launcher per run directory (agents of a job may share one).
        self._lock = None if self.agent else RunDirLock(self.run_dir)
        self._umask = child_umask(config.group_readable)
        self.prefork: Preforker | None = None
        """The prefork server the workers are forked from (`elastrain.launch.prefork`)."""
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if config.token:
            self.token = config.token
        else:
            self.token = secrets.token_hex(16)
            write_private(self.run_dir / "token", self.token)
        self.events = EventLog(self.run_dir, f"agent-{config.name}" if self.agent else "launcher")
        self.on_status = on_status
        self.workers: dict[str, Worker] = {}
        self.pids: dict[str, list[int]] = {}
        self.exits: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self._next_id = 0
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._spawn_held: dict[Any, float] = {}
        """A replacement's start held for unread exits: since when (`_hold_spawn`)."""
        self._stop = threading.Event()
        self._fast_failures = 0
        self.failures = FailureWatch(
            config.max_same_error, config.max_replacements, config.replacement_window_s
        )
        """When replacing cannot help (`elastrain.launch.startup`)."""
        self._stopped_by: dict[str, Any] = {}
        """The failure watch's stop, for the job_end event (cause, count, error_*)."""
        self._deaths_injected = True
        """Every worker exit since a live member last held the state was a kill the
        fault schedule injected, or a leave (the whole-job-death rule exempts those)."""
        self._holders: set[str] = set()
        """Members a status showed in a ready generation: they hold the training state
        (a fresh replacement or a standby does not until then; see `_job_died`)."""
        self.checkpoint_dir = self.run_dir / CHECKPOINTS
        self.injector = faults.injector_for(
            config.faults,
            config.seed,
            faults.JobHandles(
                events=self.events,
                run_dir=self.run_dir,
                checkpoint_dir=self.checkpoint_dir,
                at=self._at,
                host_of=self._host_of,
            ),
        )
        self.net: SimHosts | None = None
        """The simulated hosts (--hosts), while the job runs."""
        self._slot: dict[str, int] = {}
        """Member -> index of the simulated host it runs on (a replacement takes
        the host of the member it replaces, as a rescheduled pod would)."""
        self.replicas = (
            ReplicaBook(
                config.replica_procs,
                config.workers // config.replica_procs,
                lambda: free_address(config.advertise_host or "127.0.0.1"),
            )
            if config.replica_procs > 1
            else None
        )
        """Multi-process JAX replicas (--replica-procs): who belongs to which."""
        self.device_pool = DevicePool(config.devices) if config.devices else None
        """Which local device each worker uses (--devices; `elastrain.launch.devices`)."""
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.client: CoordinatorClient | None = None
        self.status: dict[str, Any] = {}
        self.done_members: set[str] = set()

        self.resume_step: int | None = None
        self.plain_step: int | None = None
        """The step of the plain DCP checkpoint the job starts from (--resume-from)."""
        self._preempt_asked = threading.Event()
        self._drain_asked = threading.Event()
        self._draining = False
        self._preempt_deadline: float | None = None
        self._coordinator_bind: tuple[str, int, int] | None = None
        """(host, port, store port) of the first coordinator; restarts reuse them."""
        self._coordinator_deaths: list[float] = []
        self._max_gen = 0
        """The highest generation any coordinator of this job reported (a restarted
        one numbers after it: a status read between two quick restarts says 0)."""
        self._unreported_exits: list[p.ExitRequest] = []
        self._stragglers: tuple[EventTail, StragglerScores] | None = None
        """--evict-stragglers: the run's events as they come, and the scores."""
        self._evicting: set[str] = set()
        """Members sent SIGTERM as stragglers that have not exited yet."""
        self._refills: list[Refill] = []
        """Replacements of members whose slot a hot spare took, waiting for the
        job to move on before they start (`elastrain.launch.refill`)."""
        self._claimed: set[str] = set()
        """Standbys a death has counted on (`_spare_for`) that a status has not yet
        shown promoted: one spare backs one death, however stale the status."""

    # ---- processes -------------------------------------------------------------

    def _start_coordinator(self) -> None:
        c = self.config
        bind = []
        if self._coordinator_bind is not None:
            host, port, store_port = self._coordinator_bind
            # Same ports; generation numbers go on after the highest one seen,
            # even if no worker that ran one is left to report it.
            bind = ["--bind", f"{host}:{port}", "--store-port", str(store_port)]
            bind += ["--gen-floor", str(self._max_gen)]
        elif self.net is not None:
            bind = ["--bind", f"{self.net.coord.addr}:0"]  # where the hosts can reach it
        cmd = [
            sys.executable,
            "-m",
            "elastrain.control.server",
            "--run-dir",
            str(self.run_dir),
            "--job-id",
            self.job_id,
            "--target",
            str(c.workers),
            "--min",
            str(c.min_workers),
            "--lease",
            str(c.lease_s),
            "--suspect",
            str(c.suspect_s),
            "--hang-silence",
            str(c.hang_silence_s),
            *c.coordinator_policy_args(),
            *bind,
        ]
        log = open(self.run_dir / "logs" / "coordinator.log", "ab")  # noqa: SIM115
        e = dict(os.environ)
        e[env.TOKEN] = self.token
        # Its stdout is a pipe read once (where it listens): keep events off it.
        e.pop(env.EVENTS_STDOUT, None)
        self.coordinator = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=log,
            env=spawn_env(e),  # dies with the launcher
            start_new_session=True,
            umask=self._umask,
        )
        assert self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the coordinator did not start; see {self.run_dir / 'logs' / 'coordinator.log'}"
            )
        info = json.loads(line)
        self.address = f"{info['host']}:{info['port']}"
        self._coordinator_bind = (info["host"], int(info["port"]), int(info["store_port"]))
        if self.client is None:
            self.client = CoordinatorClient(self.address, self.token, timeout_s=5.0)

    def _on_coordinator_exit(self) -> None:
        """Status 0 means it was told to end (SIGTERM: the whole job is being
        preempted, see elastrain.control.server): end the job the same way.
        Anything else is a crash: restart it."""
        assert self.coordinator is not None
        if self.coordinator.returncode != 0:
            self._restart_coordinator()
            return
        if not self._preempt_asked.is_set():
            self.events.emit(EventKind.COORDINATOR_EXITED, pid=self.coordinator.pid, returncode=0)
            print(
                "elastrain: the coordinator was terminated: the job is being preempted",
                file=sys.stderr,
                flush=True,
            )
            self.preempt()
        self.coordinator = None

    def _restart_coordinator(self) -> None:
        """The coordinator died: start a new one on the same ports (blocks until it listens)."""
        assert self.coordinator is not None
        rc = self.coordinator.returncode
        now = time.monotonic()
        injected = self.coordinator.pid in self.injector.killed
        # Kills the fault schedule injected are not a crash loop.
        recent = [t for t in self._coordinator_deaths if now - t < 600]
        self._coordinator_deaths = recent if injected else [*recent, now]
        self.events.emit(EventKind.COORDINATOR_EXITED, pid=self.coordinator.pid, returncode=rc)
        if len(self._coordinator_deaths) > self.config.max_coordinator_restarts:
            raise _Failed(
                f"the coordinator died {len(self._coordinator_deaths)} times in 10 minutes "
                f"(last exit code {rc}); see {self.run_dir / 'logs' / 'coordinator.log'}"
            )
        print(
            f"elastrain: the coordinator exited ({rc}); restarting it on {self.address}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._start_coordinator()
        except (RuntimeError, OSError, ValueError) as e:
            raise _Failed(f"could not restart the coordinator: {e}") from e
        assert self.coordinator is not None
        self.events.emit(
            EventKind.COORDINATOR_RESTARTED,
            pid=self.coordinator.pid,
            down_s=time.monotonic() - now,
            restarts=len(self._coordinator_deaths),
        )
        pending, self._unreported_exits = self._unreported_exits, []
        for req in pending:
            self._report_exit(req)

    def _report_exit(self, req: p.ExitRequest) -> None:
        if self.client is None:
            return
        try:
            self.client.exit(req)
        except CoordinatorError:
            # Down (restarting): tell the next one, so it need not wait out a lease.
            self._unreported_exits.append(req)

    def _spawn(
        self, replacement: bool, replaces: str | None = None, replaces_pid: int | None = None
    ) -> Worker | None:
        c = self.config
        member = f"{c.name}-w{self._next_id}" if c.name else f"w{self._next_id}"
        device: dict[str, str] = {}
        if self.device_pool is not None:
            if self.device_pool.take(member, replaces) is None:
                msg = (
                    f"no healthy device is free for a replacement of {replaces} (devices "
                    f"{','.join(self.device_pool.devices)}; failed: "
                    f"{','.join(sorted(self.device_pool.failed)) or 'none'}): not replaced"
                )
                print(f"elastrain: {msg}", file=sys.stderr, flush=True)
                self.events.emit(EventKind.WORKER_NOT_PLACED, replaces=replaces, message=msg)
                return None
            device = self.device_pool.env(member)
        self._next_id += 1
        e = dict(os.environ)
        e.update(c.extra_env)
        e.update(device)
        e.update(
            {
                env.COORDINATOR: self.address,
                env.TOKEN: self.token,
                env.MEMBER_ID: member,
                env.RUN_DIR: str(self.run_dir),
            }
        )
        if c.advertise_host:
            e[env.ADVERTISE_HOST] = c.advertise_host
        # The worker entry point maps a WorkerExit to the exit status and installs hooks.
        argv = [sys.executable, "-m", "elastrain.worker", c.script, *c.script_args]
        if self.net is not None:
            slot = self._slot.get(replaces or "", len(self._slot) % len(self.net.hosts))
            self._slot[member] = slot
            host = self.net.hosts[slot]
            e[env.ADVERTISE_HOST] = host.addr
            argv = [*self.net.exec_prefix(host), *argv]  # execs: the PID stays the worker's
        if c.steps is not None:
            e[env.STEPS] = str(c.steps)
        if c.shard_size is not None:
            e[env.SHARD_SIZE] = str(c.shard_size)
        if self.replicas is not None:
            e.update(self.replicas.place_for(member).environ())
        e[env.CKPT_DIR] = str(self.checkpoint_dir)
        if c.checkpoint_every is not None:
            e[env.CKPT_EVERY] = str(c.checkpoint_every)
        if c.checkpoint_mtbf_s is not None:
            e[env.CKPT_MTBF] = repr(c.checkpoint_mtbf_s)
        if c.checkpoint_format is not None:
            e[env.CKPT_FORMAT] = str(c.checkpoint_format)
        if c.heal_auth is not None:
            e[env.HEAL_AUTH] = str(c.heal_auth)
        if replacement or self.agent:
            # Peers heal it if they are further; if every worker died, it is the state.
            e[env.RESUME] = "latest"
        else:
            e[env.RESUME] = "none" if self.resume_step is None else str(self.resume_step)
        if c.resume_from is not None and self.plain_step is not None:
            # Replacements too: with no elastrain checkpoint yet, it is the state.
            e[env.RESUME_FROM] = str(Path(c.resume_from).resolve())
            e[env.RESUME_STEP] = str(self.plain_step)
        if c.fault_points:
            e[env.FAULTS] = c.fault_points
        log_path = self.run_dir / "logs" / f"{member}.log"
        proc: Proc | None = None
        if self.prefork is not None and self.net is None:
            proc = self.prefork.spawn(
                [c.script, *c.script_args], e, os.getcwd(), log_path, self._umask
            )
        forked = proc is not None
        if proc is None:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Workers die with their launcher (or agent), as they would with their node.
                    env=spawn_env(e),
                    start_new_session=True,
                    umask=self._umask,
                )
        w = Worker(member, proc, time.monotonic(), replacement)
        self.workers[member] = w
        self.pids.setdefault(member, []).append(proc.pid)
        self.events.emit(
            EventKind.WORKER_SPAWNED,
            member=member,
            pid=proc.pid,
            replacement=replacement,
            replaces=replaces,
            replaces_pid=replaces_pid,
            forked=forked,
            **({} if self.net is None else {"host": self.net.hosts[self._slot[member]].name}),
            **({"device": device[env.VISIBLE_DEVICES]} if device else {}),
        )
        threading.Thread(target=self._reap, args=(w,), daemon=True, name=f"reap-{member}").start()
        return w

    def _reap(self, w: Worker) -> None:
        rc = w.proc.wait()
        self.exits.put((w.member, w.proc.pid, rc))

    def _at(self, delay_s: float, what: str, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (time.monotonic() + delay_s, self._seq, what, arg))

    # ---- main loop -------------------------------------------------------------

    def run(self) -> RunResult:
        """Run the job to its end (see the module docstring). With --hosts, the
        simulated hosts are built first and this thread (with the coordinator
        and every thread it starts) moves into their switch's namespace until
        the job is over; they are deleted after it."""
        if not self.config.hosts:
            return self._run()
        try:
            hosts = faults.plugin("simulated hosts (--hosts)").hosts(self.config.hosts)
        except (RuntimeError, OSError, ValueError) as e:
            msg = f"cannot build {self.config.hosts} simulated hosts (--hosts): {e}"
            self.events.emit(EventKind.JOB_END, status="failed", steps=0, message=msg)
            self.events.close()
            if self._lock is not None:
                self._lock.release()
            return RunResult("failed", self.run_dir, self.pids, 0, msg, None)
        with hosts as net:
            self.net = net
            try:
                return self._run()
            finally:
                self.net = None

    def _tensorboard(self, logdir: str) -> TensorBoardSink:
        """The job's one TensorBoard writer (--tensorboard), following the run's
        events from now on; _Failed if tensorboard is not installed."""
        try:
            sink = TensorBoardSink(self.run_dir, logdir)
        except (ImportError, OSError) as e:
            raise _Failed(f"{e}") from e
        sink.start()
        return sink

    def _run(self) -> RunResult:
        c = self.config
        self.events.emit(
            EventKind.JOB_START,
            job_id=self.job_id,
            target=c.workers,
            min=c.min_workers,
            script=c.script,
        )
        status, message = "failed", ""
        previous = None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM to the launcher: a preemption notice for the whole job;
            # to an agent: its node is going away, its workers leave.
            previous = signal.signal(
                signal.SIGTERM, lambda *_: self.drain() if self.agent else self.preempt()
            )
        sink = None
        try:
            if c.prefork and self.net is None:
                # Its imports run while the coordinator starts (on this thread: the
                # server's death signal is tied to the thread that starts it).
                self.prefork = Preforker()
                self.prefork.start(
                    {**os.environ, **c.extra_env},
                    self.run_dir / "logs" / "prefork.log",
                    self._umask,
                )
            if c.tensorboard is not None:
                sink = self._tensorboard(c.tensorboard)
            if self.agent:
                assert c.coordinator is not None
                self.address = c.coordinator
                self.client = CoordinatorClient(self.address, self.token, timeout_s=5.0)
                self._prepare_plain()
            else:
                try:
                    self._prepare_resume()
                except OSError as e:
                    raise _Failed(
                        f"cannot prepare the checkpoint directory {self.checkpoint_dir} for "
                        f"resuming: {e}"
                    ) from e
                self._start_coordinator()
            for _ in range(c.workers + c.spares):
                self._spawn(replacement=False)
            status, message = self._loop()
        except _Failed as e:
            status, message = "failed", str(e)
        except KeyboardInterrupt:
            status, message = "interrupted", "interrupted by Ctrl-C"
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self._stopped_by and self.workers:
                # The failure watch stopped the job: the members' leaves as they are
                # stopped are on purpose, not more failures (`recognise_failures`).
                self.events.emit(EventKind.DRAIN, members=sorted(self.workers), reason="stopped")
            self._shutdown()
            self.events.emit(
                EventKind.JOB_END,
                status=status,
                steps=self.status.get("step", 0),
                message=message,
                **self._stopped_by,
            )
            if sink is not None:
                try:
                    sink.close()
                except Exception as e:  # noqa: BLE001 - the job's end must still be recorded
                    print(f"elastrain: warning: --tensorboard: {e}", file=sys.stderr, flush=True)
            self.events.close()
            if self._lock is not None:
                self._lock.release()
        return RunResult(
            status,
            self.run_dir,
            self.pids,
            int(self.status.get("step", 0)),
            message,
            self.resume_step if self.resume_step is not None else self.plain_step,
        )

    def stop(self) -> None:
        self._stop.set()

    def drain(self) -> None:
        """Agent mode: this node is leaving (any thread, signal-safe). Its workers
        get SIGTERM (a graceful leave: the job goes on without them), nobody is
        replaced, and the agent ends once they have exited."""
        self._drain_asked.set()

    def preempt(self) -> None:
        """The whole job is being preempted (what SIGTERM does; any thread, signal-safe).

        The main loop asks the coordinator to have every member take one
        emergency checkpoint at the next step boundary and exit, stops
        replacing workers, and ends the job once every worker has exited or
        the grace period (minus a margin for stopping stragglers) is over.
        A second call stops the job at once.
        """
        if self._preempt_asked.is_set():
            self._stop_reason = ("interrupted", "terminated by a second SIGTERM")
            self._stop.set()
        self._preempt_asked.set()

    def _prepare_resume(self) -> None:
        if self.config.resume_from is not None:
            note = newest_checkpoint_note(self.checkpoint_dir)
            if note != NO_CHECKPOINT:
                raise _Failed(
                    f"--resume-from {self.config.resume_from}: this run directory already "
                    f"has its own checkpoints ({note}); run without --resume-from to resume "
                    "them, or use a fresh --run-dir to start from the DCP checkpoint"
                )
        self.resume_step = choose_checkpoint(self.checkpoint_dir, self.events)
        self._prepare_plain()

    def _prepare_plain(self) -> None:
        """--resume-from: check the directory and learn its step before any worker
        starts (the workers check it against the model)."""
        c = self.config
        if c.resume_from is None:
            return
        from elastrain.checkpoint.plain import PlainCheckpointError  # imports torch

        try:
            self.plain_step = plain_start(c.resume_from, c.resume_step, self.events)
        except PlainCheckpointError as e:
            raise _Failed(f"--resume-from: {e}") from None

    def _newest_checkpoint(self) -> str:
        return newest_checkpoint_note(self.checkpoint_dir)

    def _begin_preempt(self) -> None:
        c = self.config
        margin = min(5.0, 0.2 * c.grace_s)
        self._preempt_deadline = time.monotonic() + c.grace_s - margin
        self.events.emit(EventKind.PREEMPT_NOTICE, grace_s=c.grace_s)
        print(
            f"elastrain: SIGTERM: emergency checkpoint, then exit (grace {c.grace_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        if self.client is not None and self.coordinator is not None:
            try:
                self.client.preempt(p.PreemptRequest(c.grace_s - margin))
            except CoordinatorError as e:
                print(f"elastrain: could not notify the coordinator: {e}", file=sys.stderr)

    def _loop(self) -> tuple[str, str]:
        last_status = 0.0
        while not self._stop.is_set():
            if self._drain_asked.is_set() and not self._draining:
                self._draining = True
                self.events.emit(EventKind.DRAIN, members=sorted(self.workers))
                for w in self.workers.values():
                    if w.proc.poll() is None:
                        w.proc.send_signal(signal.SIGTERM)
            if self._preempt_asked.is_set() and self._preempt_deadline is None:
                self._begin_preempt()
            if self._preempt_deadline is not None:
                if not self.workers:
                    return "preempted", "preempted (SIGTERM): " + self._newest_checkpoint()
                if time.monotonic() >= self._preempt_deadline:
                    return "preempted", (
                        f"preempted (SIGTERM): grace period over with "
                        f"{', '.join(sorted(self.workers))} still running"
                    )
            try:
                member, pid, rc = self.exits.get(timeout=0.1)
                r = self._on_exit(member, pid, rc)
                if r is not None:
                    return r
            except queue.Empty:
                pass
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, what, arg = heapq.heappop(self._timers)
                self._on_timer(what, arg)
            if self._refills:
                self._start_due_refills(now)
            if self.coordinator is not None and self.coordinator.poll() is not None:
                self._on_coordinator_exit()
            if now - last_status >= 0.25:
                last_status = now
                self._poll_status()
                if self.config.evict_stragglers:
                    self._evict_stragglers()
            if (
                not self.workers
                and not self._refills
                and not any(t[2] == "spawn" for t in self._timers)
            ):
                if self._draining:
                    return "drained", "SIGTERM: this node's workers left the job"
                # _preempt_asked too: an agent whose last worker exited 76 in this very
                # iteration has not begun its preemption yet, and was preempted all the same.
                if self._preempt_deadline is not None or self._preempt_asked.is_set():
                    return "preempted", "preempted (SIGTERM): " + self._newest_checkpoint()
                if self.status.get("finished") or self.done_members:
                    return "done", ""
                return "failed", "no workers left"
        return getattr(self, "_stop_reason", ("interrupted", "stopped"))

    def _on_exit(self, member: str, pid: int, rc: int) -> tuple[str, str] | None:
        w = self.workers.pop(member, None)
        if self.device_pool is not None:
            self.device_pool.release(member, poisoned=rc == EXIT_DEVICE_POISONED)
        err = read_record(self.run_dir, member, pid) if rc > 0 else None
        error = err.fields() if err is not None else {}
        self.events.emit(EventKind.WORKER_EXITED, member=member, pid=pid, returncode=rc, **error)
        self._report_exit(p.ExitRequest(member, pid, rc, **error))
        if rc == 0:
            if not self.done_members:
                # The job is finishing: members still alive get a grace period to finish too.
                self._at(15.0, "finish", None)
            self.done_members.add(member)
            return None
        if w is not None and w.stopped:
            return None
        if self._preempt_deadline is not None or self._draining:
            return None  # the job (or this node) is ending: nobody is replaced
        if rc == EXIT_PREEMPTED:
            # Members exit so only on a whole-job preemption notice (from the
            # coordinator, which got SIGTERM itself): end the job with them.
            if not self._preempt_asked.is_set():
                self.preempt()
            return None
        if rc == EXIT_REFUSED:
            return "failed", f"{member} was refused by the coordinator; see logs/{member}.log"
        killed = pid in self.injector.killed
        ex = read_exit(self.run_dir, member, pid, rc, time.monotonic(), killed, err)
        # A leave or an injected kill is no failure of the job's own.
        self._deaths_injected = self._deaths_injected and not FailureWatch.costs_a_replacement(ex)
        stop = self.failures.on_exit(ex)
        if stop is not None:
            return "failed", self._stop_text(stop)
        if (
            w is not None
            and time.monotonic() - w.started < 10
            and rc != EXIT_LEFT
            and pid not in self.injector.killed
        ):
            self._fast_failures += 1
            if self._fast_failures >= self.config.max_fast_failures:
                return "failed", (
                    f"{self._fast_failures} workers in a row died within 10 s of "
                    f"starting; see {self.run_dir}/logs/{member}.log"
                )
        else:
            self._fast_failures = 0
        mates = self._replica_lost(member)
        if self.config.replace and not self.status.get("finished") and not self.done_members:
            stop = self.failures.on_replace(ex)
            if stop is not None:
                return "failed", self._stop_text(stop)
            delay = self.injector.replace_delay(pid, self.config.replace_delay_s)
            spare = self._spare_for(member)
            if spare is not None:
                # The spare takes the slot; its refill must not slow the recovery.
                self._claimed.add(spare)
                refill = refill_at(member, pid, self._progress_now(), time.monotonic(), delay)
                self._refills.append(refill)
            else:
                self._at(delay, "spawn", (member, pid))
                for mate, mate_pid in mates:  # the whole replica is rebuilt
                    self._at(delay, "spawn", (mate, mate_pid))
        return None

    def _replica_lost(self, member: str) -> list[tuple[str, int]]:
        """A worker of a multi-process replica failed: its mates are stopped
        (`replicas.stop_mates`); returns them, for the replica's rebuild."""
        return [] if self.replicas is None else stop_mates(self.replicas, member, self.workers)

    def _stop_text(self, stop: Stop) -> str:
        """The console's message for `stop` (`startup.stop_text`); keeps its fields
        for the job_end event."""
        self._stopped_by = stop_fields(stop)
        note = self._newest_checkpoint()
        return stop_text(stop, self.run_dir, None if note == NO_CHECKPOINT else note)

    def _hold_spawn(self, arg: Any) -> bool:
        """Whether a replacement's start waits (asked again in `EXIT_READ_POLL_S`, for
        at most `EXIT_READ_WAIT_S`): a worker has died whose exit this thread has not
        read yet (its reaper queues it as it dies). The failure watch must see every
        exit before the whole-job-death rule is asked: four members raising the same
        error at one step are a bug in the script, which the same-error rule names at
        the second exit, not a whole-job death seen at the first (as it was when the
        replacement's start came between them)."""
        if not any(w.proc.poll() is not None for w in self.workers.values()):
            self._spawn_held.pop(arg, None)
            return False
        since = self._spawn_held.setdefault(arg, time.monotonic())
        if time.monotonic() - since >= EXIT_READ_WAIT_S:
            self._spawn_held.pop(arg, None)
            return False
        self._at(EXIT_READ_POLL_S, "spawn", arg)
        return True

    def _job_died(self) -> Stop | None:
        """Asked before a replacement starts: if no member holding the state is
        alive, the failure watch's whole-job-death rule decides (local jobs: an
        agent sees one node)."""
        standby = set(self.status.get("standby") or [])
        if self.agent or any(
            w.proc.poll() is None
            # A worker started with the job holds its state from the start (a
            # replacement or a standby only once a status shows it in a ready
            # generation: statuses come every 0.25 s, a short job may show none).
            and (m in self._holders or not (w.replacement or m in standby))
            for m, w in self.workers.items()
        ):
            return None
        start = self.resume_step if self.resume_step is not None else (self.plain_step or 0)
        has = self._newest_checkpoint() != NO_CHECKPOINT or self.plain_step is not None
        injected = self._deaths_injected
        return self.failures.on_job_death(int(self.status.get("step", 0)), start, has, injected)

    def _spare_for(self, dead: str) -> str | None:
        """A live standby of this launcher, per the last status (as it was before
        the death), that no earlier death has counted on: the spare the coordinator
        admits in `dead`'s place. None: nobody takes the slot but a replacement."""
        for m in self.status.get("standby") or []:
            w = self.workers.get(m)
            if m != dead and m not in self._claimed and w is not None and w.proc.poll() is None:
                return m
        return None

    def _progress_now(self) -> int:
        """The job's progress (status ``step``), read now if the coordinator answers."""
        known = int(self.status.get("step", 0))
        if self.client is None:
            return known
        try:
            return max(known, int(self.client.status().get("step", 0)))
        except CoordinatorError:
            return known

    def _start_due_refills(self, now: float) -> None:
        progress = int(self.status.get("step", 0))
        alive = sum(1 for w in self.workers.values() if w.proc.poll() is None)
        due = [r for r in self._refills if refill_due(r, now, progress, alive)]
        for r in due:
            self._refills.remove(r)
            self._on_timer("spawn", (r.member, r.pid))

    def _evict_stragglers(self) -> None:
        """Send SIGTERM to the members `choose_evictions` picks (the decision is
        pure; this is its I/O): each leaves at its next step boundary, where the
        coordinator admits a waiting spare in its place."""
        if self._stragglers is None:
            self._stragglers = (
                EventTail(self.run_dir),
                StragglerScores(threshold=self.config.evict_threshold),
            )
        tail, scores = self._stragglers
        scores.feed(sorted(tail.poll(), key=lambda e: e.get("t", 0.0)))
        self._evicting &= set(self.workers)
        members = list(self.status.get("members") or [])
        standby = [m for m in self.status.get("standby") or [] if m in self.workers]
        now = scores.scores()
        for m in choose_evictions(now, members, len(standby), self._evicting):
            w = self.workers.get(m)
            if w is None or w.proc.poll() is not None:
                continue
            score, n, streak = now[m]
            self.events.emit(
                EventKind.STRAGGLER_EVICTED,
                member=m,
                pid=w.proc.pid,
                score=score,
                steps=n,
                streak=streak,
            )
            print(
                f"elastrain: evicting straggler {m} (computes {score:.1f}x slower than its "
                f"peers, straggling for {streak} steps); a hot spare takes its place",
                file=sys.stderr,
                flush=True,
            )
            w.proc.send_signal(signal.SIGTERM)
            self._evicting.add(m)

    def _on_timer(self, what: str, arg: Any) -> None:
        if what == "spawn":
            if not self.status.get("finished") and not self.done_members:
                if self._hold_spawn(arg):
                    return
                stop = self._job_died()
                if stop is not None:
                    self._stop_reason = ("failed", self._stop_text(stop))
                    self._stop.set()
                    return
                self._spawn(replacement=True, replaces=arg[0], replaces_pid=arg[1])
        elif what == "finish":
            self._stop_reason = ("done", "")
            self._stop.set()
        elif what == "fault":
            fault, victim = arg
            step = int(self.status.get("step", 0))
            self.injector.fire(fault, victim, self.workers, self.coordinator, step)
        elif what == "resume":
            member, pid = arg
            self.injector.resume(member, pid, self.workers, int(self.status.get("step", 0)))
        elif what == "release-disk":
            self.injector.release_disk(int(self.status.get("step", 0)))
        elif what == "reconnect":
            self.injector.reconnect(arg, int(self.status.get("step", 0)))

    def _poll_status(self) -> None:
        if self.client is None:
            return
        try:
            status = self.client.status()
        except CoordinatorError:
            return
        # A restarted coordinator learns the step from its workers' next
        # quorum calls; never report progress going backwards.
        status["step"] = max(int(status.get("step", 0)), int(self.status.get("step", 0)))
        self._max_gen = max(self._max_gen, int(status.get("gen", 0)))
        self.status = status
        self._claimed &= set(status.get("standby") or [])
        if status.get("ready"):
            self._holders.update(status.get("members") or [])
            if any(m in self.workers for m in status.get("members") or []):
                self.failures.on_state_held()
                self._deaths_injected = True
        if self.replicas is not None:
            self._rebuild_expelled_replicas()
        if self.on_status is not None:
            self.on_status(self.status)
        self.injector.poll(self.status, list(self.workers))

    def _rebuild_expelled_replicas(self) -> None:
        """A process of a multi-process replica that was expelled (hung) but still
        runs: its replica cannot compute again. Stop it and its mates, spawn K fresh."""
        running = [m for m, w in self.workers.items() if not w.stopped and w.proc.poll() is None]
        for m in expelled(self.status, self._holders, running, bool(self.done_members)):
            print(f"elastrain: {m} was expelled (hung): its replica is rebuilt", file=sys.stderr)
            w = self.workers[m]
            w.stopped = True
            w.proc.send_signal(signal.SIGKILL)
            for who, pid in [(m, w.proc.pid), *self._replica_lost(m)]:
                self._at(self.config.replace_delay_s, "spawn", (who, pid))

    @property
    def schedule(self) -> FaultView:
        return self.injector.schedule

    @property
    def fault_log(self) -> list[dict[str, Any]]:
        return self.injector.log

    def _host_of(self, member: str) -> tuple[SimHosts, Any] | None:
        if self.net is None or member not in self._slot:
            return None
        return self.net, self.net.hosts[self._slot[member]]

    def member_pids(self) -> dict[str, int]:
        return {m: w.proc.pid for m, w in self.workers.items()}

    # ---- shutdown --------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every child: SIGCONT (a stopped one cannot die of SIGTERM), SIGTERM, then SIGKILL."""
        self.injector.close()  # frees a disk it filled
        procs = [w.proc for w in self.workers.values()]
        for w in self.workers.values():
            w.stopped = True
        for pr in procs:
            if pr.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        os.kill(pr.pid, sig)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + 5
        for pr in procs:
            try:
                pr.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
        # The coordinator and the prefork server end side by side: each takes a
        # moment to exit, and the job's end waits for both.
        coordinator = self.coordinator
        if coordinator is not None and coordinator.poll() is not None:
            coordinator = None  # already gone
        if coordinator is not None:
            # SIGINT: stop now. (SIGTERM would be a preemption notice to drain.)
            coordinator.send_signal(signal.SIGINT)
        if self.prefork is not None:
            self.prefork.close()
            self.prefork = None
        if coordinator is not None:
            try:
                coordinator.wait(timeout=5)
            except subprocess.TimeoutExpired:
                coordinator.kill()
                coordinator.wait()
        if self.client is not None:
            self.client.close()
