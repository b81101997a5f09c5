"""The script's own scalars (`trainer.log`) past the engine: the wire, the tally,
`/metrics`, the live view and TensorBoard. In-process, no jobs (the engine's side
is in test_protocol.py, a real job's in test_examples.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from elastrain.control import protocol as p
from elastrain.launch.progress import Progress, observe
from elastrain.observe.events import EventKind, EventLog
from elastrain.observe.metrics import USER_SCALAR, CoordinatorMetrics
from elastrain.observe.scalars import MAX_METRIC_SCALARS, check_scalar, last_scalars
from elastrain.observe.tally import WorkerTally
from elastrain.observe.tensorboard import LOSS, TensorBoardSink

from .conftest import metric_samples


def test_names_and_values_a_script_may_log() -> None:
    assert check_scalar("eval/ppl-2.x_y", 3) == 3.0
    for bad in ("", "a b", "é", "x" * 65, 7):
        with pytest.raises(ValueError, match="letters, digits"):
            check_scalar(bad, 1.0)
    for v in (math.inf, math.nan):
        with pytest.raises(ValueError, match="finite"):
            check_scalar("lr", v)
    for v in ("1", None, True):
        with pytest.raises(TypeError, match="expected a number"):
            check_scalar("lr", v)


def quorum(scalars: Any) -> dict[str, Any]:
    return {"member": "w0", "incarnation": 1, "gen": 1, "step": 3, "scalars": scalars}


def test_the_wire_takes_valid_scalars_and_refuses_the_rest() -> None:
    assert p.decode(p.QuorumRequest, quorum({"lr": 1e-3, "n": 2})).scalars == {"lr": 1e-3, "n": 2}
    assert p.decode(p.QuorumRequest, quorum({"lr": -1.5})).scalars == {"lr": -1.5}
    with pytest.raises(p.ProtocolError, match="name 'a b'"):
        p.decode(p.QuorumRequest, quorum({"a b": 1.0}))
    with pytest.raises(p.ProtocolError, match="finite"):
        p.decode(p.QuorumRequest, quorum({"lr": math.nan}))
    too_many = {f"s{i}": 1.0 for i in range(MAX_METRIC_SCALARS + 1)}
    with pytest.raises(p.ProtocolError, match=f"more than {MAX_METRIC_SCALARS} names"):
        p.decode(p.QuorumRequest, quorum(too_many))


def scalar_event(name: str, value: float, step: int, t: float = 0.0) -> dict[str, Any]:
    return {"kind": "user_scalar", "name": name, "value": value, "step": step, "t": t, "mono": t}


def test_the_tally_sends_the_last_value_per_name_and_at_most_the_bound() -> None:
    tally = WorkerTally()
    for i in range(MAX_METRIC_SCALARS + 5):
        tally.see(scalar_event(f"s{i}", float(i), 1))
    tally.see(scalar_event("s0", -2.0, 2))
    got = tally.take_scalars()
    assert len(got) == MAX_METRIC_SCALARS and got["s0"] == -2.0
    assert f"s{MAX_METRIC_SCALARS}" not in got
    assert tally.take_scalars() == {}


def test_metrics_show_the_last_value_of_the_first_names_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = CoordinatorMetrics(lambda: {"job_id": "j"})
    assert USER_SCALAR not in metrics.exposition().decode()
    metrics.observe_scalars({"lr": 0.1, "eval/ppl": 9.0})
    metrics.observe_scalars({"lr": 0.05})
    metrics.observe_scalars({f"x{i}": 1.0 for i in range(MAX_METRIC_SCALARS)})
    samples = [s for s in metric_samples(metrics.exposition().decode()) if s.name == USER_SCALAR]
    by_name = {s.labels["name"]: s.value for s in samples}
    assert len(by_name) == MAX_METRIC_SCALARS
    assert by_name["lr"] == 0.05 and by_name["eval/ppl"] == 9.0
    assert "x31" not in by_name and "'x31' is not in /metrics" in caplog.text


def test_the_live_view_and_report_show_the_last_value_per_name() -> None:
    events = [scalar_event("lr", 0.1, 0, 1.0), scalar_event("acc", 0.5, 0, 1.1),
              scalar_event("lr", 0.2, 1, 2.0)]  # fmt: skip
    assert last_scalars(events) == {"lr": (0.2, 1), "acc": (0.5, 0)}
    prog = Progress(None, plain=True)
    prog.observed = observe(events)
    assert "lr 0.2 acc 0.5" in prog.health()


def test_tensorboard_files_hold_each_step_once_and_the_scripts_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    w0, w1 = EventLog(run, "w0"), EventLog(run, "w1")
    sink = TensorBoardSink(run, tmp_path / "tb", poll_s=3600)  # polled by hand below
    for step in range(3):
        for log in (w0, w1):  # every member commits the same step
            log.emit(EventKind.STEP_COMMIT, step=step, gen=1, loss=1.0 / (step + 1),
                     step_s=0.5, samples=8, samples_per_s=16.0, grad_norm=1.0, skipped=False,
                     compute_s=0.4, data_s=0.0, allreduce_s=0.05)  # fmt: skip
        w0.emit(EventKind.USER_SCALAR, name="lr", value=0.01 * (step + 1), step=step)
        if step == 1:
            sink.poll()  # a batch boundary in the middle of the run
    sink.close()
    w0.close()
    w1.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = [(s.step, s.value) for s in acc.Scalars(LOSS)]
    assert loss == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    lr = [(s.step, s.value) for s in acc.Scalars("user/lr")]
    assert lr == [(s, pytest.approx(0.01 * (s + 1))) for s in range(3)]
    assert [s.step for s in acc.Scalars("train/step_seconds")] == [0, 1, 2]
