"""The early and the late kill of benchmarks/sharded.py alone (its `--parts kill`, 3d
in its docstring), recorded as their own benchmark, so that RESULTS.md keeps
sharded.py's whole run beside them.

Run from the repository root:

    .venv/bin/python benchmarks/sharded_kills.py [--kill-step 8] [--quick] [--no-record]

A 2 x 2 elastrain job (float64 reductions, the demo GPT of sharded.py), w1
SIGKILLing itself at an in-worker fault point of step K: early (after its first
micro-batch) and late (once its twins' all-reduce started). Each: kill -> next
commit against 0.5 s + that run's own median step before the kill, and the
resumed step's held and computed micro-batches per rank. About 3-5 minutes on
this 2-core machine (load 11-24).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharded import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("sharded_kills.py", parts="kill"))
