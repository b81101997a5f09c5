"""`--await-checkpoint N@S` for the test scripts: a gate, not a pace.

A test that kills every member and asserts a resume from the checkpoint of step
N needs that checkpoint committed before the kill. Rank 0 commits it in a
background thread, so no number of steps (and no pace) promises that on a loaded
machine. With the gate every member, after step S, waits in `trainer.pause()`
until the checkpoint's commit marker exists.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from elastrain.checkpoint.files import CHECKPOINTS, MARKER, step_dir


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--await-checkpoint",
        metavar="N@S",
        help="after step S, wait until the checkpoint of step N is committed",
    )


class CheckpointGate:
    def __init__(self, spec: str | None, run_dir: str | None, timeout_s: float = 120.0) -> None:
        self.step: int | None = None
        if spec:
            n, s = (int(x) for x in spec.split("@"))
            if run_dir is None:
                raise SystemExit("--await-checkpoint needs ELASTRAIN_RUN_DIR")
            self.marker = step_dir(Path(run_dir) / CHECKPOINTS, n) / MARKER
            self.step = s
        self.timeout_s = timeout_s

    def after(self, trainer: Any, step: int) -> None:
        """Call with each committed step's number; waits after step S."""
        if step != self.step:
            return
        deadline = time.monotonic() + self.timeout_s
        with trainer.pause():
            while not self.marker.exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.marker} did not appear in {self.timeout_s:g} s")
                time.sleep(0.02)  # polls a condition another process makes true
