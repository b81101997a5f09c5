"""The reference rate for a heal: a plain gloo broadcast between two processes over loopback.

Shared by benchmarks/recovery.py and benchmarks/sharded.py, which measure it in
the same run as the heal they judge against it (_jobs/loopback_bcast.py does the
broadcasting)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _steady import kill_all, med

JOBS = Path(__file__).resolve().parent / "_jobs"


def measure_loopback(nbytes: int, reps: int, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """A plain gloo broadcast of `nbytes` between two processes over loopback, `reps`
    times (_jobs/loopback_bcast.py): MB/s per broadcast into memory touched before
    (``rates``) and into fresh memory (``fresh``), and the median of each (NaN for
    none)."""
    import torch.distributed as dist

    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, timeout=dt.timedelta(seconds=120),
        wait_for_workers=False,
    )  # fmt: skip
    out = out_dir / "bcast.json"
    procs = []
    for r in range(2):
        with open(out_dir / f"bcast-r{r}.log", "wb") as logf:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOBS / "loopback_bcast.py"), str(r), str(store.port),
                     str(nbytes), str(reps), str(out)],
                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
    try:
        rcs = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        kill_all(procs)
    if any(rcs):
        raise RuntimeError(f"loopback broadcast failed (exit {rcs}); see {out_dir}")
    got = json.loads(out.read_text())
    rates = [got["bytes"] / 1e6 / s for s in got["seconds"] if s > 0]
    fresh = [got["bytes"] / 1e6 / s for s in got.get("fresh_seconds", []) if s > 0]
    return {
        "bytes": got["bytes"],
        "rates": rates,
        "seconds": got["seconds"],
        "fresh": fresh,
        "median": med(rates),
        "fresh_median": med(fresh),
    }
