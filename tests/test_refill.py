"""When a hot spare took a dead worker's slot, its replacement (the pool's
refill) waits for the job to move on: `elastrain.launch.refill`."""

from __future__ import annotations

from pathlib import Path

from elastrain.launch.config import LaunchConfig
from elastrain.launch.launcher import Launcher, Worker
from elastrain.launch.refill import REFILL_WAIT_S, refill_at, refill_due


def test_a_refill_waits_for_the_job_to_move_past_the_step_its_member_died_in() -> None:
    r = refill_at("w1", 11, progress=8, now=100.0, delay_s=0.0)
    assert not refill_due(r, 100.0, progress=8, alive=3)  # the step is being recomputed
    assert not refill_due(r, 101.5, progress=8, alive=3)
    assert refill_due(r, 101.6, progress=9, alive=3)  # told to proceed past a later step


def test_a_refill_never_starts_before_the_replace_delay() -> None:
    r = refill_at("w1", 11, progress=8, now=100.0, delay_s=2.0)
    assert not refill_due(r, 101.0, progress=9, alive=3)
    assert not refill_due(r, 101.0, progress=8, alive=0)
    assert refill_due(r, 102.0, progress=9, alive=3)


def test_a_refill_starts_when_nobody_is_left_or_at_the_deadline() -> None:
    r = refill_at("w1", 11, progress=8, now=100.0, delay_s=0.5)
    assert refill_due(r, 100.5, progress=8, alive=0)  # nothing left to slow down
    assert not refill_due(r, 100.0 + REFILL_WAIT_S - 0.01, progress=8, alive=2)
    assert refill_due(r, 100.0 + REFILL_WAIT_S, progress=8, alive=2)  # a stalled job
    # A replace delay longer than the wait is still honoured.
    late = refill_at("w1", 11, progress=8, now=100.0, delay_s=REFILL_WAIT_S + 5)
    assert not refill_due(late, 100.0 + REFILL_WAIT_S, progress=8, alive=2)
    assert refill_due(late, 100.0 + REFILL_WAIT_S + 5, progress=8, alive=2)


class _Alive:
    """A worker process that is still running (what `Launcher` asks of its procs)."""

    pid = 4242

    def poll(self) -> int | None:
        return None


def test_one_spare_backs_one_death_however_stale_the_status(tmp_path: Path) -> None:
    # Two members die before the launcher's next status poll, with one standby
    # in the last status: the first death's refill waits for the recovery, the
    # second is a replacement that fills a slot, started after the replace delay.
    script = tmp_path / "job.py"
    script.write_text("")
    la = Launcher(
        LaunchConfig(script=str(script), workers=2, spares=1, run_dir=str(tmp_path / "run"))
    )
    la.workers["w2"] = Worker("w2", _Alive(), 0.0, replacement=False)
    la.status = {"standby": ["w2"], "step": 7, "members": ["w0", "w1"]}
    assert la._on_exit("w0", 101, -9) is None
    assert la._on_exit("w1", 102, -9) is None
    assert [(r.member, r.progress) for r in la._refills] == [("w0", 7)]
    assert [(what, arg) for _, _, what, arg in la._timers] == [("spawn", ("w1", 102))]
    # The next status shows the spare promoted: nothing is claimed any more.
    la.status = {"standby": [], "step": 8, "members": ["w2"]}
    la._claimed &= set(la.status["standby"])
    assert la._spare_for("w2") is None and not la._claimed
