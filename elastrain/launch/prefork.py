"""Workers forked from a process that has already imported torch.

A worker spends most of its start-up importing torch and elastrain (about 1.5 s
of CPU here), before it builds its model or registers. A launcher starts
workers at the job's start, replaces them after every failure, and refills its
spares: each of those paid that import again, on the cores the survivors train
on. So the launcher starts one *prefork server* (`python -m
elastrain.launch.prefork`) when the job starts: it imports torch and the
trainer once, then waits; each worker is a `fork()` of it that sets its own
environment, working directory, log file and session and runs
`elastrain.worker` as `python -m elastrain.worker SCRIPT ARGS` would. What the
import loaded is shared copy-on-write.

The server is single-threaded (a fork copies only the forking thread; torch's
import starts no thread that holds a lock a child needs) and never touches
torch beyond importing it: no tensor, no thread pool, no CUDA (a worker's
``CUDA_VISIBLE_DEVICES`` is set before anything initialises CUDA).

Contract with the launcher (`Preforker`), one JSON object per line:

- server -> launcher, once: ``{"ready": PID}`` after the imports;
- launcher -> server: ``{"argv": [SCRIPT, ARGS...], "env": {...}, "cwd": DIR,
  "log": FILE, "umask": N}``; the answer ``{"spawned": PID}`` (or
  ``{"failed": WHY}``);
- server -> launcher, whenever a child ends: ``{"exited": PID, "rc": RC}``, RC
  as `subprocess.Popen.returncode` has it (negative: killed by that signal).
  It always follows the child's ``spawned`` line.

Lifetimes: the server dies with the launcher thread that started it, and each
worker with the server (``PR_SET_PDEATHSIG``), as a `Popen`'d worker dies with
its launcher; closing the server's stdin ends it. Where the server cannot serve
(it failed to start, or died) the launcher starts workers with `Popen` as
before, and so it does for simulated hosts (``--hosts``), whose workers start
inside a network namespace. A forked worker's ``/proc/PID/cmdline`` is the
server's (``python -m elastrain.launch.prefork``); its log, PID, exit status,
session and environment are what a `Popen`'d one's would be.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn, Protocol

from elastrain.children import die_with, die_with_parent, end_process, spawn_env

READY_TIMEOUT_S = 60.0
"""How long a spawn waits for the server's imports before starting the worker with
`Popen` instead (a loaded machine can take several seconds)."""

ANSWER_TIMEOUT_S = 30.0
"""How long a spawn waits for the server's answer to one request."""


class Proc(Protocol):
    """What the launcher asks of a worker's process: `subprocess.Popen`'s subset."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A worker forked by the prefork server: `Popen`'s interface, its exit status
    reported by the server (it is the server's child, not the launcher's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def finish(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self._done.set()


class Preforker:
    """The launcher's side: starts the server, hands it spawn requests, and turns its
    exit reports into `ForkedProcess` exits.

    `spawn` must be called from the thread that called `start` (the server's
    death signal is tied to that thread), one call at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self._dead = False
        self._answers: queue.SimpleQueue[ForkedProcess | str] = queue.SimpleQueue()
        self._children: dict[int, ForkedProcess] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self, env: dict[str, str], log: Path, umask: int) -> None:
        """Start the server with the environment the workers share (`env`) and
        `umask`, its stderr appended to `log`; it dies with the calling thread.
        Returns at once; the imports run meanwhile."""
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "elastrain.launch.prefork"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=spawn_env(env),
                # Its own session, as the workers have: a terminal's Ctrl-C reaches the
                # launcher, which stops the workers in order, not the server.
                start_new_session=True,
                umask=umask,
            )
        self._reader = threading.Thread(target=self._read, daemon=True, name="prefork-reader")
        self._reader.start()

    @property
    def serving(self) -> bool:
        return self._proc is not None and not self._dead

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, log: Path, umask: int
    ) -> ForkedProcess | None:
        """Fork a worker running `elastrain.worker` with `argv` (SCRIPT ARGS...);
        None when the server cannot (not ready in time, dead): use `Popen` then."""
        proc = self._proc
        if proc is None or self._dead or not self._ready.wait(READY_TIMEOUT_S) or self._dead:
            return None
        request = {"argv": argv, "env": env, "cwd": cwd, "log": str(log), "umask": umask}
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            answer = self._answers.get(timeout=ANSWER_TIMEOUT_S)
        except (OSError, queue.Empty):
            return None
        return answer if isinstance(answer, ForkedProcess) else None

    def close(self) -> None:
        """End the server (after the workers: any child still running dies with it)."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _read(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ready" in msg:
                self._ready.set()
            elif "spawned" in msg:
                child = ForkedProcess(int(msg["spawned"]))
                with self._lock:
                    self._children[child.pid] = child
                self._answers.put(child)
            elif "failed" in msg:
                self._answers.put(str(msg["failed"]))
            elif "exited" in msg:
                with self._lock:
                    done = self._children.pop(int(msg["exited"]), None)
                if done is not None:
                    done.finish(int(msg["rc"]))
        # The server is gone, and its children with it (their death signal).
        self._dead = True
        self._ready.set()
        self._answers.put("the prefork server ended")
        with self._lock:
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            child.finish(-signal.SIGKILL)


# ---- the server ----------------------------------------------------------------------


def _send(msg: dict[str, Any]) -> None:
    os.write(1, json.dumps(msg).encode() + b"\n")


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def serve() -> dict[str, Any] | None:
    """The server's loop. Returns in a forked child, with the request it is to run;
    returns None in the server when the launcher closed its stdin."""
    import torch  # noqa: F401 - the point: children start with it imported

    # torch.optim imports dynamo when the script builds its first optimizer: about
    # 1.3 s of CPU, which every worker paid after its fork, on the survivors' cores.
    # Its import starts no thread (the fork contract above).
    import torch._dynamo  # noqa: F401

    import elastrain.runtime.trainer  # noqa: F401
    import elastrain.worker  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send({"ready": os.getpid()})
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
            _reap()
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError as e:
                _send({"failed": f"bad request: {e}"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # What the imports created stays out of the children's garbage
            # collections: a full one no longer walks torch's and dynamo's objects
            # (0.15 s each), nor writes to their pages, which stay shared.
            gc.freeze()
            try:
                pid = os.fork()
            except OSError as e:
                _send({"failed": f"fork: {e}"})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                return dict(request)
            _send({"spawned": pid})


def become_worker(request: dict[str, Any], server: int) -> NoReturn:
    """In a forked child: become the worker `request` describes, and end with it."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setsid()
    os.umask(int(request["umask"]))
    die_with(server)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator anew
        sys.modules["numpy"].random.seed()
    from elastrain.worker import main

    main(list(request["argv"]))


if __name__ == "__main__":
    die_with_parent()
    server_pid = os.getpid()
    child_request = serve()
    if child_request is None:
        end_process(0)  # the job's end waits for it: no teardown of torch's modules
    become_worker(child_request, server_pid)
