"""One JSON line per event, flushed at once: how the torchrun and torchft jobs of
benchmarks/versus.py report their steps (elastrain has its own event log).

Every record has `t` (wall time, time.time()), `kind`, `proc` and `pid`; the
kinds the analysis reads are `start` (process start, taken before `import
torch`), `ready` (group built, state loaded; `resumed` = first step to run),
`commit` (a step's optimizer update was applied: `step`, `loss` = this
process's mean loss over its `n` samples, plus `attempt` for torchrun or
`quorum`/`participating`/`participants` for torchft) and `abort` (a step
that was not committed). Standard library only, so it can be imported before
torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StepLog:
    """Appends JSON lines to `path`. Not thread-safe; one per process."""

    def __init__(self, path: str | Path, proc: str, **common: Any) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115
        self.proc = proc
        self.common = common

    def emit(self, kind: str, t: float, **fields: Any) -> None:
        rec = {"t": t, "kind": kind, "proc": self.proc, "pid": os.getpid(), **self.common}
        rec.update(fields)
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
