"""A fresh sharded job started from a model built on the meta device: every rank's peak
resident memory against the full training state, and against the same job started
from the model materialised whole (issue 41, item 2).

Run from the repository root:

    .venv/bin/python benchmarks/meta_start.py [--dim 768 --layers 10] [--quick] [--no-record]

Four elastrain jobs of 4 processes, one after the other, each running
_jobs/meta_gpt.py (ElasticTrainer on the demo GPT, AdamW, float64 reductions,
global batch 4, micro-batch 1, one thread per process, gloo over loopback) for
--steps steps (3: AdamW's moments exist from the first step on):

  M 2x2  built on the meta device, 2 replica groups x 2 shards: each member
         initialises only its rows, module by module (elastrain.runtime.meta_init);
  W 2x2  the same model materialised whole in every process from the same seed
         (what a fresh sharded job needed before), the shard taken from it;
  M 1x4, W 1x4  the same as one group of 4 shards.

The model: the demo GPT at dim 768, 10 layers, 12 heads, context 64 by default
(71.2M parameters, 285 MB float32; the full training state, parameters and
AdamW's two moments, 856 MB: exact numbers printed). Each rank writes, at its
end, its resident size after the imports and after building the model, and
its peak (/proc VmHWM) at three moments: when its first forward begins (the
start: construction, rendezvous, the shard taken, the first FSDP2 wrapper),
after the first step, and at the end. Reported per side and rank: the start's
peak and the run's peak above the imports, each against the full state and
the run's against the rank's own share of it (state / S). Targets, at both
layouts: every M rank's start peak above the imports is below the full
training state and below the lowest W rank's; every M rank's run peak above
the imports is below the full training state. What a rank holds besides its
state: the shard's float64 gradient sum (twice its parameters' bytes), the
gathered parameters and gradients of the FSDP2 unit computing, activations,
the dataset (the "model built" column of an M side: 72 MB).

Only one job runs at a time, but the machine is shared: its load is recorded.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "_jobs"))

from _harness import Bench, Figure, at_most, log, table, target  # noqa: E402
from _kills import run_bounded  # noqa: E402
from _steady import shape_args  # noqa: E402
from common import Shape  # noqa: E402

from elastrain.launch.launcher import LaunchConfig, Launcher  # noqa: E402

JOBS = Path(__file__).resolve().parent / "_jobs"
WORKERS = 4
ALL_SIDES = [("M", 2), ("W", 2), ("M", 4), ("W", 4)]
BUILD = {"M": "meta", "W": "whole"}


LEAN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
"""What a user sharding a model to fit it sets (docs/guide/sharded.md, "Memory"):
glibc maps every tensor of 1 MiB or more on its own, so what a step frees goes
back to the system at once (and the step costs more: runtime/shard_memory.py)."""


def state_bytes(shape: Shape) -> tuple[int, int]:
    """(parameters, full training state: parameters and AdamW's two moments) in bytes."""
    import torch

    from elastrain.demo.gpt import GPT

    with torch.device("meta"):
        model = GPT(block=shape.block, d=shape.dim, layers=shape.layers, heads=shape.heads)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, 3 * params


def run_side(shape: Shape, build: str, size: int, steps: int, out: Path, timeout_s: float) -> dict:
    import json

    rss_dir = out / "rss"
    rss_dir.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(
        script=str(JOBS / "meta_gpt.py"),
        script_args=[*shape_args(shape), "--build", build, "--shard-size", str(size)],
        workers=WORKERS,
        shard_size=size,
        run_dir=str(out / "run"),
        steps=steps,
        progress=False,
        replace=False,
        extra_env={"BENCH_RSS_DIR": str(rss_dir), **LEAN_ENV},
    )
    result, wall = run_bounded(Launcher(cfg), timeout_s)
    ranks = [json.loads(f.read_text()) for f in sorted(rss_dir.glob("*.json"))]
    return {"status": result.status, "wall_s": wall, "ranks": ranks}


def mb(nbytes: float) -> str:
    return "n/a" if not math.isfinite(nbytes) else f"{nbytes / 1e6:.0f}"


def main() -> int:
    bench = Bench("meta_start.py", __doc__, quick="tiny model, 2 steps", runs_dir=True)
    ap = bench.ap
    ap.add_argument("--dim", type=int, default=None, help="model width (768; --quick 64)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (10; --quick 2)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--steps", type=int, default=None, help="steps per job (3; --quick 2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--sides", default="M2,W2,M4,W4", help="which jobs (M/W and the shard size)")
    a = bench.parse()
    sides = [(x[0], int(x[1:])) for x in a.sides.split(",")]
    if not set(sides) <= set(ALL_SIDES):
        ap.error(f"--sides: each of {','.join(f'{s}{z}' for s, z in ALL_SIDES)}")
    dim = a.dim or (64 if a.quick else 768)
    layers = a.layers or (2 if a.quick else 10)
    heads = 4 if a.quick and a.dim is None else a.heads
    steps = a.steps or (2 if a.quick else 3)
    shape = Shape(dim=dim, layers=layers, heads=heads, block=64, global_batch=4, micro_batch=1)
    params, full = state_bytes(shape)
    log(f"GPT dim {dim} x {layers}: {params / 4:.0f} parameters, {mb(params)} MB; "
        f"training state {mb(full)} MB")  # fmt: skip
    base = bench.run_dir("meta_start")
    got: dict[tuple[str, int], dict[str, Any]] = {}
    for side, size in sides:
        log(f"{side} {WORKERS // size}x{size} ({BUILD[side]}) ...")
        got[side, size] = run_side(
            shape, BUILD[side], size, steps, base / f"{side}{size}", a.timeout
        )
        log(f"  {got[side, size]['status']} in {got[side, size]['wall_s']:.0f} s, "
            f"{len(got[side, size]['ranks'])} ranks reported")  # fmt: skip

    def above(side: str, size: int, field: str) -> list[float]:
        ranks = got.get((side, size), {"ranks": []})["ranks"]
        return [(r[field] - r["rss_imports_kb"]) * 1024.0 for r in ranks]

    rows = []
    for side, size in sides:
        for r in sorted(got[side, size]["ranks"], key=lambda r: r["member"]):
            up = (r["hwm_kb"] - r["rss_imports_kb"]) * 1024.0
            start = (r["hwm_start_kb"] - r["rss_imports_kb"]) * 1024.0
            rows.append([
                f"{side} {WORKERS // size}x{size}", r["member"], f"{r['shard']}/{r['shard_size']}",
                mb(r["rss_imports_kb"] * 1024.0), mb((r["rss_built_kb"] - r["rss_imports_kb"]) * 1024.0),
                mb(start), f"{start / full:.2f}",
                mb((r["hwm_first_step_kb"] - r["rss_imports_kb"]) * 1024.0), mb(up),
                f"{up / full:.2f}", f"{up / (full / size):.2f}",
            ])  # fmt: skip
    per_rank = table(
        ["side", "rank", "shard", "after imports (MB)", "model built (MB)", "start peak (MB)",
         "start / full state", "peak after step 1 (MB)", "run peak (MB)", "run / full state",
         "run / rank's share (state / S)"],
        rows,
    )  # fmt: skip
    per_rank = "peaks and sizes above the resident size after the imports\n\n" + per_rank
    print(per_rank)
    figures: list[Figure] = []
    targets = []
    notes = [
        f"GPT dim {dim}, {layers} layers, {heads} heads, context 64: {params // 4} parameters "
        f"({mb(params)} MB float32); full training state (params + AdamW moments) {mb(full)} MB",
        f"{steps} steps per job, global batch 4, micro-batch 1, float64 reductions, "
        "jobs one after the other",
        f"every worker runs with {' '.join(f'{k}={v}' for k, v in LEAN_ENV.items())}, as a user "
        "sharding a model to fit it would (glibc's default raises the threshold as large "
        "blocks are freed and keeps their space: the run peaks grow by about the full state)",
    ]
    for size in (2, 4):
        lay = f"{WORKERS // size}x{size}"
        ms, ws = above("M", size, "hwm_start_kb"), above("W", size, "hwm_start_kb")
        mr, wr = above("M", size, "hwm_kb"), above("W", size, "hwm_kb")
        for what, xs in (("meta", ms), ("whole", ws)):
            if xs:
                figures.append(Figure(f"start_peak_mb[{what} {lay}]",
                                      f"max rank start peak above imports, {what} {lay}",
                                      max(xs) / 1e6, "MB"))  # fmt: skip
        for what, xs in (("meta", mr), ("whole", wr)):
            if xs:
                figures.append(Figure(f"run_peak_mb[{what} {lay}]",
                                      f"max rank run peak above imports, {what} {lay}",
                                      max(xs) / 1e6, "MB"))  # fmt: skip
        if len(ms) != WORKERS:
            notes.append(f"meta {lay}: {len(ms)} of {WORKERS} ranks reported: no verdict")
            continue
        targets += [
            target(f"meta {lay}: every rank's start peak above the imports < full training state",
                   f"< {mb(full)} MB", f"{mb(max(ms))} MB", at_most(max(ms), full)),
            target(f"meta {lay}: every rank's run peak above the imports < full training state",
                   f"< {mb(full)} MB", f"{mb(max(mr))} MB", at_most(max(mr), full)),
        ]  # fmt: skip
        if len(ws) == WORKERS:
            targets.append(target(
                f"meta {lay}: every rank's start peak < the materialised start's lowest",
                f"< {mb(min(ws))} MB", f"{mb(max(ms))} MB", at_most(max(ms), min(ws)),
            ))  # fmt: skip
    import torch

    bench.finish(
        f"torch {torch.__version__}, gloo over loopback, CPU",
        figures,
        targets,
        notes,
        per_rank,
        extra={"sides": {f"{s}{z}": got[s, z] for s, z in sides}},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
