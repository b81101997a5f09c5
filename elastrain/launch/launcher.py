"""The local launcher behind `elastrain run`: coordinator + N workers on this machine.

It starts the coordinator as a process of its own, spawns the workers with the
coordinator's address and the job token in their environment, tells the
coordinator at once when a child exits, replaces dead workers after
`replace_delay_s` (the stand-in for scheduling a pod), fires the fault
schedule, shows progress, and shuts everything down on Ctrl-C. Everything
about the run lands in the run directory.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain import env
from elastrain.chaos.schedule import Fault, FaultSchedule
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError
from elastrain.observe.events import EventLog

EXIT_LEFT = 75
EXIT_REFUSED = 3


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How `elastrain run` runs a job on this machine."""

    script: str
    """The training script (run with this Python)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments passed through to the script."""
    workers: int = 4
    """Workers to keep running (-n)."""
    min_workers: int = 1
    """Fewer members than this: training pauses until replacements arrive (--min)."""
    replace_delay_s: float = 0.0
    """Seconds between a worker's death and its replacement's start (stands in for pod scheduling)."""
    replace: bool = True
    """Replace workers that die or leave."""
    run_dir: str | None = None
    """Where everything about the run goes (default runs/<job-id>)."""
    steps: int | None = None
    """Override the script's total steps."""
    faults: list[Fault] = field(default_factory=list)
    """Faults to inject (see elastrain.chaos.schedule)."""
    fault_points: str | None = None
    """JSON of in-worker fault points (see elastrain.chaos.points), for tests."""
    seed: int = 0
    """Seeds the fault schedule's choices."""
    lease_s: float = 5.0
    """Coordinator lease (see CoordinatorConfig)."""
    suspect_s: float = 1.0
    """Coordinator suspicion window (see CoordinatorConfig)."""
    max_fast_failures: int = 5
    """Give up after this many consecutive workers die within 10 s of their start."""
    progress: bool = True
    """Show live progress."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the workers."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"-n must be >= 1 (got {self.workers})")
        if not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"--min must be between 1 and -n={self.workers} (got {self.min_workers})"
            )
        if self.replace_delay_s < 0:
            raise ValueError("--replace-delay must be >= 0")
        if not Path(self.script).is_file():
            raise ValueError(f"training script not found: {self.script}")
        if self.steps is not None and self.steps < 0:
            raise ValueError("--steps must be >= 0")


@dataclass
class Worker:
    member: str
    proc: subprocess.Popen[bytes]
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


class Launcher:
    """Runs one job to completion. `run()` blocks; `stop()` (any thread) ends it."""

    def __init__(
        self, config: LaunchConfig, on_status: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.config = config
        self.job_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        self.run_dir = Path(config.run_dir or Path("runs") / self.job_id).resolve()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        tok = self.run_dir / "token"
        tok.write_text(self.token)
        tok.chmod(0o600)
        self.events = EventLog(self.run_dir, "launcher")
        self.on_status = on_status
        self.workers: dict[str, Worker] = {}
        self.pids: dict[str, list[int]] = {}
        self.exits: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self._next_id = 0
        self._timers: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._stop = threading.Event()
        self._fast_failures = 0
        self.schedule = FaultSchedule(config.faults, config.seed)
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.client: CoordinatorClient | None = None
        self.status: dict[str, Any] = {}
        self.done_members: set[str] = set()
        self.fault_log: list[dict[str, Any]] = []

    # ---- processes -------------------------------------------------------------

    def _start_coordinator(self) -> None:
        c = self.config
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
        ]
        log = open(self.run_dir / "logs" / "coordinator.log", "ab")  # noqa: SIM115
        e = dict(os.environ)
        e[env.TOKEN] = self.token
        self.coordinator = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, env=e, start_new_session=True
        )
        assert self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the coordinator did not start; see {self.run_dir / 'logs' / 'coordinator.log'}"
            )
        info = json.loads(line)
        self.address = f"{info['host']}:{info['port']}"
        self.client = CoordinatorClient(self.address, self.token, timeout_s=5.0)

    def _spawn(self, replacement: bool, replaces: str | None = None) -> Worker:
        c = self.config
        member = f"w{self._next_id}"
        self._next_id += 1
        e = dict(os.environ)
        e.update(c.extra_env)
        e.update(
            {
                env.COORDINATOR: self.address,
                env.TOKEN: self.token,
                env.MEMBER_ID: member,
                env.RUN_DIR: str(self.run_dir),
            }
        )
        if c.steps is not None:
            e[env.STEPS] = str(c.steps)
        if c.fault_points:
            e[env.FAULTS] = c.fault_points
        log = open(self.run_dir / "logs" / f"{member}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, c.script, *c.script_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,
        )
        log.close()
        w = Worker(member, proc, time.monotonic(), replacement)
        self.workers[member] = w
        self.pids.setdefault(member, []).append(proc.pid)
        self.events.emit(
            "worker_spawned",
            member=member,
            pid=proc.pid,
            replacement=replacement,
            replaces=replaces,
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
        c = self.config
        self.events.emit(
            "job_start", job_id=self.job_id, target=c.workers, min=c.min_workers, script=c.script
        )
        status, message = "failed", ""
        previous = None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM to the launcher ends the job cleanly (children stopped by PID).
            previous = signal.signal(signal.SIGTERM, lambda *_: self._terminate())
        try:
            self._start_coordinator()
            for _ in range(c.workers):
                self._spawn(replacement=False)
            status, message = self._loop()
        except KeyboardInterrupt:
            status, message = "interrupted", "interrupted by Ctrl-C"
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._shutdown()
            self.events.emit(
                "job_end", status=status, steps=self.status.get("step", 0), message=message
            )
            self.events.close()
        return RunResult(status, self.run_dir, self.pids, int(self.status.get("step", 0)), message)

    def stop(self) -> None:
        self._stop.set()

    def _terminate(self) -> None:
        self._stop_reason = ("interrupted", "terminated by SIGTERM")
        self._stop.set()

    def _loop(self) -> tuple[str, str]:
        last_status = 0.0
        while not self._stop.is_set():
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
            if self.coordinator is not None and self.coordinator.poll() is not None:
                return "failed", f"the coordinator exited ({self.coordinator.returncode})"
            if now - last_status >= 0.25:
                last_status = now
                self._poll_status()
            if not self.workers and not any(t[2] == "spawn" for t in self._timers):
                if self.status.get("finished") or self.done_members:
                    return "done", ""
                return "failed", "no workers left"
        return getattr(self, "_stop_reason", ("interrupted", "stopped"))

    def _on_exit(self, member: str, pid: int, rc: int) -> tuple[str, str] | None:
        w = self.workers.pop(member, None)
        self.events.emit("worker_exited", member=member, pid=pid, returncode=rc)
        if self.client is not None:
            try:
                self.client.exit(p.ExitRequest(member, pid, rc))
            except CoordinatorError:
                pass
        if rc == 0:
            if not self.done_members:
                # The job is finishing: members still alive get a grace period to finish too.
                self._at(15.0, "finish", None)
            self.done_members.add(member)
            return None
        if w is not None and w.stopped:
            return None
        if rc == EXIT_REFUSED:
            return "failed", f"{member} was refused by the coordinator; see logs/{member}.log"
        if w is not None and time.monotonic() - w.started < 10 and rc != EXIT_LEFT:
            self._fast_failures += 1
            if self._fast_failures >= self.config.max_fast_failures:
                return "failed", (
                    f"{self._fast_failures} workers in a row died within 10 s of "
                    f"starting; see {self.run_dir}/logs/{member}.log"
                )
        else:
            self._fast_failures = 0
        if self.config.replace and not self.status.get("finished") and not self.done_members:
            self._at(self.config.replace_delay_s, "spawn", member)
        return None

    def _on_timer(self, what: str, arg: Any) -> None:
        if what == "spawn":
            if not self.status.get("finished") and not self.done_members:
                self._spawn(replacement=True, replaces=arg)
        elif what == "finish":
            self._stop_reason = ("done", "")
            self._stop.set()
        elif what == "signal":
            fault, member = arg
            self._signal(fault, member)
        elif what == "resume":
            member, pid = arg
            w = self.workers.get(member)
            if w is not None and w.proc.pid == pid:
                os.kill(pid, signal.SIGCONT)
                self.events.emit(
                    "fault_injected",
                    fault="resume",
                    member=member,
                    pid=pid,
                    step=self.status.get("step", 0),
                )

    def _poll_status(self) -> None:
        if self.client is None:
            return
        try:
            self.status = self.client.status()
        except CoordinatorError:
            return
        if self.on_status is not None:
            self.on_status(self.status)
        step = int(self.status.get("step", 0))
        for f in self.schedule.due(step):
            members = [m for m in self.status.get("members", []) if m in self.workers]
            victim = self.schedule.pick(f, members)
            if victim is None:
                continue
            rate = float(self.status.get("steps_per_s") or 0.0)
            self._at(self.schedule.offset(1.0 / rate if rate > 0 else 0.2), "signal", (f, victim))

    def _signal(self, fault: Fault, member: str) -> None:
        w = self.workers.get(member)
        if w is None:
            return
        sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}[fault.kind]
        step = self.status.get("step", 0)
        self.events.emit(
            "fault_injected", fault=fault.kind, member=member, pid=w.proc.pid, step=step
        )
        self.fault_log.append(
            {"fault": fault.kind, "member": member, "pid": w.proc.pid, "step": step}
        )
        os.kill(w.proc.pid, sig)
        if fault.kind == "hang" and fault.duration_s is not None:
            self._at(fault.duration_s, "resume", (member, w.proc.pid))

    def member_pids(self) -> dict[str, int]:
        return {m: w.proc.pid for m, w in self.workers.items()}

    # ---- shutdown --------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every child: SIGCONT (a stopped one cannot die of SIGTERM), SIGTERM, then SIGKILL."""
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
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            try:
                self.coordinator.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait()
        if self.client is not None:
            self.client.close()
