"""Faults sent from outside count as injected ones do (a real run, twice).

The same small job runs twice. Run A gets its faults from the launcher
(`--fault`: a SIGKILL of w1, a SIGTERM of w3, a SIGSTOP of w2 that is
SIGCONTed a few seconds later). Run B gets the same signals at the same committed steps
from this test, with `os.kill` on the launcher's worker PIDs, so nothing in B's
events says a fault was injected. Failures are recognised from what happened
(`elastrain.observe.failures`), so both runs must show the same failures, the
same recovery rows (kind, victim, the replacement the launcher spawned for it)
and a comparable goodput ledger; and the coordinator's `/metrics` must count
the same failures in both. Were a failure only seen through `fault_injected`,
run B would show none and every comparison below would fail.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastrain.launch.launcher import Launcher
from elastrain.observe.failures import Failure, FailureKind, recognise_failures
from elastrain.observe.goodput import Goodput, goodput
from elastrain.observe.metrics import FAILURE_KINDS
from elastrain.observe.recovery import recoveries
from tests.conftest import Job, failures_metric, scrape

STEPS = 120
PACE_S = 0.1
"""Seconds per committed step at least (`--min-step-s`): the faults land at known
steps whatever the machine's speed, and the job lasts (~12 s of steps) long
enough after the last fault for its replacement to be spawned and for the hung
member to come back."""
HANG_S = 6.0
"""How long w2 stays stopped: past the coordinator's lease (5 s), so the
coordinator itself expels it whatever the watchdog did first, and /metrics sees
the hang in both runs."""


@dataclass(frozen=True)
class Planned:
    """One fault of the plan: send `kind` to `member` once `step` is committed."""

    kind: str
    step: int
    member: str

    @property
    def spec(self) -> str:
        """The same fault as a launcher `--fault` spec (elastrain.chaos.schedule)."""
        arg = f"/{HANG_S:g}" if self.kind == "hang" else ""
        return f"{self.kind}@{self.step}:{self.member}{arg}"


PLAN = (Planned("kill", 8, "w1"), Planned("term", 16, "w3"), Planned("hang", 24, "w2"))
"""The two faults that get a replacement come first: a replacement takes seconds
to start on a loaded machine, and it should have joined before the job ends."""
SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}
EXPECTED = [  # (failure kind, victim, the replacement spawned for it)
    (FailureKind.KILL, "w1", "w4"),
    (FailureKind.TERM, "w3", "w5"),
    (FailureKind.HANG, "w2", None),  # a stopped process never exits: it rejoins
]


def due(plan: Sequence[Planned], step: int, members: Sequence[str]) -> list[Planned]:
    """The faults to send now: their step is committed and their victim is a
    member of the running generation (as the launcher's injector picks them)."""
    return [f for f in plan if step >= f.step and f.member in members]


@dataclass
class Outside:
    """Sends the plan from outside the launcher, from its status callback (its main
    loop, every 0.25 s: what `--fault` fires from too). It signals only the job's
    own worker processes, through the launcher's `Popen` of the victim, and only
    while that process has not been reaped (its PID is still the worker's)."""

    plan: list[Planned]
    sent: list[tuple[Planned, int]] = field(default_factory=list)
    stopped: list[tuple[subprocess.Popen[bytes], float]] = field(default_factory=list)
    """(SIGSTOPped worker, monotonic time to SIGCONT it)."""

    def __call__(self, launcher: Launcher, status: dict[str, Any], now: float) -> None:
        for proc, until in list(self.stopped):
            if now >= until:
                self._signal(proc, signal.SIGCONT)
                self.stopped.remove((proc, until))
        step = int(status.get("step", 0))
        for f in due(self.plan, step, status.get("members", [])):
            w = launcher.workers.get(f.member)
            if w is None or w.proc.returncode is not None:
                continue  # not running right now: try again at the next status
            self.plan.remove(f)
            self.sent.append((f, w.proc.pid))
            self._signal(w.proc, SIGNALS[f.kind])
            if f.kind == "hang":
                self.stopped.append((w.proc, now + HANG_S))

    def release(self) -> None:
        """SIGCONT every worker this left stopped (teardown, whatever happened)."""
        for proc, _ in self.stopped:
            self._signal(proc, signal.SIGCONT)
        self.stopped.clear()

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        if proc.returncode is None:  # not reaped: the PID is still this worker's
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass


def scrape_failures(launcher: Launcher) -> dict[str, float]:
    """kind -> `elastrain_failures_total` on the job's coordinator's /metrics."""
    host, _, port = launcher.address.rpartition(":")
    status, text = scrape(host, int(port), launcher.token)
    assert status == 200, text
    return failures_metric(text)


@dataclass
class Watch:
    """The status callback of one run: sends the outside faults (run B only) and,
    once every planned fault was sent, scrapes the coordinator's /metrics."""

    outside: Outside | None
    metrics: list[dict[str, float]] = field(default_factory=list)

    def __call__(self, launcher: Launcher, status: dict[str, Any]) -> None:
        if self.outside is not None:
            self.outside(launcher, status, time.monotonic())
            done = not self.outside.plan
        else:
            done = launcher.schedule.exhausted and not launcher.schedule.pending
        if done and launcher.coordinator is not None:
            self.metrics.append(scrape_failures(launcher))


def kinds(fails: Sequence[Failure]) -> list[tuple[str, str]]:
    return [(str(f.kind), f.member) for f in fails]


def rows(job: Job) -> list[tuple[str, str, str | None]]:
    return [(r.fault, r.member, r.replacement) for r in recoveries(job.events)]


FAILURE_BUCKETS = ("detection", "regroup", "healing", "wasted", "replacement_wait")
"""What the failures cost ("disruption" badput): the survivors' detection,
regroup and heal, the steps they lost, the victims' detection, and the empty
slots until a replacement is spawned (or while the hung member is out). The
other buckets measure the machine, not the faults, and are not compared:
`startup` and `other` are how long `import torch` takes six processes and how
long the launcher waits for the last replacement to exit, and `productive`
grows as the load stretches the paced steps (at a load average of 8 on this
2-core machine one pair of runs had 29.8 and 22.8 productive member-s, and
14.9 and 15.0 member-s of failure badput)."""

TOLERANCE: dict[str, tuple[float, float]] = {
    # The hang dominates both: it is detected when the survivors' step watchdog
    # fires (3 s floor, or 8x the slowest recent all-reduce wait) and it holds up
    # three processes (two survivors and the victim). One load spike that slows
    # an all-reduce wait to 0.5 s makes that 4 s in one run only: +3 member-s.
    # Measured (A/B, load average 5 to 8): detection 6.2/6.2 member-s, all
    # failure buckets 11.9/12.9; with the hang planned second, 9.9/9.4 and
    # 15.0/14.6, 9.5/9.0 and 14.9/15.0.
    "detection": (0.3, 3.5),
    "failure": (0.3, 4.0),
}
"""(relative, absolute member-seconds) allowed between the two runs:
`math.isclose(a, b, rel_tol, abs_tol)`. A failure that B did not recognise moves
B's detection by that failure's whole detection time (the hang's: 6 to 9 member-s)."""


def compared(gp: Goodput) -> dict[str, float]:
    """The member-seconds that TOLERANCE compares."""
    return {
        "detection": gp.buckets["detection"],
        "failure": sum(gp.buckets[b] for b in FAILURE_BUCKETS),
    }


def test_faults_from_outside_are_recognised_as_injected_ones(
    run_job: Callable[..., Job],
) -> None:
    common: dict[str, Any] = dict(
        steps=STEPS,
        workers=4,
        script_args=["--min-step-s", str(PACE_S)],
        replace_delay_s=0.5,
        checkpoint_every=0,
    )
    watch_a = Watch(outside=None)
    a = run_job(name="injected", faults=[f.spec for f in PLAN], on_status=watch_a, **common)
    outside = Outside(list(PLAN))
    watch_b = Watch(outside=outside)
    try:
        b = run_job(name="outside", on_status=watch_b, **common)
    finally:
        outside.release()
    for job in (a, b):
        assert job.result.status == "done", job.result.message
    assert not outside.plan, f"never sent: {outside.plan}"
    assert [(f.kind, f.member) for f, _ in outside.sent] == [(f.kind, f.member) for f in PLAN]
    assert [e["fault"] for e in a.of("fault_injected")] == ["kill", "term", "hang", "resume"]
    assert b.of("fault_injected") == [], "run B must carry no injection record"

    # 1. The same failures, recognised from what happened; only A's are labelled.
    fa, fb = recognise_failures(a.events), recognise_failures(b.events)
    expected_kinds = [(str(k), m) for k, m, _ in EXPECTED]
    assert kinds(fa) == expected_kinds, fa
    assert kinds(fb) == expected_kinds, fb
    assert [f.injected for f in fa] == [f.kind for f in PLAN]
    assert [f.injected for f in fb] == [None, None, None]
    # B's victims are the very processes the test signalled.
    assert [f.pid for f in fb] == [pid for _, pid in outside.sent]

    # 2. The same recovery rows; the replacement is the one the launcher spawned for it.
    expected_rows = [(str(k), m, r) for k, m, r in EXPECTED]
    assert rows(a) == rows(b) == expected_rows
    for job in (a, b):
        for _, victim, repl in expected_rows:
            if repl is not None:
                (spawned,) = job.of("worker_spawned", member=repl)
                assert spawned["replacement"] and spawned["replaces"] == victim
        assert not job.of("worker_spawned", replaces="w2"), "a hung member is not replaced"
        for r in recoveries(job.events):
            assert r.total_s is not None and r.gen is not None, r  # the survivors recovered

    # 3. The coordinator's /metrics counted the same failures in both runs.
    want = {str(k): 0.0 for k in FAILURE_KINDS} | {str(k): 1.0 for k, _, _ in EXPECTED}
    for watch in (watch_a, watch_b):
        assert watch.metrics, "/metrics was never scraped after the faults"
        assert watch.metrics[-1] == want, watch.metrics[-1]
    assert Counter(str(f.kind) for f in fb) == Counter({k: int(v) for k, v in want.items() if v})

    # 4. Goodput: the same buckets, within a tolerance.
    ga, gb = compared(goodput(a.events)), compared(goodput(b.events))
    assert ga["detection"] > 0 and gb["detection"] > 0
    for g, (rel, abs_) in TOLERANCE.items():
        assert math.isclose(ga[g], gb[g], rel_tol=rel, abs_tol=abs_), (g, ga, gb)
