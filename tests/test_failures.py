"""Failures recognised from what happened (issue 15): an outside `kill -9`, SIGSTOP or
SIGTERM counts exactly as the same fault injected with `--fault`."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest

from elastrain.observe.failures import FailureKind, classify_exit, recognise_failures
from elastrain.observe.goodput import goodput
from elastrain.observe.recovery import recoveries
from tests.test_observe import Run, T, hang_run, kill_run, share, term_run

DATA = Path(__file__).parent / "sim" / "data"


def without_injections(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same run as if every fault had been sent from outside."""
    return [e for e in events if e["kind"] != "fault_injected"]


def rows(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (r.fault, r.member, r.gen, tuple(r.survivors), r.replacement) for r in recoveries(events)
    ]


def recorded(name: str) -> list[dict[str, Any]]:
    raw = gzip.decompress((DATA / f"{name}.jsonl.gz").read_bytes())
    return [json.loads(line) for line in raw.splitlines()]


@pytest.mark.parametrize("make", [kill_run, hang_run, term_run])
def test_outside_faults_give_the_same_failures_rows_and_buckets(make: Any) -> None:
    injected = make().events
    outside = without_injections(injected)
    assert rows(outside) == rows(injected) and len(rows(injected)) == 1
    a, b = goodput(injected).buckets, goodput(outside).buckets
    for name in a:  # the same buckets; only the fault's instant is less exact
        assert b[name] == pytest.approx(a[name], abs=0.35), name
    [fi], [fo] = recognise_failures(injected), recognise_failures(outside)
    assert fi.injected is not None and fo.injected is None
    assert fi.evidence == fo.evidence


@pytest.mark.parametrize("name", ["demo_kill_hang", "minimal_kill_hang_kill"])
def test_recorded_runs_without_their_injections(name: str) -> None:
    ev = recorded(name)
    assert rows(without_injections(ev)) == rows(ev)
    kinds = [f.kind for f in recognise_failures(ev)]
    assert kinds == ([FailureKind.KILL, FailureKind.HANG] if name == "demo_kill_hang"
                     else [FailureKind.KILL, FailureKind.HANG, FailureKind.KILL])  # fmt: skip
    a, b = goodput(ev), goodput(without_injections(ev))
    assert b.buckets["wasted"] == pytest.approx(a.buckets["wasted"], rel=0.1, abs=1.0)
    assert b.buckets["detection"] == pytest.approx(a.buckets["detection"], rel=0.1, abs=1.0)


def test_exit_statuses() -> None:
    assert classify_exit(0) is None and classify_exit(76) is None
    assert classify_exit(-9) == (FailureKind.KILL, "exited by SIGKILL")
    assert classify_exit(-15) == (FailureKind.TERM, "exited by SIGTERM")
    assert classify_exit(75)[0] is FailureKind.TERM  # type: ignore[index]
    assert classify_exit(1) == (FailureKind.CRASH, "exited with code 1")


def test_an_injection_without_evidence_is_not_a_failure() -> None:
    r = Run()
    t = r.start(["w0", "w1"])
    t = r.steps(t, 1, ["w0", "w1"], 0, 3)
    r.ev(t, "launcher", "fault_injected", fault="kill", member="w1", pid=r.pids["w1"], step=3)
    r.steps(t, 1, ["w0", "w1"], 3, 3)  # the kill missed: w1 goes on committing
    assert recognise_failures(r.events) == [] and recoveries(r.events) == []


def test_a_stall_seen_only_by_the_watchdog_is_a_failure_of_the_silent_member() -> None:
    """Issue 15: a long evaluation on rank 0 fired the others' watchdog; nobody was
    removed. It is a hang of w0, dated from when the others began to wait."""
    r = Run()
    g = ["w0", "w1", "w2"]
    t = r.start(g)
    t = r.steps(t, 1, g, 0, 3)
    for m in ("w1", "w2"):
        r.ev(t + 0.3, m, "step_contrib", step=3, gen=1, samples=share(3, g, m))
        r.ev(t + 5.3, m, "watchdog_fired", step=3, gen=1, timeout_s=5.0)
        r.ev(t + 5.3, m, "step_abort", step=3, gen=1, error="watchdog", phase="watchdog")
    r.ev(t + 9.0, "w0", "step_abort", step=3, gen=1, error="reset", phase="allreduce")
    r.form(t + 9.1, 2, g, "failure")
    r.ready(t + 9.2, 2, g)
    tb = r.build(t + 9.3, 2, g)
    r.steps(tb, 2, g, 3, 2)
    [f] = recognise_failures(r.events)
    assert (f.kind, f.member, f.injected) == (FailureKind.HANG, "w0", None)
    assert f.t == pytest.approx(T + t + 0.3, abs=1e-3)
    assert "w0 never reached the step's all-reduce" in f.how
    [rec] = recoveries(r.events)
    assert rec.gen == 2 and rec.total_s is not None
    gp = goodput(r.events)
    assert gp.buckets["detection"] > 2 * 4.9  # the others' wait is detection, not waste


def test_nothing_is_a_failure_once_the_job_is_preempted() -> None:
    r = Run()
    g = ["w0", "w1"]
    t = r.start(g)
    t = r.steps(t, 1, g, 0, 2)
    r.ev(t + 0.1, "launcher", "preempt_notice", grace_s=30)
    for m in g:
        r.ev(t + 0.5, m, "worker_exit", reason="preempted", committed=2)
        r.ev(t + 0.6, "coordinator", "member_removed", member=m, reason="left")
        r.ev(t + 0.7, "launcher", "worker_exited", member=m, pid=r.pids[m], returncode=76)
    assert recognise_failures(r.events) == []


def test_a_member_is_one_failure_until_it_rejoins() -> None:
    r = hang_run()  # removed once (suspected), its own late abort, re-registered
    r.ev(r.events[-1]["t"] - T + 1, "launcher", "worker_exited", member="w2",
         pid=r.pids["w2"], returncode=-9)  # fmt: skip
    fs = recognise_failures(r.events)
    assert [(f.kind, f.member) for f in fs] == [(FailureKind.HANG, "w2"), (FailureKind.KILL, "w2")]
    assert not math.isnan(fs[1].t) and fs[1].exited and not fs[0].exited


def test_a_kill_after_a_kill_all_is_labelled_by_the_kill() -> None:
    r = Run()
    g = ["w0", "w1"]
    t = r.start(g)
    r.ev(t + 1, "launcher", "fault_injected", fault="kill-all", member="job", pid=None, step=1)
    for m in g:
        r.ev(t + 1.1, "launcher", "worker_exited", member=m, pid=r.pids[m], returncode=-9)
    r.spawn(t + 5, "w2", replacement=True)
    r.ev(t + 9, "launcher", "fault_injected", fault="kill", member="w2", pid=r.pids["w2"], step=3)
    r.ev(t + 9.1, "launcher", "worker_exited", member="w2", pid=r.pids["w2"], returncode=-9)
    labels = [(f.member, f.injected) for f in recognise_failures(r.events)]
    assert labels == [("w0", "kill-all"), ("w1", "kill-all"), ("w2", "kill")]
