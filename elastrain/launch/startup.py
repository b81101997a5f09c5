"""The launcher's start-up watch: workers that fail the same way before their first
step stop the job after the first repeat, with the failing worker's last lines.

Replacing such a worker only repeats the failure (a typo, a missing file, batch
sizes that do not fit), so the launcher stops at the second worker that dies
before committing a step with the same last line (the exception, usually), or
at the first that exits with EXIT_MISCONFIGURED (the worker already knows it
is a mistake in the script) or EXIT_STATE_LOST (part of the state is gone from
memory: only a rerun, resuming from the newest checkpoint, can go on). The message holds the log's last lines and, for
well-known torch errors, what to change (`elastrain.runtime.preflight.explain`).
Pure decisions (`signature`, `StartupWatch.on_exit`) over what the logs and
event files hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastrain.exitcodes import EXIT_LEFT, EXIT_MISCONFIGURED, EXIT_PREEMPTED, EXIT_STATE_LOST
from elastrain.runtime.preflight import explain

TAIL_LINES = 15
"""Lines of the failing worker's log shown on the console."""


def tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> list[str]:
    """The last `lines` lines of a file (empty when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return [x.rstrip("\r") for x in data.decode("utf-8", "replace").splitlines()][-lines:]


def signature(lines: list[str]) -> str:
    """What identifies a failure in a log tail: the last exception line (`Name: text`
    or a bare `SomethingError`), else the last non-empty line."""
    for line in reversed(lines):
        s = line.strip()
        head = s.split(":", 1)[0]
        if (
            head
            and not head.startswith(" ")
            and head.isidentifier()
            and (head.endswith(("Error", "Exception", "Exit", "Interrupt")) or head == "elastrain")
        ):
            return s
    return next((x.strip() for x in reversed(lines) if x.strip()), "")


@dataclass
class StartupWatch:
    """Decides, per worker exit, whether the job should stop (see the module docstring)."""

    run_dir: Path
    seen: dict[str, str] = field(default_factory=dict)
    """signature -> the member that first failed with it."""

    def committed(self, member: str, pid: int) -> bool:
        path = self.run_dir / "events" / f"{member}-{pid}.jsonl"
        try:
            return b'"step_commit"' in path.read_bytes()
        except OSError:
            return False

    def on_exit(self, member: str, pid: int, rc: int, injected: bool) -> str | None:
        """The message to stop the job with, or None to go on."""
        if rc in (0, EXIT_LEFT, EXIT_PREEMPTED) or rc < 0 or injected:
            return None  # a signal came from outside: not the script's fault
        log = self.run_dir / "logs" / f"{member}.log"
        lines = tail(log)
        if rc == EXIT_STATE_LOST:
            head = f"{member} found part of the job's state lost from memory (exit {rc})"
        elif rc != EXIT_MISCONFIGURED:
            if self.committed(member, pid):
                return None
            sig = signature(lines)
            first = self.seen.setdefault(sig, member)
            if first == member:
                return None
            head = f"{first} and {member} failed the same way before their first step (exit {rc})"
        else:
            head = f"{member} found a mistake in the script (exit {rc})"
        hint = next((h for h in map(explain, lines) if h), None)
        body = "\n".join("  | " + x for x in lines)
        out = f"{head}; stopping instead of starting more.\nlast lines of {log}:\n{body}"
        return out + (f"\nwhat to change: {hint}" if hint else "")
