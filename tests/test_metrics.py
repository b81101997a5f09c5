"""The coordinator's Prometheus endpoint: format, token, and a live scrape."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer
from elastrain.exitcodes import EXIT_LEFT
from elastrain.launch.launcher import Launcher
from elastrain.observe.events import read_events
from elastrain.observe.failures import EVIDENCE_KINDS, recognise_failures
from elastrain.observe.metrics import (
    FAILURE_KINDS,
    FAILURES,
    CoordinatorMetrics,
    failure_counts,
)
from elastrain.observe.tally import RECOVERY_PHASES, Observed, WorkerTally
from tests.conftest import failures_metric, metric_samples, metric_values, scrape


def exposition(status: dict[str, Any]) -> str:
    return CoordinatorMetrics(lambda: status).exposition().decode()


def test_status_gauges_in_the_prometheus_text_format() -> None:
    st = {"job_id": 'j"1', "step": 12, "members": ["w0", "w1"], "target": 3, "min": 1,
          "registered": {"w0": {}, "w1": {}}, "gen": 4, "ready": True, "steps_per_s": 2.5,
          "samples_per_s": 80.0, "loss": None, "waiting": "", "finished": False,
          "preempting": False, "uptime_s": 9.5}  # fmt: skip
    text = exposition(st)
    m = metric_values(text)
    assert m["elastrain_step"] == 12 and m["elastrain_members"] == 2
    assert m["elastrain_target"] == 3 and m["elastrain_generation"] == 4
    assert m["elastrain_generation_ready"] == 1 and m["elastrain_waiting"] == 0
    assert m["elastrain_samples_per_second"] == 80.0
    assert "elastrain_loss" not in m  # unknown before the first step: left out
    info = [s for s in metric_samples(text) if s.name == "elastrain_job_info"]
    assert [s.labels for s in info] == [{"job_id": 'j"1'}]  # escaped and read back
    assert "# TYPE elastrain_step gauge" in text
    assert "elastrain_loss" in metric_values(exposition({**st, "loss": 0.5}))
    assert FAILURES not in text  # a status without failure counts: no counter
    # Nothing observed yet: counters at zero, every recovery phase present, no goodput.
    assert m["elastrain_committed_steps_total"] == 0 and m["elastrain_healed_bytes_total"] == 0
    phases = {s.labels["phase"] for s in metric_samples(text)
              if s.name == "elastrain_recovery_seconds_count"}  # fmt: skip
    assert phases == set(RECOVERY_PHASES)
    assert "elastrain_goodput_ratio" not in m


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
    text = exposition({"job_id": "j", "step": 3, "failures": counts})
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


def wev(mono: float, kind: str, **f: Any) -> dict[str, Any]:
    return {"t": mono, "mono": mono, "proc": "w0", "pid": 1, "kind": kind, **f}


def test_a_workers_tally_reports_each_number_once_across_the_members() -> None:
    """The leader reports step seconds and, once per interruption, the recovery
    phases from its first abort; a receiver reports its heal; nothing twice."""
    leader, receiver = WorkerTally(), WorkerTally()
    for e in [
        wev(1.0, "group_built", gen=1, rank=0, size=2, build_s=0.2),
        wev(2.0, "step_commit", step=0, gen=1, step_s=0.1),
        wev(10.0, "step_abort", step=1, gen=1, error="peer died", phase="allreduce"),
        wev(10.5, "step_abort", step=1, gen=1, error="again", phase="regroup"),  # same one
        wev(12.0, "group_built", gen=2, rank=0, size=2, build_s=0.5),
        wev(13.0, "heal_end", gen=2, role="send", bytes=4096, seconds=1.0, rate_mb_s=0.0),
        wev(14.0, "step_commit", step=1, gen=2, step_s=0.2),
    ]:
        leader.see(e)
    got = leader.take()
    assert got == {
        Observed.STEP_S: [0.1, 0.2],
        Observed.RECOVERY_QUORUM_S: [1.5],  # abort -> generation ready (12.0 - 0.5)
        Observed.RECOVERY_REGROUP_S: [0.5],
        Observed.RECOVERY_HEAL_S: [1.0],
        Observed.RECOVERY_FIRST_STEP_S: [1.0],
    }
    assert leader.take() == {}  # taken once
    for e in [
        wev(10.0, "step_abort", step=1, gen=1, error="x", phase="allreduce"),
        wev(12.0, "group_built", gen=2, rank=1, size=2, build_s=0.5),
        wev(13.0, "heal_end", gen=2, role="recv", bytes=4096, seconds=0.8, rate_mb_s=5.0),
        wev(14.0, "step_commit", step=1, gen=2, step_s=0.2),
    ]:
        receiver.see(e)
    assert receiver.take() == {Observed.HEAL_S: [0.8], Observed.HEALED_BYTES: [4096.0]}


def test_the_coordinator_counts_commits_and_what_the_workers_observed(tmp_path: Path) -> None:
    """Quorum requests move the counters and histograms on a live coordinator's
    /metrics (port 0), read back with prometheus_client's parser; a request
    carrying an unknown kind is refused."""
    srv = CoordinatorServer(CoordinatorConfig(target=2), "t0ken", run_dir=str(tmp_path)).start()
    cl = CoordinatorClient(srv.address, "t0ken", timeout_s=5.0)
    try:
        sig = [["w", [2], "torch.float32"]]
        inc = {m: cl.register(p.RegisterRequest(m, 100 + i, "127.0.0.1", sig)).incarnation
               for i, m in enumerate(["w0", "w1"])}  # fmt: skip
        for m in inc:
            cl.rendezvous(p.RendezvousRequest(m, inc[m], 0, 0, wait_s=0.0))
        gen = cl.rendezvous(p.RendezvousRequest("w0", inc["w0"], 0, 0)).gen
        _, before = scrape(srv.host, srv.port, "t0ken")
        leader = {Observed.STEP_S: [0.25], Observed.RECOVERY_QUORUM_S: [0.5],
                  Observed.RECOVERY_REGROUP_S: [0.1], Observed.RECOVERY_HEAL_S: [2.0],
                  Observed.RECOVERY_FIRST_STEP_S: [0.3]}  # fmt: skip
        healed = {Observed.HEAL_S: [2.0], Observed.HEALED_BYTES: [1e6]}
        for step in range(3):
            for m, seen in (("w0", leader if step else {}), ("w1", healed if step == 1 else {})):
                v = cl.quorum(p.QuorumRequest(m, inc[m], gen, step, global_batch=8, observed=seen))
                assert v.verdict == "proceed"
        with pytest.raises(CoordinatorError, match="unknown kind 'bogus'"):
            cl.quorum(p.QuorumRequest("w0", inc["w0"], gen, 3, observed={"bogus": [1.0]}))
        _, after = scrape(srv.host, srv.port, "t0ken")
    finally:
        cl.close()
        srv.stop()
    m0, m = metric_values(before), metric_values(after)
    assert m0["elastrain_committed_steps_total"] == 0 and m0["elastrain_step_seconds_count"] == 0
    assert m["elastrain_committed_steps_total"] == 3  # one per step, not per member
    assert m["elastrain_samples_total"] == 24
    assert m["elastrain_step_seconds_count"] == 2 and m["elastrain_step_seconds_sum"] == 0.5
    assert m["elastrain_heal_seconds_count"] == 1 and m["elastrain_healed_bytes_total"] == 1e6
    assert m["elastrain_recoveries_total"] == 2
    phases = {s.labels["phase"]: s.value for s in metric_samples(after)
              if s.name == "elastrain_recovery_seconds_sum"}  # fmt: skip
    assert phases == {"quorum": 1.0, "regroup": 0.2, "heal": 4.0, "first_step": 0.6}
    buckets = [s for s in metric_samples(after) if s.name == "elastrain_step_seconds_bucket"]
    assert {s.labels["le"]: s.value for s in buckets}["0.25"] == 2  # base unit: seconds
    assert 0 < m["elastrain_goodput_ratio"] <= 1
    assert m["elastrain_members"] == 2 and m["elastrain_generation"] == gen


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
    job runs, until two scrapes saw different committed step counts and the
    leader's step seconds arrived."""
    seen: list[dict[str, float]] = []
    texts: list[str] = []
    refused: list[int] = []

    def on_status(launcher: Launcher, status: dict[str, Any]) -> None:
        moved = len({s["elastrain_step"] for s in seen if s["elastrain_step"] > 0}) >= 2
        if moved and seen[-1]["elastrain_step_seconds_count"] > 0:
            return
        host, _, port = launcher.address.rpartition(":")
        if not refused:
            refused.append(scrape(host, int(port), None)[0])
        code, text = scrape(host, int(port), launcher.token)
        assert code == 200, text
        seen.append(metric_values(text))
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
    # The counters and the leader's step seconds (sent in its quorum requests) moved.
    commits = [s["elastrain_committed_steps_total"] for s in seen]
    assert commits == sorted(commits) and commits[-1] > commits[0], commits
    assert last["elastrain_samples_total"] > 0 and last["elastrain_step_seconds_count"] > 0
    assert last["elastrain_step_seconds_sum"] > 0 and 0 < last["elastrain_goodput_ratio"] <= 1
    # No failure in this run: every kind is exposed, at zero.
    assert failures_metric(texts[-1]) == {str(k): 0.0 for k in FAILURE_KINDS}


def test_the_grafana_dashboard_queries_only_exported_metrics() -> None:
    """docs/grafana-dashboard.json is valid JSON whose every panel queries metrics
    that /metrics exports (sample names, `_bucket`/`_sum`/`_count` included)."""
    import json
    import re

    from tests.conftest import ROOT

    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    st = {"job_id": "j", "step": 3, "members": ["w0"], "target": 2, "min": 1, "registered": {},
          "gen": 1, "ready": True, "steps_per_s": 1.0, "samples_per_s": 8.0, "loss": 0.5,
          "waiting": "", "finished": False, "preempting": False, "uptime_s": 1.0,
          "failures": failure_counts([])}  # fmt: skip
    metrics = CoordinatorMetrics(lambda: st)
    metrics.observe({Observed.STEP_S: [0.1]})
    exported = {s.name for s in metric_samples(metrics.exposition().decode())}
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert len(exprs) >= len(dash["panels"]) >= 8
    for expr in exprs:
        names = set(re.findall(r"\belastrain_\w+", expr))
        assert names and names <= exported, (expr, names - exported)
