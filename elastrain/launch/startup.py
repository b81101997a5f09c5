"""The launcher's failure watch: when replacing a dead worker cannot help, stop the
job with what broke instead of starting more (docs/design/script-failures.md).

Four rules, each a pure decision of `FailureWatch` over what the launcher saw:

- **A deterministic error.** `max_same_error` exits (default 2) within
  `window_s` whose exit records (`elastrain.exitrecord`) name the same exception
  type at the same script line, whichever members and steps: a bug in the script
  that every replacement would hit again. Only an exception the script raised
  and did not catch leaves a record, so a kill, a hang, a device error or a
  graceful leave never counts, and neither does any exit of a process the
  launcher's fault schedule killed (`injected`). A torn heal (EXIT_STATE_TORN)
  leaves one only when its cause is the member's own (its install refused the
  healed state): repeats of that cause stop the job too; one torn by a peer's
  failure is replaced.
- **The start-up rule** (before this issue's rule, and still the one for exits
  without a record: a crash in native code, `sys.exit(1)`): the second worker
  that dies before committing a step with the same last log line (the exception,
  usually), or the first that exits with EXIT_MISCONFIGURED (the worker already
  knows it is a mistake in the script) or EXIT_STATE_LOST (part of the state is
  gone from memory: only a rerun, resuming from the newest checkpoint, can go on).
- **The restart budget.** A failure that would be the (K+1)th replaced within
  `window_s` (`max_replacements`).
- **A whole-job death** (`on_job_death`): every member holding the training
  state died. With no checkpoint, after steps were committed, starting again
  would silently train from the beginning: stop and say how to resume. With a
  checkpoint, the job resumes from it once; a second death with no step
  committed since the first stops.

`signature` and the formatting are pure too; the launcher reads the logs, event
files and exit records and hands them in (`Exit`).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from elastrain.exitcodes import (
    EXIT_LEFT,
    EXIT_MISCONFIGURED,
    EXIT_PREEMPTED,
    EXIT_STATE_LOST,
    EXIT_STATE_TORN,
)
from elastrain.exitrecord import ScriptError
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


class StopCause(StrEnum):
    """Why the failure watch stopped the job."""

    SAME_ERROR = "same_error"
    STARTUP = "startup"
    MISCONFIGURED = "misconfigured"
    STATE_LOST = "state_lost"
    BUDGET = "budget"
    JOB_DEATH = "job_death"


@dataclass(frozen=True)
class Exit:
    """One worker exit, as the launcher saw it."""

    member: str
    pid: int
    returncode: int
    t: float
    """When it was reaped (monotonic seconds)."""
    injected: bool = False
    """The launcher's fault schedule killed this process."""
    committed: bool = False
    """The process committed at least one step."""
    error: ScriptError | None = None
    """Its exit record: the exception the script raised."""
    log_signature: str = ""
    """`signature` of its log's last lines (the start-up rule's key)."""


@dataclass(frozen=True)
class Stop:
    """The watch's decision to stop the job: why, and whose log to show."""

    cause: StopCause
    head: str
    """One sentence: what happened."""
    member: str
    """The member whose last log lines the console shows (the first to fail so)."""
    error: ScriptError | None = None
    count: int = 1
    """How many exits the rule counted."""


@dataclass
class FailureWatch:
    """Decides, per worker exit, whether the job should stop (see the module docstring)."""

    max_same_error: int = 2
    max_replacements: int = 20
    window_s: float = 3600.0
    seen: dict[str, str] = field(default_factory=dict)
    """Start-up rule: log signature -> the member that first failed with it."""
    errors: dict[tuple[str, str], deque[tuple[float, str]]] = field(default_factory=dict)
    """Exception key -> (time, member) of its exits within the window, oldest first."""
    replaced: deque[tuple[float, str]] = field(default_factory=deque)
    """Times of the failures replaced within the window."""
    death_progress: int | None = None
    """The job's committed steps at its last whole-job death (None: none yet)."""
    dead: bool = False
    """A whole-job death was let through and no member holds the state yet: the
    next replacements of it are the same death, not another."""

    @staticmethod
    def counts(ex: Exit) -> bool:
        """Whether the exit is a failure at all: not a success, a leave, a
        preemption, a signal sent from outside, or an injected fault."""
        return not (
            ex.returncode in (0, EXIT_LEFT, EXIT_PREEMPTED) or ex.returncode < 0 or ex.injected
        )

    @staticmethod
    def costs_a_replacement(ex: Exit) -> bool:
        """Whether the restart budget counts the exit: any failure, a kill from
        outside included (an out-of-memory kill, a lost machine), but no leave
        (SIGTERM, SIGINT, EXIT_LEFT), preemption or injected fault."""
        left = ex.returncode in (0, EXIT_LEFT, EXIT_PREEMPTED, -signal.SIGTERM, -signal.SIGINT)
        return not (left or ex.injected)

    def _prune(self, times: deque[tuple[float, str]], now: float) -> None:
        while times and now - times[0][0] > self.window_s:
            times.popleft()

    def on_exit(self, ex: Exit) -> Stop | None:
        """The decision to stop the job at this exit, or None (replace, go on)."""
        if ex.returncode == EXIT_STATE_LOST:
            head = (
                f"{ex.member} found part of the job's state lost from memory (exit {ex.returncode})"
            )
            return Stop(StopCause.STATE_LOST, head, ex.member)
        if ex.returncode == EXIT_MISCONFIGURED:
            head = f"{ex.member} found a mistake in the script (exit {ex.returncode})"
            return Stop(StopCause.MISCONFIGURED, head, ex.member)
        if ex.returncode == EXIT_STATE_TORN and self.counts(ex):
            # Torn by a peer's failure (no record): replace it. Torn by its own
            # (the record names the cause): a repeat would tear every replacement.
            if ex.error is None or self.max_same_error <= 0:
                return None
            return self._same_error(ex, ex.error)
        if not self.counts(ex):
            return None
        if ex.error is not None and self.max_same_error > 0:
            stop = self._same_error(ex, ex.error)
            if stop is not None:
                return stop
        if not ex.committed:
            first = self.seen.setdefault(ex.log_signature, ex.member)
            if first != ex.member:
                head = (
                    f"{first} and {ex.member} failed the same way before their first step "
                    f"(exit {ex.returncode})"
                )
                return Stop(StopCause.STARTUP, head, first, ex.error, 2)
        return None

    def _same_error(self, ex: Exit, err: ScriptError) -> Stop | None:
        times = self.errors.setdefault(err.key, deque())
        self._prune(times, ex.t)
        times.append((ex.t, ex.member))
        if len(times) < self.max_same_error:
            return None
        members = list(dict.fromkeys(m for _, m in times))
        who = (
            " and ".join(members)
            if len(members) <= 3
            else f"{members[0]} and {len(members) - 1} others"
        )
        span = ex.t - times[0][0]
        if ex.returncode == EXIT_STATE_TORN:
            head = (
                f"a heal into {who} failed the same way after landing in the live state, "
                f"{len(times)} times in {span:.1f} s (exit {ex.returncode}, torn by "
                f"{err.headline()}): every fresh process would be torn again"
            )
        elif ex.committed:
            head = (
                f"{who} raised the same {err.type} at the same line, {len(times)} times in "
                f"{span:.1f} s: a bug in the script, not a hardware failure"
            )
        else:  # the start-up rule's words: nothing was trained yet
            head = (
                f"{who} failed the same way before their first step ({err.type}, exit "
                f"{ex.returncode})"
            )
        return Stop(StopCause.SAME_ERROR, head, times[0][1], err, len(times))

    def on_replace(self, ex: Exit) -> Stop | None:
        """The restart budget, asked before a failed worker is replaced: stop
        rather than replace one more than `max_replacements` within the window."""
        if self.max_replacements <= 0 or not self.costs_a_replacement(ex):
            return None
        self._prune(self.replaced, ex.t)
        if len(self.replaced) >= self.max_replacements:
            head = (
                f"{len(self.replaced)} failed workers were replaced in the last "
                f"{self.window_s:g} s and {ex.member} failed too (exit {ex.returncode}): over "
                f"the restart budget (--max-replacements {self.max_replacements} per "
                f"--replacement-window {self.window_s:g})"
            )
            return Stop(StopCause.BUDGET, head, ex.member, ex.error, len(self.replaced) + 1)
        self.replaced.append((ex.t, ex.member))
        return None

    def on_job_death(
        self, progress: int, start: int, has_checkpoint: bool, injected: bool = False
    ) -> Stop | None:
        """Every member holding the state died, with `progress` steps committed
        (the job started at `start`): stop, or None to resume from the newest
        checkpoint (see the module docstring). Asked before each replacement
        starts, until `on_state_held`. `injected`: the launcher's fault schedule
        killed every one of them (the chaos soak's kill-all): a simulated
        hardware failure, resumed from whatever there is, as before this rule."""
        if self.dead:
            return None
        if injected:
            self.dead = True
            return None
        if progress <= start and self.death_progress is None:
            return None  # nothing committed: the start-up rule's business
        if not has_checkpoint:
            head = (
                f"every member died after the job had committed {progress} steps, and there is "
                "no checkpoint to resume from: stopping instead of training again from step "
                f"{start}"
            )
            return Stop(StopCause.JOB_DEATH, head, "")
        if self.death_progress is not None and progress <= self.death_progress:
            head = (
                f"every member died again without committing a step since the last time (step "
                f"{progress}): stopping instead of resuming from the same checkpoint again"
            )
            return Stop(StopCause.JOB_DEATH, head, "")
        self.death_progress = progress
        self.dead = True
        return None

    def on_state_held(self) -> None:
        """A live member holds the training state again (it is in a ready generation)."""
        self.dead = False


def stop_message(stop: Stop, log: Path | None, lines: list[str], what_next: str) -> str:
    """The console's text for `stop`: the sentence, the exception once, the last
    lines of the first failing member's log, what to change for a well-known
    torch error, and `what_next` (what to run)."""
    out = [f"{stop.head}; stopping instead of starting more."]
    if stop.error is not None:
        out.append(f"  {stop.error.type}: {stop.error.message.strip()}")
        out.append(f"  at {stop.error.where}")
    if log is not None:
        out.append(f"last lines of {log}:")
        out += ["  | " + x for x in lines]
    hint = next((h for h in map(explain, lines) if h), None)
    if hint:
        out.append(f"what to change: {hint}")
    if what_next:
        out.append(what_next)
    return "\n".join(out)


def read_exit(
    run_dir: Path,
    member: str,
    pid: int,
    rc: int,
    t: float,
    injected: bool,
    error: ScriptError | None,
) -> Exit:
    """What the failure watch needs of an exit, read from the run directory: whether
    the process committed a step (its event file) and its log's signature."""
    bare = Exit(member, pid, rc, t, injected)
    if not FailureWatch.counts(bare):
        return bare
    path = run_dir / "events" / f"{member}-{pid}.jsonl"
    try:
        committed = b'"step_commit"' in path.read_bytes()
    except OSError:
        committed = False
    lines = tail(run_dir / "logs" / f"{member}.log")
    return Exit(member, pid, rc, t, False, committed, error, signature(lines))


def stop_text(stop: Stop, run_dir: Path, checkpoint_note: str | None) -> str:
    """The console's message for a stop: what broke, the first failing member's last
    lines, and what to run next (`checkpoint_note`: the newest checkpoint, None when
    none was committed)."""
    log = run_dir / "logs" / f"{stop.member}.log" if stop.member else None
    if checkpoint_note is None:
        nxt = (
            "no checkpoint was committed: a rerun starts from step 0; checkpoint with "
            "--ckpt-every K to resume after a failure"
        )
    else:
        nxt = f"{checkpoint_note}: fix the cause, then run the same command (same --run-dir)"
    if stop.error is not None:
        nxt += "; --max-same-error 0 replaces workers whatever they raise"
    return stop_message(stop, log, tail(log) if log else [], nxt)


def stop_fields(stop: Stop) -> dict[str, object]:
    """The `job_end` event's fields for a stop (cause, count, the exception)."""
    out: dict[str, object] = {"cause": str(stop.cause), "count": stop.count}
    if stop.error is not None:
        out.update(stop.error.fields())
    return out
