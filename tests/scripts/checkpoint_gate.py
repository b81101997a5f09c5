"""`--await-checkpoint N@S` for the test scripts: a gate, not a pace.

A test that kills every member and asserts a resume from the newest checkpoint
needs the checkpoint of step N *decided* before the kill, and every earlier
one that was begun: committed, or known never to commit. Rank 0 commits in a background thread, and a member whose
previous write is still running skips a checkpoint (by design, under load), so
no number of steps (and no pace) promises either by any time. With the gate
every member, after step S, waits in `trainer.pause()` until, for step N and
every step directory below it, the commit marker exists or some process recorded
that it skipped or failed that step's checkpoint (`checkpoint_skipped`/
`checkpoint_failed`: it will not commit). (With step N's skipped because the
previous save was still writing, that previous one is still to commit.) The
test then reads which checkpoint is the newest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from elastrain.checkpoint.files import CHECKPOINTS, MARKER, list_steps, step_dir

GIVEN_UP = ('"checkpoint_skipped"', '"checkpoint_failed"')


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--await-checkpoint",
        metavar="N@S",
        help="after step S, wait until the checkpoint of step N is committed or given up",
    )


def given_up(run_dir: Path, step: int) -> bool:
    """Some process recorded a skip or failure of the checkpoint of `step`."""
    for f in (run_dir / "events").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if any(k in line for k in GIVEN_UP) and json.loads(line).get("step") == step:
                return True
    return False


class CheckpointGate:
    def __init__(self, spec: str | None, run_dir: str | None, timeout_s: float = 120.0) -> None:
        self.step: int | None = None
        if spec:
            n, s = (int(x) for x in spec.split("@"))
            if run_dir is None:
                raise SystemExit("--await-checkpoint needs ELASTRAIN_RUN_DIR")
            self.run_dir = Path(run_dir)
            self.n = n
            self.step = s
        self.timeout_s = timeout_s

    def after(self, trainer: Any, step: int) -> None:
        """Call with each committed step's number; waits after step S."""
        if step != self.step:
            return
        deadline = time.monotonic() + self.timeout_s
        with trainer.pause():
            while not self.decided():
                if time.monotonic() > deadline:
                    raise SystemExit(f"checkpoint {self.n} undecided after {self.timeout_s:g} s")
                time.sleep(0.05)  # polls a condition other threads and processes make true

    def decided(self) -> bool:
        ckpts = self.run_dir / CHECKPOINTS
        steps = {self.n, *(k for k, _ in list_steps(ckpts) if k <= self.n)}
        return all(
            (step_dir(ckpts, k) / MARKER).exists() or given_up(self.run_dir, k) for k in steps
        )
