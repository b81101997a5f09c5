"""What `elastrain run` shows of the workers' own output.

Every worker's stdout and stderr go to ``<run_dir>/logs/<member>.log`` (the
launcher opens them; nothing is lost when the console is slow or closed). The
console shows the output of the *leader*, rank 0 of the current generation,
as a plain `torchrun` script's rank 0 would print it. Rank 0 moves when
members fail, so the launcher follows the logs (`LogFollower`) and shows the
lines of whoever is rank 0 now, which it learns from the coordinator's status
(`members[0]` of the current generation). A leader change is announced on one
line. Lines a member printed before any leader was known (imports, data
loading) are held and shown once it turns out to be the leader.

Why the launcher and not the worker: a worker cannot know it is rank 0 before
its first generation forms, and two workers would both print while the
leadership changes hands; the launcher sees one status at a time and never
interleaves two members' lines. The cost is up to one poll (0.25 s) of delay.

`--console all` shows every member's lines prefixed with ``[member]`` (the
habit of torchrun's `--tee`); `--console none` shows none. The logs are kept
either way.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = ["ConsoleMode", "LogFollower", "leader_of"]

HELD_LINES = 1000
"""Lines kept per member before any leader is known."""


class ConsoleMode(StrEnum):
    LEADER = "leader"
    ALL = "all"
    NONE = "none"


def leader_of(status: dict[str, Any]) -> str | None:
    """Rank 0 of the coordinator's current generation (None before the first one)."""
    members = status.get("members")
    return str(members[0]) if isinstance(members, list) and members else None


class LogFollower:
    """Follows `logs/*.log` of a run and writes the chosen members' lines to `out`.

    `update(status)` (any thread) tells it the current leader; `poll()` reads what
    the logs gained since the last call (the thread started by `start()` calls it
    every `interval_s`); `close()` reads the logs to their end once more and stops.
    """

    def __init__(
        self,
        run_dir: Path,
        mode: ConsoleMode = ConsoleMode.LEADER,
        out: Callable[[str], None] | None = None,
        interval_s: float = 0.2,
    ) -> None:
        self.logs = Path(run_dir) / "logs"
        self.mode = mode
        self.out = out or (lambda line: print(line, file=sys.stdout, flush=True))
        self.interval_s = interval_s
        self.leader: str | None = None
        self._shown_leader: str | None = None
        self._offsets: dict[Path, int] = {}
        self._partial: dict[str, bytes] = {}
        self._held: dict[str, deque[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, status: dict[str, Any]) -> None:
        leader = leader_of(status)
        if leader is not None:
            self.leader = leader

    def start(self) -> None:
        if self.mode is ConsoleMode.NONE:
            return
        self._thread = threading.Thread(target=self._run, daemon=True, name="console")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.mode is not ConsoleMode.NONE:
            self.poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Read new log lines and show those of the chosen members."""
        with self._lock:
            self._switch_leader()
            if not self.logs.is_dir():
                return
            for path in sorted(self.logs.glob("*.log")):
                member = path.stem
                if member == "coordinator":
                    continue
                for line in self._read(path, member, final):
                    self._line(member, line)

    def _switch_leader(self) -> None:
        if self.mode is not ConsoleMode.LEADER or self.leader == self._shown_leader:
            return
        if self._shown_leader is not None:
            self.out(f"elastrain: rank 0 is now {self.leader}; its output follows")
        self._shown_leader = self.leader
        held = self._held.pop(self.leader or "", deque())
        self._held.clear()  # once a leader is known, nobody else's past lines matter
        for line in held:
            self.out(line)

    def _read(self, path: Path, member: str, final: bool) -> list[str]:
        try:
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
                self._offsets[path] = f.tell()
        except OSError:
            return []
        data = self._partial.pop(member, b"") + data
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest and final:
            lines.append(rest)
        elif rest:
            self._partial[member] = rest
        return [x.decode("utf-8", "replace").rstrip("\r") for x in lines]

    def _line(self, member: str, line: str) -> None:
        if self.mode is ConsoleMode.ALL:
            self.out(f"[{member}] {line}")
        elif self._shown_leader is None:
            self._held.setdefault(member, deque(maxlen=HELD_LINES)).append(line)
        elif member == self._shown_leader:
            self.out(line)
