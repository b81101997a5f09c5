"""The state digest beside a recovery's first step: what it costs the training thread (issue 18).

Run from the repository root:

    .venv/bin/python benchmarks/digest.py [--rounds N] [--no-record]

Every member digests its whole state (`state_digest`) at each generation start,
on a thread beside the generation's first step, so that the members' states
can be compared (the invariants line). What that costs the first step is the
digest's CPU and, when it holds the GIL, the training thread's Python waiting
for it. This measures both in one process, for recovery.py's model (the demo
GPT, dim 320, 8 layers, 5 heads, context 64, AdamW after one step: about 120
MB of model and optimizer state), one intra-op thread:

- alone: the digest by itself (flattening included), ms;
- beside: the training thread's time for three forward and backward passes of
  one sample (a step of three micro-batches) while a second thread digests
  the state, against the same passes with no digest running; the difference
  is what the digest costs that step.

Ways, taking turns in every round (the order rotates, so a load swing hits
them alike): ``none``; ``xxh3``, `state_digest` as the code has it (XXH3-128,
which releases the GIL); ``poly1305``, the definition before it (a Poly1305
tag under a fixed key, fed 1 MiB at a time because it holds the GIL),
rebuilt here from its description as the baseline. Prints a table and
records the run (benchmarks/results/) with date, machine, command, commit and
load (unless --no-record). About 30 s on the 2-core machine.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from _harness import Bench, Figure, log, table  # noqa: E402

PASSES = 3
"""Forward and backward passes per measured step."""
POLY_PIECE = 1 << 20
"""The Poly1305 baseline's bytes per call (as the old definition fed it)."""


def poly1305_digest(state: Any) -> str:
    """The digest's previous definition: a Poly1305 tag under a fixed key over the
    same input as `state_digest` (`digest_input`), 1 MiB per call."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from elastrain.transfer.flatten import digest_input

    h = Poly1305(hashlib.sha256(b"elastrain/state-digest/1").digest())
    for part in digest_input(state):
        for at in range(0, len(part), POLY_PIECE):
            h.update(part[at : at + POLY_PIECE])
    return h.finalize().hex()


def measure(rounds: int) -> dict[str, Any]:
    import torch

    from elastrain.demo.gpt import GPT
    from elastrain.transfer import TorchState, state_digest

    torch.manual_seed(0)
    model = GPT(block=64, d=320, layers=8, heads=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = TorchState(model, opt)
    nbytes = sum(t.numel() * t.element_size() for _, t in state.flatten().tensors)
    x = torch.randint(0, 256, (1, 64))

    def passes() -> float:
        t0 = time.perf_counter()
        for _ in range(PASSES):
            model(x).sum().backward()
        return time.perf_counter() - t0

    ways: dict[str, Callable[[Any], str] | None] = {
        "none": None,
        "xxh3": state_digest,
        "poly1305": poly1305_digest,
    }
    for _ in range(2):
        passes()
        for fn in ways.values():
            if fn is not None:
                fn(state)
    beside: dict[str, list[float]] = {w: [] for w in ways}
    alone: dict[str, list[float]] = {w: [] for w in ways if ways[w] is not None}
    names = list(ways)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for w in order:
            fn = ways[w]
            th = threading.Thread(target=fn, args=(state,)) if fn is not None else None
            if th is not None:
                th.start()
            beside[w].append(passes())
            if th is not None:
                th.join()
        for w in order:
            fn = ways[w]
            if fn is not None:
                t0 = time.perf_counter()
                fn(state)
                alone[w].append(time.perf_counter() - t0)
    return {
        "bytes": nbytes,
        "beside": {w: statistics.median(v) for w, v in beside.items()},
        "alone": {w: statistics.median(v) for w, v in alone.items()},
        "n": rounds,
    }


def main() -> int:
    bench = Bench("digest.py", __doc__)
    bench.ap.add_argument("--rounds", type=int, default=12, help="rounds of the three ways (12)")
    args = bench.parse()
    if args.rounds < 1:
        bench.ap.error("--rounds must be >= 1")

    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    log(f"digest beside {PASSES} forward+backward passes, {args.rounds} rounds")
    r = measure(args.rounds)
    seconds = time.time() - t0
    assert bench.load is not None
    mean_load = bench.load.mean(t0, time.time())

    none = r["beside"]["none"]
    rows = [["none", "-", f"{none * 1e3:.1f}", "-", "-"]]
    for w in ("xxh3", "poly1305"):
        b = r["beside"][w]
        rows.append([
            w, f"{r['alone'][w] * 1e3:.1f}", f"{b * 1e3:.1f}", f"{(b - none) * 1e3:.1f}",
            f"{(b / none - 1) * 100:+.1f}%",
        ])  # fmt: skip
    t = table(
        ["digest", "alone ms", f"{PASSES} passes beside it, ms", "cost to the passes, ms",
         "vs none"],
        rows,
    )  # fmt: skip
    print()
    print(t)
    anomalies = []
    if r["beside"]["xxh3"] > r["beside"]["poly1305"]:
        anomalies.append("the passes beside XXH3 were slower than beside Poly1305")
    notes = [
        f"state: the demo GPT, dim 320, 8 layers, 5 heads, context 64, AdamW after one step "
        f"({r['bytes'] / 1e6:.1f} MB of model and optimizer state, recovery.py's model)",
        f"passes: {PASSES} forward and backward passes of one sample on the training thread; "
        "beside: while a second thread digests the state (started just before); medians of "
        f"{r['n']} rounds, the ways taking turns in every round, the order rotating",
        "xxh3: state_digest as the code has it; poly1305: the digest's previous definition "
        "(a Poly1305 tag under a fixed key, 1 MiB per call), rebuilt in the benchmark",
        f"one process, torch.set_num_threads(1); {seconds:.0f} s at load average {mean_load:.1f}",
    ]
    figures = [
        Figure("beside_ms[none]", f"{PASSES} passes alone", none * 1e3, "ms"),
        *(f for w in ("xxh3", "poly1305") for f in (
            Figure(f"alone_ms[{w}]", f"{w} digest of the state, alone", r["alone"][w] * 1e3, "ms"),
            Figure(f"cost_pct[{w}]", f"{w} digest's cost to {PASSES} passes beside it",
                   (r["beside"][w] / none - 1) * 100, "%"),
        )),
    ]  # fmt: skip
    bench.finish(f"torch {torch.__version__}", figures, [], notes, t, anomalies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
