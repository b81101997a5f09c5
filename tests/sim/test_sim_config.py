"""Config validation: bad values and combinations are refused with a hint."""

from __future__ import annotations

import math

import pytest

from elastrain.sim.config import (
    CheckpointPolicy,
    Delay,
    FailureProcess,
    RecoveryCosts,
    SimConfig,
    StrategyConfig,
    Topology,
    Workload,
)
from elastrain.sim.svg import Chart, Marker, Series, render


@pytest.mark.parametrize(
    ("make", "hint"),
    [
        (lambda: Topology(accelerators=12), "multiple of accelerators_per_host"),
        (lambda: Topology(accelerators=64, accelerators_per_replica=12), "whole hosts"),
        (
            lambda: Topology(accelerators=64, accelerators_per_replica=48),
            "whole number of replicas",
        ),
        (lambda: FailureProcess(mtbf_s=-1), "positive"),
        (lambda: FailureProcess(mtbf_s=10, shape=0.5), "kind='weibull'"),
        (lambda: Delay(mean_s=1, kind="gamma"), "fixed, exponential or lognormal"),  # type: ignore[arg-type]
        (lambda: RecoveryCosts(detect_s=math.nan), "detect_s"),
        (lambda: CheckpointPolicy(interval_s="often"), "'young' or 'daly'"),  # type: ignore[arg-type]
        (lambda: CheckpointPolicy(save_s=0), "fixed interval_s"),
        (lambda: StrategyConfig(kind="hot-spare"), "--spare-hosts"),
        (lambda: StrategyConfig(kind="restart", spare_hosts=2), "use kind='hot-spare'"),
        (lambda: Workload(steps=0), "steps"),
        (lambda: SimConfig(topology=Topology(accelerators=8), horizon_s=None), "--days"),
        (
            lambda: SimConfig(
                topology=Topology(accelerators=16),
                strategy=StrategyConfig(kind="elastic", min_replicas=3),
            ),
            "lower min_replicas",
        ),
        (
            lambda: SimConfig(
                topology=Topology(accelerators=64), workload=Workload(global_microbatches=4)
            ),
            "every replica needs a micro-batch",
        ),
    ],
)
def test_rejected_with_a_hint(make: object, hint: str) -> None:
    with pytest.raises(ValueError, match=hint.replace("(", r"\(")):
        make()  # type: ignore[operator]


def test_derived_topology() -> None:
    t = Topology(accelerators=16384, accelerators_per_replica=128, hosts_per_domain=18)
    assert (t.hosts, t.hosts_per_replica, t.replicas, t.domains) == (2048, 16, 128, 114)
    assert FailureProcess.from_afr(0.5).mtbf_s == pytest.approx(2 * 365 * 86400)
    w = FailureProcess(mtbf_s=100.0, kind="weibull", shape=2.0)
    assert w.weibull_scale == pytest.approx(100.0 / math.gamma(1.5))
    c = RecoveryCosts(heal_s=1.0, state_bytes=8e9, heal_gbps=8.0)
    assert c.heal_time_s(hosts_per_replica=2) == pytest.approx(1.0 + 4e9 * 8 / 8e9)


def test_svg_chart_is_well_formed() -> None:
    import xml.etree.ElementTree as ET

    chart = Chart(
        title="a < b & c",
        x_label="x",
        y_label="y",
        series=[Series("s", [1, 10, 100], [0.5, 0.7, 0.6], [0.01, 0.02, 0.0])],
        markers=[Marker(20.0, "opt")],
        log_x=True,
        y_percent=True,
    )
    svg = render(chart)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert "a &lt; b &amp; c" in svg and "opt" in svg and "70%" in svg
    with pytest.raises(ValueError):
        render(Chart(title="", x_label="", y_label="", series=[]))
