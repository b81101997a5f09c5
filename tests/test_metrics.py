"""The coordinator's Prometheus endpoint: format, token, and a live scrape."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any

from elastrain.launch.launcher import Launcher
from elastrain.observe.metrics import parse_prometheus, prometheus_text


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


def scrape(host: str, port: int, token: str | None) -> tuple[int, str]:
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c.request("GET", "/metrics", headers=headers)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def test_metrics_scraped_over_http_show_the_step_moving(run_job: Callable[..., Any]) -> None:
    """Scrape /metrics from the launcher's status callback (every 0.25 s) while the
    job runs, until two scrapes saw different committed step counts."""
    seen: list[dict[str, float]] = []
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
