"""The coordinator's Prometheus endpoint: format, token, and a live scrape."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer
from elastrain.exitcodes import EXIT_LEFT
from elastrain.launch.launcher import Launcher
from elastrain.observe.events import read_events
from elastrain.observe.failures import EVIDENCE_KINDS, recognise_failures
from elastrain.observe.metrics import (
    FAILURE_KINDS,
    FAILURES,
    failure_counts,
    parse_prometheus,
    prometheus_text,
)
from tests.conftest import failures_metric, scrape


def test_prometheus_text_format() -> None:
    st = {"job_id": 'j"1', "step": 12, "members": ["w0", "w1"], "target": 3, "min": 1,
          "registered": {"w0": {}, "w1": {}}, "gen": 4, "ready": True, "steps_per_s": 2.5,
          "samples_per_s": 80.0, "loss": None, "waiting": "", "finished": False,
          "preempting": False, "uptime_s": 9.5}  # fmt: skip
    text = prometheus_text(st)
    m = parse_prometheus(text)
    assert m["elastrain_step"] == 12 and m["elastrain_members"] == 2
    assert m["elastrain_target"] == 3 and m["elastrain_generation"] == 4
    assert m["elastrain_generation_ready"] == 1 and m["elastrain_waiting"] == 0
    assert m["elastrain_samples_per_second"] == 80.0
    assert "elastrain_loss" not in m  # unknown before the first step: left out
    assert 'elastrain_step{job="j\\"1"} 12.0' in text
    assert "# TYPE elastrain_step gauge" in text
    assert "elastrain_loss" in prometheus_text({**st, "loss": 0.5})
    assert FAILURES not in text  # a status without failure counts: no counter


def ev(t: float, kind: str, proc: str = "coordinator", **f: Any) -> dict[str, Any]:
    return {"t": t, "mono": t, "proc": proc, "pid": 1, "kind": kind, **f}


# What a coordinator writes for: w1 SIGKILLed (the launcher reports the exit),
# w2 hung (its lease ran out; it re-registers once continued), w3 SIGTERMed (it
# leaves, then exits with EXIT_LEFT), w0 finishing (exit 0: not a failure).
COORDINATOR_SAW = [
    ev(0.0, "generation_formed", gen=1, members=["w0", "w1", "w2", "w3"], reason="start"),
    ev(5.0, "exit_reported", member="w1", pid=11, returncode=-9),
    ev(5.0, "member_removed", member="w1", reason="exited"),
    ev(5.1, "generation_formed", gen=2, members=["w0", "w2", "w3"], reason="failure"),
    ev(9.0, "member_removed", member="w2", reason="lease_expired"),
    ev(9.1, "generation_formed", gen=3, members=["w0", "w3"], reason="failure"),
    ev(12.0, "member_registered", member="w2", incarnation=2, pid=12, gen=2, running=False),
    ev(14.0, "member_removed", member="w3", reason="left"),
    ev(14.2, "exit_reported", member="w3", pid=13, returncode=EXIT_LEFT),
    ev(20.0, "exit_reported", member="w0", pid=10, returncode=0),
]


def test_failures_counted_from_a_recorded_coordinator_sequence() -> None:
    """The counter is `recognise_failures` over the coordinator's own records, every
    member kind present; and in a run's merged events the launcher's
    `worker_exited` and the coordinator's `exit_reported` of one exit are one failure."""
    counts = failure_counts(COORDINATOR_SAW)
    assert counts == {"kill": 1, "term": 1, "crash": 0, "hang": 1}
    assert set(counts) == {str(k) for k in FAILURE_KINDS}
    text = prometheus_text({"job_id": "j", "step": 3, "failures": counts})
    assert failures_metric(text) == {"kill": 1.0, "term": 1.0, "crash": 0.0, "hang": 1.0}
    assert f"# TYPE {FAILURES} counter" in text
    assert all(e["kind"] in EVIDENCE_KINDS for e in COORDINATOR_SAW)
    launcher = [
        ev(4.99, "worker_exited", "launcher", member="w1", pid=11, returncode=-9),
        ev(14.19, "worker_exited", "launcher", member="w3", pid=13, returncode=EXIT_LEFT),
    ]
    merged = recognise_failures(COORDINATOR_SAW + launcher)
    assert [(f.kind, f.member) for f in merged] == [("kill", "w1"), ("hang", "w2"), ("term", "w3")]
    kill = merged[0]
    assert kill.exit_t == 4.99 and [e.event for e in kill.evidence] == [
        "worker_exited", "exit_reported", "member_removed"]  # fmt: skip
    # An exit status the launcher reported but the coordinator alone knows still counts.
    crash = ev(30.0, "exit_reported", member="w4", pid=14, returncode=1)
    assert failure_counts([*COORDINATOR_SAW, crash])["crash"] == 1


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CoordinatorServer]:
    # Short lease: a member that stops heartbeating is expelled within ~2 s.
    cfg = CoordinatorConfig(target=5, min_members=1, lease_s=2.0, suspect_s=1.0)
    srv = CoordinatorServer(cfg, "t0ken", run_dir=str(tmp_path / "coord")).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_coordinator_metrics_count_the_exits_it_was_told_and_the_lease_it_saw_run_out(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    """A live coordinator (HTTP on port 0): the launcher's `exit` ops and a lapsed
    lease become `elastrain_failures_total`; what it wrote is what it counted."""
    cl = CoordinatorClient(server.address, "t0ken", timeout_s=5.0)
    sig = [["w", [2], "torch.float32"]]
    try:
        inc = {m: cl.register(p.RegisterRequest(m, 100 + i, "127.0.0.1", sig)).incarnation
               for i, m in enumerate(["w0", "w1", "w2", "w3", "w4"])}  # fmt: skip

        def beat(*members: str) -> None:
            for m in members:
                cl.heartbeat(p.HeartbeatRequest(m, inc[m], 0, 0.0))

        cl.exit(p.ExitRequest("w1", 101, -9))  # SIGKILL
        cl.leave(p.LeaveRequest("w3", inc["w3"], "left"))
        cl.exit(p.ExitRequest("w3", 103, EXIT_LEFT))  # SIGTERM: a graceful leave
        cl.exit(p.ExitRequest("w4", 104, 1))  # a crash
        # w2 goes silent while w0 keeps heartbeating: its lease runs out (a hang).
        deadline = time.monotonic() + 10
        while cl.status()["failures"]["hang"] == 0:
            assert time.monotonic() < deadline, "the silent member was never expelled"
            beat("w0")
            time.sleep(0.1)  # heartbeat cadence of a live member, not a wait for a result
        status, text = scrape(server.host, server.port, "t0ken")
        assert status == 200
        assert failures_metric(text) == {"kill": 1.0, "term": 1.0, "crash": 1.0, "hang": 1.0}
        cl.exit(p.ExitRequest("w0", 100, 0))  # finished: not a failure
        assert cl.status()["failures"] == {"kill": 1, "term": 1, "crash": 1, "hang": 1}
    finally:
        cl.close()
    server.events.close()
    own = [e for e in read_events(tmp_path / "coord") if e["proc"] == "coordinator"]
    assert [e["member"] for e in own if e["kind"] == "exit_reported"] == ["w1", "w3", "w4", "w0"]
    assert failure_counts(own) == {"kill": 1, "term": 1, "crash": 1, "hang": 1}


def test_metrics_scraped_over_http_show_the_step_moving(run_job: Callable[..., Any]) -> None:
    """Scrape /metrics from the launcher's status callback (every 0.25 s) while the
    job runs, until two scrapes saw different committed step counts."""
    seen: list[dict[str, float]] = []
    texts: list[str] = []
    refused: list[int] = []

    def on_status(launcher: Launcher, status: dict[str, Any]) -> None:
        if len({s["elastrain_step"] for s in seen if s["elastrain_step"] > 0}) >= 2:
            return
        host, _, port = launcher.address.rpartition(":")
        if not refused:
            refused.append(scrape(host, int(port), None)[0])
        code, text = scrape(host, int(port), launcher.token)
        assert code == 200, text
        seen.append(parse_prometheus(text))
        texts.append(text)

    job = run_job(steps=150, workers=2, on_status=on_status)
    assert job.result.status == "done"
    assert refused == [401], "/metrics requires the job token"
    steps = [s["elastrain_step"] for s in seen]
    moving = sorted({x for x in steps if x > 0})
    assert len(moving) >= 2, f"the step never moved between scrapes: {steps}"
    assert steps == sorted(steps)
    last = seen[-1]
    assert last["elastrain_target"] == 2 and last["elastrain_members"] == 2
    assert last["elastrain_samples_per_second"] > 0 and "elastrain_loss" in last
    # No failure in this run: every kind is exposed, at zero.
    assert failures_metric(texts[-1]) == {str(k): 0.0 for k in FAILURE_KINDS}
