"""The failure watch's pure rules (`elastrain.launch.startup.FailureWatch`, issue 40):
a deterministic script error, the restart budget, a whole-job death; and the exit
record's script frame (`elastrain.exitrecord`) and its wire shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain.control import protocol as p
from elastrain.exitcodes import EXIT_DEVICE_POISONED, EXIT_LEFT, EXIT_STATE_LOST, EXIT_STATE_TORN
from elastrain.exitrecord import ScriptError, from_exception, read_record, write_record
from elastrain.launch.startup import Exit, FailureWatch, StopCause, stop_message

BUG = ScriptError("ValueError", "grad norm is None at step 3", "/job/train.py:66")
OTHER_LINE = ScriptError("ValueError", "grad norm is None at step 3", "/job/train.py:70")


def crash(member: str, t: float, err: ScriptError | None = BUG, **kw: object) -> Exit:
    return Exit(member, 100 + int(t * 10), 1, t, committed=True, error=err, **kw)  # type: ignore[arg-type]


def test_the_same_exception_at_the_same_line_twice_stops_whatever_members_and_messages() -> None:
    w = FailureWatch(max_same_error=2, window_s=60.0)
    assert w.on_exit(crash("w0", 0.0)) is None
    other_msg = ScriptError("ValueError", "grad norm is None at step 4", BUG.where)
    stop = w.on_exit(crash("w1", 1.5, other_msg))
    assert stop is not None and stop.cause is StopCause.SAME_ERROR
    assert stop.member == "w0" and stop.count == 2 and stop.error == other_msg
    assert "not a hardware failure" in stop.head and "w0 and w1" in stop.head


def test_another_line_another_type_or_a_record_outside_the_window_is_not_the_same_error() -> None:
    w = FailureWatch(max_same_error=2, window_s=10.0)
    assert w.on_exit(crash("w0", 0.0)) is None
    assert w.on_exit(crash("w1", 1.0, OTHER_LINE)) is None
    assert w.on_exit(crash("w2", 2.0, ScriptError("KeyError", "'x'", BUG.where))) is None
    assert w.on_exit(crash("w3", 10.5)) is None  # w0's is 10.5 s old: out of the window
    assert w.on_exit(crash("w4", 11.0)) is not None


def test_kills_injected_faults_leaves_and_device_errors_never_count() -> None:
    """How the rule tells the soak's injected crashes apart: they leave no exit
    record (a signal, exit 74 or 75), and a process the fault schedule killed is
    `injected` whatever it exited with."""
    w = FailureWatch(max_same_error=2)
    for i, rc in enumerate((-9, EXIT_LEFT, EXIT_DEVICE_POISONED, 0)):
        assert w.on_exit(Exit(f"w{i}", i, rc, float(i), committed=True)) is None
    assert w.on_exit(crash("w5", 5.0, injected=True)) is None
    assert w.on_exit(crash("w6", 6.0, injected=True)) is None
    assert w.on_exit(crash("w7", 7.0)) is None  # the first that counts
    assert not FailureWatch.counts(Exit("w8", 8, -9, 8.0))


def test_zero_never_stops_for_the_same_error() -> None:
    w = FailureWatch(max_same_error=0)
    assert all(w.on_exit(crash(f"w{i}", float(i))) is None for i in range(10))


def test_before_the_first_step_the_startup_rule_still_reads_the_log() -> None:
    w = FailureWatch(max_same_error=0)
    assert w.on_exit(Exit("w0", 1, 1, 0.0, log_signature="OSError: no data")) is None
    stop = w.on_exit(Exit("w1", 2, 1, 0.1, log_signature="OSError: no data"))
    assert stop is not None and stop.cause is StopCause.STARTUP and stop.member == "w0"
    stop = FailureWatch().on_exit(Exit("w0", 1, EXIT_STATE_LOST, 0.0))
    assert stop is not None and stop.cause is StopCause.STATE_LOST


def test_torn_heals_are_replaced_even_before_the_first_step_but_cost_the_budget() -> None:
    """Two joiners torn by the same dying sender leave the same log: a peer's failure,
    not a startup mistake, so the job goes on; each replacement still counts."""
    w = FailureWatch(max_replacements=1, window_s=100.0)
    for i in range(2):
        torn = Exit(f"w{i}", i, EXIT_STATE_TORN, float(i), log_signature="heal failed midway")
        assert w.on_exit(torn) is None
    assert w.on_replace(Exit("w0", 0, EXIT_STATE_TORN, 0.0)) is None
    stop = w.on_replace(Exit("w1", 1, EXIT_STATE_TORN, 1.0))
    assert stop is not None and stop.cause is StopCause.BUDGET


def test_torn_heals_with_the_same_cause_of_their_own_stop_the_job_naming_the_cause() -> None:
    """A torn heal whose cause is the member's own (an object refusing the healed
    state, in its exit record) tears every replacement again: the second with the
    same cause stops the job, naming it; injected ones and another cause do not."""
    refused = ScriptError("ValueError", "refuses the healed state", "/job/train.py:40")

    def torn(member: str, t: float, err: ScriptError, **kw: object) -> Exit:
        return Exit(member, int(t * 10), EXIT_STATE_TORN, t, error=err, **kw)  # type: ignore[arg-type]

    w = FailureWatch(max_same_error=2, window_s=100.0)
    assert w.on_exit(torn("w0", 0.0, refused)) is None
    assert w.on_exit(torn("w1", 1.0, refused, injected=True)) is None
    assert w.on_exit(torn("w2", 2.0, ScriptError("KeyError", "'x'", refused.where))) is None
    stop = w.on_exit(torn("w3", 3.0, refused))
    assert stop is not None and stop.cause is StopCause.SAME_ERROR, stop
    assert stop.member == "w0" and stop.count == 2 and stop.error == refused
    assert "exit 73" in stop.head and "ValueError: refuses the healed state" in stop.head
    assert "torn again" in stop.head, stop.head
    quiet = FailureWatch(max_same_error=0)
    assert all(quiet.on_exit(torn(f"w{i}", float(i), refused)) is None for i in range(5))


def test_the_restart_budget_counts_replaced_failures_within_the_window() -> None:
    w = FailureWatch(max_replacements=2, window_s=100.0)
    assert w.on_replace(crash("w0", 0.0, None)) is None
    assert w.on_replace(Exit("w1", 1, -9, 1.0)) is None  # a kill from outside is a failure
    assert w.on_replace(crash("w2", 2.0, None, injected=True)) is None  # injected: free
    assert w.on_replace(Exit("w3", 3, EXIT_LEFT, 3.0)) is None  # a leave: free
    stop = w.on_replace(crash("w4", 50.0, None))
    assert (
        stop is not None and stop.cause is StopCause.BUDGET and "--max-replacements 2" in stop.head
    )
    assert w.on_replace(crash("w5", 101.0, None)) is None  # w0's replacement aged out
    assert FailureWatch(max_replacements=0).on_replace(crash("w0", 0.0)) is None


def test_a_whole_job_death_without_a_checkpoint_after_committed_steps_stops() -> None:
    w = FailureWatch()
    assert w.on_job_death(progress=0, start=0, has_checkpoint=False) is None  # nothing trained
    stop = w.on_job_death(progress=12, start=0, has_checkpoint=False)
    assert stop is not None and stop.cause is StopCause.JOB_DEATH
    assert "12 steps" in stop.head and "from step 0" in stop.head


def test_a_whole_job_death_resumes_once_per_committed_progress() -> None:
    w = FailureWatch()
    assert w.on_job_death(progress=12, start=0, has_checkpoint=True) is None
    # The same death, asked again by the next replacement: still let through.
    assert w.on_job_death(progress=12, start=0, has_checkpoint=True) is None
    w.on_state_held()
    stop = w.on_job_death(progress=12, start=0, has_checkpoint=True)
    assert stop is not None and "without committing a step" in stop.head
    w2 = FailureWatch()
    assert w2.on_job_death(12, 0, True) is None
    w2.on_state_held()
    assert w2.on_job_death(15, 0, True) is None  # it got further: resume again


def test_the_message_shows_the_exception_once_the_log_and_what_to_run(tmp_path: Path) -> None:
    w = FailureWatch()
    w.on_exit(crash("w0", 0.0))
    stop = w.on_exit(crash("w1", 1.0))
    assert stop is not None
    msg = stop_message(stop, tmp_path / "w0.log", ["Traceback", "ValueError: x"], "run it again")
    assert msg.count("ValueError: grad norm is None at step 3") == 1
    assert f"at {BUG.where}" in msg and "  | ValueError: x" in msg
    assert msg.splitlines()[-1] == "run it again"


def _raise_here() -> None:
    raise KeyError("lr")


def test_the_record_names_the_innermost_frame_outside_libraries(tmp_path: Path) -> None:
    try:
        _raise_here()
    except KeyError as e:
        err = from_exception(e)
    line = _raise_here.__code__.co_firstlineno + 1
    assert err == ScriptError("KeyError", "'lr'", f"{__file__}:{line}")
    # A frame inside the standard library is skipped for the caller's.
    try:
        int("x")
    except ValueError as e:
        assert from_exception(e).where.startswith(__file__ + ":")
    write_record(tmp_path, "w3", 42, err)
    assert read_record(tmp_path, "w3", 42) == err
    assert read_record(tmp_path, "w3", 43) is None


_TORN_SCRIPT = """
from elastrain.exitcodes import WorkerExit
from elastrain.exitrecord import ScriptError
raise WorkerExit(73, "state_torn", "torn", record=ScriptError("ValueError", "no", "t.py:4"))
"""


def test_the_entry_point_writes_the_record_a_library_exit_carries(tmp_path: Path) -> None:
    """A torn heal of the member's own leaves its cause where the launcher reads
    exit records, with the exit status the library asked for."""
    import os
    import subprocess
    import sys

    from elastrain import env

    script = tmp_path / "torn.py"
    script.write_text(_TORN_SCRIPT)
    environ = dict(os.environ, **{env.RUN_DIR: str(tmp_path), env.MEMBER_ID: "w2"})
    proc = subprocess.Popen([sys.executable, "-m", "elastrain.worker", str(script)], env=environ)
    assert proc.wait(timeout=120) == EXIT_STATE_TORN
    assert read_record(tmp_path, "w2", proc.pid) == ScriptError("ValueError", "no", "t.py:4")


def test_the_exit_request_carries_the_error_and_old_bodies_still_decode() -> None:
    old = {"member": "w1", "pid": 7, "returncode": 1}
    assert p.decode(p.ExitRequest, old) == p.ExitRequest("w1", 7, 1, "", "", "")
    req = p.ExitRequest("w1", 7, 1, BUG.type, BUG.message, BUG.where)
    assert p.decode(p.ExitRequest, p.encode(req)) == req
    with pytest.raises(p.ProtocolError):
        p.decode(p.ExitRequest, {**old, "error_message": "x" * 600})


def test_failures_of_one_script_error_are_one_row_with_their_count() -> None:
    from elastrain.observe.failures import recognise_failures
    from elastrain.observe.recovery import by_cause, format_recoveries, recoveries

    err = {"error_type": BUG.type, "error_message": BUG.message, "error_where": BUG.where}
    evs: list[dict[str, object]] = [{"kind": "job_start", "t": 0.0, "proc": "launcher"}]
    for i, m in enumerate(("w0", "w1", "w2")):
        evs.append({"kind": "worker_exited", "t": 1.0 + i, "proc": "launcher", "member": m,
                    "pid": 10 + i, "returncode": 1, **err})  # fmt: skip
    evs.append({"kind": "worker_exited", "t": 5.0, "proc": "launcher", "member": "w3",
                "pid": 13, "returncode": -9})  # fmt: skip
    fails = recognise_failures(evs)
    assert [f.cause for f in fails] == [f"ValueError at {BUG.where}"] * 3 + [None]
    assert fails[0].how == f"raised ValueError: {BUG.message}"
    grouped = by_cause(recoveries(evs, fails))
    assert [(r.member, n) for r, n in grouped] == [("w0", 3), ("w3", 1)]
    table = format_recoveries(recoveries(evs, fails)).splitlines()
    assert len(table) == 3 and "(x3, the same error: ValueError at" in table[1]


def test_a_whole_job_death_the_fault_schedule_injected_resumes_as_before() -> None:
    """The soak's kill-all: every member killed by the launcher's own schedule is a
    simulated hardware failure, resumed from whatever there is."""
    w = FailureWatch()
    assert w.on_job_death(progress=12, start=0, has_checkpoint=False, injected=True) is None
    w.on_state_held()
    assert w.on_job_death(progress=12, start=0, has_checkpoint=False) is not None
