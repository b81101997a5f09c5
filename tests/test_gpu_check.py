"""benchmarks/gpu_check.py (issue 22) with --device cpu: every line that needs no GPU
runs here, so the script a lent GPU machine runs is known to work up to the device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import ROOT


def test_the_gpu_check_runs_on_the_cpu_and_its_checks_pass(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
         "--no-record", "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for check in (
        "ran until both recoveries trained",
        "every sample used once",
        "identical state at every generation start",
        "w0, w2, w3 kept their PIDs",
        "the replacement and the continued w2 were healed",
    ):
        assert f"| 4 processes: {check} " in text and "| NO " not in text, (check, text[-3000:])
    for check in (
        "w1 left with exit 74 (device poisoned)",
        "ran until a fresh process trained",
        "the fresh process was healed, trained and left only when stopped",
        "w0 kept its PID",
    ):
        assert f"| 2 processes: {check} " in text, (check, text[-3000:])
    assert "NCCL world size 1" in text and "no CUDA device: NCCL needs one" in text
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in text.splitlines() if line.startswith("| ") and line.count("|") >= 3}  # fmt: skip
    plain, elastic = (
        rows["1 process: step, plain loop / elastrain (median, s)"].split(" (")[0].split(" / ")
    )
    assert float(plain) > 0 and float(elastic) > 0
    assert float(rows["4 processes: kill -> survivors' next commit (s)"]) > 0
    assert float(rows["4 processes: 4 s SIGSTOP -> next commit (s)"]) > 0
    # Part 5: heal_rate.py's smoke run on this machine's cores, its figures read back.
    head = "heal on the host's cores, 1 sender"
    assert rows[head].endswith(" cores"), rows[head]
    for figure in ("warm broadcast (MB/s)", "digest heal / warm broadcast (ratio)",
                   "digest floor / warm broadcast (ratio)"):  # fmt: skip
        assert float(rows[f"{head}: {figure}"]) > 0, (figure, text[-3000:])


def test_a_failed_part_is_a_row_naming_its_error_and_the_other_parts_still_report() -> None:
    """A lent GPU is scarce: one run reports every part, a failed one as FAILED with
    its error's last line (the first GPU run failed in part 1 on a device mismatch)."""
    from .conftest import load_benchmark

    g = load_benchmark("gpu_check.py")

    def broken(x: int) -> int:
        raise RuntimeError(f"plain loop failed (1):\nTraceback ...\nindex is on cpu ({x})")

    assert g.attempt(lambda x: x + 1, 1) == (2, None)
    got, err = g.attempt(broken, 7)
    assert got is None and err == "RuntimeError: index is on cpu (7)"
    assert g.part1_rows(None, err) == [["1 process", f"FAILED: {err}"]]
    assert g.part5_rows(None, err) == [["heal on the host's cores, 1 sender", f"FAILED: {err}"]]
    assert g.part2_rows(None, err, 4.0) == [
        [f"4 processes: kill@{g.KILL_AT}:w1, then a 4 s SIGSTOP of w2", f"FAILED: {err}"]
    ]
    assert g.part4_rows(None, err)[0][1] == f"FAILED: {err}"
    rows = g.nccl_rows(None, "RuntimeError: the probe exited 1: boom")
    assert [r[1] for r in rows] == ["FAILED: RuntimeError: the probe exited 1: boom"] * 2
