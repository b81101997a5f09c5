"""The short soaks CI runs, one per job (PyTorch, JAX): every fault kind at least once,
zero invariant violations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastrain.chaos.schedule import KINDS
from elastrain.chaos.soak import format_table, main, plan_faults, soak
from elastrain.chaos.soak_jobs import SoakJob


def test_plan_deals_every_kind_and_keeps_a_quiet_tail() -> None:
    faults = plan_faults(list(KINDS), 75.0, 6.0, seed=3)
    assert {f.kind for f in faults} == set(KINDS)
    assert max(f.at_s or 0 for f in faults) < 75.0 * 0.75 + 1
    assert plan_faults(list(KINDS), 75.0, 6.0, seed=3) == faults


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--duration", "soon"], "bad duration"),
        (["--duration", "1m", "--kinds", "kill,explode"], "unknown fault kind"),
        (["--duration", "1m", "-n", "1"], "-n must be >= 2"),
        (["--duration", "1m", "--job", "mxnet"], "invalid SoakJob value"),
    ],
)
def test_bad_arguments(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


JAX_KINDS = ["kill", "hang", "term", "kill-all", "corrupt-ckpt"]
SOAK_S = {SoakJob.TORCH: 64.0, SoakJob.JAX: 30.0}


@pytest.mark.parametrize("job", list(SoakJob))
def test_the_soaks_deal_their_whole_deck(job: SoakJob) -> None:
    """The short soaks below are as short as dealing every kind of their deck allows."""
    kinds = list(KINDS) if job is SoakJob.TORCH else JAX_KINDS
    faults = plan_faults(kinds, SOAK_S[job], 5.0, seed=0)
    assert {f.kind for f in faults} == set(kinds)
    assert {f.kind for f in plan_faults(kinds, SOAK_S[job] - 4.0, 5.0, seed=0)} != set(kinds)


@pytest.mark.parametrize("job", list(SoakJob))
def test_short_soak_every_fault_kind_zero_violations(job: SoakJob, tmp_path: Path) -> None:
    if job is SoakJob.JAX:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    # Both frameworks run the one step engine and protocol, so the JAX soak takes the
    # faults whose recovery goes through the framework's own state (heal, leave,
    # abort, whole-job resume, a damaged checkpoint's load) and leaves the
    # protocol-only ones (slow, cut, coordinator, disk, truncation) to the torch soak.
    # Faults every 5 s (+-30%) in the first 75% of the duration, seed 0: each run is
    # just long enough to deal its whole deck once (`plan_faults`, deterministic;
    # test_the_soaks_deal_their_whole_deck): the torch soak's 9 kinds in 64 s
    # (11 faults, the last at 47 s), the JAX soak's 4 in 30 s (5 faults, the last
    # at 19.8 s). A longer run only deals the deck again.
    kinds = list(KINDS) if job is SoakJob.TORCH else JAX_KINDS
    summary = soak(
        SOAK_S[job],
        job=job,
        workers=3,
        every_s=5.0,
        kinds=kinds,
        seed=0,
        run_dir=tmp_path / "soak",
    )
    table = format_table(summary)
    print(table)
    injected = {f["fault"] for f in summary["faults"] if not f["skipped"]}
    # fill-disk mounts a tmpfs and cut builds network namespaces: both need root.
    expected = set(kinds) if os.geteuid() == 0 else set(kinds) - {"fill-disk", "cut"}
    assert injected >= expected, table
    assert summary["violations"] == 0, table
    assert table.splitlines()[-1] == "violations: 0"
    assert summary["job"] == job and table.startswith(f"soak: {job} job,")
    # Every fault was followed by progress (zero violations includes that).
    assert all(f["recovery_s"] is not None for f in summary["faults"] if not f["skipped"])
    # A slowed member that computed a window's worth of slowed steps was flagged as
    # a straggler by its compute per sample against the others' (not by the order).
    slowed = [f["straggler"] for f in summary["faults"] if f["fault"] == "slow"]
    assert False not in slowed, table


def test_a_fault_too_close_to_the_end_is_not_judged_but_a_late_one_is() -> None:
    from elastrain.chaos.soak import judge_recoveries, pending_recoveries

    def rec(t: float, recovery_s: float | None) -> dict[str, object]:
        return {"fault": "kill", "t": t, "recovery_s": recovery_s, "bound_s": 60.0,
                "skipped": False}  # fmt: skip

    recs = [rec(0, 2.0), rec(50, None), rec(10, None), rec(20, 70.0)]
    late, notes = judge_recoveries(recs, 80)
    # 50 s: the soak ended 30 s later, within the bound: a note, not a violation.
    assert late == ["kill at 10 s: no progress after it (bound 60 s)",
                    "kill at 20 s: 70.0 s (bound 60 s)"]  # fmt: skip
    assert len(notes) == 1 and notes[0].startswith("kill at 50 s: no progress before")
    # What the soak waits for at the end of its duration before it ends the job: only
    # the fault at 50 s (no progress yet, bound not up); at 110 s nothing is left.
    assert [r["t"] for r in pending_recoveries(recs, 80)] == [50]
    assert pending_recoveries(recs, 110) == []


def test_threads_waiting_out_abandoned_collectives_are_not_counted_as_leaks() -> None:
    import threading

    from elastrain.chaos.soak import _fds_threads
    from elastrain.threads import COLLECTIVE_WAIT, name_native_thread

    base = _fds_threads(os.getpid())
    assert base is not None
    named, plain = threading.Event(), threading.Event()
    release = threading.Event()

    def waiter(ready: threading.Event, name: str | None) -> None:
        if name:
            name_native_thread(name)
        ready.set()
        release.wait()

    ts = [threading.Thread(target=waiter, args=(named, COLLECTIVE_WAIT)),
          threading.Thread(target=waiter, args=(plain, None))]  # fmt: skip
    for t in ts:
        t.start()
    try:
        named.wait(5)
        plain.wait(5)
        got = _fds_threads(os.getpid())
        assert got is not None and got[1] == base[1] + 1  # the plain one only
    finally:
        release.set()
        for t in ts:
            t.join()


@pytest.mark.parametrize(("slowed", "computed", "alone", "want"),
                         [(True, 40, False, True), (False, 40, False, False),
                          (True, 6, False, None), (True, 40, True, None)])  # fmt: skip
def test_a_slow_fault_is_judged_by_whether_its_victim_was_flagged(
    slowed: bool, computed: int, alone: bool, want: bool | None
) -> None:
    """The soak's row for a slow fault says whether the straggler score saw the
    victim within its slowed steps; no verdict when it computed too few of them,
    or computed them with no other member to compare with (seen in a soak: earlier
    faults had left the slowed member the only one of its generation)."""
    from elastrain.chaos.soak import recoveries

    from .test_stragglers import run

    members = {"w1": 12} if alone else {"w0": 4, "w1": 4, "w2": 4}
    ev = run(40, members, slow={"w1": (10, 39, 0.05)} if slowed else None)
    # w1 computed only `computed` steps from step 10 on (killed or expelled after).
    ev = [e for e in ev if e["proc"] != "w1" or e["step"] < 10 + computed]
    for i, e in enumerate(ev):
        e["t"] = 100.0 + e["step"] + i * 1e-4
    ev.append({"kind": "fault_injected", "proc": "launcher", "t": 109.5, "fault": "slow",
               "member": "w1", "delay_s": 0.05, "steps": 30})  # fmt: skip
    (row,) = [r for r in recoveries(ev) if r["fault"] == "slow"]
    assert row["straggler"] is want
