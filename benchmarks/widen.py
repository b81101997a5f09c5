"""What the exact (float64) reduction costs a worker's compute phase, by how the
gradients are widened, interleaved in one process.

Run from the repository root:

    .venv/bin/python benchmarks/widen.py [--sizes 20ms,1s] [--no-record]

With reduce_dtype "float64" every micro-batch's gradient is converted to float64
and added into the step's sum (`elastrain.runtime.torch_backend`). This measures
one worker's compute phase (`TorchBackend.begin_step`, then `compute` for each
micro-batch of its share; `apply` runs after each step, outside the timing) three
ways on the same model and batches, taking turns in blocks so that the shared
machine's drift falls on all three alike:

- hooks: every parameter widened by its own post-accumulate-grad hook (the
  layout before `SMALL_GRAD_ELEMENTS`: the threshold set to 0);
- batched: parameters under `SMALL_GRAD_ELEMENTS` widened together once per
  micro-batch, the larger ones by their hooks (the default);
- native: no widening (reduce_dtype "native"), the floor.

The sizes are step_cost.py's (the demo GPT; one intra-op thread); each side
computes that benchmark's per-worker share of micro-batches (2 workers). hooks and
batched must end with identical parameters (the same float64 sums, so the same
update): the run says so, or lists it as an anomaly. Prints a table and records
the run (benchmarks/results/) with date, machine, command, commit and load.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_jobs"))

from _harness import Bench, Figure, log, table  # noqa: E402
from _steady import pick_sizes  # noqa: E402
from common import Shape, build, param_count  # noqa: E402

WORKERS = 2
"""step_cost.py's workers per side: each computes global batch / micro-batch / 2."""


@dataclass(frozen=True)
class Size:
    shape: Shape
    blocks: int
    steps: int
    """Measured steps per way per block (after one unmeasured)."""


SIZES = {
    "20ms": Size(
        Shape(dim=128, layers=2, heads=4, block=64, global_batch=4, micro_batch=1), 10, 12
    ),
    "1s": Size(Shape(dim=320, layers=8, heads=5, block=64, global_batch=16, micro_batch=1), 6, 3),
}
WAYS = ("hooks", "batched", "native")


def loss_fn(model: Any, batch: Any) -> Any:
    import torch

    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def measure(name: str, size: Size) -> dict[str, Any]:
    import torch

    from elastrain.runtime import torch_backend as tb
    from elastrain.runtime.config import TrainerConfig
    from elastrain.runtime.engine import EXTRA_SLOTS

    sh = size.shape
    share = sh.global_batch // sh.micro_batch // WORKERS
    default_small = tb.SMALL_GRAD_ELEMENTS
    backends: dict[str, Any] = {}
    for way in WAYS:
        model, opt, _ = build(sh)
        cfg = TrainerConfig(
            global_batch_size=share * sh.micro_batch,
            micro_batch_size=sh.micro_batch,
            total_steps=1,
            reduce_dtype="native" if way == "native" else "float64",
        )
        # The layout is made at the first begin_step, with the threshold of that moment.
        tb.SMALL_GRAD_ELEMENTS = 0 if way == "hooks" else default_small
        be = tb.TorchBackend(model, opt, loss_fn, cfg)
        be.begin_step(EXTRA_SLOTS)
        backends[way] = be
    tb.SMALL_GRAD_ELEMENTS = default_small
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 256, (sh.micro_batch, sh.block), generator=gen),
            torch.randint(0, 256, (sh.micro_batch, sh.block), generator=gen),
        )
        for _ in range(share)
    ]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for block in range(size.blocks):
        order = WAYS if block % 2 == 0 else tuple(reversed(WAYS))
        for way in order:
            be = backends[way]
            for i in range(size.steps + 1):
                be.begin_step(EXTRA_SLOTS)
                t0 = time.perf_counter()
                for mb, b in enumerate(batches):
                    be.compute(0, mb, b, sh.micro_batch)
                t1 = time.perf_counter()
                be.apply()
                if i:  # the block's first step warms the caches for this way
                    times[way].append(t1 - t0)
    same = all(
        torch.equal(p, q)
        for p, q in zip(
            backends["hooks"].model.parameters(),
            backends["batched"].model.parameters(),
            strict=True,
        )
    )
    n_small = sum(1 for q in backends["batched"].model.parameters() if q.numel() < default_small)
    n_all = sum(1 for _ in backends["batched"].model.parameters())
    return {
        "name": name,
        "params": param_count(backends["native"].model),
        "share": share,
        "small": n_small,
        "tensors": n_all,
        "median": {w: statistics.median(v) * 1e3 for w, v in times.items()},
        "n": {w: len(v) for w, v in times.items()},
        "same": same,
    }


def main() -> int:
    bench = Bench("widen.py", __doc__)
    bench.ap.add_argument("--sizes", default="20ms,1s", help="comma list of 20ms, 1s")
    args = bench.parse()
    names = pick_sizes(bench.ap, args.sizes, SIZES)

    import torch

    torch.set_num_threads(1)
    load = bench.load
    assert load is not None
    results = []
    for name in names:
        t0 = time.time()
        log(f"{name}: measuring {', '.join(WAYS)} in turns")
        r = measure(name, SIZES[name])
        r["load"] = load.mean(t0, time.time())
        r["seconds"] = time.time() - t0
        results.append(r)

    rows = []
    anomalies = []
    for r in results:
        m = r["median"]
        cost = {w: m[w] - m["native"] for w in ("hooks", "batched")}
        rows.append([
            r["name"], f"{r['share']}", f"{m['hooks']:.2f}", f"{m['batched']:.2f}",
            f"{m['native']:.2f}", f"{cost['hooks']:.2f}", f"{cost['batched']:.2f}",
            f"{m['batched'] / m['hooks']:.3f}", "yes" if r["same"] else "NO",
        ])  # fmt: skip
        if not r["same"]:
            anomalies.append(f"{r['name']}: hooks and batched ended with different parameters")
    t = table(
        ["size", "micro-batches", "hooks ms", "batched ms", "native ms", "widening: hooks",
         "widening: batched", "batched / hooks", "same update"],
        rows,
    )  # fmt: skip
    print()
    print(t)
    notes = []
    for r in results:
        sh = SIZES[r["name"]].shape
        notes.append(
            f"{r['name']}: demo GPT dim {sh.dim}, {sh.layers} layers, {sh.heads} heads, context "
            f"{sh.block} ({r['params']:,} parameters in {r['tensors']} tensors, {r['small']} of "
            f"them under SMALL_GRAD_ELEMENTS), {r['share']} micro-batches of {sh.micro_batch} "
            f"per step (step_cost.py's share of one of {WORKERS} workers); median of "
            f"{r['n']['hooks']} steps per way; {r['seconds']:.0f} s at load average "
            f"{r['load']:.1f}"
        )
    notes.append(
        "compute phase of one worker's step (begin_step excluded, every micro-batch's forward, "
        "backward and widening included), one process, one intra-op thread, the three ways "
        "taking turns in blocks (hooks batched native | native batched hooks | ...); widening: "
        "the way's median less native's"
    )
    figures = [
        f for r in results for f in (
            Figure(f"batched_over_hooks[{r['name']}]",
                   f"compute phase, batched widening / per-tensor hooks, {r['name']} steps",
                   r["median"]["batched"] / r["median"]["hooks"], ""),
            Figure(f"widening_ms[{r['name']}, batched]",
                   f"widening's cost per step, batched, {r['name']} steps",
                   r["median"]["batched"] - r["median"]["native"], "ms"),
        )
    ]  # fmt: skip
    bench.finish(f"torch {torch.__version__}", figures, [], notes, t, anomalies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
