"""benchmarks/digest.py runs and reports both digests (one round, not recorded), and
its Poly1305 baseline is a digest: equal for equal states, different from the
current definition's."""

from __future__ import annotations

import subprocess
import sys

import torch

from elastrain.transfer import TorchState, state_digest

from .conftest import ROOT, load_benchmark


def test_the_digest_benchmark_runs_and_reports_both_ways() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "digest.py"), "--rounds", "1", "--no-record"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| digest")
    }
    assert set(rows) == {"none", "xxh3", "poly1305"}, out.stdout
    for way in ("xxh3", "poly1305"):
        alone, beside = float(rows[way][0]), float(rows[way][1])
        assert alone > 0 and beside > 0, rows
    assert "recorded benchmarks/results" not in out.stdout + out.stderr


def _state(seed: int) -> TorchState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    return TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_baseline_tells_states_apart_and_is_not_the_current_digest() -> None:
    d = load_benchmark("digest.py")
    a, b, c = _state(0), _state(0), _state(1)
    assert d.poly1305_digest(a) == d.poly1305_digest(b) != d.poly1305_digest(c)
    assert state_digest(a) == state_digest(b) != state_digest(c)
    assert d.poly1305_digest(a) != state_digest(a)
    assert len(state_digest(a)) == 32 and int(state_digest(a), 16) >= 0
