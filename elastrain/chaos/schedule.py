"""Launcher-side fault schedule: faults injected from outside the workers.

A fault is written `KIND@WHEN[:MEMBER][/ARG]`:

    kill@15              SIGKILL a seeded-random member once the job reached step 15
    kill@15:w2           ... member w2 (any worker with a process: a hot spare too)
    kill@15:w2/hold=20s  ... and start its replacement 20 s after its death
                         instead of --replace-delay (a vacancy that lasts, e.g.
                         for a sharded job to reshard; term takes it too)
    kill@90s             ... 90 s after the job's first committed step (also 2m, 1h)
    kill@every45s~15s    ... every 45 s, each time shifted by up to +-15 s (seeded)
    hang@30/6            SIGSTOP a member at step 30, SIGCONT it 6 s later
    term@40              SIGTERM a member (graceful leave)
    slow@20:w1/0.2x30    straggler: w1 spends 0.2 s more on each of its next 30 steps
    kill-all@50          SIGKILL every worker at once (replacements resume from
                         the newest checkpoint that verifies)
    kill-coordinator@20  SIGKILL the coordinator (the launcher restarts it)
    corrupt-ckpt@60      flip bytes in one shard of the newest committed checkpoint
    truncate-ckpt@60     cut one shard of the newest committed checkpoint in half
    fill-disk@70/10      fill the checkpoint filesystem for 10 s (only a small,
                         dedicated one: see `elastrain.launch.faults`)
    cut@30:w1/8          take w1's host off the network for 8 s (default 10 s):
                         its link goes dark, packets are dropped both ways
                         (needs `elastrain run --hosts N`, simulated hosts)

Member faults (kill, hang, term, slow, cut) pick their victim with a seeded
generator among the members alive at that moment, so a schedule with a seed is
reproducible; the others hit the job. To land *inside* a step rather than at
its boundary, member signals are sent after a seeded fraction of the measured
step time. A file of faults (`--faults-file`) holds one spec per line; `#`
starts a comment.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

MEMBER_KINDS = ("kill", "hang", "term", "slow", "cut")
JOB_KINDS = (
    "kill-all",
    "kill-coordinator",
    "corrupt-ckpt",
    "truncate-ckpt",
    "fill-disk",
)
KINDS = MEMBER_KINDS + JOB_KINDS
COORDINATOR = "coordinator"
"""The victim name of a fault aimed at the coordinator rather than a member."""
JOB = "job"
"""The victim name of a fault aimed at the whole job (kill-all, checkpoint and disk faults)."""

_DUR = r"\d+(?:\.\d+)?(?:s|m|h)"
_RE = re.compile(
    rf"^(?P<kind>[a-z-]+)@(?:(?P<step>\d+)|(?P<at>{_DUR})|every(?P<every>{_DUR})(?:~(?P<jit>{_DUR}))?)"
    rf"(?::(?P<member>[\w.-]+))?(?:/(?P<arg>[\d.x]+|hold=[\d.]+[smh]?))?$"
)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'90s', '2m', '1.5h' or a bare number of seconds -> seconds."""
    t = text.strip()
    try:
        if t and t[-1] in _UNITS:
            v = float(t[:-1]) * _UNITS[t[-1]]
        else:
            v = float(t)
    except ValueError:
        raise ValueError(f"bad duration {text!r}: expected e.g. 90, 90s, 30m or 2h") from None
    if not v >= 0:
        raise ValueError(f"bad duration {text!r}: must be >= 0")
    return v


@dataclass(frozen=True)
class Fault:
    kind: str
    at_step: int | None = None
    """Due once the job has committed this step (None: time-based)."""
    at_s: float | None = None
    """Due this many seconds after the job's first committed step."""
    every_s: float | None = None
    """Repeats with this period (seconds after the first committed step)."""
    jitter_s: float = 0.0
    """Each repetition is shifted by a seeded uniform draw in [-jitter, +jitter]."""
    member: str | None = None
    duration_s: float | None = None
    """hang: when to SIGCONT (None: leave it stopped); fill-disk: how long the disk
    stays full; cut: how long the host stays off the network."""
    delay_s: float | None = None
    """slow: the extra seconds per step."""
    steps: int | None = None
    """slow: for how many steps."""
    hold_s: float | None = None
    """kill, term: seconds from the victim's death to its replacement's start,
    instead of the launcher's --replace-delay (None: that delay)."""

    def __str__(self) -> str:
        if self.every_s is not None:
            when = f"every{self.every_s:g}s" + (f"~{self.jitter_s:g}s" if self.jitter_s else "")
        elif self.at_s is not None:
            when = f"{self.at_s:g}s"
        else:
            when = str(self.at_step)
        s = f"{self.kind}@{when}"
        if self.member:
            s += f":{self.member}"
        if self.kind == "slow":
            s += f"/{self.delay_s:g}x{self.steps}"
        elif self.duration_s is not None:
            s += f"/{self.duration_s:g}"
        elif self.hold_s is not None:
            s += f"/hold={self.hold_s:g}s"
        return s

    @property
    def targets_member(self) -> bool:
        return self.kind in MEMBER_KINDS


def parse_fault(text: str) -> Fault:
    spec = text.strip()
    m = _RE.match(spec)
    if not m:
        raise ValueError(
            f"bad fault {text!r}: expected KIND@WHEN[:MEMBER][/ARG], WHEN a step (15), "
            "a time (90s, 2m) or every45s[~15s]; e.g. kill@15, hang@30/6, kill@every1m~20s"
        )
    kind = m["kind"]
    if kind not in KINDS:
        raise ValueError(f"bad fault {text!r}: kind must be one of {', '.join(KINDS)}")
    if m["member"] and kind not in MEMBER_KINDS:
        raise ValueError(f"bad fault {text!r}: {kind} hits the whole job and takes no member")
    f = Fault(
        kind,
        at_step=int(m["step"]) if m["step"] else None,
        at_s=parse_duration(m["at"]) if m["at"] else None,
        every_s=parse_duration(m["every"]) if m["every"] else None,
        jitter_s=parse_duration(m["jit"]) if m["jit"] else 0.0,
        member=m["member"],
    )
    if f.every_s is not None and not f.every_s > 0:
        raise ValueError(f"bad fault {text!r}: the period must be > 0")
    if f.every_s is not None and f.jitter_s >= f.every_s:
        raise ValueError(f"bad fault {text!r}: the jitter must be smaller than the period")
    arg = m["arg"]
    if kind == "slow":
        sm = re.fullmatch(r"(\d+(?:\.\d+)?)x(\d+)", arg or "")
        if not sm or not float(sm[1]) > 0 or int(sm[2]) < 1:
            raise ValueError(
                f"bad fault {text!r}: slow takes /DELAYxSTEPS, e.g. slow@20/0.2x30 "
                "(0.2 s more on each of 30 steps)"
            )
        return replace(f, delay_s=float(sm[1]), steps=int(sm[2]))
    if arg is not None and arg.startswith("hold="):
        if kind not in ("kill", "term"):
            raise ValueError(f"bad fault {text!r}: only kill and term take /hold=SECONDS")
        return replace(f, hold_s=parse_duration(arg[5:]))
    if arg is not None:
        if kind not in ("hang", "fill-disk", "cut"):
            raise ValueError(
                f"bad fault {text!r}: only hang, fill-disk and cut take a /SECONDS "
                "(kill and term take /hold=SECONDS)"
            )
        try:
            dur = float(arg)
        except ValueError:
            raise ValueError(f"bad fault {text!r}: /SECONDS must be a number") from None
        return replace(f, duration_s=dur)
    if kind in ("fill-disk", "cut"):
        return replace(f, duration_s=10.0)
    return f


def read_faults_file(path: str | Path) -> list[Fault]:
    """One fault spec per line; blank lines and `#` comments are ignored."""
    out: list[Fault] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        try:
            out.append(parse_fault(spec))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return out


class FaultSchedule:
    """Which faults are due, and on whom. Pure apart from its seeded generator.

    Who calls: the launcher's main loop, with the job's committed step and the
    seconds since its first committed step (None before it).
    """

    def __init__(self, faults: list[Fault], seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.pending = [f for f in faults if f.every_s is None]
        self._repeating: list[tuple[Fault, float]] = []
        for f in faults:
            if f.every_s is not None:
                self._repeating.append((f, self._next_time(f, 0.0)))

    def add(self, fault: Fault) -> None:
        """Schedule one more fault while the job runs (a driver that waits for an
        event before the next fault, as `elastrain demo --sharded` does)."""
        if fault.every_s is None:
            self.pending.append(fault)
        else:
            self._repeating.append((fault, self._next_time(fault, 0.0)))

    def _next_time(self, f: Fault, after: float) -> float:
        assert f.every_s is not None
        return after + f.every_s + (self.rng.uniform(-f.jitter_s, f.jitter_s) if f.jitter_s else 0)

    def due(self, step: int, elapsed_s: float | None = None) -> list[Fault]:
        """The faults due now (each one-off fault once; repeating ones each period)."""

        def is_due(f: Fault) -> bool:
            if f.at_step is not None:
                return step >= f.at_step
            return elapsed_s is not None and f.at_s is not None and elapsed_s >= f.at_s

        out = [f for f in self.pending if is_due(f)]
        self.pending = [f for f in self.pending if not is_due(f)]
        if elapsed_s is not None:
            again: list[tuple[Fault, float]] = []
            for f, t in self._repeating:
                if elapsed_s >= t:
                    out.append(f)
                    t = self._next_time(f, elapsed_s)
                again.append((f, t))
            self._repeating = again
        return out

    @property
    def exhausted(self) -> bool:
        """No fault will ever be due again."""
        return not self.pending and not self._repeating

    def pick(self, fault: Fault, members: list[str]) -> str | None:
        if fault.kind == "kill-coordinator":
            return COORDINATOR
        if not fault.targets_member:
            return JOB
        if fault.member is not None:
            return fault.member if fault.member in members else None
        return self.rng.choice(sorted(members)) if members else None

    def offset(self, step_s: float) -> float:
        """Delay after the step boundary so the signal lands mid-step."""
        return self.rng.uniform(0.2, 0.8) * step_s
