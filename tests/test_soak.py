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


@pytest.mark.parametrize("job", list(SoakJob))
def test_short_soak_every_fault_kind_zero_violations(job: SoakJob, tmp_path: Path) -> None:
    if job is SoakJob.JAX:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    summary = soak(80.0, job=job, workers=3, every_s=5.5, seed=0, run_dir=tmp_path / "soak")
    table = format_table(summary)
    print(table)
    injected = {f["fault"] for f in summary["faults"] if not f["skipped"]}
    # fill-disk mounts a tmpfs and cut builds network namespaces: both need root.
    expected = set(KINDS) if os.geteuid() == 0 else set(KINDS) - {"fill-disk", "cut"}
    assert injected >= expected, table
    assert summary["violations"] == 0, table
    assert table.splitlines()[-1] == "violations: 0"
    assert summary["job"] == job and table.startswith(f"soak: {job} job,")
    # Every fault was followed by progress (zero violations includes that).
    assert all(f["recovery_s"] is not None for f in summary["faults"] if not f["skipped"])
