"""Process bookkeeping and fault firing for the torchrun and torchft runs (see versus.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from analysis import (
    FaultMark,
    Plan,
)
from job import HANG_VICTIM, KILL_VICTIM


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (Linux /proc), recursively."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Procs:
    """Every process this benchmark started (directly or through torchrun), stopped by
    PID: SIGCONT (a stopped process cannot die of anything else first), then SIGKILL."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.pids: set[int] = set()

    def start(self, cmd: list[str], logf: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(logf, "ab") as f:
            p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.popens.append(p)
        return p

    def note(self, pid: int) -> None:
        self.pids.add(pid)

    def stop(self, p: subprocess.Popen[bytes] | None = None) -> None:
        targets = [p] if p is not None else list(self.popens)
        pids: list[int] = []
        for q in targets:
            if q.poll() is None:
                pids += [*children_of(q.pid), q.pid]
        if p is None:
            pids += [x for x in self.pids if alive(x)]
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        for q in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                q.wait(timeout=5)
        if p is None:
            self.popens = [q for q in self.popens if q.poll() is None]
            self.pids = {x for x in self.pids if alive(x)}


PROCS = Procs()


class Tail:
    """New JSON records from the JSON-lines files matching a glob (incremental)."""

    def __init__(self, d: Path, pattern: str) -> None:
        self.d, self.pattern = d, pattern
        self.off: dict[Path, int] = {}
        self.buf: dict[Path, str] = {}

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in sorted(self.d.glob(self.pattern)):
            try:
                with open(p) as f:
                    f.seek(self.off.get(p, 0))
                    chunk = f.read()
                    self.off[p] = f.tell()
            except OSError:
                continue
            text = self.buf.get(p, "") + chunk
            lines = text.split("\n")
            self.buf[p] = lines.pop()
            for line in lines:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


class Injector:
    """Fires a Plan's kill and hang for the torchrun and torchft runs from the commit
    records as they arrive: once `at` steps are committed, wait the drawn offset, send
    the signal. `pid_of(victim)` gives the victim's current PID."""

    def __init__(
        self, plan: Plan, pid_of: Callable[[int], int | None], name: Callable[[int], str]
    ) -> None:
        self.plan = plan
        self.pid_of, self.name = pid_of, name
        self.draw = plan.offsets()
        todo: list[tuple[int, str, int]] = []
        if plan.kill_at is not None:
            todo.append((plan.kill_at, "kill", KILL_VICTIM))
        if plan.hang_at is not None:
            todo.append((plan.hang_at, "hang", HANG_VICTIM))
        self.todo = sorted(todo)
        self.due: float | None = None
        self.marks: list[FaultMark] = []
        self.resume: tuple[float, int] | None = None
        self.on_kill: Callable[[int, int], None] | None = None

    def tick(self, committed: int, step_s: float, now: float) -> None:
        if self.resume is not None and now >= self.resume[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.resume[1], signal.SIGCONT)
            self.resume = None
        if not self.todo or committed < self.todo[0][0]:
            return
        if self.due is None:
            self.due = now + self.draw(step_s if step_s > 0 else 0.2)
        if now < self.due:
            return
        at, kind, victim = self.todo.pop(0)
        self.due = None
        pid = self.pid_of(victim)
        if pid is None:
            return
        t = time.time()
        if kind == "kill" and self.on_kill is not None:
            self.on_kill(victim, pid)
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        self.marks.append(FaultMark(kind, t, self.name(victim), pid, committed))
        if kind == "hang":
            self.resume = (now + self.plan.hang_s, pid)

    @property
    def pending(self) -> bool:
        return bool(self.todo) or self.resume is not None


def recent_step_s(commit_t: dict[int, float]) -> float:
    ks = sorted(commit_t)[-11:]
    d = [commit_t[b] - commit_t[a] for a, b in zip(ks, ks[1:], strict=False) if b == a + 1]
    return sorted(d)[len(d) // 2] if d else 0.2
